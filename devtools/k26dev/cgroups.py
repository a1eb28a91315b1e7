"""Cgroup subtrees and processes of our own: what the sandbox and the booted host share.

Both confine a systemd to a child cgroup (``k26sbx-*``, ``k26host-*``) that they
make, and on teardown end every process inside it *by PID*, remove the cgroups
depth-first and check that PID 1 is where it was. Nothing here ever touches a
cgroup or a process outside a subtree named by the caller. Standard library and
the package's error types only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from k26dev.errors import SandboxError

CGROUP_ROOT = Path("/sys/fs/cgroup")

# Popen objects of launchers started by this process, so teardown can reap them.
LAUNCHED: dict[int, subprocess.Popen[bytes]] = {}


def read_pid1_cgroup() -> str:
    return Path("/proc/1/cgroup").read_text()


def cgroup_mounts() -> dict[str, str]:
    """Mount point -> file system type, for this process's mount namespace."""
    found: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        parts = left.split()
        if len(parts) >= 5 and right:
            found[parts[4]] = right.split()[0]
    return found


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_pid_exit(pid: int, timeout_s: float) -> bool:
    """Block until ``pid`` exits or the timeout passes, using a pidfd (no polling)."""
    if pid <= 0:
        return True
    proc = LAUNCHED.get(pid)
    if proc is not None:
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready) or not pid_alive(pid)
    finally:
        os.close(fd)


def procs_in(cgroup: Path) -> list[int]:
    """Every PID in ``cgroup`` and below it."""
    pids: list[int] = []
    if not cgroup.exists():
        return pids
    for procs in cgroup.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids.extend(int(x) for x in procs.read_text().split())
    return pids


def kill_all(dirs: Iterable[Path], what: str, timeout_s: float) -> None:
    """SIGKILL every process in ``dirs`` (our own subtree), by PID, until none is left."""
    dirs = list(dirs)
    deadline = time.monotonic() + timeout_s
    while True:
        pids = sorted({pid for cg in dirs for pid in procs_in(cg) if pid > 0})
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            wait_pid_exit(pid, max(0.0, min(1.0, deadline - time.monotonic())))
        if time.monotonic() > deadline:
            raise OSError(f"processes {pids} in {what} survived SIGKILL")


def remove_cgroups(dirs: Iterable[Path]) -> list[str]:
    """rmdir each tree depth-first; return what could not be removed."""
    left: list[str] = []
    for top in dirs:
        if not top.exists():
            continue
        subdirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for path in [*subdirs, top]:
            for _attempt in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        left.append(f"{path}: {exc.strerror}")
                        break
                    # A killed task leaves its cgroup a moment after it is reaped.
                    time.sleep(0.02)
            else:
                left.append(f"{path}: busy")
    return left


def launch(
    cmd: list[str], log: BinaryIO, env: dict[str, str], made: Iterable[str], what: str
) -> subprocess.Popen[bytes]:
    """Start a launcher in its own session, logging to ``log``; remember it by PID.

    If it cannot start, the cgroups made for it are removed and SandboxError
    names ``what``.
    """
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        remove_cgroups(Path(p) for p in made)
        raise SandboxError(f"cannot start {what}: {exc}") from exc
    LAUNCHED[proc.pid] = proc
    return proc


@contextlib.contextmanager
def torn_down(down: Callable[[], None], *, keep_up: bool = False) -> Iterator[None]:
    """What the body makes is undone by ``down`` on any exit, a signal's included;
    with ``keep_up``, a body that ends normally leaves it. On an error the first
    error is the one reported (a failing ``down`` then says nothing)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(SandboxError):
            _through_a_signal(down)
        raise
    if not keep_up:
        _through_a_signal(down)


def _through_a_signal(teardown: Callable[[], None]) -> None:
    """Run ``teardown`` to its end even if a signal interrupts it once: the CLI's
    handler ignores every later one, so a second run finishes; then the first
    signal goes on ending the command."""
    try:
        teardown()
    except KeyboardInterrupt:
        teardown()
        raise


def end_unrecorded(proc: subprocess.Popen[bytes] | None, recorded_pid: int) -> None:
    """A launcher that started but is not yet in the state file: ``down`` cannot
    know it, so it is ended here, by its own handle."""
    if proc is not None and recorded_pid != proc.pid:
        proc.kill()
        proc.wait()


def make_cgroups(dirs: Iterable[Path]) -> list[str]:
    """Create each child cgroup; on any failure remove what was made and raise OSError."""
    made: list[str] = []
    try:
        for cg in dirs:
            cg.mkdir()
            made.append(str(cg))
    except OSError:
        remove_cgroups([Path(p) for p in made])
        raise
    return made


def leftovers(prefix: str) -> list[Path]:
    """Every cgroup named ``prefix*`` directly under a hierarchy's root (each
    ``/sys/fs/cgroup/<hierarchy>`` of the hybrid layout, or ``/sys/fs/cgroup`` itself
    when it is the single cgroup2 hierarchy)."""
    found: list[Path] = []
    if not CGROUP_ROOT.exists():
        return found
    unified = cgroup_mounts().get(str(CGROUP_ROOT)) == "cgroup2"
    hierarchies = [CGROUP_ROOT] if unified else list(CGROUP_ROOT.iterdir())
    for hierarchy in hierarchies:
        with contextlib.suppress(OSError):
            found.extend(p for p in hierarchy.glob(f"{prefix}*") if p.is_dir())
    return sorted(found)
