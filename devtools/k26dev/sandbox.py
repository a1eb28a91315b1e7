"""A real systemd user manager, confined to a cgroup subtree of its own.

Tests, the demo and anyone checking their own unit files use this one
implementation (``k26-dev sandbox up|down|sweep``). The recipe is the one
in ``shared/docs/systemd-sandbox.md``:

1. create ``k26sbx-<pid>-<hex>`` in the systemd, unified, cpu, memory and pids
   hierarchies (the hybrid layout of these CPU machines), or once at the root of
   a host's single cgroup2 hierarchy (the unified layout of most GPU servers,
   where the units then get the memory and pids controllers);
2. a launcher process writes its own PID into each ``cgroup.procs`` and only
   then enters new cgroup and mount namespaces (``unshare``), so the child
   cgroup is the namespace's root;
3. inside, ``sandbox_inner`` re-mounts the hierarchies, puts a tmpfs on
   ``/run/systemd``, *checks that it is confined*, starts dbus-daemon and execs
   ``systemd --user``.

Why so careful: a bare ``systemd --user`` on these machines believes it owns the
root cgroup and moves every process, PID 1 included, into its ``init.scope``.
The launcher and the inner step each refuse to go on unless the confinement is
proven (see ``sandbox_inner``), so the manager cannot start unconfined.

Teardown (``down``) asks the manager to exit, then kills whatever is left in the
subtree (the dbus-daemons included), removes the cgroups depth-first and checks
that PID 1's cgroups are what they were before.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k26dev import cgroups
from k26dev.errors import SandboxError
from supervisor.atomic_write import write_atomic

CGROUP_ROOT = cgroups.CGROUP_ROOT
# The hierarchies the user manager touches. Order matters only for messages.
HIERARCHIES: tuple[str, ...] = ("systemd", "unified", "cpu", "memory", "pids")
NAME_PREFIX = "k26sbx-"
STATE_FILE = "sandbox.json"
SYSTEMD_BINARY = Path("/usr/lib/systemd/systemd")
# A host without systemd (the lent GPU host) brings its own: Debian's systemd and
# dbus binaries unpacked in one folder (bench/gpu/KIT.md): bin/systemd,
# bin/dbus-daemon, share/dbus-1/session.conf and units/ (default.target, ...).
KIT_ENV = "K26_SYSTEMD_KIT"
INNER_SCRIPT = Path(__file__).with_name("sandbox_inner.py")


def layout() -> str:
    """``unified`` when ``/sys/fs/cgroup`` is one cgroup2 hierarchy, else ``hybrid``."""
    return "unified" if cgroups.cgroup_mounts().get(str(CGROUP_ROOT)) == "cgroup2" else "hybrid"


def _kit() -> Path | None:
    value = os.environ.get(KIT_ENV)
    return Path(value) if value else None


def systemd_binary() -> Path:
    kit = _kit()
    return kit / "bin" / "systemd" if kit else SYSTEMD_BINARY


@dataclass
class SandboxInfo:
    """What ``up`` made; saved as ``DIR/sandbox.json`` so ``down`` can undo it."""

    dir: str
    name: str
    launcher_pid: int
    runtime_dir: str
    bus_address: str
    cgroups: list[str] = field(default_factory=list)
    pid1_cgroup: str = ""
    started_at: float = 0.0
    layout: str = "hybrid"

    @property
    def env(self) -> dict[str, str]:
        # XDG_STATE_HOME: a daemon's state (learned shapes) stays in the sandbox, never
        # in the invoking user's ~/.local/state.
        return {
            "XDG_RUNTIME_DIR": self.runtime_dir,
            "DBUS_SESSION_BUS_ADDRESS": self.bus_address,
            "XDG_STATE_HOME": str(Path(self.dir) / "state"),
        }

    @property
    def unit_dir(self) -> Path:
        return Path(self.runtime_dir) / "systemd" / "user"

    def exports(self) -> str:
        return "".join(f"export {k}={_shell_quote(v)}\n" for k, v in self.env.items())

    def save(self) -> None:
        path = Path(self.dir) / STATE_FILE
        write_atomic(path, json.dumps(asdict(self), indent=2), new_mode=0o666, durable=False)

    @classmethod
    def load(cls, directory: Path) -> SandboxInfo:
        path = directory / STATE_FILE
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except FileNotFoundError as exc:
            raise SandboxError(f"{path}: no sandbox here (was 'sandbox up --dir' run?)") from exc
        except (ValueError, TypeError) as exc:
            raise SandboxError(
                f"{path}: unreadable sandbox state ({exc}); use 'sandbox sweep'"
            ) from exc


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _check_host(kind: str) -> None:
    """Refuse early, with a clear reason, on a host the recipe does not fit."""
    if os.geteuid() != 0:
        raise SandboxError("the systemd sandbox needs root (it creates cgroups and namespaces)")
    for tool in ("unshare", "mount", "umount"):
        if shutil.which(tool) is None:
            raise SandboxError(f"'{tool}' not found on PATH; install util-linux")
    kit = _kit()
    binary = systemd_binary()
    if not binary.exists():
        hint = f"check ${KIT_ENV}" if kit else "install the 'systemd' package"
        raise SandboxError(f"{binary} not found; {hint}")
    if kit is None and shutil.which("dbus-daemon") is None:
        raise SandboxError("'dbus-daemon' not found on PATH; install dbus and dbus-user-session")
    if kit is not None:
        for needed in ("bin/dbus-daemon", "share/dbus-1/session.conf", "units/default.target"):
            if not (kit / needed).exists():
                raise SandboxError(f"${KIT_ENV}={kit}: {needed} is missing (see bench/gpu/KIT.md)")
    if kind == "unified":
        return
    mounts = cgroups.cgroup_mounts()
    for hierarchy in HIERARCHIES:
        fstype = mounts.get(str(CGROUP_ROOT / hierarchy))
        want = "cgroup2" if hierarchy == "unified" else "cgroup"
        if fstype != want:
            raise SandboxError(
                f"{CGROUP_ROOT / hierarchy} is not a {want} mount (found {fstype or 'nothing'}); "
                "the sandbox needs the hybrid cgroup layout or a single cgroup2 hierarchy"
            )


def _cgroup_dirs(name: str, kind: str | None = None) -> list[Path]:
    if (kind or layout()) == "unified":
        return [CGROUP_ROOT / name]
    return [CGROUP_ROOT / hierarchy / name for hierarchy in HIERARCHIES]


def _kit_units(kit: Path, unit_dir: Path) -> None:
    """The session bus as the manager's own socket-activated unit, from the kit's
    dbus-daemon (a host without systemd has no dbus.socket of Debian's)."""
    daemon, config = kit / "bin" / "dbus-daemon", kit / "share" / "dbus-1" / "session.conf"
    (unit_dir / "dbus.socket").write_text("[Socket]\nListenStream=%t/bus\n")
    (unit_dir / "dbus.service").write_text(
        "[Unit]\nRequires=dbus.socket\n[Service]\nType=notify\nNotifyAccess=main\n"
        f"ExecStart={daemon} --config-file={config} --address=systemd: --nofork "
        "--nopidfile --systemd-activation --nosyslog\nSlice=session.slice\n"
    )
    wants = unit_dir / "sockets.target.wants"
    wants.mkdir(exist_ok=True)
    link = wants / "dbus.socket"
    if not link.is_symlink():
        link.symlink_to("../dbus.socket")


def _enable_controllers(info: SandboxInfo) -> None:
    """Unified layout: give the units memory and pids (so ``MemoryMax=`` is enforced
    and ends in ``Result=oom-kill``). Allowed only once the subtree's root holds no
    process (cgroup v2's no-internal-process rule): the manager has moved itself and
    everything else into ``init.scope`` by the time it answers on the bus."""
    root = CGROUP_ROOT / info.name
    available = (root / "cgroup.controllers").read_text().split()
    wanted = [c for c in ("memory", "pids", "cpu", "io") if c in available]
    for controller in wanted:
        try:
            (root / "cgroup.subtree_control").write_text(f"+{controller}\n")
        except OSError as exc:
            raise SandboxError(
                f"cannot enable {controller} for the sandbox's units ({root}): {exc.strerror}"
            ) from exc


def up(directory: Path, *, timeout_s: float = 30.0) -> SandboxInfo:
    """Start a confined user manager under ``directory`` and leave it up; torn down
    if the start fails or a signal lands before it is up."""
    with running(directory, timeout_s=timeout_s, keep_up=True) as info:
        return info


@contextlib.contextmanager
def running(
    directory: Path, *, timeout_s: float = 30.0, keep_up: bool = False
) -> Iterator[SandboxInfo]:
    """``with running(dir) as sbx:`` starts a confined user manager under
    ``directory`` and tears it down on any exit, error or signal. With ``keep_up``,
    a body that ends normally leaves it up.

    One ``try`` covers everything from the state file on: a signal that lands
    anywhere, right after the start or before the body's first line included,
    tears down what was made."""
    kind = layout()
    _check_host(kind)
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / STATE_FILE).exists():
        stale = SandboxInfo.load(directory)
        if cgroups.pid_alive(stale.launcher_pid):
            raise SandboxError(
                f"{directory}: a sandbox is already up here ({stale.name}); 'down' it first"
            )
        down(directory)
    runtime = directory / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    os.chmod(runtime, 0o700)
    (runtime / "systemd" / "user").mkdir(parents=True, exist_ok=True)
    kit = _kit()
    if kit is not None:
        _kit_units(kit, runtime / "systemd" / "user")
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    _register(name)
    with cgroups.torn_down(lambda: down(directory), keep_up=keep_up):
        yield _start(directory, name, kind, runtime, kit, timeout_s)


