"""Explaining one exit: gather its evidence, then ask the pure classifier.

The kernel log (only this run's records), the unit's own output from this run
(its ``StandardOutput=append:`` file) or else the journal. Never blocks the loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from supervisor.adapters.evidence import KernelLog, OutputTail, journal_lines
from supervisor.core.classify import ExitSnapshot, Verdict, classify
from supervisor.core.exits import ExitObserved

OUTPUT_TAIL_BYTES = 64 * 1024
OUTPUT_TAIL_LINES = 2000


async def output_size(path: str) -> int:
    """Size of the unit's output file now: where this run's output begins."""
    return await OutputTail(path or None).mark()


async def explain(
    exit_: ExitObserved,
    kernel_log: KernelLog | None,
    *,
    user_bus: bool,
    journal: bool | None = None,
) -> Verdict:
    """Gather this exit's evidence and classify it."""
    kernel: list[str] = []
    if kernel_log is not None:
        # Only this run's kernel records: an OOM of an earlier run names the same cgroup.
        kernel = kernel_log.recent_for_exit(since_monotonic=exit_.started_monotonic or None)
    output: list[str] = []
    if exit_.output_path:
        tail = OutputTail(exit_.output_path, max_bytes=OUTPUT_TAIL_BYTES)
        tail.start_offset = exit_.output_offset
        output = await tail.lines(n=OUTPUT_TAIL_LINES)
    if journal is None:
        journal = await asyncio.to_thread(Path("/run/systemd/journal/socket").exists)
    if journal and not output:
        output = await journal_lines(
            exit_.unit, since=exit_.started_at or exit_.exited_at, user=user_bus
        )
    snap = ExitSnapshot(
        unit=exit_.unit,
        result=exit_.result,
        exec_main_code=exit_.exec_main_code,
        exec_main_status=exit_.exec_main_status,
        main_pid=exit_.exec_main_pid,
        control_group=exit_.control_group,
        exited_at=exit_.exited_at,
    )
    return classify(snap, kernel, output)
