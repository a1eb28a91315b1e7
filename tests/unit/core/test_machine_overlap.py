"""The warm-up alongside the load: never ready until the warm-up and a probe after it."""

from __future__ import annotations

import pytest

from supervisor.core.events import (
    CancelOp,
    CheckGate,
    GateChecked,
    GateFacts,
    HealthOk,
    IllegalEvent,
    JobDone,
    ProbeOk,
    RunWarmup,
    SampledProbe,
    SamplingBackend,
    ScheduleTimer,
    StartRequested,
    StartUnit,
    StopUnit,
    Timer,
    TimerFired,
    UnitExited,
    UnitState,
    UnitStoppedBySupervisor,
    WaitHealthy,
    WarmupFailed,
    WarmupOk,
)
from supervisor.core.machine import Machine, UnitPolicy

from .test_machine import Drive, none_of, only

OVERLAP = UnitPolicy(overlap="auto")
ACCEPTS = GateFacts("accepts", "12.0", "0.7.4")
REJECTS = GateFacts("rejects", "12.0", "0.7.0")


def checked(policy: UnitPolicy = OVERLAP, gate: GateFacts = ACCEPTS) -> Drive:
    """Started, and the gate's verdict just came back."""
    d = Drive(policy, now=100.0)
    actions = d.send(StartRequested())
    assert d.m.state is UnitState.WARMING
    assert d.m.warmup_mode == "checking-gate"
    check = only(actions, CheckGate)
    assert only(actions, ScheduleTimer).timer is Timer.WARMUP_DEADLINE
    d.send(GateChecked(check.op, gate), at=105.0)
    return d


def overlapped(policy: UnitPolicy = OVERLAP) -> Drive:
    d = checked(policy)
    assert d.m.state is UnitState.STARTING
    return d


def test_a_gate_that_accepts_starts_the_unit_and_warms_alongside() -> None:
    d = Drive(OVERLAP, now=100.0)
    check = only(d.send(StartRequested()), CheckGate)
    actions = d.send(GateChecked(check.op, ACCEPTS), at=105.0)
    assert d.m.state is UnitState.STARTING
    assert only(actions, StartUnit).sampling_backend is SamplingBackend.FLASHINFER
    # No patch alongside a unit: it would not reach a server that imported FlashInfer.
    assert only(actions, RunWarmup).patch_allowed is False
    timers = {a.timer for a in actions if isinstance(a, ScheduleTimer)}
    assert timers == {Timer.START_DEADLINE, Timer.WARMUP_DEADLINE}
    assert d.m.warmup_mode == "overlapped"
    assert (
        d.m.warmup_why == "FlashInfer 0.7.4's gate accepts 12.0 as installed: no patch to wait for"
    )


def test_loaded_before_the_warm_up_ends_waits_warming_then_probes_then_ready() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    assert d.m.state is UnitState.LOADING
    actions = d.send(HealthOk(d.op(WaitHealthy)), at=200.0)
    assert d.m.state is UnitState.WARMING
    none_of(actions, SampledProbe)
    assert Timer.WARMUP_DEADLINE in d.timers  # the wait keeps its deadline
    actions = d.send(WarmupOk(d.op(RunWarmup), ACCEPTS), at=260.0)
    assert d.m.state is UnitState.PROBING
    probe = only(actions, SampledProbe)
    d.send(ProbeOk(probe.op, 10.0, 4), at=261.0)
    assert d.m.state is UnitState.READY


def test_a_warm_up_that_ends_first_lets_health_lead_straight_to_the_probe() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    actions = d.send(WarmupOk(d.op(RunWarmup), ACCEPTS), at=150.0)
    assert d.m.state is UnitState.LOADING
    none_of(actions, SampledProbe, StartUnit)
    actions = d.send(HealthOk(d.op(WaitHealthy)), at=200.0)
    assert d.m.state is UnitState.PROBING
    only(actions, SampledProbe)


def test_the_next_restart_overlaps_at_once_on_the_verdict_it_learnt() -> None:
    d = overlapped()
    d.send(WarmupOk(d.op(RunWarmup), ACCEPTS))
    d.send(JobDone(d.op(StartUnit), "done"))
    d.send(HealthOk(d.op(WaitHealthy)))
    d.send(ProbeOk(d.op(SampledProbe), 10.0, 4))
    d.send(UnitExited("sigkill"), at=500.0)
    assert d.m.state is UnitState.BACKOFF
    actions = d.fire(Timer.BACKOFF)
    assert d.m.state is UnitState.STARTING
    only(actions, StartUnit)
    only(actions, RunWarmup)
    none_of(actions, CheckGate)


def test_a_warm_up_that_fails_while_loading_stops_the_unit_and_backs_off() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    health = d.op(WaitHealthy)
    actions = d.send(WarmupFailed(d.op(RunWarmup), "the build failed (exit 1)"), at=150.0)
    assert d.m.state is UnitState.BACKOFF
    only(actions, StopUnit)
    assert CancelOp(health) in actions
    assert "FlashInfer warm-up failed: the build failed" in (d.m.reason or "")