def _start(
    directory: Path,
    name: str,
    kind: str,
    runtime: Path,
    kit: Path | None,
    timeout_s: float,
) -> SandboxInfo:
    pid1_before = cgroups.read_pid1_cgroup()
    planned = _cgroup_dirs(name, kind)
    info = SandboxInfo(
        dir=str(directory),
        name=name,
        launcher_pid=0,
        runtime_dir=str(runtime),
        bus_address=f"unix:path={runtime / 'bus'}",
        cgroups=[str(cg) for cg in planned],
        pid1_cgroup=pid1_before,
        started_at=time.time(),
        layout=kind,
    )
    # The state goes to disk before anything is made, so that ``down`` can undo
    # whatever was done, whenever a signal (or an error) lands.
    info.save()
    proc: subprocess.Popen[bytes] | None = None
    try:
        try:
            cgroups.make_cgroups(planned)
        except OSError as exc:
            raise SandboxError(f"cannot create cgroup {name}: {exc}") from exc
        proc = _launch(info, directory, runtime, kit)
        info.launcher_pid = proc.pid
        info.save()
        _wait_running(info, proc, timeout_s)
        if kind == "unified":
            _enable_controllers(info)
    except BaseException:
        cgroups.end_unrecorded(proc, info.launcher_pid)
        raise
    if cgroups.read_pid1_cgroup() != pid1_before:
        raise SandboxError("PID 1's cgroup changed while the sandbox started; it was torn down")
    return info


