#!/usr/bin/env python3
"""A confined `systemd --user` on a PURE cgroup2 layout (the lent GPU host's), proven and torn down.

    python3 bench/gpu/cgroup2_spike.py run   [--kit DIR] [--workdir DIR] [--strace FILE]
    python3 bench/gpu/cgroup2_spike.py probe [--kit DIR] [--strace FILE] [--env K=V ...] -- ARGS...
    python3 bench/gpu/cgroup2_spike.py sweep

`run`   brings up a confined user manager with its session bus, starts a `Type=exec` sleep unit and
        shows (a) its ControlGroup lies inside our subtree, (b) a SIGKILL of its MainPID gives
        Result=signal / status 9, (c) PID 1's cgroup (and every other process's) is unchanged;
        on a host with controllers it also checks that `memory` and `pids` reach the unit. Then it
        tears everything down. Exit 0 only when every check held.
`probe` runs `systemd ARGS...` once inside the same confinement, waits (<= 10 s) for it to exit,
        prints its output, tears down. For reproducing start-up failures (with --strace).
`sweep` removes empty `k26sbx-spike-*` cgroups left behind by a killed run (never kills anything).

Layouts (auto-detected):
  pure    /sys/fs/cgroup is cgroup2 (the GPU host). Our subtree: /sys/fs/cgroup/k26sbx-spike-PID.
  hybrid  v1 controllers + cgroup2 at /sys/fs/cgroup/unified (the CPU machines). Our subtree is
          k26sbx-spike-PID in unified, systemd, cpu, memory and pids, as supervisor/sandbox.py
          makes it; inside the namespaces ONLY cgroup2 is mounted at /sys/fs/cgroup, so systemd
          sees a pure ("unified") layout: this emulates the GPU host here.

Safety (see shared/docs/systemd-sandbox.md, THE DANGER): systemd is exec'd only by the `inner`
step, and only after it has proven that (1) it sits in our child cgroups in every hierarchy, (2)
it is in a cgroup and mount namespace of its own (inode differs from the launcher's and PID 1's)
and /proc/self/cgroup reads `/` everywhere, (3) /sys/fs/cgroup is the cgroup2 root of that
namespace holding only this process, and (4) /run/systemd is a private tmpfs. /run/systemd/system
is only ever created on that tmpfs. Teardown (always, in `finally`): `systemctl --user exit`, then
SIGKILL by PID whatever is left in our cgroups, rmdir depth-first, check PID 1.

Stdlib only; Python 3.11+ (the GPU host has 3.12).
"""

from __future__ import annotations

import argparse
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


