"""The one exit pipeline: systemd's signals in, explained exits out.

Both ``k26-supervisor watch`` and the daemon run every bus event through
``ExitWatch.handle``. It feeds the pure ``ExitTracker`` (transitions, exits,
who asked for a stop), learns each new run's cgroup and output offset, and for
every exit gathers its evidence and asks the pure classifier:

- the kernel log, only this run's records (an OOM of an earlier run names the
  same cgroup);
- the unit's own output from this run (``StandardOutput=append:FILE``), or
  else the journal. journald reads a unit's stdout from a stream socket of its
  own and can still be writing the last lines when systemd reports the death;
  ``JournalReader`` waits (bounded) until journald has closed every stream that
  the dead unit had open, so the classifier never decides on a journal that has
  not caught up.

Nothing here blocks the event loop: snapshots go through the bus adapter's
thread, files through ``to_thread``, journalctl as an async subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.adapters.bus import Bus
from supervisor.adapters.evidence import KernelLog, OutputTail, journal_lines
from supervisor.core.bus_events import (
    BusEvent,
    BusReconnected,
    JobRemoved,
    PropertiesChanged,
    UnitSnapshot,
)
from supervisor.core.classify import ExitSnapshot, Verdict, classify
from supervisor.core.errors import BusError
from supervisor.core.exits import ActiveStateChanged, ExitObserved, ExitTracker, ForeignJobDone

log = logging.getLogger("k26.exits")

OUTPUT_TAIL_BYTES = 64 * 1024
OUTPUT_TAIL_LINES = 2000
JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
# journald keeps one state file per open stdout stream, named after the stream
# socket and naming the unit (journald-stream.c, stdout_stream_save); it removes
# the file when the stream is freed, after it has read the stream to its end.
JOURNAL_STREAMS = Path("/run/systemd/journal/streams")
JOURNAL_CATCHUP_MAX_S = 5.0
_STREAM_POLL_S = 0.02


async def output_size(path: str) -> int:
    """Size of the unit's output file now: where this run's output begins."""
    return await OutputTail(path or None).mark()


@dataclass(frozen=True)
class ExplainedExit:
    exit: ExitObserved
    verdict: Verdict


def _streams_of(unit: str, streams: Path) -> set[Path]:
    found: set[Path] = set()
    try:
        entries = list(streams.iterdir())
    except OSError:
        return found
    needle = f"UNIT={unit}\n"
    for entry in entries:
        with contextlib.suppress(OSError):
            if needle in entry.read_text(errors="replace"):
                found.add(entry)
    return found


class JournalReader:
    """A unit's journal lines for one run, read once journald has caught up."""

    def __init__(
        self,
        *,
        user: bool,
        streams: Path = JOURNAL_STREAMS,
        socket: Path = JOURNAL_SOCKET,
        max_wait_s: float = JOURNAL_CATCHUP_MAX_S,
    ) -> None:
        self.user = user
        self.streams = streams
        self.socket = socket
        self.max_wait_s = max_wait_s
        self.last_wait_s = 0.0  # how long the last read waited for journald (measured)

    async def available(self) -> bool:
        return await asyncio.to_thread(self.socket.exists)

    async def caught_up(self, unit: str) -> float:
        """Wait until journald has closed every stdout stream ``unit`` had open;
        return the seconds waited (at most ``max_wait_s``)."""
        started = time.monotonic()
        pending = await asyncio.to_thread(_streams_of, unit, self.streams)
        while pending and time.monotonic() - started < self.max_wait_s:
            await asyncio.sleep(_STREAM_POLL_S)  # journald offers no event for it
            pending = {p for p in pending if await asyncio.to_thread(p.exists)}
        waited = time.monotonic() - started
        if pending:
            log.warning(
                "%s: journald still had %d stream(s) open after %.1f s; reading what it has",
                unit,
                len(pending),
                waited,
            )
        return waited

    async def lines(self, unit: str, since: Any) -> list[str]:
        self.last_wait_s = await self.caught_up(unit)
        return await journal_lines(unit, since=since, user=self.user)