def _launch(
    info: SandboxInfo, directory: Path, runtime: Path, kit: Path | None
) -> subprocess.Popen[bytes]:
    """Start the inner launcher (it confines itself, then runs systemd)."""
    log = open(directory / "sandbox.log", "ab")  # noqa: SIM115 - handed to the child
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"}
    }
    env.update(info.env)
    if kit is not None:
        env["K26_SYSTEMD_BINARY"] = str(systemd_binary())
        # The runtime dir first: the project's units and the bus units above win.
        env["SYSTEMD_UNIT_PATH"] = f"{runtime / 'systemd' / 'user'}:{kit / 'units'}"
    cmd = [
        sys.executable,
        "-I",  # stdlib only, run as a file: no PYTHONPATH, nor the package installed
        str(INNER_SCRIPT),
        "launch",
        "--name",
        info.name,
        "--runtime",
        str(runtime),
        "--layout",
        info.layout,
    ]
    try:
        return cgroups.launch(cmd, log, env, info.cgroups, "the sandbox launcher")
    finally:
        log.close()


REGISTRY_ENV = "K26_SANDBOX_REGISTRY"


def _register(name: str) -> None:
    """Note ``name`` in the run's registry file ($K26_SANDBOX_REGISTRY), if there is one,
    so that a sweep after a killed run removes this run's sandboxes and no one else's."""
    registry = os.environ.get(REGISTRY_ENV)
    if not registry:
        return
    try:
        with open(registry, "a", encoding="utf-8") as handle:
            handle.write(name + "\n")
    except OSError as exc:
        raise SandboxError(
            f"cannot record the sandbox in {registry} (${REGISTRY_ENV}): {exc}"
        ) from exc


