"""Evidence adapters: /dev/kmsg records, unit output files, unit files, journalctl."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.adapters.evidence import (
    CGROUP_ROOTS,
    KernelLog,
    OutputTail,
    cgroup_is,
    journal_lines,
    parse_kmsg_record,
    parse_output_path,
    process_cgroup,
    read_unit_output_path,
)

SAMPLES = Path(__file__).parents[1] / "samples"
DEADLINE_S = 5.0


async def wait_for(log: KernelLog, predicate: Callable[[str], bool]) -> str | None:
    """The first message, held or arriving within DEADLINE_S, for which ``predicate``
    holds: through ``records_after``, as the daemon reads the log. None at the deadline
    or once the log is closed."""

    async def first() -> str | None:
        seen = 0
        while True:
            seen, records = await log.records_after(seen)
            if not records:
                return None
            for record in records:
                if predicate(record.message):
                    return record.message

    try:
        return await asyncio.wait_for(first(), DEADLINE_S)
    except TimeoutError:
        return None


# --- /dev/kmsg records --------------------------------------------------------------


def test_parse_a_real_record() -> None:
    raw = (SAMPLES / "kmsg_memcg_oom.raw").read_text().splitlines()
    killed = next(r for r in raw if "Killed process" in r)
    record = parse_kmsg_record(killed)
    assert record is not None
    assert record.level == 3 and record.facility == 0
    assert record.seq == 423 and record.kernel_usec == 473304080
    assert record.message.startswith("Memory cgroup out of memory: Killed process 10136 (python3)")


def test_continuation_lines_and_extra_header_fields_are_dropped() -> None:
    record = parse_kmsg_record(b"6,1234,5678,-,caller=T12;usb 1-1: new device\n SUBSYSTEM=usb\n")
    assert record is not None
    assert (record.seq, record.message) == (1234, "usb 1-1: new device")


def test_user_written_records_carry_their_facility() -> None:
    record = parse_kmsg_record("12,9,10,-;k26test: hello")
    assert record is not None
    assert (record.facility, record.level, record.message) == (1, 4, "k26test: hello")


@pytest.mark.parametrize("raw", ["", "no header here", "a,b,c;msg", "6,1;too few fields"])
def test_non_records(raw: str) -> None:
    assert parse_kmsg_record(raw) is None


def test_kmsg_messages_of_a_saved_dump() -> None:
    raw = (SAMPLES / "kmsg_memcg_oom.raw").read_text().splitlines()
    messages = [r.message for r in map(parse_kmsg_record, raw) if r is not None]
    assert len(messages) == 80
    assert messages[0] == (
        "python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0"
    )
    assert any(m.startswith("oom-kill:constraint=CONSTRAINT_MEMCG,") for m in messages)


# --- KernelLog ----------------------------------------------------------------------


def _kmsg_usable() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        os.close(os.open("/dev/kmsg", os.O_WRONLY))
    except OSError:
        return False
    return True


@pytest.fixture
def kmsg() -> None:
    """These tests write to and read from the real /dev/kmsg (root, as CI runs)."""
    if not _kmsg_usable():
        pytest.fail("these tests read and write /dev/kmsg: run them as root on a host that has it")


needs_kmsg = pytest.mark.usefixtures("kmsg")


@needs_kmsg
async def test_kernel_log_sees_a_new_record() -> None:
    before = time.monotonic()
    async with KernelLog() as log:
        assert log.available and log.unavailable_reason is None
        token = f"k26test: hello {uuid.uuid4()}"
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, token.encode() + b"\n")
        finally:
            os.close(fd)
        line = await wait_for(log, lambda m: token in m)
        assert line == token
        [record] = [r for r in log.records() if r.message == token]
        assert before <= record.received_monotonic <= time.monotonic()
        assert time.time() - 60 <= record.received_wall <= time.time()
    assert not log.available


@needs_kmsg
async def test_an_xid_explains_only_the_death_of_the_process_it_names() -> None:
    """The driver's Xid names the faulting process. Read live, its cgroup is resolved
    while it still runs: another unit's exit does not take it as evidence; the unit
    it names does; an Xid naming no process (or one gone) stays for everyone."""
    mine = process_cgroup(os.getpid())
    assert mine is not None and cgroup_is(mine, mine) and not cgroup_is(mine, "/x/other.service")
    bus = f"{os.getpid() % 256:02x}"  # a fake PCI bus id of this test's own
    named = f"NVRM: Xid (PCI:0000:{bus}:7e): 43, pid={os.getpid()}, name=python, channel 0x9"
    nameless = f"NVRM: Xid (PCI:0000:{bus}:7f): 79, pid='<unknown>', name=<unknown>, {uuid.uuid4()}"
    async with KernelLog() as log:
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, named.encode() + b"\n")
            os.write(fd, nameless.encode() + b"\n")
        finally:
            os.close(fd)
        assert await wait_for(log, lambda m: m == nameless) == nameless
        other = log.recent_for_exit(control_group="/system.slice/other-unit.service")
        assert named not in other and nameless in other
        own = log.recent_for_exit(control_group=mine)
        assert named in own and nameless in own
        assert named in log.recent_for_exit()  # no cgroup known: nothing is left out


def _fault_and_die_without_the_loop(log: KernelLog) -> str:
    """A child faults (its Xid is logged) and dies, all in one synchronous stretch:
    the event loop does not run meanwhile, as in a daemon busy with something else.
    Returns the Xid's message."""
    child = subprocess.Popen(["sleep", "600"])
    bus = f"{child.pid % 256:02x}"
    named = f"NVRM: Xid (PCI:0000:{bus}:6e): 43, pid={child.pid}, name=sleep, {uuid.uuid4()}"
    try:
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, named.encode() + b"\n")
        finally:
            os.close(fd)
        deadline = time.monotonic() + DEADLINE_S
        while not any(r.message == named for r in log.records()):
            assert time.monotonic() < deadline, "the reader thread never read the record"
            time.sleep(0.01)  # polling for the event, with a deadline
    finally:
        child.kill()
        child.wait()
    assert process_cgroup(child.pid) is None  # gone: too late to ask /proc now
    return named