def mountinfo() -> list[tuple[str, str]]:
    """(mount point, fstype) in mount order; the last entry for a path is the visible one."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        out.append((left.split()[4], right.split()[0]))
    return out


def visible_fstype(path: str) -> str | None:
    hit = None
    for mp, fs in mountinfo():
        if mp == path:
            hit = fs
    return hit


def pids_in(top: Path) -> list[int]:
    pids: list[int] = []
    if not top.exists():
        return pids
    for procs in top.rglob("cgroup.procs"):
        try:
            pids.extend(int(x) for x in procs.read_text().split())
        except (OSError, ValueError):
            pass
    return pids


def all_cgroups() -> dict[int, str]:
    snap: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                snap[int(d)] = Path(f"/proc/{d}/cgroup").read_text()
            except OSError:
                pass
    return snap


def alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st.rpartition(")")[2].split()[0] != "Z"


# ---------------------------------------------------------------- tools (system or kit)
class Tools:
    def __init__(self, kit: str | None) -> None:
        self.kit = Path(kit).resolve() if kit else None
        if self.kit:
            b = self.kit / "bin"
            self.systemd, self.systemctl = b / "systemd", b / "systemctl"
            self.busctl, self.dbus_daemon = b / "busctl", b / "dbus-daemon"
            self.dbus_conf = self.kit / "share/dbus-1/session.conf"
            self.units = self.kit / "units"
        else:
            self.systemd = Path("/usr/lib/systemd/systemd")
            self.systemctl = Path(shutil.which("systemctl") or "/usr/bin/systemctl")
            self.busctl = Path(shutil.which("busctl") or "/usr/bin/busctl")
            self.dbus_daemon = Path(shutil.which("dbus-daemon") or "/usr/bin/dbus-daemon")
            self.dbus_conf = Path("/usr/share/dbus-1/session.conf")
            self.units = None
        for p in (self.systemd, self.systemctl, self.busctl, self.dbus_daemon, self.dbus_conf):
            if not p.exists():
                die(f"{p} not found")

    def manager_env(self, runtime: Path) -> dict[str, str]:
        env = {
            "XDG_RUNTIME_DIR": str(runtime),
            "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime}/bus",
            "SYSTEMD_LOG_TARGET": "console",
        }
        if self.units:
            # No trailing ':' -> the compiled-in /usr/lib/systemd/user etc. are NOT searched (the GPU
            # host has none): our runtime dir first (the project's unit files), then the kit's targets.
            env["SYSTEMD_UNIT_PATH"] = f"{runtime}/systemd/user:{self.units}"
            env["PATH"] = f"{self.kit}/bin:" + os.environ.get("PATH", "/usr/bin:/bin")
        return env


def write_bus_units(tools: Tools, runtime: Path) -> None:
    """dbus.socket + dbus.service as user units (the manager socket-activates its own bus)."""
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
    lay = layout()
    hs = hierarchies(lay)
    for h, mp in hs.items():
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
    argv = [
        "unshare",
        "--cgroup",
        "--mount",
        "--propagation",
        "private",
        "--",
        sys.executable,
        "-I",
        str(SELF),
        "inner",
        "--name",
        name,
        "--layout",
        lay,
        "--outer-ns",
        outer,
        "--runtime",
        a.runtime,
        "--systemd",
        a.systemd,
    ]
    if a.strace:
        argv += ["--strace", a.strace]
    if not a.console:
        argv += ["--no-console"]
    argv += ["--", *a.args]
    os.execvp("unshare", argv)


def run_quiet(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode:
        die(f"{' '.join(cmd)}: {r.stderr.strip()}")


def step_inner(a: argparse.Namespace) -> None:
    me = os.getpid()
    # (2) namespaces of our own
    outer = dict(zip(("cgroup", "mnt"), a.outer_ns.split(","), strict=True))
    for n in ("cgroup", "mnt"):
        mine = os.readlink(f"/proc/self/ns/{n}")
        if mine == outer[n]:
            die(f"still in the launcher's {n} namespace")
        try:
            if mine == os.readlink(f"/proc/1/ns/{n}"):
                die(f"still in PID 1's {n} namespace")
        except OSError:
            pass
    own = own_cgroups()
    if not own or any(p != "/" for p in own.values()):
        die(f"/proc/self/cgroup is not '/' everywhere: {own}")
    # (3) only cgroup2 at /sys/fs/cgroup; seen through our cgroup namespace its root is our subtree
    run_quiet("mount", "-t", "cgroup2", "-o", "nosuid,nodev,noexec", "cgroup2", str(CG))
    if fs_magic(CG) != CGROUP2_SUPER_MAGIC or visible_fstype(str(CG)) != "cgroup2":
        die("/sys/fs/cgroup is not our cgroup2 mount")
    root_procs = (CG / "cgroup.procs").read_text().split()
    if root_procs != [str(me)]:
        die(f"the namespace's cgroup2 root holds {root_procs}, expected only {me}")
    # (4) /run/systemd: a private tmpfs; /run/systemd/system only there
    run_quiet("mount", "-t", "tmpfs", "-o", "mode=755,size=4m", "k26spike", "/run/systemd")
    if (
        fs_magic("/run/systemd") != TMPFS_MAGIC
        or visible_fstype("/run/systemd") != "tmpfs"
        or os.stat("/run/systemd").st_dev == os.stat("/run").st_dev
    ):
        die("/run/systemd is not a private tmpfs")
    os.mkdir("/run/systemd/system")
    if os.stat("/run/systemd/system").st_dev != os.stat("/run/systemd").st_dev:
        die("/run/systemd/system is not on the private tmpfs")
    try:
        pid1_ns = os.readlink("/proc/1/ns/cgroup")
    except OSError as exc:
        pid1_ns = f"unreadable: {exc.strerror}"
    print(
        f"spike: inner {me}: confined (cgroup ns {os.readlink('/proc/self/ns/cgroup')}, launcher's "
        f"{outer['cgroup']}, PID 1's {pid1_ns}); /proc/self/cgroup all '/'; layout seen by systemd: unified",
        flush=True,
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
    (strace: `openat(AT_FDCWD, "/dev/console", O_WRONLY|O_NOCTTY|O_CLOEXEC) = 3` then
    `writev(3, ...)`), and it needs a tty there (it checks with TCGETS). So a manager started from a
    script "prints nothing" even with --log-target=console --log-level=debug. A bind-mounted pty
    slave on /dev/console, private to this mount namespace, brings its messages back.
    """
    if not os.path.exists("/dev/console"):
        print(
            "spike: no /dev/console to bind a pty on; use SYSTEMD_LOG_TARGET=kmsg and dmesg",
            flush=True,
        )
        return
    import termios
    import tty

    master, slave = os.openpty()
    tty.setraw(slave)
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    run_quiet("mount", "--bind", os.ttyname(slave), "/dev/console")
    if os.fork() == 0:  # the relay: in our cgroup, killed by PID at teardown
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
    # the relay keeps the slave open through its copy of the fd table; ours closes at exec? keep it
    # open until exec (not CLOEXEC-inherited: systemd closes stray fds itself).
    os.set_inheritable(slave, False)


