"""A booted host for tests: systemd as PID 1 of a container, confined like the sandbox.

The product runs under the *system* manager: ``systemctl start k26-supervisor``,
the system bus, polkit deciding what the ``k26-supervisor`` user may do,
journald holding the SGLang units' output, the hardened unit and
the Debian package on a fresh root. ``up`` boots exactly that, from the recipe
in ``shared/docs/booted-host.md``:

1. a ``k26host-<pid>-<hex>`` child in every cgroup hierarchy (cpuset refuses
   and is skipped); the launcher (``bootedhost_inner``) enters it and proves it
   before anything else runs, so systemd-nspawn makes its cgroups beneath it;
2. a private mount namespace with a tmpfs on ``/run/systemd`` (nspawn would
   otherwise leave ``/run/systemd/nspawn`` on the host);
3. the container's root is an overlay of the machine's own root whose writes
   land on a tmpfs: every installed package, Python and nvcc is there, and
   everything the test writes vanishes with it;
4. a machine-id of its own, the host's enabled units masked;
5. ``systemd-nspawn -b --private-network --register=no --keep-unit``: its own
   loopback, so ports never clash with the host.

``run`` executes a command inside with ``nsenter`` (mount, UTS, IPC, network and
PID namespaces of the container's PID 1); ``path`` reaches the container's files
through ``/proc/<pid 1>/root``. ``down`` powers the container off, ends by PID
whatever is left in the subtree, removes the cgroups and checks that PID 1's
cgroups are what they were. It lacks ``/dev/kmsg`` and the v1 memory
controller (``MemoryMax=`` is not enforced there): never run a memory-eating
unit in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k26dev import cgroups
from k26dev.bootedhost_inner import hierarchies
from k26dev.errors import SandboxError
from supervisor.atomic_write import write_atomic

NAME_PREFIX = "k26host-"
STATE_FILE = "bootedhost.json"
REGISTRY_ENV = "K26_SANDBOX_REGISTRY"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class HostInfo:
    """What ``up`` made; saved as ``DIR/bootedhost.json`` so ``down`` can undo it."""

    dir: str
    name: str
    launcher_pid: int  # the nspawn process, after the launcher's execs
    leader_pid: int = 0  # the container's PID 1, as the host sees it
    cgroups: list[str] = field(default_factory=list)
    pid1_cgroup: str = ""
    boot_s: float = 0.0

    def save(self) -> None:
        path = Path(self.dir) / STATE_FILE
        write_atomic(path, json.dumps(asdict(self), indent=2), new_mode=0o666, durable=False)

    @classmethod
    def load(cls, directory: Path) -> HostInfo:
        path = directory / STATE_FILE
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError as exc:
            raise SandboxError(
                f"{path}: no booted host here (was 'sandbox up --boot' run?)"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise SandboxError(f"{path}: unreadable state ({exc}); use 'sandbox sweep'") from exc

    # --- talking to it ------------------------------------------------------------

    def nsenter(self, *argv: str, env: Mapping[str, str] | None = None) -> list[str]:
        """The command line that runs ``argv`` inside, as root, with a clean environment."""
        environment = {"PATH": _PATH, "LANG": "C.UTF-8", **(env or {})}
        return [
            "nsenter",
            "-t",
            str(self.leader_pid),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "--",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in environment.items()),
            *argv,
        ]

    def run(
        self,
        *argv: str,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
        timeout_s: float = 120.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the booted host; raise SandboxError naming it if it fails."""
        done = subprocess.run(
            self.nsenter(*argv, env=env),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and done.returncode != 0:
            raise SandboxError(
                f"in the booted host: {shlex.join(argv)} exited {done.returncode}: "
                + (done.stderr.strip() or done.stdout.strip())[-2000:]
            )
        return done

    def systemctl(self, *args: str, check: bool = True, timeout_s: float = 120.0) -> str:
        return self.run("systemctl", *args, check=check, timeout_s=timeout_s).stdout.strip()

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit)

    def path(self, inside: str) -> Path:
        """A path inside the container, reachable from the host."""
        return Path(f"/proc/{self.leader_pid}/root") / inside.lstrip("/")

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        target = self.path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def journal(self, unit: str, *args: str) -> str:
        return self.run("journalctl", "-u", unit, "--no-pager", "-q", "-o", "cat", *args).stdout