@needs_kmsg
async def test_an_xid_is_attributed_while_the_loop_is_busy_and_the_process_dies_after() -> None:
    """The record is read the moment it is logged, by the log's own thread, not when
    the loop next gets round to it: a child that faults and dies while the loop is
    blocked is still known to be of this test's cgroup, so another unit's exit does
    not take the Xid as its own."""
    mine = process_cgroup(os.getpid())
    assert mine is not None
    async with KernelLog() as log:
        named = _fault_and_die_without_the_loop(log)
        held = next(r for r in log.records() if r.message == named)
        assert held.pid_cgroup is not None and cgroup_is(held.pid_cgroup, mine)
        assert named not in log.recent_for_exit(control_group="/system.slice/other.service")
        assert named in log.recent_for_exit(control_group=mine)


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv)


def _log_line(line: str) -> str:
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)
    return line


def _log_xid(bus: str, pid: int, number: int = 48) -> str:
    return _log_line(
        f"NVRM: Xid (PCI:0000:{bus}:5e): {number}, pid={pid}, name=python, {uuid.uuid4()}"
    )


@needs_kmsg
async def test_a_tracked_units_pid_is_its_own_after_it_is_gone_and_no_other_pid_is() -> None:
    """Real SGLang's scheduler dies milliseconds after its Xid is logged, sometimes
    before even the reader thread gets to /proc. A tracked unit's PIDs are remembered
    (its cgroup read as the thread polls), so such an Xid is still that unit's; a gone
    PID that no tracked unit ever held is another program's, kept from every unit."""
    mine = process_cgroup(os.getpid())
    assert mine is not None
    never, child = _spawn(["true"]), _spawn(["sleep", "600"])
    never.wait()  # gone before anything is tracked
    bus = f"{child.pid % 256:02x}"
    async with KernelLog() as log:
        log.track("me.service", mine, os.getpid())
        # track() wakes the thread to read the cgroup before anything it reads after:
        # once a record logged now is in, the child's PID has been seen.
        marker = f"k26test: tracked {uuid.uuid4()}"
        _log_line(marker)
        assert await wait_for(log, lambda m: m == marker) == marker
        child.kill()
        child.wait()
        assert process_cgroup(child.pid) is None  # gone: /proc no longer says whose it was
        ours = _log_xid(bus, child.pid)
        theirs = _log_xid(bus, never.pid)
        assert await wait_for(log, lambda m: m == theirs) == theirs
        held = {r.message: r for r in log.records()}
        assert held[ours].pid_unit == "me.service" and held[ours].pid_cgroup == mine
        assert not held[ours].pid_foreign
        assert held[theirs].pid_foreign and held[theirs].pid_unit is None
        own = log.recent_for_exit(control_group=mine)
        assert ours in own and theirs not in own
        assert theirs in log.recent_for_exit()  # no unit asked: nothing is left out