def test_a_warm_up_past_its_deadline_while_loading_stops_the_unit() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    warm = d.op(RunWarmup)
    actions = d.fire(Timer.WARMUP_DEADLINE)
    assert d.m.state is UnitState.BACKOFF
    only(actions, StopUnit)
    assert CancelOp(warm) in actions
    assert "did not finish within" in (d.m.reason or "")


def test_hopeless_warm_up_while_loading_restarts_with_pytorch_sampling() -> None:
    d = overlapped(UnitPolicy(overlap="auto", pytorch_sampling_fallback=True))
    d.send(JobDone(d.op(StartUnit), "done"))
    actions = d.send(WarmupFailed(d.op(RunWarmup), "rejects 12.0", arch_rejected=True))
    assert d.m.state is UnitState.BACKOFF
    stop = only(actions, StopUnit)
    none_of(actions, StartUnit)  # not while the FlashInfer-sampling process is up
    actions = d.send(UnitExited("stopped"))
    assert d.m.state is UnitState.STARTING
    assert only(actions, StartUnit).sampling_backend is SamplingBackend.PYTORCH
    none_of(actions, RunWarmup, CheckGate)
    assert d.send(JobDone(stop.op, "done")) == ()  # stale: the unit went down already


def test_an_arch_rejection_while_loading_without_a_way_out_fails_and_stops_it() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    actions = d.send(WarmupFailed(d.op(RunWarmup), "rejects 12.0", arch_rejected=True))
    assert d.m.state is UnitState.FAILED
    only(actions, StopUnit)
    assert "FlashInfer rejects the GPU arch" in (d.m.reason or "")


def test_a_gate_that_turns_to_rejecting_restarts_in_the_old_order_with_the_patch() -> None:
    d = overlapped(UnitPolicy(overlap="auto", allow_patch=True))
    d.send(JobDone(d.op(StartUnit), "done"))
    actions = d.send(
        WarmupFailed(d.op(RunWarmup), "rejects 12.0", arch_rejected=True, gate=REJECTS)
    )
    assert d.m.state is UnitState.BACKOFF
    stop = only(actions, StopUnit)
    d.send(JobDone(stop.op, "done"))
    actions = d.fire(Timer.BACKOFF)
    assert d.m.state is UnitState.WARMING
    warm = only(actions, RunWarmup)
    assert warm.patch_allowed and warm.recheck
    none_of(actions, StartUnit)
    assert d.m.warmup_mode == "sequential"


def test_the_unit_dying_mid_overlap_cancels_the_warm_up_and_backs_off() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    warm = d.op(RunWarmup)
    actions = d.send(UnitExited("sigkill"), at=150.0)
    assert d.m.state is UnitState.BACKOFF
    assert CancelOp(warm) in actions
    assert Timer.WARMUP_DEADLINE not in d.timers
    assert d.send(WarmupOk(warm, ACCEPTS)) == ()  # its late answer is stale


def test_a_warm_up_cut_short_by_the_unit_s_exit_runs_first_at_the_restart() -> None:
    """H200, fp8 K2 dying at CUDA-graph capture: each death cancelled the overlapped
    warm-up, and each restart began FlashInfer's norm build again from nothing. The
    restart after a cut-short warm-up warms first; once one succeeds, overlap resumes."""
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    d.send(UnitExited("sigkill"), at=150.0)
    actions = d.fire(Timer.BACKOFF)
    assert d.m.state is UnitState.WARMING
    assert d.m.warmup_mode == "sequential"
    assert "cut short when the unit exited" in str(d.m.warmup_why)
    none_of(actions, StartUnit)
    warm = only(actions, RunWarmup)
    actions = d.send(WarmupOk(warm.op, ACCEPTS), at=400.0)
    assert d.m.state is UnitState.STARTING
    only(actions, StartUnit)
    d.send(JobDone(d.op(StartUnit), "done"))
    d.send(HealthOk(d.op(WaitHealthy)))
    d.send(ProbeOk(d.op(SampledProbe), 10.0, 4))
    assert d.m.state is UnitState.READY
    d.send(UnitExited("sigkill"), at=900.0)
    actions = d.fire(Timer.BACKOFF)
    assert d.m.warmup_mode == "overlapped"  # the cache is warm: overlap again
    only(actions, StartUnit)
    only(actions, RunWarmup)


