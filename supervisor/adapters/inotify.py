"""Linux inotify through ctypes: a non-blocking fd the event loop reads, recursive
watches over directory trees, and one callback per file that appears.

The standard library has no inotify. This module owns the raw calls
(``inotify_init1``, ``inotify_add_watch``, ``inotify_rm_watch``) and the parsing
of ``struct inotify_event``; ``TreeWatch`` keeps one watch per directory of a
tree, adds one for every directory created under it (and reports what was
already inside by the time the watch took hold, so a burst of writes is never
missed), and calls back for every file closed after writing or moved in: the
two ways compilers and caches make a file appear (write in place, or write a
temporary and rename it over). Nothing here uses a timer: the loop wakes when
the kernel has events (``loop.add_reader``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("k26.inotify")

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE_SELF | IN_MOVE_SELF
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


@dataclass(frozen=True, slots=True)
class RawEvent:
    wd: int
    mask: int
    name: str


def parse_events(data: bytes) -> list[RawEvent]:
    """``struct inotify_event`` records, as read(2) returns them (names NUL-padded)."""
    events: list[RawEvent] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        raw = data[offset : offset + length]
        offset += length
        events.append(RawEvent(wd, mask, os.fsdecode(raw.split(b"\0", 1)[0])))
    return events


class Inotify:
    """One inotify instance: a non-blocking, close-on-exec fd."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        self.fd: int = fd

    def add(self, path: Path, mask: int) -> int:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(path))
        return int(wd)

    def read(self) -> list[RawEvent]:
        chunks: list[bytes] = []
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return parse_events(b"".join(chunks))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class TreeWatch:
    """Every file written or moved in under ``roots`` (recursively), reported through
    ``on_file(root, path)`` (a file written twice is reported twice). A root that does
    not exist yet is watched from its nearest existing parent until it appears (a
    cache made on first use)."""

    def __init__(
        self,
        roots: list[Path],
        on_file: Callable[[Path, Path], None],
        *,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.roots = [Path(os.path.abspath(r)) for r in roots]
        self.on_file = on_file
        self.on_error = on_error or (lambda message: log.warning("%s", message))
        self._ino: Inotify | None = None
        self._dirs: dict[int, Path] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def watched(self) -> list[Path]:
        return sorted(self._dirs.values())

    def start(self) -> None:
        """Take the watches here (a few syscalls per directory), then read events on
        the running loop, if there is one."""
        self._take_watches()
        self._listen()

    async def start_async(self) -> None:
        """The same, with the walk over the existing trees (a big Triton cache holds
        thousands of directories) in a thread: the loop never waits on it. Events of
        that time wait in the kernel's queue until the loop reads them."""
        await asyncio.to_thread(self._take_watches)
        self._listen()

    def _take_watches(self) -> None:
        self._ino = Inotify()
        for root in self.roots:
            self._watch_root(root, report=False)

    def _listen(self) -> None:
        assert self._ino is not None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._ino.fd, self._drain)

    def close(self) -> None:
        if self._ino is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._ino.fd)
        self._ino.close()
        self._ino = None
        self._dirs.clear()

    def _watch_root(self, root: Path, *, report: bool) -> None:
        anchor = root
        while not anchor.is_dir() and anchor != anchor.parent:
            anchor = anchor.parent  # wait for the root to be made, from where it will be
        if anchor == root:
            self._watch_tree(root, report=report)
        else:
            self._add(anchor)

    def _add(self, directory: Path) -> bool:
        assert self._ino is not None
        try:
            wd = self._ino.add(directory, _MASK | IN_ONLYDIR)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self.on_error(
                    f"cannot watch {directory}: the inotify watch limit is reached "
                    "(raise fs.inotify.max_user_watches)"
                )
            elif exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                self.on_error(f"cannot watch {directory}: {exc.strerror}")
            return False
        self._dirs[wd] = directory
        return True

    def _watch_tree(self, top: Path, *, report: bool) -> None:
        """Watch ``top`` and every directory below it; with ``report``, what is already
        in it appeared just now (made between its creation and this watch)."""
        if not self._add(top):
            return
        for directory, subdirs, files in os.walk(top):
            here = Path(directory)
            if here != top:
                self._add(here)
            if report:
                for name in files:
                    self._report(here / name)
            subdirs.sort()

    def _root_of(self, path: Path) -> Path | None:
        for root in self.roots:
            if path == root or root in path.parents:
                return root
        return None

    def _report(self, path: Path) -> None:
        root = self._root_of(path)
        if root is not None:
            self.on_file(root, path)

    def _drain(self) -> None:
        if self._ino is None:
            return
        try:
            events = self._ino.read()
        except OSError as exc:
            self.on_error(f"reading inotify events: {exc.strerror}")
            return
        for event in events:
            self.handle(event)

    def handle(self, event: RawEvent) -> None:
        if event.mask & IN_Q_OVERFLOW:
            self.on_error("inotify queue overflowed: some JIT artifacts may have gone unseen")
            return
        directory = self._dirs.get(event.wd)
        if directory is None:
            return
        if event.mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
            if event.mask & IN_IGNORED:
                self._dirs.pop(event.wd, None)
            return
        path = directory / event.name
        if event.mask & IN_ISDIR and event.mask & (IN_CREATE | IN_MOVED_TO):
            if self._root_of(path) is not None:
                self._watch_tree(path, report=True)
            elif any(path == r or path in r.parents for r in self.roots):
                # On the way to a root that does not exist yet.
                for root in self.roots:
                    if path == root or path in root.parents:
                        self._watch_root(root, report=True)
            return
        if event.mask & (IN_CLOSE_WRITE | IN_MOVED_TO):
            self._report(path)