@pytest.fixture
def own_cgroup() -> Iterator[Path]:
    """A cgroup of this test's own on the unified hierarchy (root: CI runs as root)."""
    root = next(r for r in CGROUP_ROOTS if (r / "cgroup.procs").is_file())
    group = root / f"k26test-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    try:
        yield group
    finally:
        if group.exists():
            group.rmdir()  # empty by then: its one process was killed


@needs_kmsg
async def test_a_tracked_cgroup_that_vanishes_does_not_stop_the_reader(own_cgroup: Path) -> None:
    """A tracked unit stops and systemd removes its cgroup: the next PID read finds
    nothing there, and the kernel log is read on. (The soak's own failure, the cgroup
    vanishing in the middle of a walk, is a race no test can time: the next test
    covers it by making the PID read fail.)"""
    child = _spawn(["sleep", "600"])
    try:
        (own_cgroup / "cgroup.procs").write_text(str(child.pid))
        path = process_cgroup(child.pid)
        assert path is not None and path.endswith(own_cgroup.name)
        async with KernelLog() as log:
            log.track("gone.service", path, child.pid)
            first = _log_line(f"k26test: tracked {uuid.uuid4()}")
            assert await wait_for(log, lambda m: m == first) == first
            child.kill()
            child.wait()
            await asyncio.to_thread(own_cgroup.rmdir)  # as systemd does when the unit stops
            log.track("other.service", "/x/other.service", 0)  # the thread reads again now
            after = _log_line(f"k26test: still reading {uuid.uuid4()}")
            assert await wait_for(log, lambda m: m == after) == after
            assert log.available
    finally:
        child.kill()
        child.wait()


@needs_kmsg
async def test_the_reader_outlives_a_failed_pid_read(caplog: pytest.LogCaptureFixture) -> None:
    """The soak's traceback: the walk raised when the cgroup vanished between its
    is-a-directory check and its scandir, a race no test can time. Whatever the PID
    read raises, the kernel log is read on and the failure is logged."""

    class BrokenPids(KernelLog):
        def _read_pids(self, *, force: bool = False) -> None:
            raise FileNotFoundError(2, "No such file or directory", "/sys/fs/cgroup/x.service")

    async with BrokenPids() as log:
        log.track("x.service", "/x.service", os.getpid())  # wakes the thread to read PIDs
        after = _log_line(f"k26test: still reading {uuid.uuid4()}")
        assert await wait_for(log, lambda m: m == after) == after
    assert "reading the tracked units' PIDs failed" in caplog.text


@needs_kmsg
async def test_records_after_hands_each_record_over_once_in_order() -> None:
    async with KernelLog() as log:
        seen = log.appended
        lines = [_log_xid("5f", 1, 43), _log_xid("5f", 2, 43)]
        got: list[str] = []
        while len(got) < 2:
            seen, records = await asyncio.wait_for(log.records_after(seen), DEADLINE_S)
            got.extend(r.message for r in records if r.message in lines)
        assert got == lines
    assert await log.records_after(seen) == (seen, [])  # closed: nothing to wait for