def registered(registry: Path) -> set[str]:
    """The sandbox names a run recorded in ``registry`` (see ``_register``)."""
    try:
        lines = registry.read_text(encoding="utf-8").split()
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise SandboxError(f"cannot read the sandbox registry {registry}: {exc}") from exc
    # Booted hosts (bootedhost.NAME_PREFIX) record their names here too.
    return {line for line in lines if line.startswith(("k26sbx-", "k26host-")) and "/" not in line}


def _systemctl(
    info: SandboxInfo, *args: str, timeout_s: float = 10.0
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(info.env)
    return subprocess.run(
        ["systemctl", "--user", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _wait_running(info: SandboxInfo, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait until the manager answers on the bus; fail fast if the launcher dies."""
    deadline = time.monotonic() + timeout_s
    private = Path(info.runtime_dir) / "systemd" / "private"
    while True:
        code = proc.poll()
        if code is not None:
            tail = _log_tail(Path(info.dir) / "sandbox.log")
            raise SandboxError(f"the sandbox launcher exited with {code}: {tail}")
        if private.exists():
            # Not is-system-running: outside the mount namespace there is no
            # /run/systemd/system, so systemctl would answer "offline".
            result = _systemctl(info, "show", "-p", "SystemState", "--value", timeout_s=5.0)
            state = result.stdout.strip()
            if state in {"running", "degraded"} and _manager_on_bus(info):
                return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxError(
                f"the sandbox manager did not come up within {timeout_s:.0f}s; "
                f"see {Path(info.dir) / 'sandbox.log'}"
            )
        # Startup takes tens of milliseconds; wake on the launcher's exit or a short tick.
        cgroups.wait_pid_exit(proc.pid, min(0.05, remaining))


def _manager_on_bus(info: SandboxInfo) -> bool:
    """The manager answers on its private socket before it owns its bus name."""
    env = dict(os.environ)
    env.update(info.env)
    result = subprocess.run(
        [
            "busctl",
            "--user",
            "call",
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            "GetNameOwner",
            "s",
            "org.freedesktop.systemd1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=5.0,
        check=False,
    )
    return result.returncode == 0


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def down(directory: Path, *, timeout_s: float = 15.0) -> None:
    """Stop the manager, kill what is left, remove every cgroup ``up`` made."""
    directory = directory.resolve()
    info = SandboxInfo.load(directory)
    if not info.name.startswith(NAME_PREFIX):
        raise SandboxError(
            f"{directory / STATE_FILE}: refusing a cgroup name not ours: {info.name}"
        )
    if cgroups.pid_alive(info.launcher_pid):
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            _systemctl(info, "exit", timeout_s=5.0)
        cgroups.wait_pid_exit(info.launcher_pid, 5.0)
    _kill_all(info.name, timeout_s, info.layout)
    proc = cgroups.LAUNCHED.pop(info.launcher_pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    left = cgroups.remove_cgroups(_cgroup_dirs(info.name, info.layout))
    if left:
        raise SandboxError("could not remove cgroups: " + "; ".join(left))
    (directory / STATE_FILE).unlink(missing_ok=True)
    if info.pid1_cgroup and cgroups.read_pid1_cgroup() != info.pid1_cgroup:
        raise SandboxError("PID 1's cgroups differ from before the sandbox; inspect /proc/1/cgroup")


def _kill_all(name: str, timeout_s: float, kind: str | None = None) -> None:
    try:
        cgroups.kill_all(_cgroup_dirs(name, kind), name, timeout_s)
    except OSError as exc:
        raise SandboxError(str(exc)) from exc


def leftovers() -> list[Path]:
    """Every ``k26sbx-*`` cgroup on the machine, in any hierarchy."""
    return cgroups.leftovers(NAME_PREFIX)


def sweep(*, force: bool = False, only: set[str] | None = None) -> list[str]:
    """Remove sandboxes left behind by a killed run.

    Without ``force`` only empty ``k26sbx-*`` cgroups are removed; with it, the
    processes inside them are killed first. ``only`` limits it to those names
    (other sandboxes, e.g. a test session's own, are left alone). Returns the
    names removed.
    """
    names = sorted({p.name for p in leftovers() if only is None or p.name in only})
    removed: list[str] = []
    for name in names:
        busy = [pid for cg in _cgroup_dirs(name) for pid in cgroups.procs_in(cg)]
        if busy and not force:
            continue
        if busy:
            _kill_all(name, 10.0)
        dirs = [p for p in leftovers() if p.name == name]
        if not cgroups.remove_cgroups(dirs):
            removed.append(name)
    return removed