def _check_host() -> None:
    if os.geteuid() != 0:
        raise SandboxError("a booted host needs root (cgroups, namespaces, systemd-nspawn)")
    for tool in ("systemd-nspawn", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            raise SandboxError(
                f"'{tool}' not found on PATH; install systemd-container and util-linux"
            )
    if Path("/run/systemd/system").is_dir():
        raise SandboxError(
            "systemd is PID 1 here: test on this host's own system manager instead "
            "(the booted host is for machines booted without it)"
        )


def _register(name: str) -> None:
    registry = os.environ.get(REGISTRY_ENV)
    if registry:
        with open(registry, "a", encoding="utf-8") as handle:
            handle.write(name + "\n")


def _leader_of(nspawn_pid: int) -> int:
    """The container's PID 1: nspawn's child that runs systemd in a PID namespace of
    its own (nspawn's short-lived outer child is neither)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{nspawn_pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    own = os.readlink("/proc/self/ns/pid")
    for child in children:
        with contextlib.suppress(OSError):
            if (
                os.readlink(f"/proc/{child}/ns/pid") != own
                and Path(f"/proc/{child}/comm").read_text().strip() == "systemd"
            ):
                return child
    return 0


def up(directory: Path, **kw: object) -> HostInfo:
    """Boot a host under ``directory`` and leave it up (``sandbox up --boot --detach``);
    torn down if the boot fails or a signal lands before it is up."""
    with running(directory, keep_up=True, **kw) as info:  # type: ignore[arg-type]
        return info


@contextlib.contextmanager
def running(
    directory: Path,
    *,
    binds: Sequence[str] = (),
    binds_ro: Sequence[str] = (),
    timeout_s: float = 60.0,
    layer_size: str = "6G",
    keep_up: bool = False,
    lower: Path | None = None,
    boot_args: Sequence[str] = (),
) -> Iterator[HostInfo]:
    """``with running(dir) as host:`` boots a confined container under ``directory``
    and powers it off and removes it on any exit. ``binds`` and ``binds_ro`` are
    nspawn's ``SRC:DST`` (host path, path inside). With ``keep_up``, a body that
    ends normally leaves it up. ``lower`` is the root the container's overlay
    lies on (default: this machine's own ``/``), such as another Debian release made
    with debootstrap; ``boot_args`` go to its PID 1 as its command line.

    One ``try`` covers everything from the state file on: a signal that lands
    anywhere, right after the boot or before the body's first line included,
    tears down what was made."""
    _check_host()
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / STATE_FILE).exists():
        stale = HostInfo.load(directory)
        if cgroups.pid_alive(stale.launcher_pid):
            raise SandboxError(f"{directory}: a booted host is already up ({stale.name})")
        down(directory)
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    _register(name)
    with cgroups.torn_down(lambda: down(directory), keep_up=keep_up):
        yield _boot(
            directory, name, binds, binds_ro, timeout_s, layer_size, lower, boot_args
        )  # fmt: skip


def _boot(
    directory: Path,
    name: str,
    binds: Sequence[str],
    binds_ro: Sequence[str],
    timeout_s: float,
    layer_size: str,
    lower: Path | None = None,
    boot_args: Sequence[str] = (),
) -> HostInfo:
    pid1_before = cgroups.read_pid1_cgroup()
    planned = [h / name for h in hierarchies()]
    info = HostInfo(
        dir=str(directory), name=name, launcher_pid=0, cgroups=[str(p) for p in planned]
    )
    info.pid1_cgroup = pid1_before
    # The state goes to disk before anything is made, so that ``down`` can undo
    # whatever was done, whenever a signal (or an error) lands.
    info.save()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"}
    }
    cmd = [
        sys.executable,
        "-I",
        "-m",
        "k26dev.bootedhost_inner",
        "launch",
        "--name",
        name,
        "--dir",
        str(directory),
        "--layer-size",
        layer_size,
        "--lower",
        str(lower or "/"),
        *(f"--bind={b}" for b in binds),
        *(f"--bind-ro={b}" for b in binds_ro),
        *(f"--boot-arg={a}" for a in boot_args),
    ]
    proc: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    try:
        try:
            cgroups.make_cgroups(planned)
        except OSError as exc:
            raise SandboxError(f"cannot create cgroup {name}: {exc}") from exc
        with open(directory / "bootedhost.log", "ab") as log:
            proc = cgroups.launch(cmd, log, env, info.cgroups, "the booted host's launcher")
        info.launcher_pid = proc.pid
        info.save()
        _wait_booted(info, proc, timeout_s)
    except BaseException:
        cgroups.end_unrecorded(proc, info.launcher_pid)
        raise
    info.boot_s = time.monotonic() - started
    info.save()
    if cgroups.read_pid1_cgroup() != pid1_before:
        raise SandboxError("PID 1's cgroup changed while the host booted; it was torn down")
    return info


def _wait_booted(info: HostInfo, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            tail = (Path(info.dir) / "bootedhost.log").read_text(errors="replace")[-1500:]
            raise SandboxError(f"the booted host's launcher exited with {code}: {tail}")
        info.leader_pid = _leader_of(proc.pid)
        if info.leader_pid:
            # Right after boot the system bus may not exist yet: ask until it answers.
            done = subprocess.run(
                info.nsenter("systemctl", "is-system-running", "--wait"),
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
            if done.stdout.strip() in ("running", "degraded"):
                return
        if time.monotonic() >= deadline:
            raise SandboxError(
                f"the booted host did not come up within {timeout_s:.0f} s; see "
                f"{Path(info.dir) / 'bootedhost.log'}"
            )
        cgroups.wait_pid_exit(proc.pid, 0.05)  # wakes early if the launcher dies


def _cgroup_dirs(name: str) -> list[Path]:
    return [h / name for h in hierarchies()]


def down(directory: Path, *, timeout_s: float = 30.0) -> None:
    """Power the container off, end what is left by PID, remove the cgroups."""
    directory = directory.resolve()
    info = HostInfo.load(directory)
    if not info.name.startswith(NAME_PREFIX):
        raise SandboxError(
            f"{directory / STATE_FILE}: refusing a cgroup name not ours: {info.name}"
        )
    if cgroups.pid_alive(info.launcher_pid) and info.leader_pid:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run(
                info.nsenter("systemctl", "poweroff", "--no-block"),
                capture_output=True,
                timeout=10,
                check=False,
            )
        cgroups.wait_pid_exit(info.launcher_pid, timeout_s)
    try:
        cgroups.kill_all(_cgroup_dirs(info.name), info.name, 15.0)
    except OSError as exc:
        raise SandboxError(str(exc)) from exc
    proc = cgroups.LAUNCHED.pop(info.launcher_pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    left = cgroups.remove_cgroups(_cgroup_dirs(info.name))
    if left:
        raise SandboxError("could not remove cgroups: " + "; ".join(left))
    (directory / STATE_FILE).unlink(missing_ok=True)
    if info.pid1_cgroup and cgroups.read_pid1_cgroup() != info.pid1_cgroup:
        raise SandboxError("PID 1's cgroups differ from before the booted host; see /proc/1/cgroup")


def leftovers() -> list[Path]:
    return cgroups.leftovers(NAME_PREFIX)


def sweep(*, force: bool = False, only: set[str] | None = None) -> list[str]:
    """Remove booted hosts a killed run left: their processes (with ``force``), by PID,
    then their cgroups. ``only`` limits it to those names. Returns the names removed.
    (Their mounts were in a private namespace and went with its last process.)"""
    names = sorted({p.name for p in leftovers() if only is None or p.name in only})
    removed: list[str] = []
    for name in names:
        dirs = [p for p in leftovers() if p.name == name]
        if any(cgroups.procs_in(d) for d in dirs):
            if not force:
                continue
            with contextlib.suppress(OSError):
                cgroups.kill_all(dirs, name, 15.0)
        if not cgroups.remove_cgroups(dirs):
            removed.append(name)
    return removed


def shell(info: HostInfo) -> int:
    """An interactive login shell inside the booted host; its exit status."""
    argv = info.nsenter("/bin/bash", "-l", env={"TERM": os.environ.get("TERM", "xterm")})
    return subprocess.run(argv, check=False).returncode