@needs_kmsg
async def test_kernel_log_starts_at_the_end() -> None:
    async with KernelLog() as log:
        log.poll()
        # Boot messages were logged long before; none is replayed.
        assert not any("Linux version" in r.message for r in log.records())


async def test_kernel_log_unavailable_degrades_to_nothing(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "no-such-kmsg")
    assert await log.start() is False
    assert not log.available
    assert log.unavailable_reason is not None and "cannot open" in log.unavailable_reason
    assert log.records() == [] and log.poll() == 0
    assert await wait_for(log, lambda m: True) is None
    log.close()


async def test_kernel_log_refuses_an_unpollable_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("6,1,1,-;x\n")
    log = KernelLog(plain)
    assert await log.start() is False
    assert log.unavailable_reason is not None and "cannot follow" in log.unavailable_reason


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kmsg-fifo"
    os.mkfifo(path)
    yield path


async def test_overwritten_records_are_counted_and_skipped(fifo: Path) -> None:
    """EPIPE means the kernel's ring buffer wrapped past our cursor: read on."""
    script: list[bytes | BaseException] = [
        BrokenPipeError(),
        b"6,500,100,-;after the gap\n",
        BrokenPipeError(),
        b"4,502,101,-;and on\n SUBSYSTEM=x\n",
        BlockingIOError(),
    ]

    class ScriptedLog(KernelLog):
        @staticmethod
        def _read(fd: int, size: int) -> bytes:
            step = script.pop(0)
            if isinstance(step, BaseException):
                raise step
            return step

    async with ScriptedLog(fifo, capacity=10) as log:
        assert log.poll() == 2
        assert log.overwritten == 2
        assert [r.message for r in log.records()] == ["after the gap", "and on"]
        assert [r.seq for r in log.records()] == [500, 502]


async def test_the_ring_buffer_is_bounded(fifo: Path) -> None:
    script: list[bytes | BaseException] = [
        *(f"6,{i},{i},-;record {i}\n".encode() for i in range(10)),
        BlockingIOError(),
    ]

    class ScriptedLog(KernelLog):
        @staticmethod
        def _read(fd: int, size: int) -> bytes:
            step = script.pop(0)
            if isinstance(step, BaseException):
                raise step
            return step

    async with ScriptedLog(fifo, capacity=3) as log:
        log.poll()
        assert [r.message for r in log.records()] == ["record 7", "record 8", "record 9"]
        found = await wait_for(log, lambda m: m.endswith("8"))
        assert found == "record 8"


# --- the unit's output file ---------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("append:/var/log/sglang/k26.log", Path("/var/log/sglang/k26.log")),
        ("file:/tmp/out.log", Path("/tmp/out.log")),
        ("truncate:/tmp/out.log", Path("/tmp/out.log")),
        ("append", None),  # what the D-Bus StandardOutput property says
        ("journal", None),
        ("journal+console", None),
        ("inherit", None),
        ("null", None),
        ("fd:stdout", None),
        ("append:relative/path", None),
        ("", None),
    ],
)
def test_parse_output_path(setting: str, expected: Path | None) -> None:
    assert parse_output_path(setting) == expected


async def test_output_tail_reads_only_this_run(tmp_path: Path) -> None:
    path = tmp_path / "unit.log"
    path.write_text("old crash: CUDA out of memory\n")
    tail = OutputTail(path)
    assert await tail.mark() == path.stat().st_size
    with path.open("a") as handle:
        handle.write("standin: loaded\nline two\nline three\n")
    assert await tail.lines() == ["standin: loaded", "line two", "line three"]
    assert await tail.lines(2) == ["line two", "line three"]


