"""UnitOps: every action ends in exactly one completion event, whatever breaks inside."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from supervisor.adapters import sampling_env
from supervisor.adapters import warmup as warmup_module
from supervisor.adapters.unit_ops import UnitOps
from supervisor.adapters.warmup import Warmup
from supervisor.core.config import parse_config
from supervisor.core.errors import BusError
from supervisor.core.events import (
    INTERNAL_ERROR,
    JobDone,
    ProbeFailed,
    RunWarmup,
    SampledProbe,
    SamplingBackend,
    StartUnit,
    StopUnit,
    WaitHealthy,
    WarmupFailed,
)
from supervisor.core.exits import ExitTracker
from supervisor.core.status import StatusBoard

UNIT = "sglang-k26.service"


class Bus:
    """Answers jobs as the real adapter does, or fails as told."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.calls: list[str] = []

    async def job(self, verb: str, unit: str, **kw: Any) -> Any:
        self.calls.append(verb)
        if self.fail is not None:
            raise self.fail

        class Done:
            result = "done"
            job_path = f"/org/freedesktop/systemd1/job/{len(self.calls)}"

        return Done()


def ops(bus: Bus, tmp_path: Path, **flashinfer: Any) -> tuple[UnitOps, ExitTracker]:
    config = parse_config(
        {
            "supervisor": {"bus": "user", "job_timeout_s": 5.0},
            "flashinfer": {"enabled": True, "python": "/nonexistent/python", **flashinfer},
            "units": [{"name": UNIT, "role": "autoregressive", "url": "http://127.0.0.1:9"}],
        }
    )
    board = StatusBoard(version="t", config_path="c")
    board.add_unit(UNIT, "autoregressive")
    tracker = ExitTracker()
    warmup = Warmup(config.flashinfer, board, accepted_record=tmp_path / "state" / "accepted")
    made = UnitOps(config, bus, board, warmup, tracker)  # type: ignore[arg-type]
    return made, tracker


@pytest.fixture(autouse=True)
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


async def test_a_job_that_the_bus_refuses_is_a_failed_job(tmp_path: Path) -> None:
    bus = Bus(BusError("Interactive authentication required."))
    unit_ops, tracker = ops(bus, tmp_path)
    start = StartUnit(3, SamplingBackend.FLASHINFER, restart=False)
    refused = "Interactive authentication required."
    assert await unit_ops.run(UNIT, start) == JobDone(3, "failed", refused)
    assert await unit_ops.run(UNIT, StopUnit(4)) == JobDone(4, "failed", refused)
    assert tracker.watch(UNIT).own_jobs == 0  # every expected job was answered


async def test_an_unexpected_exception_is_that_actions_failure(tmp_path: Path) -> None:
    unit_ops, tracker = ops(Bus(KeyError("JobRemoved")), tmp_path)
    done = await unit_ops.run(UNIT, StopUnit(5))
    assert (done.op, done.result) == (5, "failed") and "KeyError" in done.error
    assert tracker.watch(UNIT).own_jobs == 0


async def test_a_sampling_env_that_cannot_be_written_fails_the_start_not_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "k26-supervisor").write_text("a file where the runtime directory should be")
    bus = Bus()
    unit_ops, _ = ops(bus, tmp_path)
    start = StartUnit(6, SamplingBackend.PYTORCH, restart=True)
    done = await unit_ops.run(UNIT, start)
    assert (done.op, done.result) == (6, "failed") and done.error
    assert bus.calls == []  # never started without the backend it was meant to have


async def test_a_warm_up_that_raises_keyerror_is_a_failed_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kw: Any) -> Any:
        raise KeyError("gate")

    monkeypatch.setattr(warmup_module.flashinfer, "warm", broken)
    unit_ops, _ = ops(Bus(), tmp_path)
    event = await unit_ops.run(UNIT, RunWarmup(7, recheck=False, patch_allowed=True))
    assert isinstance(event, WarmupFailed) and event.op == 7
    assert "KeyError" in event.error