@pytest.mark.parametrize(
    ("timer", "warms_first"),
    [(Timer.LOAD_DEADLINE, True), (Timer.START_DEADLINE, True), (Timer.WARMUP_DEADLINE, False)],
)
def test_a_warm_up_cancelled_by_the_supervisor_s_own_stop_also_runs_first_next_time(
    timer: Timer, warms_first: bool
) -> None:
    """A unit stopped for its start or load deadline loses the overlapped warm-up as a
    dying one does; a warm-up past its own deadline was not cut short by the unit."""
    d = overlapped()
    if timer is not Timer.START_DEADLINE:
        d.send(JobDone(d.op(StartUnit), "done"))
    d.fire(timer)
    assert d.m.state is UnitState.BACKOFF
    d.fire(Timer.BACKOFF)  # waits for the stop it asked for
    actions = d.send(UnitStoppedBySupervisor("stopped"))
    assert (d.m.warmup_mode == "sequential") is warms_first, d.m.warmup_why
    if warms_first:
        none_of(actions, StartUnit)
    else:
        only(actions, StartUnit)


def test_the_unit_dying_while_it_waits_for_the_warm_up_backs_off() -> None:
    d = overlapped()
    d.send(JobDone(d.op(StartUnit), "done"))
    d.send(HealthOk(d.op(WaitHealthy)))
    assert d.m.state is UnitState.WARMING
    warm = d.op(RunWarmup)
    actions = d.send(UnitExited("oom-kill"))
    assert d.m.state is UnitState.BACKOFF
    assert CancelOp(warm) in actions
    assert not d.m.running


def test_a_gate_that_rejects_keeps_the_warm_up_before_the_start() -> None:
    d = checked(UnitPolicy(overlap="auto", allow_patch=True), REJECTS)
    assert d.m.state is UnitState.WARMING
    assert d.m.warmup_mode == "sequential"
    assert "rejects 12.0" in (d.m.warmup_why or "")
    assert d.last[RunWarmup] == RunWarmup(d.op(RunWarmup), False, True)
    assert StartUnit not in d.last


def test_overlap_never_warms_first_without_asking_the_gate() -> None:
    d = Drive(UnitPolicy(overlap="never"))
    actions = d.send(StartRequested())
    assert d.m.state is UnitState.WARMING
    only(actions, RunWarmup)
    none_of(actions, CheckGate, StartUnit)


def test_a_gate_answer_is_not_a_warm_up_answer() -> None:
    d = Drive(OVERLAP)
    check = only(d.send(StartRequested()), CheckGate)
    with pytest.raises(IllegalEvent):
        d.send(WarmupOk(check.op, ACCEPTS))
    assert d.m.state is UnitState.WARMING


def test_found_running_with_a_probe_that_passed_is_not_ready_until_warm_and_probed() -> None:
    """The supervisor was SIGKILLed mid-overlap: a probe before the warm-up counts not."""
    m, actions = Machine.rediscover(
        "u.service", OVERLAP, now=0.0, active_state="active", probe_ok=True, cache_unverified=True
    )
    assert m.state is UnitState.WARMING and m.running
    warm = only(actions, RunWarmup)
    assert warm.patch_allowed is False
    none_of(actions, SampledProbe, StartUnit, StopUnit)
    actions = m.handle(WarmupOk(warm.op, ACCEPTS), 5.0)
    assert m.state is UnitState.PROBING
    probe = only(actions, SampledProbe)
    m.handle(ProbeOk(probe.op, 10.0, 4), 6.0)
    assert m.state is UnitState.READY


def test_found_still_loading_warms_alongside_the_load() -> None:
    m, actions = Machine.rediscover(
        "u.service", OVERLAP, now=0.0, active_state="activating", cache_unverified=True
    )
    assert m.state is UnitState.LOADING
    only(actions, RunWarmup)
    only(actions, WaitHealthy)
    m.handle(TimerFired(Timer.WARMUP_DEADLINE), OVERLAP.warmup_deadline_s)
    assert m.state is UnitState.BACKOFF  # the deadline holds there too


def test_found_running_on_the_pytorch_drop_in_needs_no_warm_up() -> None:
    m, actions = Machine.rediscover(
        "u.service",
        OVERLAP,
        now=0.0,
        active_state="active",
        probe_ok=True,
        cache_unverified=True,
        sampling_backend=SamplingBackend.PYTORCH,
    )
    assert m.state is UnitState.READY
    none_of(actions, RunWarmup)


def test_the_supervisor_is_not_ready_while_a_found_unit_warms() -> None:
    from supervisor.core.policy import (
        Observed,
        PairPolicy,
        Role,
        StartupVerdict,
        Supervisor,
        UnitSpec,
    )

    specs = [UnitSpec("u.service", Role.AUTOREGRESSIVE)]
    observed = {"u.service": Observed("active", True, True, cache_unverified=True)}
    sup, commands = Supervisor.rediscover(specs, OVERLAP, PairPolicy(), observed, now=0.0)
    assert sup.machines["u.service"].state is UnitState.WARMING
    assert not sup.serving_ready() and sup.startup_verdict() is not StartupVerdict.READY
    assert [c.action for c in commands if isinstance(c.action, RunWarmup)]