async def test_output_tail_reads_a_bounded_tail(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    path.write_text("".join(f"line {i:05d}\n" for i in range(10000)))  # 11 bytes a line
    tail = OutputTail(path, max_bytes=100)
    lines = await tail.lines(1000)
    assert lines[-1] == "line 09999"
    assert all(ln.startswith("line ") and len(ln) == 10 for ln in lines)  # no partial line
    assert len(lines) == 9


async def test_output_tail_after_truncation_and_without_a_file(tmp_path: Path) -> None:
    path = tmp_path / "unit.log"
    path.write_text("a\n" * 50)
    tail = OutputTail(path)
    await tail.mark()
    path.write_text("fresh\n")  # rotated or truncated since the mark
    assert await tail.lines() == ["fresh"]
    assert await OutputTail(tmp_path / "missing.log").lines() == []
    none = OutputTail(None)
    assert await none.mark() == 0 and await none.lines() == []


def test_unit_output_path_from_unit_file_and_drop_ins(tmp_path: Path) -> None:
    fragment = tmp_path / "sglang@k26.service"
    fragment.write_text(
        "[Unit]\nDescription=x\nStandardOutput=append:/wrong/section\n\n"
        "[Service]\nExecStart=/bin/true\nStandardOutput=journal\n"
    )
    dropin = tmp_path / "override.conf"
    dropin.write_text("# comment\n[Service]\nStandardOutput=append:/var/log/%p/%i-%n.log\n")
    path = read_unit_output_path("sglang@k26.service", str(fragment), [str(dropin)])
    assert path == Path("/var/log/sglang/k26-sglang@k26.service.log")
    assert read_unit_output_path("sglang@k26.service", str(fragment)) is None
    homeward = tmp_path / "home.conf"
    homeward.write_text("[Service]\nStandardOutput=append:%h/k26.log\n")
    assert read_unit_output_path("x.service", str(homeward)) is None  # %h is not ours to know
    assert read_unit_output_path("x.service", str(tmp_path / "missing")) is None


# --- journalctl ---------------------------------------------------------------------


def _fake_journalctl(tmp_path: Path, body: str) -> str:
    path = tmp_path / "journalctl"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


async def test_journal_lines_runs_journalctl(tmp_path: Path) -> None:
    fake = _fake_journalctl(tmp_path, 'echo "args: $*"\necho\necho "second line"\n')
    lines = await journal_lines("sglang-k26.service", 1700000000.5, user=True, journalctl=fake)
    assert lines == [
        "args: --user -u sglang-k26.service -o cat --no-pager -q --lines=2000 --since=@1700000000",
        "second line",
    ]


async def test_journal_lines_degrades_to_nothing(tmp_path: Path) -> None:
    failing = _fake_journalctl(tmp_path, "echo 'No journal files were found.'\nexit 1\n")
    assert await journal_lines("x.service", journalctl=failing) == []
    assert await journal_lines("x.service", journalctl=str(tmp_path / "absent")) == []


async def test_journal_lines_times_out(tmp_path: Path) -> None:
    stuck = _fake_journalctl(tmp_path, "exec sleep 30\n")
    started = time.monotonic()
    assert await journal_lines("x.service", journalctl=stuck, timeout_s=0.3) == []
    assert time.monotonic() - started < DEADLINE_S


async def test_real_journalctl_without_entries() -> None:
    assert shutil.which("journalctl"), "journalctl is needed (Debian: the systemd package)"
    lines = await asyncio.wait_for(
        journal_lines(f"k26-no-such-{uuid.uuid4().hex[:8]}.service"), DEADLINE_S
    )
    assert lines == []


async def test_recent_for_exit_drains_and_windows(fifo: Path) -> None:
    script: list[bytes | BaseException] = [b"3,1,1,-;Killed process 42 (python3)\n"]

    class ScriptedLog(KernelLog):
        @staticmethod
        def _read(fd: int, size: int) -> bytes:
            step = script.pop(0) if script else BlockingIOError()
            if isinstance(step, BaseException):
                raise step
            return step

    async with ScriptedLog(fifo) as log:
        before = time.monotonic()
        # Not polled yet: recent_for_exit drains first.
        assert log.recent_for_exit() == ["Killed process 42 (python3)"]
        assert log.recent_for_exit(since_monotonic=before) == ["Killed process 42 (python3)"]
        assert log.recent_for_exit(since_monotonic=time.monotonic() + 1) == []
        assert log.recent_for_exit(window_s=-1.0) == []