async def test_probes_of_a_server_that_is_not_there_fail_with_a_reason(tmp_path: Path) -> None:
    unit_ops, _ = ops(Bus(), tmp_path)
    await unit_ops.open()
    try:
        event = await unit_ops.run(UNIT, SampledProbe(8))
        assert isinstance(event, ProbeFailed) and event.reason == "connect-refused"
    finally:
        await unit_ops.close()


async def test_an_exception_inside_a_probe_is_an_internal_error_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unit_ops, _ = ops(Bus(), tmp_path)

    async def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("loop closed")

    monkeypatch.setattr("supervisor.adapters.unit_ops.wait_healthy", broken)
    event = await unit_ops.run(UNIT, WaitHealthy(9))
    assert event == ProbeFailed(9, INTERNAL_ERROR, "RuntimeError: loop closed")


async def test_a_gate_check_answers_with_the_verdict_even_when_doctor_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.core.events import CheckGate, GateChecked

    async def broken(*args: Any, **kw: Any) -> Any:
        raise KeyError("versions")

    monkeypatch.setattr(warmup_module.flashinfer, "doctor", broken)
    unit_ops, _ = ops(Bus(), tmp_path)
    event = await unit_ops.run(UNIT, CheckGate(9))
    assert isinstance(event, GateChecked) and event.op == 9
    assert event.gate.verdict == "unknown" and "KeyError" in (event.gate.error or "")


class SlowJobs(Bus):
    """systemd as seen from the supervisor: a job is queued at once, then runs until
    ``finish`` is set; ``calls`` is the order jobs reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.finish = asyncio.Event()
        self.two_queued = asyncio.Event()

    async def job(self, verb: str, unit: str, **kw: Any) -> Any:
        enqueued = kw.get("enqueued")
        self.calls.append(verb)
        if len(self.calls) >= 2:
            self.two_queued.set()
        if enqueued is not None:
            enqueued()
        await self.finish.wait()

        class Done:
            result = "done"
            job_path = f"/org/freedesktop/systemd1/job/{verb}"

        return Done()


async def test_a_stop_issued_after_a_start_reaches_systemd_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen live: a restart's start was still writing its sampling drop-in when the
    overlapped warm-up failed and the machine asked for a stop. The stop reached
    systemd first (the unit was down: a no-op), then the start brought the unit up,
    and the supervisor's own later stop was taken for an operator's."""
    env_written = asyncio.Event()
    real_apply = sampling_env.apply

    async def slow_apply(*args: Any) -> None:
        await env_written.wait()
        await real_apply(*args)

    monkeypatch.setattr(sampling_env, "apply", slow_apply)
    bus = SlowJobs()
    unit_ops, tracker = ops(bus, tmp_path)
    start = asyncio.create_task(
        unit_ops.run(UNIT, StartUnit(8, SamplingBackend.FLASHINFER, restart=True))
    )
    stop = asyncio.create_task(unit_ops.run(UNIT, StopUnit(9)))
    for _ in range(20):  # let every task run as far as it can
        await asyncio.sleep(0)
    assert bus.calls == []  # the stop waits for the start to be queued
    env_written.set()
    await asyncio.wait_for(bus.two_queued.wait(), 5)
    # Both queued while the start job still runs: the lock is held to the queue only.
    assert bus.calls == ["start", "stop"] and not bus.finish.is_set()
    bus.finish.set()
    assert await start == JobDone(8, "done") and await stop == JobDone(9, "done")
    assert tracker.watch(UNIT).own_jobs == 0


async def test_a_start_cancelled_before_its_call_lets_the_next_job_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    never = asyncio.Event()

    async def stuck_apply(*args: Any) -> None:
        await never.wait()

    monkeypatch.setattr(sampling_env, "apply", stuck_apply)
    bus = SlowJobs()
    bus.finish.set()
    unit_ops, _ = ops(bus, tmp_path)
    start = asyncio.create_task(
        unit_ops.run(UNIT, StartUnit(10, SamplingBackend.FLASHINFER, restart=False))
    )
    stop = asyncio.create_task(unit_ops.run(UNIT, StopUnit(11)))
    for _ in range(20):
        await asyncio.sleep(0)
    start.cancel()
    async with asyncio.timeout(5):
        assert await stop == JobDone(11, "done")
    assert bus.calls == ["stop"]
