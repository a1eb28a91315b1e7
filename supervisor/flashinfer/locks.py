"""FlashInfer's build locks: who holds them, and removing one nobody can hold.

FlashInfer takes ``filelock.FileLock`` (``flock(2)`` on Linux) on
``cached_ops/tmp/<module>.lock`` while it builds. The file stays after release
by design (waiters must share one inode), and a SIGKILLed builder leaves it
too. A lock file is only *stale* when no live process holds its flock; it is
removed only when, while this process holds the flock itself, no other process
has the file open at all (so nobody is queued on the inode either).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from supervisor.flashinfer.models import LockInfo


def _proc_locks(proc: Path) -> dict[tuple[int, int, int], list[int]]:
    """(major, minor, inode) -> pids holding a lock, from /proc/locks."""
    holders: dict[tuple[int, int, int], list[int]] = {}
    try:
        text = (proc / "locks").read_text()
    except OSError:
        return holders
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) < 6:
            continue
        pid_text, device = fields[4], fields[5]
        parts = device.split(":")
        if len(parts) != 3 or not pid_text.isdigit():
            continue
        try:
            key = (int(parts[0], 16), int(parts[1], 16), int(parts[2]))
        except ValueError:
            continue
        holders.setdefault(key, []).append(int(pid_text))
    return holders


def _openers(path: Path, proc: Path) -> list[int]:
    """PIDs (other than ours) with ``path``'s inode open, as far as /proc shows."""
    try:
        target = path.stat()
    except OSError:
        return []
    own = os.getpid()
    found: list[int] = []
    try:
        entries = list(proc.iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                st = fd.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                found.append(int(entry.name))
                break
    return found


def inspect_lock(path: Path, proc: Path = Path("/proc")) -> LockInfo:
    """Say whether a live process holds ``path``'s flock. Never takes or removes it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return LockInfo(path, "stale", (), "gone")
    key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    holders = tuple(_proc_locks(proc).get(key, ()))
    if holders:
        return LockInfo(path, "held", holders, f"held by pid {', '.join(map(str, holders))}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return LockInfo(path, "unknown", (), f"cannot open: {exc.strerror}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return LockInfo(path, "held", (), "held by a process this one cannot see")
        return LockInfo(path, "unknown", (), f"flock unsupported here: {exc.strerror}")
    finally:
        os.close(fd)  # closing drops a flock we may have won
    return LockInfo(path, "stale", (), "no live holder")


def find_lock_files(jit_dir: Path) -> list[Path]:
    """Lock files FlashInfer leaves under ``cached_ops`` (``tmp/*.lock``, ``*/*.lock``)."""
    if not jit_dir.is_dir():
        return []
    found = set(jit_dir.glob("tmp/*.lock")) | set(jit_dir.glob("*/*.lock"))
    return sorted(found)


def remove_if_stale(path: Path, proc: Path = Path("/proc")) -> LockInfo:
    """Delete ``path`` only when provably nobody holds or waits on it.

    Holds the flock itself while it checks that no other process has the file
    open, then unlinks it; a process that opens the path afterwards creates a
    fresh lock file, which is what FlashInfer would do on a clean cache.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return LockInfo(path, "stale", (), "gone")
    except OSError as exc:
        return LockInfo(path, "unknown", (), f"cannot open: {exc.strerror}")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return inspect_lock(path, proc)
            return LockInfo(path, "unknown", (), f"flock unsupported here: {exc.strerror}")
        opened = os.fstat(fd)
        try:
            current = path.stat()
        except FileNotFoundError:
            return LockInfo(path, "stale", (), "gone")
        if (opened.st_dev, opened.st_ino) != (current.st_dev, current.st_ino):
            return LockInfo(path, "unknown", (), "replaced while checking; left alone")
        others = _openers(path, proc)
        if others:
            return LockInfo(
                path, "held", tuple(others), f"open in pid {', '.join(map(str, others))}"
            )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return LockInfo(path, "stale", (), "removed")
    finally:
        os.close(fd)
