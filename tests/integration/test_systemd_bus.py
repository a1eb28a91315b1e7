"""The async pystemd adapter against a real systemd (user manager in the sandbox)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from k26dev import sandbox
from supervisor.adapters.systemd_bus import SystemdBus, escape_unit_path, unescape_unit_path
from supervisor.core.bus_events import BusEvent, BusReconnected, JobRemoved, PropertiesChanged
from supervisor.core.errors import UnitNameError

from .conftest import write_unit

pytestmark = pytest.mark.integration


def _sleep_unit(info: sandbox.SandboxInfo, tmp_path: Path, name: str) -> None:
    write_unit(info, name, "/bin/sleep 600", tmp_path / f"{name}.out")


def _is_state(unit: str, state: str) -> Callable[[object], bool]:
    def pred(ev: object) -> bool:
        return (
            isinstance(ev, PropertiesChanged)
            and ev.unit == unit
            and ev.changed.get("ActiveState") == state
        )

    return pred


async def next_match(
    bus: SystemdBus, predicate: Callable[[BusEvent], bool], timeout_s: float
) -> BusEvent:
    """The next event (from the daemon's own stream) that ``predicate`` accepts."""

    async def first() -> BusEvent:
        async for event in bus.events():
            if predicate(event):
                return event
        raise AssertionError("the event stream ended")

    return await asyncio.wait_for(first(), timeout_s)


def _systemctl(info: sandbox.SandboxInfo, *args: str) -> None:
    env = dict(os.environ, **info.env)
    subprocess.run(["systemctl", "--user", *args], env=env, check=True, capture_output=True)


def test_unit_path_escaping_round_trips() -> None:
    for name in ["sglang-k26.service", "a@1.service", "x_y:z\\-.service", "9lives.service"]:
        assert unescape_unit_path(escape_unit_path(name)) == name
    assert escape_unit_path("sglang-k26.service").endswith("/sglang_2dk26_2eservice")


async def test_start_and_stop_wait_for_their_own_jobs(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> None:
    unit = "k26t-jobs.service"
    _sleep_unit(bus_env, tmp_path, unit)
    async with SystemdBus("user") as bus:
        started = await bus.job("start", unit)
        assert started.ok and started.result == "done" and started.verb == "start"
        snap = await bus.snapshot(unit)
        assert snap.active_state == "active" and snap.main_pid > 0
        assert snap.control_group.endswith(f"/app.slice/{unit}")
        assert snap.restart == "no" and snap.standard_output == "append"
        assert snap.standard_output_path == str(tmp_path / f"{unit}.out")
        assert snap.exec_main_start is not None and snap.active_enter is not None
        stopped = await bus.job("stop", unit)
        assert stopped.ok
        final = await bus.snapshot(unit)
        assert final.active_state == "inactive" and final.main_pid == 0
        assert final.result == "success"


async def test_failed_start_reports_the_job_result(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> None:
    unit = "k26t-nostart.service"
    # Type=exec: the start job itself fails when the binary cannot be executed.
    write_unit(bus_env, unit, "/nonexistent/binary", tmp_path / "x.out", extra="Type=exec\n")
    async with SystemdBus("user") as bus:
        job = await bus.job("start", unit)
        assert job.result == "failed" and not job.ok
        await asyncio.to_thread(_systemctl, bus_env, "reset-failed", unit)


async def test_sigkill_arrives_as_typed_events_within_milliseconds(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> None:
    unit = "k26t-kill.service"
    _sleep_unit(bus_env, tmp_path, unit)
    async with SystemdBus("user") as bus:
        await bus.job("start", unit)
        pid = (await bus.snapshot(unit)).main_pid
        assert pid > 0  # never signal pid 0: that is our own process group
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def died(ev: object) -> bool:
            return (
                isinstance(ev, PropertiesChanged)
                and ev.unit == unit
                and ev.interface.endswith(".Service")
                and ev.changed.get("ExecMainCode") == 2
            )

        ev = await next_match(bus, died, timeout_s=10)
        assert isinstance(ev, PropertiesChanged)
        assert ev.changed["ExecMainStatus"] == 9 and ev.changed["Result"] == "signal"
        assert all(isinstance(k, str) for k in ev.changed)
        assert ev.at - t0 < 5.0
        await next_match(bus, _is_state(unit, "failed"), timeout_s=10)
        snap = await bus.snapshot(unit)
        assert (snap.result, snap.exec_main_code, snap.exec_main_status) == ("signal", 2, 9)
        assert snap.exec_main_pid == pid
        await asyncio.to_thread(_systemctl, bus_env, "reset-failed", unit)


async def test_job_removed_is_delivered_as_an_event(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> None:
    unit = "k26t-jobev.service"
    _sleep_unit(bus_env, tmp_path, unit)
    async with SystemdBus("user") as bus:
        job = await bus.job("start", unit)
        ev = await next_match(
            bus, lambda e: isinstance(e, JobRemoved) and e.job_path == job.job_path, timeout_s=5
        )
        assert isinstance(ev, JobRemoved) and ev.unit == unit and ev.result == "done"
        await bus.job("stop", unit)


async def test_bad_unit_names_never_reach_the_bus(bus_env: sandbox.SandboxInfo) -> None:
    async with SystemdBus("user") as bus:
        for bad in ["../../etc/passwd", "x.service; rm -rf /", "a\nb.service", ""]:
            with pytest.raises(UnitNameError):
                await bus.job("start", bad)
            with pytest.raises(UnitNameError):
                await bus.snapshot(bad)


async def test_manager_restart_is_reconnected_and_resubscribed(
    fresh_sbx: sandbox.SandboxInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in fresh_sbx.env.items():
        monkeypatch.setenv(key, value)
    unit = "k26t-reexec.service"
    _sleep_unit(fresh_sbx, tmp_path, unit)
    async with SystemdBus("user") as bus:
        await bus.job("start", unit)
        env = dict(os.environ, **fresh_sbx.env)
        await asyncio.to_thread(
            subprocess.run, ["systemctl", "--user", "daemon-reexec"], env=env, check=True
        )
        ev = await next_match(bus, lambda e: isinstance(e, BusReconnected), timeout_s=20)
        assert isinstance(ev, BusReconnected)
        # Still subscribed: a kill after the re-exec is seen.
        pid = (await bus.snapshot(unit)).main_pid
        assert pid > 0
        os.kill(pid, signal.SIGKILL)
        await next_match(bus, _is_state(unit, "failed"), timeout_s=10)


@pytest.mark.parametrize("how", ["restart", "kill-9"])
async def test_dbus_daemon_restart_is_reconnected(
    fresh_sbx: sandbox.SandboxInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    for key, value in fresh_sbx.env.items():
        monkeypatch.setenv(key, value)
    unit = "k26t-busrestart.service"
    _sleep_unit(fresh_sbx, tmp_path, unit)
    env = dict(os.environ, **fresh_sbx.env)

    def systemctl(*args: str) -> str:
        return subprocess.run(
            ["systemctl", "--user", *args], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()

    async with SystemdBus("user", reconnect_max_s=0.5) as bus:
        await bus.job("start", unit)
        # systemctl --user talks over the manager's private socket, not the bus.
        bus_pid = int(
            await asyncio.to_thread(systemctl, "show", "-p", "MainPID", "--value", "dbus.service")
        )
        assert bus_pid > 1
        if how == "restart":
            await asyncio.to_thread(systemctl, "restart", "dbus.service")
        else:
            os.kill(bus_pid, signal.SIGKILL)
            # dbus.socket still listens; the next connection re-activates the bus.
        ev = await next_match(bus, lambda e: isinstance(e, BusReconnected), timeout_s=30)
        assert isinstance(ev, BusReconnected)
        snap = await bus.snapshot(unit)
        assert snap.active_state == "active" and snap.main_pid > 1
        # Re-subscribed on the new bus: a kill is still seen.
        os.kill(snap.main_pid, signal.SIGKILL)
        await next_match(bus, _is_state(unit, "failed"), timeout_s=10)
