"""The output of a unit's current run, for the server's own account of its start.

Where the unit's output goes decides where it is read from: its output file
(``StandardOutput=append:FILE``; the tail of the file, cut at the last start) or
the journal, since the run's ``ExecMainStartTimestamp``. Off the event loop;
nothing found is an empty list, never an error (the timeline then says unknown).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from supervisor.adapters.evidence import journal_lines
from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.startup_log import last_start

MAX_BYTES = 2 << 20
RECENT_BYTES = 64 * 1024  # recent_output: many batch lines
RECENT_JOURNAL_LINES = 300


def _file_tail(path: Path, max_bytes: int = MAX_BYTES) -> list[str]:
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


async def run_output(snapshot: UnitSnapshot, *, user: bool) -> list[str]:
    """The lines the unit's current run has printed (its start-up among them)."""
    if snapshot.standard_output_path:
        lines = await asyncio.to_thread(_file_tail, Path(snapshot.standard_output_path))
    else:
        lines = await journal_lines(
            snapshot.unit, since=snapshot.exec_main_start, user=user, max_lines=20000
        )
    return last_start(lines)


async def recent_output(snapshot: UnitSnapshot, *, user: bool) -> list[str]:
    """The last lines the unit's current run printed, newest last (the learned
    shapes' batch lines: adapters/learned_shapes.py)."""
    if snapshot.standard_output_path:
        path = Path(snapshot.standard_output_path)
        return await asyncio.to_thread(_file_tail, path, RECENT_BYTES)
    return await journal_lines(
        snapshot.unit, since=snapshot.exec_main_start, user=user, max_lines=RECENT_JOURNAL_LINES
    )
