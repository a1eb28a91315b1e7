"""Where a start's time goes, from the states a unit went through (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from supervisor.core.timeline import Timelines, compact

T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def feed(tl: Timelines, unit: str, steps: list[tuple[str, float]]) -> None:
    for state, at in steps:
        tl.entered(unit, state, at, T0 + timedelta(seconds=at))


def test_a_cold_start_phase_by_phase() -> None:
    tl = Timelines()
    feed(tl, "u", [("warming", 0.0), ("starting", 100.0), ("loading", 100.5), ("probing", 170.0)])
    start, recovery = tl.ready("u", 175.0, T0 + timedelta(seconds=175), coverage_s=4.0)
    assert recovery is None
    assert start is not None and start.kind == "start" and start.total_s == 175.0
    assert start.phases == {
        "warm-up": 100.0, "start job": 0.5, "load": 69.5, "probe": 1.0, "coverage": 4.0,
    }  # fmt: skip
    assert "backoff" not in start.phases  # a first start waited for no backoff
    assert start.to_json()["phases_s"]["coverage"] == 4.0


def test_a_recovery_from_the_exit_with_its_backoff_and_cause() -> None:
    tl = Timelines()
    feed(tl, "u", [("starting", 0.0), ("loading", 0.1), ("probing", 50.0)])
    tl.ready("u", 51.0, T0)
    tl.exited("u", "sigkill", 500.0, T0)
    feed(tl, "u", [("backoff", 500.2), ("warming", 510.2), ("starting", 511.0),
                   ("loading", 511.1), ("probing", 560.0)])  # fmt: skip
    start, recovery = tl.ready("u", 561.0, T0, coverage_s=0.5)
    assert recovery is not None and recovery.kind == "recovery" and recovery.cause == "sigkill"
    assert recovery.total_s == 61.0
    assert recovery.phases["backoff"] == pytest.approx(10.2)  # the exit's moment, then the timer
    assert start is not None and start.total_s == pytest.approx(50.8)  # from the warm-up on
    assert "backoff" not in start.phases and start.phases["warm-up"] == pytest.approx(0.8)


def test_an_overlapped_warm_up_waited_for_after_the_load() -> None:
    tl = Timelines()
    feed(tl, "u", [("starting", 0.0), ("loading", 0.2), ("warming", 30.0), ("probing", 90.0)])
    start, _ = tl.ready("u", 91.0, T0, overlapped_warmup_s=89.5)
    assert start is not None
    assert start.phases["load"] == 29.8 and start.phases["warm-up"] == 60.0
    assert "coverage" not in start.phases  # none ran: not a zero
    assert start.overlapped_warmup_s == 89.5
    assert any("warm-up beside the load" in ln for ln in compact(start.to_json()))


def test_an_exit_before_ready_is_no_recovery_and_the_start_restarts_its_clock() -> None:
    tl = Timelines()
    feed(tl, "u", [("starting", 0.0), ("loading", 0.1)])
    tl.exited("u", "gpu-oom", 10.0, T0)  # it was never ready: nothing to recover
    feed(tl, "u", [("backoff", 10.0), ("starting", 20.0), ("loading", 20.1), ("probing", 40.0)])
    start, recovery = tl.ready("u", 41.0, T0)
    assert recovery is None
    assert start is not None and start.total_s == 21.0