class ExitWatch:
    """Follows ``units`` on ``bus``; ``handle`` turns bus events into what matters."""

    def __init__(
        self,
        bus: Bus,
        units: Iterable[str],
        *,
        kernel_log: KernelLog | None = None,
        journal: JournalReader | None = None,
        tracker: ExitTracker | None = None,
    ) -> None:
        self.bus = bus
        self.units = tuple(units)
        self.kernel_log = kernel_log
        self.journal = journal
        self.tracker = tracker or ExitTracker()
        self._tasks: set[asyncio.Task[Any]] = set()
        for unit in self.units:
            self.tracker.watch(unit)

    async def seed(self, unit: str) -> UnitSnapshot:
        """Read the unit now; exits before this are not news."""
        snap = await self.bus.snapshot(unit)
        self.tracker.seed(snap, output_offset=await output_size(snap.standard_output_path))
        return snap

    async def handle(
        self, event: BusEvent
    ) -> list[ActiveStateChanged | ExplainedExit | ForeignJobDone]:
        """What ``event`` means for the watched units, exits already explained."""
        if isinstance(event, BusReconnected):
            # The signals in between are gone: re-read, and report what changed.
            log.warning("D-Bus reconnected (%s): re-reading every unit", event.reason)
            return list(await self.reconcile(self.units, lost=True))
        if isinstance(event, JobRemoved) and event.unit in self.units:
            foreign = self.tracker.job_removed(event.unit, event.job_path, event.result, event.at)
            if foreign is None:
                return []
            # A start's job ends too, with the unit up: only a fresh read tells.
            try:
                snap = await self.bus.snapshot(event.unit)
            except BusError as exc:  # the periodic re-read is the safety net
                log.warning("%s: cannot read it after a job ended: %s", event.unit, exc)
                return []
            if snap.active_state in ("inactive", "failed") and not snap.job:
                log.info(
                    "%s: a job the supervisor did not issue (%s) left it down",
                    foreign.unit,
                    foreign.job,
                )
                return [foreign]
            return []
        if not isinstance(event, PropertiesChanged) or event.unit not in self.units:
            return []
        return list(await self._explained(self.tracker.feed(event)))

    async def reconcile(
        self, units: Sequence[str], *, lost: bool = False
    ) -> list[ActiveStateChanged | ExplainedExit]:
        """Re-read ``units`` and report whatever no signal told us. ``lost``: signals
        were certainly lost (a reconnect), so even a unit with fresh signals is
        compared."""
        out: list[ActiveStateChanged | ExplainedExit] = []
        for unit in units:
            before = None if lost else self.tracker.signal_count(unit)
            snap = await self.bus.snapshot(unit)
            changes = self.tracker.reconcile(snap, time.monotonic(), signals_seen=before)
            if changes:
                log.warning("%s: a re-read found what no signal said: %s", unit, changes)
            out += await self._explained(changes)
        return out

    async def _explained(
        self, changes: Iterable[ActiveStateChanged | ExitObserved]
    ) -> list[ActiveStateChanged | ExplainedExit]:
        out: list[ActiveStateChanged | ExplainedExit] = []
        for change in changes:
            if isinstance(change, ActiveStateChanged):
                if change.new in ("activating", "active") and change.old in ("inactive", "failed"):
                    # Learn the new run's cgroup for OOM evidence, off the hot path.
                    self._spawn(self.seed(change.unit))
                out.append(change)
            else:
                verdict = await self.explain(change)
                # The next run's output starts after what we have read.
                self.tracker.note_output_offset(change.unit, await output_size(change.output_path))
                out.append(ExplainedExit(change, verdict))
        return out

    async def explain(self, exit_: ExitObserved) -> Verdict:
        """Gather this exit's evidence and classify it."""
        kernel: list[str] = []
        if self.kernel_log is not None:
            kernel = self.kernel_log.recent_for_exit(
                since_monotonic=exit_.started_monotonic or None,
                control_group=exit_.control_group,
            )
        output: list[str] = []
        if exit_.output_path:
            tail = OutputTail(exit_.output_path, max_bytes=OUTPUT_TAIL_BYTES)
            tail.start_offset = exit_.output_offset
            output = await tail.lines(n=OUTPUT_TAIL_LINES)
        if not output and self.journal is not None and await self.journal.available():
            output = await self.journal.lines(exit_.unit, exit_.started_at or exit_.exited_at)
            log.info(
                "exit evidence: unit=%s journal caught up in %.3f s (%d lines)",
                exit_.unit,
                self.journal.last_wait_s,
                len(output),
            )
        snap = ExitSnapshot(
            unit=exit_.unit,
            result=exit_.result,
            exec_main_code=exit_.exec_main_code,
            exec_main_status=exit_.exec_main_status,
            main_pid=exit_.exec_main_pid,
            control_group=exit_.control_group,
            exited_at=exit_.exited_at,
            stop_requested=exit_.stop_by is not None,
        )
        return classify(snap, kernel, output)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
