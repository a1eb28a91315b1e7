#!/usr/bin/env python3
"""A confined `systemd --user` on a PURE cgroup2 layout (the lent GPU host's), proven and torn down.

    python3 bench/gpu/cgroup2_spike.py run   [--kit DIR] [--workdir DIR] [--emulate-gpu-host] [--strace F]
    python3 bench/gpu/cgroup2_spike.py up    --workdir DIR [--kit DIR] ...   (prints the client exports)
    python3 bench/gpu/cgroup2_spike.py down  --workdir DIR
    python3 bench/gpu/cgroup2_spike.py probe [--kit DIR] [--strace F] [--env K=V ...] -- SYSTEMD-ARGS...
    python3 bench/gpu/cgroup2_spike.py sweep

`run`   brings up a confined user manager with its socket-activated session bus, then proves:
        (a) a `Type=exec` sleep unit's ControlGroup lies inside our subtree (systemd's view and the
        kernel's, read from outside); (b) a SIGKILL of its MainPID gives Result=signal,
        ExecMainCode=2, ExecMainStatus=9; (c) PID 1's cgroup is unchanged and no process that
        existed before was pulled into our subtree; (d) where the layout has controllers (the GPU
        host), `memory` and `pids` reach the unit (memory.max, pids.max) and a MemoryMax= unit that
        overflows ends with Result=oom-kill; (e) `systemd-run --user --wait` works; (f) pystemd, if
        importable, reads the unit over the session bus. Then it tears everything down and writes
        WORKDIR/result.json. Exit 0 only when every check held and teardown was clean.
`up`/`down` the same bring-up and teardown, split, for running the daemon or tests in between.
`probe` runs `systemd SYSTEMD-ARGS...` once inside the same confinement, waits (<= --timeout s),
        prints what it said, tears down. For reproducing start-up failures (use --strace).
`sweep` removes empty `k26sbx-spike-*` cgroups left by a killed run (it never kills anything).

Layouts (auto-detected):
  pure    /sys/fs/cgroup is cgroup2 (the GPU host). Our subtree: /sys/fs/cgroup/k26sbx-spike-PID.
  hybrid  v1 controllers + cgroup2 at /sys/fs/cgroup/unified (the CPU machines). Our subtree is
          k26sbx-spike-PID in unified, systemd, cpu, memory and pids, as supervisor/devtools/sandbox.py
          makes it; inside the namespaces ONLY cgroup2 is mounted at /sys/fs/cgroup, so systemd
          sees a pure ("unified") layout: the GPU host, emulated (without controllers).

Safety (shared/docs/systemd-sandbox.md, THE DANGER): systemd is exec'd only by the `inner` step,
and only after it has proven that (1) it sits in our child cgroups in every hierarchy (checked by
`launch` before unshare), (2) it is in a cgroup and mount namespace of its own (inodes differ from
the launcher's, and from PID 1's where readable) and /proc/self/cgroup reads `/` everywhere,
(3) /sys/fs/cgroup is the cgroup2 root of that namespace and holds only this process, and (4)
/run/systemd is a private tmpfs. /run/systemd/system is only ever created on that tmpfs. Teardown
(always, in `finally`): `systemctl --user exit`, SIGKILL by PID of whatever is left in our
cgroups, rmdir depth-first, check PID 1 and look for leftovers.

Why `systemd --user` "exits 1 and prints nothing" when started by hand (found with strace here):
its `console` log target is not stderr: the manager re-opens /dev/console
(`openat(AT_FDCWD, "/dev/console", O_WRONLY|O_NOCTTY|O_CLOEXEC) = 3`, then `writev(3, ...)`), so
its messages go to the machine's console, or nowhere. What it said there, on a host without unit
files, was `Unit default.target not found.` / `Falling back to rescue.target.` /
`Unit rescue.target not found.` and `exit_group(1)`; without XDG_RUNTIME_DIR it is
`Trying to run as user instance, but $XDG_RUNTIME_DIR is not set.`. The `inner` step therefore
bind-mounts a pty over /dev/console in its private mount namespace and relays it to the log, and
the kit carries the user targets (SYSTEMD_UNIT_PATH).

Stdlib only; Python 3.11+ (the GPU host has 3.12).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CG = Path("/sys/fs/cgroup")
PREFIX = "k26sbx-spike-"
V1 = {"systemd": "none,name=systemd", "cpu": "cpu", "memory": "memory", "pids": "pids"}
CGROUP2_SUPER_MAGIC = 0x63677270
TMPFS_MAGIC = 0x01021994
SELF = Path(__file__).resolve()
STATE = "spike.json"
# What the lent GPU host lacks; --emulate-gpu-host hides these from the manager (in its private
# mount namespace only), so a run here proves the kit does not lean on this machine's systemd.
GPU_HOST_LACKS = (
    "/usr/lib/systemd",
    "/usr/lib/x86_64-linux-gnu/systemd",
    "/usr/share/dbus-1",
    "/etc/systemd",
    "/etc/dbus-1",
    "/usr/bin/systemctl",
    "/usr/bin/systemd",
    "/usr/bin/busctl",
    "/usr/bin/systemd-run",
    "/usr/bin/journalctl",
    "/usr/bin/dbus-daemon",
    "/usr/lib/x86_64-linux-gnu/libkmod.so.2",
    "/usr/lib/x86_64-linux-gnu/libapparmor.so.1",
    "/usr/lib/x86_64-linux-gnu/libip4tc.so.2",
    "/usr/lib/x86_64-linux-gnu/libdbus-1.so.3",
)


def die(msg: str, code: int = 70) -> None:
    print(f"spike: refusing: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def say(msg: str) -> None:
    print(f"spike: {msg}", flush=True)


# ---------------------------------------------------------------- small helpers
class _Statfs(ctypes.Structure):
    _fields_ = [
        ("f_type", ctypes.c_long),
        ("f_bsize", ctypes.c_long),
        ("f_blocks", ctypes.c_ulong),
        ("f_bfree", ctypes.c_ulong),
        ("f_bavail", ctypes.c_ulong),
        ("f_files", ctypes.c_ulong),
        ("f_ffree", ctypes.c_ulong),
        ("f_fsid", ctypes.c_int * 2),
        ("f_namelen", ctypes.c_long),
        ("f_frsize", ctypes.c_long),
        ("f_flags", ctypes.c_long),
        ("f_spare", ctypes.c_long * 4),
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def fs_magic(path: str | Path) -> int:
    buf = _Statfs()
    if _libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))
    return buf.f_type & 0xFFFFFFFF


def layout() -> str:
    try:
        if fs_magic(CG) == CGROUP2_SUPER_MAGIC:
            return "pure"
        if fs_magic(CG / "unified") == CGROUP2_SUPER_MAGIC:
            for h in V1:
                if not (CG / h / "cgroup.procs").exists():
                    die(f"hybrid layout without the {h} hierarchy")
            return "hybrid"
    except OSError as exc:
        die(f"cannot read the cgroup layout: {exc}")
    die("neither a pure cgroup2 nor a hybrid layout")
    raise AssertionError


def hierarchies(lay: str) -> dict[str, Path]:
    """name -> mount point of each hierarchy we confine ourselves in."""
    if lay == "pure":
        return {"unified": CG}
    return {"unified": CG / "unified", **{h: CG / h for h in V1}}


def own_cgroups(pid: str = "self") -> dict[str, str]:
    found: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if ctrls == "":
            found["unified"] = path
        for c in ctrls.split(","):
            if c:
                found[c.removeprefix("name=")] = path
    return found


def visible_fstype(path: str) -> str | None:
    """fstype of the topmost mount at `path` (the last one listed for it)."""
    hit = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if left.split()[4] == path:
            hit = right.split()[0]
    return hit


def pids_in(top: Path) -> list[int]:
    pids: list[int] = []
    if not top.exists():
        return pids
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids.extend(int(x) for x in procs.read_text().split())
    return pids


def all_cgroups() -> dict[int, str]:
    snap: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                snap[int(d)] = Path(f"/proc/{d}/cgroup").read_text()
    return snap


def alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st.rpartition(")")[2].split()[0] != "Z"


def run_quiet(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if r.returncode:
        die(f"{' '.join(cmd)}: {r.stderr.strip()}")


# ---------------------------------------------------------------- tools (system or kit)
class Tools:
    def __init__(self, kit: str | None) -> None:
        self.kit = Path(kit).resolve() if kit else None
        if self.kit:
            b = self.kit / "bin"
            self.systemd, self.systemctl = b / "systemd", b / "systemctl"
            self.busctl, self.systemd_run = b / "busctl", b / "systemd-run"
            self.dbus_daemon = b / "dbus-daemon"
            self.dbus_conf = self.kit / "share/dbus-1/session.conf"
            self.units: Path | None = self.kit / "units"
        else:
            w = shutil.which
            self.systemd = Path("/usr/lib/systemd/systemd")
            self.systemctl = Path(w("systemctl") or "/usr/bin/systemctl")
            self.busctl = Path(w("busctl") or "/usr/bin/busctl")
            self.systemd_run = Path(w("systemd-run") or "/usr/bin/systemd-run")
            self.dbus_daemon = Path(w("dbus-daemon") or "/usr/bin/dbus-daemon")
            self.dbus_conf = Path("/usr/share/dbus-1/session.conf")
            self.units = None
        for p in (self.systemd, self.systemctl, self.busctl, self.dbus_daemon, self.dbus_conf):
            if not p.exists():
                die(f"{p} not found")

    def manager_env(self, runtime: Path) -> dict[str, str]:
        env = {
            "XDG_RUNTIME_DIR": str(runtime),
            "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime}/bus",
            "SYSTEMD_LOG_TARGET": "console",  # = /dev/console, which `inner` relays to the log
        }
        if self.units:
            # No trailing ':' -> the compiled-in /usr/lib/systemd/user etc. are NOT searched (the
            # GPU host has none): our runtime dir first (the project's unit files), then the kit's.
            env["SYSTEMD_UNIT_PATH"] = f"{runtime}/systemd/user:{self.units}"
            env["PATH"] = f"{self.kit}/bin:" + os.environ.get("PATH", "/usr/bin:/bin")
        return env


def write_bus_units(tools: Tools, runtime: Path) -> None:
    """dbus.socket + dbus.service as user units: the manager socket-activates its own bus."""
    ud = runtime / "systemd" / "user"
    (ud / "sockets.target.wants").mkdir(parents=True, exist_ok=True)
    (ud / "dbus.socket").write_text(
        "[Unit]\nDescription=D-Bus User Message Bus Socket\n\n[Socket]\nListenStream=%t/bus\n"
    )
    (ud / "dbus.service").write_text(
        "[Unit]\nDescription=D-Bus User Message Bus\nRequires=dbus.socket\n\n[Service]\n"
        "Type=notify\nNotifyAccess=main\n"
        # --config-file and --session exclude each other ("only one configuration file")
        f"ExecStart={tools.dbus_daemon} --config-file={tools.dbus_conf} --address=systemd: "
        "--nofork --nopidfile --systemd-activation --nosyslog\n"
        # no journald here: without this its messages go to /dev/null
        "StandardOutput=append:%t/dbus.log\nStandardError=inherit\nSlice=session.slice\n"
    )
    link = ud / "sockets.target.wants" / "dbus.socket"
    if not link.is_symlink():
        link.symlink_to("../dbus.socket")


# ---------------------------------------------------------------- launch / inner (run as children)
def step_launch(a: argparse.Namespace) -> None:
    name = a.name
    if not re.fullmatch(PREFIX + r"\d+", name):
        die(f"bad name {name!r}")
    hs = hierarchies(layout())
    for mp in hs.values():
        procs = mp / name / "cgroup.procs"
        try:
            procs.write_text(f"{os.getpid()}\n")
        except OSError as exc:
            die(f"cannot enter {procs}: {exc}")
    own = own_cgroups()
    for h in hs:
        if own.get(h) != f"/{name}":
            die(f"not in /{name} in hierarchy {h} (in {own.get(h)!r})")
    outer = ",".join(os.readlink(f"/proc/self/ns/{n}") for n in ("cgroup", "mnt"))
    argv = ["unshare", "--cgroup", "--mount", "--propagation", "private", "--"]
    argv += [sys.executable, "-I", str(SELF), "inner", "--name", name, "--outer-ns", outer]
    argv += ["--systemd", a.systemd]
    if a.strace:
        argv += ["--strace", a.strace]
    if not a.console:
        argv += ["--no-console"]
    for h in a.hide:
        argv += ["--hide", h]
    argv += ["--", *a.args]
    os.execvp("unshare", argv)


def step_inner(a: argparse.Namespace) -> None:
    me = os.getpid()
    # (2) namespaces of our own
    outer = dict(zip(("cgroup", "mnt"), a.outer_ns.split(","), strict=True))
    for n in ("cgroup", "mnt"):
        mine = os.readlink(f"/proc/self/ns/{n}")
        if mine == outer[n]:
            die(f"still in the launcher's {n} namespace")
        with contextlib.suppress(OSError):  # PID 1's may be hidden; the launcher check holds
            if mine == os.readlink(f"/proc/1/ns/{n}"):
                die(f"still in PID 1's {n} namespace")
    own = own_cgroups()
    if not own or any(p != "/" for p in own.values()):
        die(f"/proc/self/cgroup is not '/' everywhere: {own}")
    # (3) only cgroup2 at /sys/fs/cgroup; through our cgroup namespace its root is our subtree
    run_quiet("mount", "-t", "cgroup2", "-o", "nosuid,nodev,noexec", "cgroup2", str(CG))
    if fs_magic(CG) != CGROUP2_SUPER_MAGIC or visible_fstype(str(CG)) != "cgroup2":
        die("/sys/fs/cgroup is not our cgroup2 mount")
    root_procs = (CG / "cgroup.procs").read_text().split()
    if root_procs != [str(me)]:
        die(f"the namespace's cgroup2 root holds {root_procs}, expected only {me}")
    # (4) /run/systemd: a private tmpfs; /run/systemd/system only there
    run_quiet("mount", "-t", "tmpfs", "-o", "mode=755,size=64m", "k26spike", "/run/systemd")
    if (
        fs_magic("/run/systemd") != TMPFS_MAGIC
        or visible_fstype("/run/systemd") != "tmpfs"
        or os.stat("/run/systemd").st_dev == os.stat("/run").st_dev
    ):
        die("/run/systemd is not a private tmpfs")
    os.mkdir("/run/systemd/system")
    if os.stat("/run/systemd/system").st_dev != os.stat("/run/systemd").st_dev:
        die("/run/systemd/system is not on the private tmpfs")
    for h in a.hide:  # emulate a host without these (private mount namespace only)
        if os.path.isdir(h):
            run_quiet("mount", "-t", "tmpfs", "-o", "ro,mode=755,size=4k", "k26hide", h)
        elif os.path.exists(h):
            run_quiet("mount", "--bind", "/dev/null", h)
    try:
        pid1_ns = os.readlink("/proc/1/ns/cgroup")
    except OSError as exc:
        pid1_ns = f"unreadable: {exc.strerror}"
    say(
        f"inner {me}: confined: cgroup ns {os.readlink('/proc/self/ns/cgroup')} (launcher's "
        f"{outer['cgroup']}, PID 1's {pid1_ns}); /proc/self/cgroup '/' everywhere; "
        "/sys/fs/cgroup = cgroup2 holding only us; /run/systemd private tmpfs"
        + (f"; hidden: {len(a.hide)} paths" if a.hide else "")
    )
    if a.console:
        console_relay()
    argv = [a.systemd, *a.args]
    if a.strace:
        argv = ["strace", "-f", "-tt", "-s", "200", "-o", a.strace, *argv]
    os.execvp(argv[0], argv)


def console_relay() -> None:
    """Make /dev/console (in OUR mount namespace only) a pty whose output lands on our stdout.

    systemd's `console` log target does not write to stderr: the manager re-opens /dev/console
    and needs a tty there (it checks with TCGETS). A pty slave bind-mounted on /dev/console,
    private to this mount namespace, brings its messages back to the log.
    """
    if not os.path.exists("/dev/console"):
        say("no /dev/console to bind a pty on; the manager's messages are lost (try kmsg)")
        return
    import termios
    import tty

    master, slave = os.openpty()
    tty.setraw(slave)
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    run_quiet("mount", "--bind", os.ttyname(slave), "/dev/console")
    if os.fork() == 0:  # the relay: stays in our cgroups, killed by PID at teardown
        os.setsid()
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            os.write(1, data.replace(b"\r\n", b"\n"))
        os._exit(0)
    os.close(master)
    os.set_inheritable(slave, False)  # the relay holds the slave open; systemd opens its own


# ---------------------------------------------------------------- the orchestrator
class Spike:
    def __init__(
        self,
        tools: Tools,
        work: Path,
        *,
        strace: str | None = None,
        console: bool = True,
        hide: list[str] | None = None,
    ) -> None:
        if os.geteuid() != 0:
            die("needs root")
        for t in ("unshare", "mount"):
            if not shutil.which(t):
                die(f"{t} not on PATH")
        if strace and not shutil.which("strace"):
            die("strace not on PATH")
        self.tools, self.strace, self.console, self.hide = tools, strace, console, hide or []
        self.lay = layout()
        self.hs = hierarchies(self.lay)
        self.name = f"{PREFIX}{os.getpid()}"
        self.work = work.resolve()
        self.runtime = self.work / "run"
        self.log = self.work / "manager.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.launcher_pid = 0
        self.pid1 = Path("/proc/1/cgroup").read_text()
        self.made: list[Path] = []
        self.before: dict[int, str] = {}
        self.controllers: dict[str, object] = {}

    # ---- state, so `down` can undo an `up` from another process
    def save(self) -> None:
        state = {
            "name": self.name,
            "layout": self.lay,
            "made": [str(p) for p in self.made],
            "launcher_pid": self.launcher_pid,
            "runtime": str(self.runtime),
            "pid1": self.pid1,
            "kit": str(self.tools.kit) if self.tools.kit else None,
            "before": {str(k): v for k, v in self.before.items()},
        }
        (self.work / STATE).write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, work: Path) -> Spike:
        st = json.loads((work / STATE).read_text())
        if not re.fullmatch(PREFIX + r"\d+", st["name"]):
            die(f"{work / STATE}: not a spike state")
        s = cls(Tools(st["kit"]), work)
        s.name, s.lay, s.pid1 = st["name"], st["layout"], st["pid1"]
        s.hs = hierarchies(s.lay)
        s.made = [Path(p) for p in st["made"]]
        s.launcher_pid, s.runtime = st["launcher_pid"], Path(st["runtime"])
        s.before = {int(k): v for k, v in st["before"].items()}
        for p in s.made:
            if p.parent not in s.hs.values() or p.name != s.name:
                die(f"{work / STATE}: {p} is not one of our cgroups")
        return s

    def cenv(self) -> dict[str, str]:
        """env for clients outside the namespaces"""
        env = dict(os.environ)
        env["XDG_RUNTIME_DIR"] = str(self.runtime)
        env["DBUS_SESSION_BUS_ADDRESS"] = f"unix:path={self.runtime}/bus"
        return env

    def exports(self) -> str:
        e = {k: self.cenv()[k] for k in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")}
        if self.tools.kit:
            e["PATH"] = f"{self.tools.kit}/bin:$PATH"
        return "".join(f"export {k}={v}\n" for k, v in e.items())

    def systemctl(self, *args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.tools.systemctl), "--user", *args],
            env=self.cenv(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def show(self, unit: str, *props: str) -> dict[str, str]:
        r = self.systemctl("show", unit, *[f"-p{p}" for p in props])
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def launcher_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return alive(self.launcher_pid)

    def up(self, args: list[str], env_extra: dict[str, str] | None = None) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.runtime.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.runtime, 0o700)
        say(
            f"layout {self.lay}; subtree {self.name} in {', '.join(self.hs)}; runtime {self.runtime}"
        )
        say(f"PID 1 before: {' '.join(self.pid1.split())}")
        if not Path("/run/systemd").exists():
            # an empty mount point only (left in place: another manager may be mounted on it);
            # /run/systemd/system is never created here
            os.mkdir("/run/systemd", 0o755)
        self.before = all_cgroups()
        for mp in self.hs.values():
            d = mp / self.name
            d.mkdir()
            self.made.append(d)
        self.save()
        drop = {
            "NOTIFY_SOCKET",
            "LISTEN_FDS",
            "LISTEN_PID",
            "LISTEN_FDNAMES",
            "WATCHDOG_USEC",
            "WATCHDOG_PID",
            "INVOCATION_ID",
            "JOURNAL_STREAM",
            "MANAGERPID",
        }
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(self.tools.manager_env(self.runtime))
        for k, v in (env_extra or {}).items():  # K= (empty) unsets K
            if v:
                env[k] = v
            else:
                env.pop(k, None)
        cmd = [
            sys.executable,
            "-I",
            str(SELF),
            "launch",
            "--name",
            self.name,
            "--systemd",
            str(self.tools.systemd),
        ]
        if self.strace:
            cmd += ["--strace", self.strace]
        if not self.console:
            cmd += ["--no-console"]
        for h in self.hide:
            cmd += ["--hide", h]
        cmd += ["--", *args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self.launcher_pid = self.proc.pid
        self.save()

    def wait_manager(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.launcher_alive():
                raise RuntimeError(f"the manager exited; log:\n{self.log.read_text()}")
            if (self.runtime / "systemd" / "private").exists():
                st = self.systemctl("show", "-pSystemState", "--value", timeout=5).stdout.strip()
                if st in {"running", "degraded"}:
                    # the first bus client socket-activates dbus.service; the manager then
                    # takes org.freedesktop.systemd1 on it
                    r = subprocess.run(
                        [
                            str(self.tools.busctl),
                            "--user",
                            "call",
                            "org.freedesktop.DBus",
                            "/org/freedesktop/DBus",
                            "org.freedesktop.DBus",
                            "GetNameOwner",
                            "s",
                            "org.freedesktop.systemd1",
                        ],
                        env=self.cenv(),
                        capture_output=True,
                        text=True,
                        timeout=5,
                        check=False,
                    )
                    if r.returncode == 0:
                        say(
                            f"manager up: SystemState={st}, org.freedesktop.systemd1 is "
                            f"{r.stdout.split()[-1]} on {self.runtime}/bus"
                        )
                        return
            time.sleep(0.05)
        raise RuntimeError(f"manager not up in {timeout}s; log:\n{self.log.read_text()}")

    def enable_controllers(self) -> None:
        """Pure cgroup2: hand memory/pids/cpu/io down to the manager's units.

        cgroup v2's no-internal-process rule: a (non-root) cgroup can only enable a controller
        for its children while it holds no process itself. The manager has moved itself (and
        everything else that was there) into init.scope by now, so the subtree root is empty.
        systemd 252 also enables what a unit needs on its own; writing them here makes it
        independent of that and lets `run` check the result.
        """
        root = self.hs["unified"] / self.name
        avail = (root / "cgroup.controllers").read_text().split()
        want = [c for c in ("cpu", "io", "memory", "pids") if c in avail]
        self.controllers = {"available": avail, "wanted": want}
        if not want:
            say("controllers: none available in this layout (the hybrid emulation has none)")
            return
        left = (root / "cgroup.procs").read_text().split()
        if left:
            raise RuntimeError(f"subtree root still holds processes {left}: cannot enable {want}")
        errors = {}
        for c in want:  # one by one: `cpu` may refuse (realtime tasks) without spoiling the rest
            try:
                (root / "cgroup.subtree_control").write_text(f"+{c}")
            except OSError as exc:
                errors[c] = exc.strerror
        self.controllers["subtree_control"] = (root / "cgroup.subtree_control").read_text().split()
        if errors:
            self.controllers["errors"] = errors
        if any(c in errors for c in ("memory", "pids")):
            raise RuntimeError(f"cannot enable {errors} in {root}/cgroup.subtree_control")
        say(f"controllers: {root}/cgroup.subtree_control = {self.controllers['subtree_control']}")

    def check_pid1(self) -> None:
        now = Path("/proc/1/cgroup").read_text()
        if now != self.pid1:
            raise RuntimeError(f"PID 1's cgroup CHANGED:\n{now}")

    def our_pids(self) -> set[int]:
        return {p for mp in self.hs.values() for p in pids_in(mp / self.name)}

    def pulled_in(self) -> tuple[list[str], list[str]]:
        """(processes that existed before and now sit in our subtree, other cgroup changes)"""
        captured, other = [], []
        ours = self.our_pids()
        for pid, cg in all_cgroups().items():
            if pid not in self.before or self.before[pid] == cg or pid == self.launcher_pid:
                continue
            line = f"{pid}: {' '.join(self.before[pid].split())} -> {' '.join(cg.split())}"
            (captured if pid in ours else other).append(line)
        return captured, other

    def down(self) -> list[str]:
        problems: list[str] = []
        if self.launcher_alive():
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self.systemctl("exit", timeout=5)
            deadline = time.monotonic() + 5
            while self.launcher_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while True:
            pids = sorted(p for p in self.our_pids() if p > 0)
            if not pids:
                break
            if time.monotonic() > deadline:
                problems.append(f"survived SIGKILL: {pids}")
                break
            for p in pids:  # by PID, and only PIDs found in our own cgroups
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.05)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                problems.append(f"launcher {self.proc.pid} not reaped")
        for top in self.made:
            subdirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for d in [*subdirs, top]:
                for _ in range(100):
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        if exc.errno != errno.EBUSY:
                            problems.append(f"rmdir {d}: {exc.strerror}")
                            break
                        time.sleep(0.02)
                else:
                    problems.append(f"rmdir {d}: busy")
        now = Path("/proc/1/cgroup").read_text()
        if now != self.pid1:
            problems.append(f"PID 1's cgroup differs: {now!r}")
        if not all(line.rpartition(":")[2] == "/" for line in now.splitlines()):
            problems.append(f"PID 1 is not at / everywhere: {now!r}")
        ours = [str(p) for p in leftovers() if p.name == self.name]
        if ours:
            problems.append(f"our cgroups left: {ours}")
        others = [str(p) for p in leftovers() if p.name != self.name]
        if Path("/run/systemd/system").exists():
            problems.append("/run/systemd/system exists on the real filesystem")
        (self.work / STATE).unlink(missing_ok=True)
        say(
            "teardown: "
            + (
                "clean: manager gone, our cgroups removed, PID 1 at '/' everywhere, "
                "no /run/systemd/system outside"
                if not problems
                else "PROBLEMS: " + "; ".join(problems)
            )
            + (f" (other sandboxes, not ours: {others})" if others else "; no k26sbx* left")
        )
        return problems


def leftovers() -> list[Path]:
    if fs_magic(CG) == CGROUP2_SUPER_MAGIC:
        return sorted(CG.glob("k26sbx*"))
    found: list[Path] = []
    for h in CG.iterdir():
        with contextlib.suppress(OSError):
            found.extend(h.glob("k26sbx*"))
    return sorted(found)


def hide_list(a: argparse.Namespace) -> list[str]:
    hide = list(a.hide)
    if a.emulate_gpu_host:
        hide += [p for p in GPU_HOST_LACKS if os.path.lexists(p)]
    for p in hide:
        if not p.startswith("/") or p.rstrip("/") in {
            "",
            "/usr",
            "/etc",
            "/run",
            "/proc",
            "/sys",
            "/dev",
        }:
            die(f"will not hide {p!r}")
    return hide


def cmd_probe(a: argparse.Namespace) -> int:
    work = Path(a.workdir or tempfile.mkdtemp(prefix="k26spike-"))
    s = Spike(Tools(a.kit), work, strace=a.strace, console=a.console, hide=hide_list(a))
    extra = dict(kv.split("=", 1) for kv in a.env)
    try:
        s.up(a.args, extra)
        assert s.proc
        try:
            say(f"systemd exited with {s.proc.wait(timeout=a.timeout)}")
        except subprocess.TimeoutExpired:
            say(f"systemd still running after {a.timeout}s (as a working manager does)")
        s.check_pid1()
    finally:
        say("manager output:\n" + s.log.read_text(errors="replace"))
        problems = s.down()
    return 3 if problems else 0


def cmd_up(a: argparse.Namespace) -> int:
    work = Path(a.workdir)
    if (work / STATE).exists():
        die(f"{work / STATE} exists: `down --workdir {work}` first")
    tools = Tools(a.kit)
    s = Spike(tools, work, strace=a.strace, console=a.console, hide=hide_list(a))
    write_bus_units(tools, s.runtime)
    try:
        s.up(["--user"])
        s.wait_manager()
        s.enable_controllers()
        s.check_pid1()
    except BaseException as exc:
        say(f"FAILED: {exc}")
        s.down()
        return 1
    sys.stdout.write(s.exports())
    say(f"unit files go to {s.runtime}/systemd/user (then daemon-reload); `down --workdir {work}`")
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    return 1 if Spike.load(Path(a.workdir)).down() else 0


def _wait_state(s: Spike, unit: str, states: set[str], timeout: float = 15) -> dict[str, str]:
    props = ("ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus", "MainPID")
    deadline = time.monotonic() + timeout
    while True:
        q = s.show(unit, *props)
        if q.get("ActiveState") in states or time.monotonic() > deadline:
            return q
        time.sleep(0.05)


def cmd_run(a: argparse.Namespace) -> int:
    tools = Tools(a.kit)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="k26spike-"))
    s = Spike(tools, work, strace=a.strace, console=a.console, hide=hide_list(a))
    res: dict[str, object] = {
        "layout": s.lay,
        "name": s.name,
        "hidden": s.hide,
        "kit": str(tools.kit) if tools.kit else None,
    }
    ok = False
    try:
        write_bus_units(tools, s.runtime)
        ud = s.runtime / "systemd" / "user"
        unit, oom = "spike-sleep.service", "spike-oom.service"
        t0 = time.monotonic()
        s.up(["--user"])
        s.wait_manager()
        res["startup_s"] = round(time.monotonic() - t0, 3)
        # unit files written while the manager runs, then daemon-reload, as the daemon does it
        # (needs >= 16 MB free on /run/systemd: "Refusing to reload, not enough space")
        (ud / unit).write_text(
            "[Unit]\nDescription=k26 spike sleeper\n\n[Service]\nType=exec\n"
            "ExecStart=/bin/sleep 1000\nMemoryMax=256M\nTasksMax=64\n"
        )
        (ud / oom).write_text(
            "[Unit]\nDescription=k26 spike memory hog\n\n[Service]\nType=exec\n"
            f"ExecStart={sys.executable} -c \"import time; x = b'x' * (512 << 20); time.sleep(30)\"\n"
            "MemoryMax=64M\nMemorySwapMax=0\n"
        )
        r = s.systemctl("daemon-reload", timeout=20)
        if r.returncode:
            raise RuntimeError(f"daemon-reload: {r.stderr.strip()}")
        s.enable_controllers()
        res["controllers"] = s.controllers
        s.check_pid1()
        res["systemctl_version"] = s.systemctl("--version").stdout.splitlines()[0]
        r = s.systemctl("start", unit)
        if r.returncode:
            raise RuntimeError(f"start {unit}: {r.stderr}")
        p = s.show(unit, "ControlGroup", "MainPID")
        cgpath, mainpid = p["ControlGroup"], int(p["MainPID"])
        if mainpid <= 0:
            raise RuntimeError(f"{unit} has no MainPID: {p}")
        outside = own_cgroups(str(mainpid))["unified"]
        unitdir = s.hs["unified"] / s.name / cgpath.lstrip("/")
        res["a_controlgroup"] = {
            "systemd": cgpath,
            "kernel_from_outside": outside,
            "dir": str(unitdir),
        }
        if outside != f"/{s.name}{cgpath}" or not unitdir.is_dir():
            raise RuntimeError(f"(a) unit cgroup {cgpath} / {outside} is not inside /{s.name}")
        say(f"(a) ControlGroup={cgpath}; the kernel, from outside: {outside}: inside our subtree")
        has_mem = "memory" in s.controllers.get("available", [])  # type: ignore[operator]
        if has_mem:
            lim = {
                f: (unitdir / f).read_text().strip()
                for f in ("memory.max", "pids.max")
                if (unitdir / f).exists()
            }
            res["d_unit_limits"] = lim
            if lim != {"memory.max": str(256 << 20), "pids.max": "64"}:
                raise RuntimeError(f"(d) memory/pids did not reach the unit: {lim}")
            say(f"(d) unit cgroup limits: {lim}")
        os.kill(mainpid, signal.SIGKILL)
        q = _wait_state(s, unit, {"failed", "inactive"})
        res["b_sigkill"] = q
        if (q.get("Result"), q.get("ExecMainCode"), q.get("ExecMainStatus")) != (
            "signal",
            "2",
            "9",
        ):
            raise RuntimeError(f"(b) after SIGKILL: {q}")
        say(
            f"(b) SIGKILL of MainPID {mainpid}: Result={q['Result']} ExecMainCode={q['ExecMainCode']}"
            f" ExecMainStatus={q['ExecMainStatus']} ActiveState={q['ActiveState']}"
        )
        if has_mem:
            s.systemctl("start", "--no-block", oom)
            q = _wait_state(s, oom, {"failed", "inactive"}, timeout=30)
            res["d_oom"] = q
            if q.get("Result") != "oom-kill":
                raise RuntimeError(f"(d) MemoryMax=64M hog: {q}")
            say(f"(d) MemoryMax=64M hog: Result={q['Result']} (from memory.events)")
        else:
            res["d_oom"] = "skipped: no memory controller in this layout"
        r = subprocess.run(
            [str(tools.systemd_run), "--user", "--wait", "-q", "-p", "Type=exec", "/bin/true"],
            env=s.cenv(),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        res["e_systemd_run"] = {"rc": r.returncode, "stderr": r.stderr.strip()}
        if r.returncode:
            raise RuntimeError(
                f"(e) systemd-run --user --wait /bin/true: {r.returncode} {r.stderr}"
            )
        say("(e) systemd-run --user --wait /bin/true: rc 0")
        res["f_pystemd"] = pystemd_check(s, unit)
        say(f"(f) pystemd: {res['f_pystemd']}")
        s.check_pid1()
        captured, other = s.pulled_in()
        res["c_pid1_cgroup"] = Path("/proc/1/cgroup").read_text().split()
        res["c_captured"], res["c_other_changes"] = captured, other
        if captured:
            raise RuntimeError(
                f"(c) processes from outside were pulled into our subtree: {captured}"
            )
        say(
            "(c) PID 1's cgroup unchanged; no process from outside was pulled into our subtree"
            + (f" (unrelated changes elsewhere: {other})" if other else "")
        )
        ok = True
    except Exception as exc:
        res["error"] = str(exc)
        say(f"FAILED: {exc}")
    finally:
        problems = s.down()
        res["teardown_problems"] = problems
        res["manager_log_tail"] = s.log.read_text(errors="replace").splitlines()[-15:]
        (s.work / "result.json").write_text(json.dumps(res, indent=1))
        say(f"result: {s.work / 'result.json'}")
    return 0 if ok and not problems else 1


def pystemd_check(s: Spike, unit: str) -> str:
    """Read the unit's state over the session bus with pystemd, as the daemon does."""
    code = (
        "import sys\n"
        "from pystemd.systemd1 import Unit\n"
        "from pystemd.dbuslib import DBus\n"
        "with DBus(user_mode=True) as bus:\n"
        "    u = Unit(sys.argv[1].encode(), bus=bus, _autoload=True)\n"
        "    print(u.Unit.ActiveState.decode(), u.Service.Result.decode(), u.Service.ExecMainStatus)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, unit],
        env=s.cenv(),
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"not checked/failed: {tail}"
    return f"ok: {unit} reads {r.stdout.strip()!r} over {s.runtime}/bus"


def cmd_sweep(_a: argparse.Namespace) -> int:
    rc = 0
    for d in leftovers():
        if not d.name.startswith(PREFIX):
            continue
        busy = pids_in(d)
        if busy:
            say(f"{d}: busy {busy}, left alone")
            rc = 1
            continue
        for sub in [
            *sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)),
            d,
        ]:
            sub.rmdir()
        say(f"removed {d}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sp = ap.add_subparsers(dest="cmd", required=True)
    for c in ("run", "up", "probe"):
        p = sp.add_parser(c)
        p.add_argument(
            "--kit", help="use KIT/bin, KIT/units, KIT/share (kit/systemd of make_kit.sh)"
        )
        p.add_argument("--workdir", required=(c == "up"))
        p.add_argument("--strace", help="run systemd under strace -f -o FILE")
        p.add_argument(
            "--no-console",
            dest="console",
            action="store_false",
            help="leave /dev/console alone (the manager's log then goes to the console)",
        )
        p.add_argument("--hide", action="append", default=[], help="hide PATH from the manager")
        p.add_argument(
            "--emulate-gpu-host",
            action="store_true",
            help="hide this machine's systemd/dbus files and the libs the GPU host lacks",
        )
        if c == "probe":
            p.add_argument(
                "--env", action="append", default=[], help="K=V for the manager; K= unsets"
            )
            p.add_argument("--timeout", type=float, default=10)
            p.add_argument("args", nargs="*")
    sp.add_parser("down").add_argument("--workdir", required=True)
    sp.add_parser("sweep")
    for c in ("launch", "inner"):
        p = sp.add_parser(c)
        p.add_argument("--name", required=True)
        p.add_argument("--systemd", required=True)
        p.add_argument("--strace")
        p.add_argument("--no-console", dest="console", action="store_false")
        p.add_argument("--hide", action="append", default=[])
        p.add_argument("--outer-ns", default="")
        p.add_argument("args", nargs="*")
    a = ap.parse_args()
    if a.cmd == "launch":
        step_launch(a)
    elif a.cmd == "inner":
        if not a.outer_ns:
            die("inner needs --outer-ns (run it through launch)")
        step_inner(a)
    cmds = {"run": cmd_run, "up": cmd_up, "down": cmd_down, "probe": cmd_probe, "sweep": cmd_sweep}
    return cmds[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