# ---------------------------------------------------------------- the orchestrator
class Spike:
    def __init__(self, tools: Tools, workdir: Path, strace: str | None, console: bool = True) -> None:
        if os.geteuid() != 0:
            die("needs root")
        for t in ("unshare", "mount"):
            if not shutil.which(t):
                die(f"{t} not on PATH")
        if strace and not shutil.which("strace"):
            die("strace not on PATH")
        self.tools, self.strace, self.console = tools, strace, console
        self.lay = layout()
        self.hs = hierarchies(self.lay)
        self.name = f"{PREFIX}{os.getpid()}"
        self.work = workdir
        self.runtime = workdir / "run"
        self.log = workdir / "manager.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid1 = Path("/proc/1/cgroup").read_text()
        self.made: list[Path] = []
        self.made_run_systemd = False
        self.before: dict[int, str] = {}

    # env for clients outside the namespaces
    def cenv(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "XDG_RUNTIME_DIR": str(self.runtime),
                "DBUS_SESSION_BUS_ADDRESS": f"unix:path={self.runtime}/bus",
            }
        )
        return env

    def systemctl(self, *args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.tools.systemctl), "--user", *args],
            env=self.cenv(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def show(self, unit: str, *props: str) -> dict[str, str]:
        r = self.systemctl("show", unit, *[f"-p{p}" for p in props])
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def up(self, args: list[str], env_extra: dict[str, str]) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.runtime.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.runtime, 0o700)
        say(
            f"layout {self.lay}; subtree {self.name} in {', '.join(self.hs)}; runtime {self.runtime}"
        )
        say(f"PID 1 before: {' '.join(self.pid1.split())}")
        if not Path("/run/systemd").exists():
            os.mkdir("/run/systemd", 0o755)  # an empty mount point only; never system/ in it
            self.made_run_systemd = True
        self.before = all_cgroups()
        for mp in self.hs.values():
            d = mp / self.name
            d.mkdir()
            self.made.append(d)
        env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in {
                "NOTIFY_SOCKET",
                "LISTEN_FDS",
                "LISTEN_PID",
                "WATCHDOG_USEC",
                "WATCHDOG_PID",
                "INVOCATION_ID",
                "JOURNAL_STREAM",
            }
        }
        env.update(self.tools.manager_env(self.runtime))
        for k, v in env_extra.items():  # K= (empty) unsets K
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
            "--runtime",
            str(self.runtime),
            "--systemd",
            str(self.tools.systemd),
        ]
        if self.strace:
            cmd += ["--strace", self.strace]
        if not self.console:
            cmd += ["--no-console"]
        cmd += ["--", *args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )

    def wait_manager(self, timeout: float = 30) -> None:
        assert self.proc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the manager exited with {self.proc.returncode}; log:\n{self.log.read_text()}"
                )
            if (self.runtime / "systemd" / "private").exists():
                st = self.systemctl("show", "-pSystemState", "--value", timeout=5).stdout.strip()
                if st in {"running", "degraded"}:
                    # first bus client: socket-activates dbus.service; the manager then takes its name
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
                    )
                    if r.returncode == 0:
                        say(
                            f"manager up: SystemState={st}, org.freedesktop.systemd1 owned by {r.stdout.split()[-1]}"
                        )
                        return
            time.sleep(0.05)
        raise RuntimeError(f"manager not up in {timeout}s; log:\n{self.log.read_text()}")

    def check_pid1(self) -> None:
        now = Path("/proc/1/cgroup").read_text()
        if now != self.pid1:
            raise RuntimeError(f"PID 1's cgroup CHANGED:\n{now}")

    def moved_outside(self) -> list[str]:
        """Processes that existed before and are not ours whose cgroup changed."""
        ours = self.our_pids()
        bad = []
        for pid, cg in all_cgroups().items():
            if pid in self.before and pid not in ours and self.before[pid] != cg:
                bad.append(f"{pid}: {' '.join(self.before[pid].split())} -> {' '.join(cg.split())}")
        return bad

    def our_pids(self) -> set[int]:
        return {p for mp in self.hs.values() for p in pids_in(mp / self.name)}

    def down(self) -> list[str]:
        problems: list[str] = []
        if self.proc and self.proc.poll() is None:
            try:
                self.systemctl("exit", timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while True:
            pids = sorted(p for p in self.our_pids() if p > 0)
            if not pids:
                break
            if time.monotonic() > deadline:
                problems.append(f"survived SIGKILL: {pids}")
                break
            for p in pids:  # by PID, and only PIDs found in our own cgroups
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.proc:
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
        if self.made_run_systemd:
            try:
                os.rmdir("/run/systemd")
            except OSError as exc:
                problems.append(f"rmdir /run/systemd: {exc}")
        if Path("/run/systemd/system").exists() and self.made_run_systemd:
            problems.append("/run/systemd/system exists on the real filesystem")
        now = Path("/proc/1/cgroup").read_text()
        if now != self.pid1:
            problems.append(f"PID 1's cgroup differs: {now!r}")
        if not all(line.rpartition(":")[2] == "/" for line in now.splitlines()):
            problems.append(f"PID 1 is not at / everywhere: {now!r}")
        left = [str(p) for p in leftovers()]
        if left:
            problems.append(f"k26sbx* cgroups left: {left}")
        say(
            "teardown: "
            + (
                "clean (manager exited, cgroups removed, PID 1 at / everywhere, no k26sbx* left)"
                if not problems
                else "PROBLEMS: " + "; ".join(problems)
            )
        )
        return problems


def leftovers() -> list[Path]:
    found: list[Path] = []
    if fs_magic(CG) == CGROUP2_SUPER_MAGIC:
        return sorted(CG.glob("k26sbx*"))
    for h in CG.iterdir():
        try:
            found.extend(h.glob("k26sbx*"))
        except OSError:
            pass
    return sorted(found)


def cmd_probe(a: argparse.Namespace) -> int:
    tools = Tools(a.kit)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="k26spike-"))
    s = Spike(tools, work, a.strace, a.console)
    extra = dict(kv.split("=", 1) for kv in a.env)
    rc = 1
    try:
        s.up(a.args, extra)
        assert s.proc
        try:
            code = s.proc.wait(timeout=a.timeout)
            say(f"systemd exited with {code}")
            rc = 0
        except subprocess.TimeoutExpired:
            say(f"systemd still running after {a.timeout}s (that is what a working manager does)")
            rc = 0
        s.check_pid1()
    finally:
        say("manager output:\n" + s.log.read_text(errors="replace"))
        problems = s.down()
    return 3 if problems else rc


