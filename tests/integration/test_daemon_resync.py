"""The periodic resync, driven for real: an exit whose every signal was lost is still seen.

The daemon runs in this process (so the test can make its D-Bus signals go
missing) against the sandbox's real systemd, with a real stand-in unit killed
by a real SIGKILL. Nothing but ``resync_interval_s`` can find that exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.adapters.config_file import load_config
from supervisor.core.bus_events import PropertiesChanged
from supervisor.daemon import Daemon

from .conftest import StandinUnit
from .daemon_harness import unit_status, write_config

pytestmark = pytest.mark.integration


async def _until(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def test_the_periodic_resync_finds_an_exit_whose_signals_were_lost(
    standin_unit: Callable[..., StandinUnit], tmp_path: Path
) -> None:
    unit = standin_unit()
    path = write_config(tmp_path, [(unit, "autoregressive", None)])
    # A re-read every second; the periodic probe rarely, so that only the re-read can
    # find the exit (a failing probe would restart the unit and hide it).
    text = path.read_text().replace("\ninterval_s = 1\n", "\ninterval_s = 300\n")
    path.write_text(text.replace("job_timeout_s = 30", "job_timeout_s = 30\nresync_interval_s = 1"))
    config = load_config(path)
    assert config.supervisor.resync_interval_s == 1 and config.probe.interval_s == 300
    daemon = Daemon(config, path)
    real_handle = daemon.exits.handle
    lost: list[PropertiesChanged] = []
    losing = False

    async def handle_losing_signals(event: Any) -> Any:
        if losing and isinstance(event, PropertiesChanged) and event.unit == unit.name:
            lost.append(event)  # as if the bus had dropped it
            return []
        return await real_handle(event)

    daemon.exits.handle = handle_losing_signals  # type: ignore[method-assign]
    url = f"http://{config.supervisor.listen}/status"
    running = asyncio.create_task(daemon.run())
    try:
        async with httpx.AsyncClient(timeout=2) as client:

            async def status() -> dict[str, Any] | None:
                if running.done():
                    raise AssertionError(f"the daemon ended: {running.result()!r}")
                try:
                    return (await client.get(url)).json()  # type: ignore[no-any-return]
                except httpx.HTTPError:
                    return None

            async def ready() -> bool:
                s = await status()
                return bool(s and unit_status(s, unit.name)["ready"])

            await _until("the unit ready", ready, 60)
            pid = unit.main_pid()
            assert pid > 0
            losing = True
            os.kill(pid, signal.SIGKILL)

            async def exit_seen() -> dict[str, Any] | None:
                s = await status()
                last = unit_status(s, unit.name).get("last_exit") if s else None
                return last if last and last.get("main_pid") == pid else None

            seen_at = time.monotonic()
            last_exit = await _until("the resync to find the exit", exit_seen, 30)
            waited = time.monotonic() - seen_at
            assert lost, "no signal about the unit was dropped: the test proved nothing"
            assert last_exit["cause"] == "sigkill", last_exit
            assert last_exit["signal"] == 9
            losing = False
            # Found by a re-read, it goes down the same path as a signal: a restart.
            await _until("the unit ready again", ready, 60)
            assert unit.main_pid() not in (0, pid)
            print(f"\nexit found by the resync {waited:.2f} s after the kill (interval 1 s)")
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
