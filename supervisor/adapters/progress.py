"""The forward-progress watch of a ready unit (the rule: core/progress.py).

While the unit is ready, its server's ``/metrics`` is read every
``progress_interval_s``; the unit's cgroup is looked at for a compiler at work. A
server with no ``/metrics`` (started without ``--enable-metrics``) turns the watch off
for that run, saying so once. A failed read proves nothing here (a dead server is
the exit watch's, a hung one the probe's): the watch goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from supervisor.adapters.evidence import cgroup_dir, cgroup_procs_files
from supervisor.core.progress import (
    COMPILERS,
    MetricsUnreadable,
    ProgressJudge,
    parse_sglang_metrics,
)

log = logging.getLogger("k26.progress")


def compilers_in(directory: Path) -> list[str]:
    """The compiler processes (by /proc/PID/comm) in a cgroup and its children."""
    found: list[str] = []
    for procs in cgroup_procs_files(directory):
        try:
            pids = procs.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue  # gone meanwhile
            if comm in COMPILERS:
                found.append(f"{comm}[{pid}]")
    return found


class ProgressWatch:
    """One ready run of one unit. ``run()`` returns the stall's reason, or None when
    the watch cannot work (no /metrics); cancel it when the unit leaves READY."""

    def __init__(
        self,
        unit: str,
        url: str,
        *,
        stall_after_s: float,
        interval_s: float,
        client: httpx.AsyncClient,
        main_pid: Callable[[], int],
    ) -> None:
        self.unit = unit
        self.url = url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.client = client
        self.main_pid = main_pid
        self.judge = ProgressJudge(stall_after_s, time.monotonic())

    def activity(self) -> None:
        """A JIT cache of the unit gained a file: a compile is in progress."""
        self.judge.activity(time.monotonic())

    async def run(self) -> str | None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                response = await self.client.get(self.url, timeout=max(self.interval_s, 2.0))
            except httpx.HTTPError:
                continue
            if response.status_code == 404:
                log.warning(
                    "%s: its server serves no /metrics, so the forward-progress watch is off "
                    "for this run: add --enable-metrics to the unit's ExecStart",
                    self.unit,
                )
                return None
            if response.status_code != 200:
                continue
            try:
                load = parse_sglang_metrics(response.text)
            except MetricsUnreadable as exc:
                log.warning("%s: forward-progress watch off for this run: %s", self.unit, exc)
                return None
            directory = await asyncio.to_thread(cgroup_dir, self.main_pid())
            compiling = (
                [] if directory is None else await asyncio.to_thread(compilers_in, directory)
            )
            if compiling:
                self.judge.activity(time.monotonic())
            why = self.judge.observe(load, time.monotonic())
            if why is not None:
                return why