def cmd_run(a: argparse.Namespace) -> int:
    tools = Tools(a.kit)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="k26spike-"))
    s = Spike(tools, work, a.strace, a.console)
    results: dict[str, object] = {
        "layout": s.lay,
        "name": s.name,
        "kit": str(tools.kit) if tools.kit else None,
    }
    ok = False
    try:
        write_bus_units(tools, s.runtime)
        unit = "spike-sleep.service"
        (s.runtime / "systemd" / "user" / unit).write_text(
            "[Unit]\nDescription=k26 spike sleeper\n\n[Service]\nType=exec\nExecStart=/bin/sleep 1000\n"
            "MemoryMax=256M\nTasksMax=64\n"
        )
        s.up(["--user"], {})
        s.wait_manager()
        s.check_pid1()
        ver = s.systemctl("--version").stdout.splitlines()[0]
        r = s.systemctl("start", unit)
        if r.returncode:
            raise RuntimeError(f"start {unit}: {r.stderr}")
        p = s.show(unit, "ControlGroup", "MainPID", "ActiveState", "SubState")
        cgpath, mainpid = p["ControlGroup"], int(p["MainPID"])
        outside = own_cgroups(str(mainpid))["unified"]
        root_mp = s.hs["unified"]
        results["a_controlgroup"] = {
            "systemd_says": cgpath,
            "kernel_says_from_outside": outside,
            "dir": str(root_mp / s.name / cgpath.lstrip("/")),
        }
        if outside != f"/{s.name}{cgpath}" or not (root_mp / s.name / cgpath.lstrip("/")).is_dir():
            raise RuntimeError(f"(a) unit cgroup {cgpath} / {outside} not inside /{s.name}")
        say(f"(a) ControlGroup={cgpath}  == {outside} from outside: inside our subtree")
        sub = (root_mp / s.name / "cgroup.subtree_control").read_text().split()
        ctl = (root_mp / s.name / "cgroup.controllers").read_text().split()
        unitdir = root_mp / s.name / cgpath.lstrip("/")
        results["controllers"] = {
            "available_at_subtree_root": ctl,
            "subtree_control_at_root": sub,
            "unit_has_memory.max": (unitdir / "memory.max").exists(),
            "unit_has_pids.max": (unitdir / "pids.max").exists(),
        }
        if (unitdir / "memory.max").exists():
            results["controllers"]["unit_memory.max"] = (unitdir / "memory.max").read_text().strip()
            results["controllers"]["unit_pids.max"] = (unitdir / "pids.max").read_text().strip()
        say(
            f"controllers: available {ctl or '(none)'}; root subtree_control {sub or '(none)'}; "
            f"unit memory.max {'present' if (unitdir / 'memory.max').exists() else 'absent'}"
        )
        if "memory" in ctl and not (unitdir / "memory.max").exists():
            raise RuntimeError("memory is available but did not reach the unit")
        os.kill(mainpid, signal.SIGKILL) if mainpid > 0 else None
        deadline = time.monotonic() + 10
        while True:
            q = s.show(unit, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
            if q.get("ActiveState") == "failed" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        results["b_sigkill"] = q
        if (q.get("Result"), q.get("ExecMainCode"), q.get("ExecMainStatus")) != (
            "signal",
            "2",
            "9",
        ):
            raise RuntimeError(f"(b) after SIGKILL: {q}")
        say(f"(b) SIGKILL of MainPID {mainpid}: {q}")
        r = subprocess.run(
            [
                str(tools.systemctl).replace("systemctl", "systemd-run")
                if tools.kit
                else "systemd-run",
                "--user",
                "--wait",
                "-q",
                "-p",
                "Type=exec",
                "/bin/true",
            ],
            env=s.cenv(),
            capture_output=True,
            text=True,
            timeout=20,
        )
        results["systemd_run"] = {"rc": r.returncode, "stderr": r.stderr.strip()}
        say(f"systemd-run --user --wait /bin/true: rc {r.returncode} {r.stderr.strip()}")
        s.check_pid1()
        moved = s.moved_outside()
        results["c_pid1_cgroup"] = Path("/proc/1/cgroup").read_text().split()
        results["c_moved_outside"] = moved
        if moved:
            raise RuntimeError(f"(c) processes outside our subtree changed cgroup: {moved}")
        say("(c) PID 1's cgroup unchanged; no process outside our subtree changed cgroup")
        results["systemctl_version"] = ver
        ok = True
    except Exception as exc:
        results["error"] = str(exc)
        say(f"FAILED: {exc}")
    finally:
        problems = s.down()
        results["teardown_problems"] = problems
        (work / "result.json").write_text(json.dumps(results, indent=1))
        say(f"result: {work / 'result.json'}")
    return 0 if ok and not problems else 1


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
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [
            d
        ]:
            sub.rmdir()
        say(f"removed {d}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser()
    sp = ap.add_subparsers(dest="cmd", required=True)
    for c in ("run", "probe"):
        p = sp.add_parser(c)
        p.add_argument(
            "--kit", help="use KIT/bin, KIT/lib, KIT/units instead of the system's systemd"
        )
        p.add_argument("--workdir")
        p.add_argument("--strace", help="run systemd under strace -f -o FILE")
        p.add_argument("--no-console", dest="console", action="store_false",
                       help="leave /dev/console alone (the manager's console log is then lost)")
        if c == "probe":
            p.add_argument("--env", action="append", default=[], help="K=V for the manager")
            p.add_argument("--timeout", type=float, default=10)
            p.add_argument("args", nargs="*")
    sp.add_parser("sweep")
    for c in ("launch", "inner"):
        p = sp.add_parser(c)
        p.add_argument("--name", required=True)
        p.add_argument("--runtime", required=True)
        p.add_argument("--systemd", required=True)
        p.add_argument("--strace")
        p.add_argument("--no-console", dest="console", action="store_false")
        p.add_argument("--layout")
        p.add_argument("--outer-ns", default="")
        p.add_argument("args", nargs="*")
    a = ap.parse_args()
    if a.cmd == "launch":
        step_launch(a)
    if a.cmd == "inner":
        if not a.outer_ns:
            die("inner needs --outer-ns (run it through launch)")
        step_inner(a)
    return {"run": cmd_run, "probe": cmd_probe, "sweep": cmd_sweep}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
