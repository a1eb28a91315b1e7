"""Evidence for the exit classifier: the kernel log, a unit's output file, the journal.

Small async adapters. None of them blocks the event loop: ``/dev/kmsg`` is read
by a thread of its own that wakes the loop, files are read in a
worker thread, and ``journalctl`` runs as an async subprocess with a timeout. Every
one degrades to "no evidence" (an empty list) rather than raising, because a
missing journal or an unreadable kernel log must never stop supervision.

What the kernel log looks like: each ``read(2)`` of ``/dev/kmsg`` returns one record,
``PRIO,SEQ,USEC,FLAGS[,...];MESSAGE`` followed by optional continuation lines that
start with a space (``" SUBSYSTEM=..."``). Only MESSAGE is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import re
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType

log = logging.getLogger("k26.evidence")
KMSG_PATH = "/dev/kmsg"
# The kernel never hands out a record larger than this (CONSOLE_EXT_LOG_MAX is 8 KiB).
_KMSG_READ_SIZE = 16384
# Records drained per wake-up, so a flood cannot starve the loop.
_KMSG_BATCH = 2000
# How far back kernel records may explain an exit. An OOM kill is logged moments
# before the death; a child's kill precedes the main process's exit by seconds.
EXIT_WINDOW_S = 60.0
# How often the reader thread reads the tracked units' cgroups for their PIDs, and how
# long a PID is remembered after it was last seen there.
PID_POLL_S = 0.5
PID_MEMORY_S = 900.0
CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


@dataclass(frozen=True)
class KernelRecord:
    """One kernel-log record. ``received_*`` say when this process read it, which is
    the clock ``lines_since`` filters on (the kernel's own timestamp drifts from
    CLOCK_MONOTONIC on some hosts)."""

    seq: int
    level: int
    facility: int
    kernel_usec: int
    message: str
    received_monotonic: float = 0.0
    received_wall: float = 0.0
    # An NVIDIA Xid names the process whose GPU context faulted ("pid=1234, name=...").
    # Its cgroup is read the moment the record is (the process is alive then: SGLang
    # waits 5 s before it kills its tree), so the Xid explains only that unit's death.
    # None: the record names no process, or its cgroup could not be read.
    pid_cgroup: str | None = None
    # The tracked unit (KernelLog.track) whose cgroup holds or held that process.
    pid_unit: str | None = None
    # The process is gone and no tracked unit's cgroup ever held it: another program's.
    pid_foreign: bool = False


# What the loop writes to the reader thread's pipe: stop, or read the PIDs now.
_STOP, _READ_PIDS = b"x", b"p"
_PID_MEMORY_MAX = 100_000
_XID_PID_RE = re.compile(r"\bNVRM: Xid \([^)]*\): \d+, pid=(\d+)")


def process_cgroup(pid: int, proc: str = "/proc") -> str | None:
    """The unified-hierarchy cgroup of ``pid`` (``0::/path``), else systemd's
    (``name=systemd``, a hybrid host's v1 tree); None when it cannot be read."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for prefix in ("0::", "1:name=systemd:"):
        for line in lines:
            if line.startswith(prefix):
                return line[len(prefix) :] or "/"
    return None


def cgroup_dir(pid: int, roots: tuple[Path, ...] = CGROUP_ROOTS) -> Path | None:
    """The unified-hierarchy directory of ``pid``'s cgroup, as this process sees the
    tree (a unit's ControlGroup is systemd's view, which a cgroup namespace shifts)."""
    path = process_cgroup(pid) if pid > 0 else None
    return None if path is None else _cgroup_path_dir(path, roots)


def _cgroup_path_dir(path: str, roots: tuple[Path, ...] = CGROUP_ROOTS) -> Path | None:
    for root in roots:
        candidate = root / path.lstrip("/")
        if (candidate / "cgroup.procs").is_file():
            return candidate
    return None


def cgroup_procs_files(directory: Path) -> list[Path]:
    """``cgroup.procs`` of a cgroup and of every cgroup below it. A cgroup removed
    meanwhile (its unit stopped) is simply not there: never an error."""
    return [
        Path(top) / "cgroup.procs"
        for top, _dirs, files in os.walk(directory)
        if "cgroup.procs" in files
    ]


def cgroup_pids(directory: Path) -> set[int]:
    """The PIDs in a cgroup and its children; what cannot be read is left out."""
    pids: set[int] = set()
    for procs in cgroup_procs_files(directory):
        try:
            text = procs.read_text()
        except OSError:
            continue  # removed meanwhile
        pids.update(int(each) for each in text.split() if each.isdigit())
    return pids


def cgroup_is(path: str, control_group: str) -> bool:
    """``path`` (from /proc, rooted at the host's or a namespace's root) is the unit's
    ControlGroup or inside it; matched by suffix, as the roots may differ."""
    if not control_group:
        return False
    group, path = control_group.rstrip("/") or "/", path.rstrip("/") or "/"
    if group == "/":  # the root itself (a test process); no unit lives there
        return path == "/"
    while path != "/" and path:
        if path == group or path.endswith(group if group.startswith("/") else "/" + group):
            return True
        path = path.rsplit("/", 1)[0]
    return False


def _unit_cgroup(main_pid: int, control_group: str) -> tuple[str, Path] | None:
    """A unit's cgroup as this process sees it, found from its main PID: the path
    (/proc's form) and its directory. The main PID may sit in a child cgroup (a
    delegated unit): the topmost ancestor that is still the unit's is taken. None when
    the PID is gone or is not in ``control_group`` (reused by another process)."""
    path = process_cgroup(main_pid)
    if path is None or (control_group and not cgroup_is(path, control_group)):
        return None
    while control_group and path.count("/") > 1:
        parent = path.rsplit("/", 1)[0]
        if not cgroup_is(parent, control_group):
            break
        path = parent
    directory = _cgroup_path_dir(path)
    return None if directory is None else (path, directory)


def parse_kmsg_record(
    raw: str | bytes, received_monotonic: float = 0.0, received_wall: float = 0.0
) -> KernelRecord | None:
    """Parse one ``/dev/kmsg`` record; ``None`` if it is not one."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    header, sep, rest = text.partition(";")
    if not sep:
        return None
    fields = header.split(",")
    if len(fields) < 3:
        return None
    try:
        prio, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    message = rest.split("\n", 1)[0]  # drop " KEY=value" continuation lines
    return KernelRecord(
        seq=seq,
        level=prio & 7,
        facility=prio >> 3,
        kernel_usec=usec,
        message=message,
        received_monotonic=received_monotonic,
        received_wall=received_wall,
    )


def _read_kmsg_history(path: str) -> list[KernelRecord]:
    records: list[KernelRecord] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return records
    try:
        for _ in range(100_000):
            try:
                raw = os.read(fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # overwritten while we read: go on with the next
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    continue
                break
            if not raw:
                break
            record = parse_kmsg_record(raw)
            if record is not None:
                records.append(record)
    finally:
        os.close(fd)
    return records


async def kernel_history(since_monotonic: float | None = None, path: str = KMSG_PATH) -> list[str]:
    """Kernel-log messages still in the ring buffer, from ``since_monotonic`` on (the
    kernel's timestamp, CLOCK_MONOTONIC-based, in seconds); [] when it cannot be read.
    For a post-mortem (``explain``): the daemon follows the log live instead."""
    records = await asyncio.to_thread(_read_kmsg_history, path)
    if since_monotonic is not None:
        cutoff = int(since_monotonic * 1_000_000)
        records = [r for r in records if r.kernel_usec >= cutoff]
    return [r.message for r in records]


class KernelLog:
    """Follows ``/dev/kmsg`` from the moment ``start()`` is called.

    A thread of its own waits on the device (epoll) and reads each record the moment
    it is logged, whatever the event loop is doing: an Xid's ``pid=`` is resolved to a
    cgroup while that process still lives, which a busy loop could miss (SGLang's
    faulting scheduler is gone seconds later). The loop is only woken, never blocked.

    Keeps the last ``capacity`` records. Records the kernel overwrote before they
    were read (``EPIPE``) are counted in ``overwritten`` and skipped. If the device
    cannot be opened (no permission, a container without it), ``available`` is
    False, ``unavailable_reason`` says why, and every query returns nothing.
    """

    # One read(2) returns one record; a seam for tests that need EPIPE on demand.
    _read: Callable[[int, int], bytes] = staticmethod(os.read)

    def __init__(self, path: str | os.PathLike[str] = KMSG_PATH, capacity: int = 2000) -> None:
        self._path = os.fspath(path)
        self._records: deque[KernelRecord] = deque(maxlen=capacity)
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._appended = 0
        self._waiters: list[asyncio.Future[None]] = []
        # Held while reading the device and appending (the reader thread, or poll()
        # in the loop) and while taking a snapshot: a few microseconds per record.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_w: int | None = None
        self._failed: str | None = None
        self.overwritten = 0
        self.unavailable_reason: str | None = "not started"
        # unit -> (ControlGroup, MainPID), set by the loop (track), read by the thread.
        self._tracked: dict[str, tuple[str, int]] = {}
        # unit -> (MainPID it was found from, its cgroup as /proc says, its directory)
        self._groups: dict[str, tuple[int, str, Path]] = {}
        # pid -> (unit, cgroup, last seen): the PIDs the tracked units' cgroups held.
        self._pids: dict[int, tuple[str, str, float]] = {}
        self._pids_read = 0.0

    @property
    def available(self) -> bool:
        return self._fd is not None

    async def start(self) -> bool:
        """Open the log at its end, so only records from now on are seen."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.unavailable_reason = f"cannot open {self._path}: {exc.strerror or exc}"
            return False
        stop_r, stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError as exc:
                if exc.errno != errno.ESPIPE:  # a pipe has no history to skip
                    raise
            ready = select.epoll(2)  # refuses what cannot be waited on (a plain file)
            ready.register(fd, select.EPOLLIN)
            ready.register(stop_r, select.EPOLLIN)
        except (OSError, ValueError) as exc:
            for each in (fd, stop_r, stop_w):
                os.close(each)
            self.unavailable_reason = f"cannot follow {self._path}: {exc}"
            return False
        self._fd, self._loop, self.unavailable_reason = fd, asyncio.get_running_loop(), None
        self._stop_w = stop_w
        self._thread = threading.Thread(
            target=self._follow, args=(fd, ready, stop_r), name="k26-kmsg", daemon=True
        )
        self._thread.start()
        return True

    def _follow(self, fd: int, ready: select.epoll, stop_r: int) -> None:
        """The reader thread: wait, drain, wake the loop's waiters; until close()."""
        try:
            while True:
                try:
                    events = ready.poll(PID_POLL_S if self._tracked else -1)
                except InterruptedError:
                    continue
                if any(each == stop_r for each, _ in events):
                    try:
                        asked = os.read(stop_r, 64)
                    except BlockingIOError:
                        asked = b""
                    if _STOP in asked or not asked:
                        return
                    self._read_pids_safely(force=True)  # track() changed what to read
                    continue
                self._read_pids_safely()
                if any(mask & (select.EPOLLHUP | select.EPOLLERR) for _, mask in events):
                    # A writer that went away (a test's pipe); /dev/kmsg never does this.
                    self._drain()
                    ready.unregister(fd)
                    continue
                if self._drain():
                    self._wake_soon()
                if self._failed is not None:
                    return
        finally:
            ready.close()
            os.close(stop_r)

    def _wake_soon(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake_waiters)

    def _wake_waiters(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def close(self) -> None:
        if self._fd is None:
            return
        thread, stop_w = self._thread, self._stop_w
        if stop_w is not None:
            with contextlib.suppress(OSError):
                os.write(stop_w, _STOP)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if stop_w is not None:
            os.close(stop_w)
        self._thread = self._stop_w = None
        self.unavailable_reason = "closed"
        self._wake_waiters()

    async def __aenter__(self) -> KernelLog:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def poll(self) -> int:
        """Read every record that is waiting now, without blocking. The daemon calls
        this right before classifying an exit, so a kill logged a moment ago is in
        even if the reader thread has not been scheduled since."""
        count = self._drain()
        if count:
            self._wake_waiters()
        return count

    def _drain(self) -> int:
        failed: OSError | None = None
        count = 0
        with self._lock:
            fd = self._fd
            if fd is None:
                return 0
            while count < _KMSG_BATCH:
                try:
                    raw = self._read(fd, _KMSG_READ_SIZE)
                except BlockingIOError:
                    break
                except BrokenPipeError:
                    self.overwritten += 1  # the ring buffer wrapped past us; read on
                    continue
                except OSError as exc:
                    if exc.errno == errno.EINVAL:  # a record larger than our buffer
                        continue
                    failed = exc
                    break
                if not raw:
                    break
                record = parse_kmsg_record(raw, time.monotonic(), time.time())
                if record is not None:
                    if "NVRM: Xid" in record.message:
                        named = _XID_PID_RE.search(record.message)
                        if named is not None:  # a few bytes from procfs
                            record = self._attribute(record, int(named.group(1)))
                    self._records.append(record)
                    self._appended += 1
                    count += 1
        if failed is not None:
            reason = f"reading {self._path} failed: {failed}"
            if self._thread is threading.current_thread():
                self._failed = reason  # the loop closes it: close() joins this thread
                loop = self._loop
                if loop is not None and not loop.is_closed():
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._close_failed, reason)
            else:
                self._close_failed(reason)
        return count

    # --- whose process an Xid names ------------------------------------------------

    def track(self, unit: str, control_group: str, main_pid: int) -> None:
        """Remember the PIDs of ``unit``'s cgroup from now on (read every ``PID_POLL_S``
        by the reader thread, and kept ``PID_MEMORY_S`` after they leave it).

        Real SGLang's faulting scheduler dies milliseconds after its Xid is logged,
        which can be before even this thread reads the record: a PID that is gone but
        was seen in a tracked unit's cgroup is still that unit's, and one that no
        tracked unit ever held is another program's (``pid_foreign``), kept from every
        unit's evidence. ``main_pid`` finds the cgroup as this process sees it (a
        cgroup namespace shifts systemd's ``ControlGroup``); 0 keeps the last one."""
        if self._tracked.get(unit) == (control_group, main_pid) or (
            main_pid <= 0 and unit in self._tracked
        ):
            return
        with self._lock:
            self._tracked = {**self._tracked, unit: (control_group, main_pid)}
        if self._stop_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._stop_w, _READ_PIDS)

    def _read_pids_safely(self, *, force: bool = False) -> None:
        """``_read_pids``, whose failure must never end the reader: the kernel log
        matters more than the PIDs (found by the chaos soak: a stopped unit's cgroup
        vanished under a walk, and the thread died with it)."""
        try:
            self._read_pids(force=force)
        except Exception:
            log.exception("reading the tracked units' PIDs failed; the kernel log goes on")

    def _read_pids(self, *, force: bool = False) -> None:
        """The reader thread: the tracked units' PIDs, at most every ``PID_POLL_S``."""
        now = time.monotonic()
        tracked = self._tracked
        if not tracked or (not force and now - self._pids_read < PID_POLL_S):
            return
        self._pids_read = now
        seen: dict[int, tuple[str, str, float]] = {}
        for unit, (control_group, main_pid) in tracked.items():
            group = self._groups.get(unit)
            if main_pid > 0 and (group is None or group[0] != main_pid):
                found = _unit_cgroup(main_pid, control_group)
                if found is not None:
                    group = (main_pid, *found)
                    self._groups[unit] = group
            if group is not None:
                for pid in cgroup_pids(group[2]):
                    seen[pid] = (unit, group[1], now)
        with self._lock:
            self._pids.update(seen)
            if len(self._pids) > _PID_MEMORY_MAX or seen:
                cutoff = now - PID_MEMORY_S
                self._pids = {p: v for p, v in self._pids.items() if v[2] >= cutoff}

    def _attribute(self, record: KernelRecord, pid: int) -> KernelRecord:
        """``record`` with the cgroup and the tracked unit of the process it names."""
        cgroup = process_cgroup(pid)
        if cgroup is not None:
            unit = next(
                (u for u, (group, _pid) in self._tracked.items() if cgroup_is(cgroup, group)),
                None,
            )
            if unit is None and pid in self._pids:
                unit = self._pids[pid][0]  # a namespace hides the match; it was seen there
            return dataclasses.replace(record, pid_cgroup=cgroup, pid_unit=unit)
        held = self._pids.get(pid)
        if held is not None:
            return dataclasses.replace(record, pid_cgroup=held[1], pid_unit=held[0])
        return dataclasses.replace(record, pid_foreign=bool(self._tracked))

    def _close_failed(self, reason: str) -> None:
        self.close()
        self.unavailable_reason = reason

    def records(self) -> list[KernelRecord]:
        """The records held now (the last ``capacity``), oldest first."""
        with self._lock:
            return list(self._records)

    def recent_for_exit(
        self,
        since_monotonic: float | None = None,
        window_s: float = EXIT_WINDOW_S,
        control_group: str = "",
    ) -> list[str]:
        """The messages that can explain an exit that just happened: drains what is
        waiting (``poll``), then keeps records read after ``since_monotonic`` (the
        run's start, if known) and within the last ``window_s`` seconds. The window
        matters: an OOM record from an earlier run of the same unit names the same
        cgroup and must not explain this one. With ``control_group``, an Xid that
        names a process of another cgroup (another program's fault on a shared GPU)
        is left out; one naming no process, or a process already gone, stays."""
        self.poll()
        start = time.monotonic() - window_s
        if since_monotonic is not None:
            start = max(start, since_monotonic)
        return [
            r.message
            for r in self.records()
            if r.received_monotonic >= start
            and not (
                control_group
                and (
                    r.pid_foreign
                    or (r.pid_cgroup is not None and not cgroup_is(r.pid_cgroup, control_group))
                )
            )
        ]

    @property
    def appended(self) -> int:
        """How many records were read so far: the cursor ``records_after`` takes."""
        with self._lock:
            return self._appended

    async def records_after(self, seen: int) -> tuple[int, list[KernelRecord]]:
        """The records read after the first ``seen`` (an ``appended`` value), waiting
        until there is one; with the new cursor. Records the buffer dropped meanwhile
        are skipped. ``(seen, [])`` once the log is closed or unavailable."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                appended = self._appended
                new = min(appended - seen, len(self._records))
                fresh = [
                    self._records[i] for i in range(len(self._records) - new, len(self._records))
                ]
            if fresh:
                return appended, fresh
            if self._fd is None:
                return seen, []
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            await waiter


# --- the unit's output file ---------------------------------------------------------


def parse_output_path(standard_output: str) -> Path | None:
    """Where a ``StandardOutput=`` setting writes, if it is a file.

    ``append:/p``, ``file:/p`` and ``truncate:/p`` give ``/p``; ``journal``,
    ``inherit``, ``null``, ``kmsg``, ``tty``, ``socket``, ``fd:NAME``, and the bare
    ``append``/``file`` that systemd's D-Bus ``StandardOutput`` property returns
    (it drops the path) give ``None``.
    """
    kind, sep, target = standard_output.strip().partition(":")
    if sep and kind in ("append", "file", "truncate") and target.startswith("/"):
        return Path(target)
    return None


def _expand_specifiers(value: str, unit: str) -> str | None:
    """Expand the unit-name specifiers; ``None`` for ones we cannot know here."""
    stem, _, suffix = unit.rpartition(".")
    prefix, at, instance = (stem if suffix else unit).partition("@")
    table = {"n": unit, "N": stem or unit, "p": prefix, "i": instance if at else "", "%": "%"}
    out: list[str] = []
    chars = iter(value)
    for ch in chars:
        if ch != "%":
            out.append(ch)
            continue
        spec = next(chars, "")
        if spec not in table:
            return None
        out.append(table[spec])
    return "".join(out)


def _standard_output_setting(texts: Iterable[str]) -> str | None:
    """The effective ``StandardOutput=`` of a unit file and its drop-ins, in order."""
    value: str | None = None
    for text in texts:
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, rest = line.partition("=")
            if sep and section == "Service" and key.strip() == "StandardOutput":
                value = rest.strip() or None
    return value


def _read_texts(paths: list[str]) -> list[str]:
    texts: list[str] = []
    for path in paths:
        with contextlib.suppress(OSError):
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
    return texts


def read_unit_output_path(
    unit: str, fragment_path: str, dropin_paths: Iterable[str] = ()
) -> Path | None:
    """``unit_output_path`` for callers already off the event loop (it reads files)."""
    paths = [p for p in (fragment_path, *dropin_paths) if p]
    setting = _standard_output_setting(_read_texts(paths))
    if setting is None:
        return None
    expanded = _expand_specifiers(setting, unit)
    return parse_output_path(expanded) if expanded is not None else None


def _read_tail(path: Path, start: int, max_bytes: int, n: int) -> list[str]:
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < start:  # truncated or replaced since the mark
                start = 0
            begin = max(start, size - max_bytes)
            handle.seek(begin)
            data = handle.read(size - begin)
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if begin > start and lines:
        lines = lines[1:]  # we started mid-line
    return lines[-n:] if n > 0 else []


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class OutputTail:
    """The end of a unit's output file (``StandardOutput=append:PATH``).

    ``mark()`` remembers where the file ends (call it when the unit starts), so that
    ``lines()`` returns only what this run wrote, not an earlier run's crash. At
    most ``max_bytes`` are read, from the end.
    """

    def __init__(self, path: str | os.PathLike[str] | None, max_bytes: int = 256 * 1024) -> None:
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.start_offset = 0

    async def mark(self) -> int:
        if self.path is None:
            return 0
        self.start_offset = await asyncio.to_thread(_file_size, self.path)
        return self.start_offset

    async def lines(self, n: int = 200) -> list[str]:
        if self.path is None:
            return []
        return await asyncio.to_thread(_read_tail, self.path, self.start_offset, self.max_bytes, n)


# --- the journal --------------------------------------------------------------------


async def journal_lines(
    unit: str,
    since: datetime | float | None = None,
    user: bool = False,
    *,
    max_lines: int = 2000,
    timeout_s: float = 5.0,
    journalctl: str = "journalctl",
) -> list[str]:
    """The unit's journal messages since ``since`` (epoch seconds or datetime).

    Returns ``[]`` when journalctl is missing, journald holds nothing (the systemd
    sandbox runs no journald), it fails, or it takes longer than ``timeout_s``.
    """
    args = [journalctl]
    if user:
        args.append("--user")  # with --user, -u matches the user manager's units
    args += ["-u", unit, "-o", "cat", "--no-pager", "-q", f"--lines={max_lines}"]
    if since is not None:
        epoch = since.timestamp() if isinstance(since, datetime) else since
        args.append(f"--since=@{int(epoch)}")
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        return []
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return []
    if proc.returncode != 0:
        return []
    return [ln for ln in stdout.decode("utf-8", "replace").splitlines() if ln.strip()]
