"""The per-unit state machine, driven by events alone: no sockets, no clock."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

from supervisor.core.events import (
    Action,
    CancelOp,
    CancelTimer,
    Entered,
    Event,
    GpuFaultSeen,
    HealthOk,
    IllegalEvent,
    Initiator,
    JobDone,
    ManagementRefused,
    NotifyStatus,
    OperatorReset,
    OperatorStopSeen,
    ProbeFailed,
    ProbeOk,
    ProgressStalled,
    RunWarmup,
    SampledProbe,
    SamplingBackend,
    ScheduleTimer,
    Severity,
    StartRequested,
    StartUnit,
    StopRequested,
    StopUnit,
    Timer,
    TimerFired,
    UnitActive,
    UnitExited,
    UnitState,
    UnitStoppedByOperator,
    UnitStoppedBySupervisor,
    WaitHealthy,
    WarmupFailed,
    WarmupOk,
    failure_of,
)
from supervisor.core.machine import Machine, UnitPolicy

A = TypeVar("A", bound=Action)
UNIT = "sglang-k26.service"
POLICY = UnitPolicy()


def only(actions: Sequence[Action], kind: type[A]) -> A:
    found = [a for a in actions if isinstance(a, kind)]
    assert len(found) == 1, f"expected one {kind.__name__} in {actions}"
    return found[0]


def none_of(actions: Sequence[Action], *kinds: type[Action]) -> None:
    assert not [a for a in actions if isinstance(a, kinds)], actions


def snapshot(machine: Machine) -> dict[str, Any]:
    return copy.deepcopy(vars(machine))


class Drive:
    """A machine plus the last op of each kind of work it asked for."""

    def __init__(self, policy: UnitPolicy = POLICY, now: float = 1000.0) -> None:
        self.m = Machine(UNIT, policy, now=now)
        self.now = now
        self.last: dict[type[Action], Action] = {}
        # The timers the machine asked for and has not cancelled, as the daemon keeps
        # them (from ScheduleTimer and CancelTimer; a timer that fired is gone).
        self.timers: dict[Timer, float] = {}
        self.entered: list[Entered] = []

    def send(self, event: Event, at: float | None = None) -> tuple[Action, ...]:
        if at is not None:
            self.now = at
        # Each change of state is an Entered action; kept apart, so that what the
        # tests compare is the work asked for (test_entered_* check them).
        every = self.m.handle(event, self.now)
        self.entered.extend(a for a in every if isinstance(a, Entered))
        actions = tuple(a for a in every if not isinstance(a, Entered))
        due = self.timers.get(event.timer) if isinstance(event, TimerFired) else None
        if isinstance(event, TimerFired) and due is not None and due <= self.now + 0.01:
            del self.timers[event.timer]  # it fired (an early one is stale: ignored)
        for action in actions:
            self.last[type(action)] = action
            if isinstance(action, ScheduleTimer):
                self.timers[action.timer] = action.at
            elif isinstance(action, CancelTimer):
                self.timers.pop(action.timer, None)
        return actions

    def op(self, kind: type[Any]) -> int:
        op: int = self.last[kind].op  # type: ignore[attr-defined]
        return op

    def fire(self, timer: Timer) -> tuple[Action, ...]:
        self.now = self.timers[timer]
        return self.send(TimerFired(timer))

    # Walks to each state along the normal path.
    def to_warming(self) -> Drive:
        self.send(StartRequested())
        return self

    def to_starting(self) -> Drive:
        self.to_warming().send(WarmupOk(self.op(RunWarmup)))
        return self

    def to_loading(self) -> Drive:
        self.to_starting().send(JobDone(self.op(StartUnit), "done"))
        return self

    def to_probing(self) -> Drive:
        self.to_loading().send(HealthOk(self.op(WaitHealthy)), at=self.now + 300)
        return self

    def to_ready(self) -> Drive:
        self.to_probing().send(ProbeOk(self.op(SampledProbe), 12.0, 4), at=self.now + 1)
        return self

    def to_backoff(self) -> Drive:
        self.to_ready().send(UnitExited("sigkill"), at=self.now + 5)
        return self

    def to_failed(self) -> Drive:
        self.to_ready().send(ManagementRefused("Restart=on-failure is set"))
        return self

    def to_standby(self) -> Drive:
        self.send(StopRequested(standby=True))
        return self

    def to_stopped(self) -> Drive:
        return self


WALKS: dict[UnitState, Callable[[Drive], Drive]] = {
    UnitState.STOPPED: Drive.to_stopped,
    UnitState.WARMING: Drive.to_warming,
    UnitState.STARTING: Drive.to_starting,
    UnitState.LOADING: Drive.to_loading,
    UnitState.PROBING: Drive.to_probing,
    UnitState.READY: Drive.to_ready,
    UnitState.BACKOFF: Drive.to_backoff,
    UnitState.FAILED: Drive.to_failed,
    UnitState.STANDBY: Drive.to_standby,
}


def at(state: UnitState, policy: UnitPolicy = POLICY) -> Drive:
    drive = WALKS[state](Drive(policy))
    assert drive.m.state is state
    return drive


# --- the normal path ------------------------------------------------------------


def test_start_warms_up_then_starts_loads_probes_and_becomes_ready() -> None:
    d = Drive(now=100.0)
    assert d.m.state is UnitState.STOPPED

    actions = d.send(StartRequested())
    assert d.m.state is UnitState.WARMING
    assert actions == (
        RunWarmup(op=1, recheck=False, patch_allowed=False),
        ScheduleTimer(Timer.WARMUP_DEADLINE, 100.0 + POLICY.warmup_deadline_s),
    )

    actions = d.send(WarmupOk(1), at=160.0)
    assert d.m.state is UnitState.STARTING
    assert actions == (
        CancelTimer(Timer.WARMUP_DEADLINE),
        StartUnit(2, SamplingBackend.FLASHINFER, restart=False),
        ScheduleTimer(Timer.START_DEADLINE, 160.0 + POLICY.start_deadline_s),
    )
    assert d.m.running

    actions = d.send(JobDone(2, "done"), at=161.0)
    assert d.m.state is UnitState.LOADING
    assert actions == (
        CancelTimer(Timer.START_DEADLINE),
        WaitHealthy(3),
        ScheduleTimer(Timer.LOAD_DEADLINE, 161.0 + 900.0),
    )

    actions = d.send(HealthOk(3), at=700.0)
    assert d.m.state is UnitState.PROBING
    assert actions == (CancelTimer(Timer.LOAD_DEADLINE), SampledProbe(4, coverage=True))

    actions = d.send(ProbeOk(4, latency_ms=15.0, completion_tokens=4), at=701.0)
    assert d.m.state is UnitState.READY
    assert d.m.since == 701.0
    assert only(actions, NotifyStatus).severity is Severity.INFO
    assert only(actions, ScheduleTimer) == ScheduleTimer(Timer.PROBE, 731.0)


def test_without_flashinfer_a_start_skips_warm_up() -> None:
    d = Drive(UnitPolicy(warmup_enabled=False))
    actions = d.send(StartRequested())
    assert d.m.state is UnitState.STARTING
    assert isinstance(actions[0], StartUnit)


def test_unit_active_before_the_job_answer_moves_to_loading_once() -> None:
    d = at(UnitState.STARTING)
    actions = d.send(UnitActive())
    assert d.m.state is UnitState.LOADING
    assert only(actions, WaitHealthy)
    assert d.send(JobDone(d.op(StartUnit), "done")) == ()
    assert d.m.state is UnitState.LOADING


def test_ready_unit_is_probed_periodically() -> None:
    d = at(UnitState.READY)
    actions = d.fire(Timer.PROBE)
    probe = only(actions, SampledProbe)
    actions = d.send(ProbeOk(probe.op, 9.0, 4), at=d.now + 0.01)
    assert d.m.state is UnitState.READY
    assert only(actions, ScheduleTimer).at == pytest.approx(d.now + POLICY.probe_interval_s)
    none_of(actions, NotifyStatus)


# --- probe failures, load deadline ------------------------------------------------


def test_n_probe_failures_in_a_row_stop_the_unit_and_back_off() -> None:
    d = at(UnitState.READY)
    for _ in range(POLICY.probe_failures_to_fail - 1):
        probe = only(d.fire(Timer.PROBE), SampledProbe)
        actions = d.send(ProbeFailed(probe.op, "timeout", "no answer in 60 s"))
        assert d.m.state is UnitState.READY
        assert only(actions, ScheduleTimer).timer is Timer.PROBE
    probe = only(d.fire(Timer.PROBE), SampledProbe)
    actions = d.send(ProbeFailed(probe.op, "server-died", "connection reset"))
    assert d.m.state is UnitState.BACKOFF
    stop = only(actions, StopUnit)
    assert only(actions, ScheduleTimer) == ScheduleTimer(Timer.BACKOFF, d.now + 10.0)
    assert "3 sampled probes failed" in only(actions, NotifyStatus).message

    # The backoff ends before systemd finished stopping it: wait for the stop.
    assert d.fire(Timer.BACKOFF) == ()
    assert d.m.state is UnitState.BACKOFF
    actions = d.send(JobDone(stop.op, "done"))
    assert d.m.state is UnitState.WARMING
    assert isinstance(actions[0], RunWarmup)


def _hung_and_stopped(d: Drive) -> StopUnit:
    """READY, then probes fail until the machine stops the unit and backs off."""
    for _ in range(POLICY.probe_failures_to_fail):
        probe = only(d.fire(Timer.PROBE), SampledProbe)
        actions = d.send(ProbeFailed(probe.op, "timeout", "no answer within 1 s"))
    assert d.m.state is UnitState.BACKOFF
    return only(actions, StopUnit)


def test_the_end_of_a_run_it_stopped_is_never_a_failure_even_after_the_next_start() -> None:
    """Seen in CI: the stop job's answer came before the news of the exit it caused;
    the backoff had ended and the next start was issued, and the late exit then
    counted as a failure (the unit went failed, then 'adopted' its own restart)."""
    d = at(UnitState.READY)
    stop = _hung_and_stopped(d)
    failures = d.m.failures_in_window(d.now)
    d.fire(Timer.BACKOFF)
    d.send(JobDone(stop.op, "done"))  # the stop job's answer first
    d.send(WarmupOk(d.op(RunWarmup)))
    assert d.m.state is UnitState.STARTING
    start = d.op(StartUnit)
    actions = d.send(UnitStoppedBySupervisor("stopped"))  # then the exit it caused
    assert actions == ()
    assert d.m.state is UnitState.STARTING and d.m.running
    assert d.m.failures_in_window(d.now) == failures and d.m.last_exit_cause == "stopped"
    d.send(JobDone(start, "done"))
    assert d.m.state is UnitState.LOADING


def test_the_end_of_a_run_it_stopped_ends_the_backoff_wait_when_it_comes_first() -> None:
    d = at(UnitState.READY)
    stop = _hung_and_stopped(d)
    assert d.fire(Timer.BACKOFF) == ()  # still up: wait for the stop
    actions = d.send(UnitStoppedBySupervisor("stopped"))
    assert d.m.state is UnitState.WARMING and not d.m.running
    only(actions, RunWarmup)
    assert d.send(JobDone(stop.op, "done")) == ()  # its answer, now stale


@pytest.mark.parametrize("state", [UnitState.STOPPED, UnitState.STANDBY, UnitState.FAILED])
def test_the_end_of_a_run_it_stopped_for_good_changes_only_the_record(state: UnitState) -> None:
    d = at(state)
    before = d.m.state
    actions = d.send(UnitStoppedBySupervisor("gpu-oom"))
    none_of(actions, StartUnit, StopUnit, RunWarmup, NotifyStatus)
    assert d.m.state is before and d.m.last_exit_cause == "gpu-oom"


def test_a_probe_success_resets_the_consecutive_count() -> None:
    d = at(UnitState.READY)
    for ok in (False, False, True, False, False):
        probe = only(d.fire(Timer.PROBE), SampledProbe)
        if ok:
            d.send(ProbeOk(probe.op, 5.0, 4))
        else:
            d.send(ProbeFailed(probe.op, "http-status", "HTTP 500"))
    assert d.m.state is UnitState.READY  # F F T F F: the success reset the count to 0
    probe = only(d.fire(Timer.PROBE), SampledProbe)
    d.send(ProbeFailed(probe.op, "http-status", "HTTP 500"))  # the third in a row
    assert d.m.state is UnitState.BACKOFF


def test_probing_retries_the_first_sampled_probe_before_failing() -> None:
    d = at(UnitState.PROBING)
    actions = d.send(ProbeFailed(d.op(SampledProbe), "timeout", ""))
    assert d.m.state is UnitState.PROBING
    assert only(actions, ScheduleTimer).timer is Timer.PROBE
    only(d.fire(Timer.PROBE), SampledProbe)


def test_load_deadline_stops_the_unit_and_backs_off() -> None:
    d = at(UnitState.LOADING)
    actions = d.fire(Timer.LOAD_DEADLINE)
    assert d.m.state is UnitState.BACKOFF
    assert only(actions, CancelOp).op == d.op(WaitHealthy)
    only(actions, StopUnit)
    assert "900 s startup deadline" in only(actions, NotifyStatus).message


def test_a_failed_health_wait_counts_as_a_failure() -> None:
    d = at(UnitState.LOADING)
    actions = d.send(ProbeFailed(d.op(WaitHealthy), "connect-refused", "nothing listens"))
    assert d.m.state is UnitState.BACKOFF
    assert only(actions, CancelTimer).timer is Timer.LOAD_DEADLINE
    only(actions, StopUnit)


def test_a_failed_start_job_backs_off_and_the_next_start_is_a_restart() -> None:
    d = at(UnitState.STARTING)
    d.send(JobDone(d.op(StartUnit), "failed"))
    assert d.m.state is UnitState.BACKOFF
    assert not d.m.running
    d.fire(Timer.BACKOFF)
    actions = d.send(WarmupOk(d.op(RunWarmup)))
    assert only(actions, StartUnit).restart
    assert d.m.restarts == 1


def test_a_start_job_cancelled_by_another_job_is_an_operators_stop_and_held() -> None:
    """Found by the chaos soak: `systemctl stop` while our start job was queued
    replaces it (JobRemoved result 'canceled'). Backing off and starting again would
    override the operator; the unit is held until an operator starts or resets it."""
    d = at(UnitState.STARTING)
    actions = d.send(JobDone(d.op(StartUnit), "canceled"))
    assert d.m.state is UnitState.STOPPED and d.m.held_by_operator
    assert not d.m.running
    assert not [a for a in actions if isinstance(a, (StartUnit, ScheduleTimer))]
    assert "cancelled the supervisor's start" in only(actions, NotifyStatus).message
    assert d.m.restarts == 0


def test_an_operator_stop_seen_between_runs_holds_the_unit() -> None:
    """In backoff nothing runs: the operator's `systemctl stop` leaves no exit, only
    its job. The backoff is dropped and the unit held until an operator acts."""
    d = at(UnitState.BACKOFF)
    actions = d.send(OperatorStopSeen())
    assert d.m.state is UnitState.STOPPED and d.m.held_by_operator
    assert only(actions, CancelTimer).timer is Timer.BACKOFF
    assert "between runs" in only(actions, NotifyStatus).message
    assert d.send(OperatorStopSeen()) == ()  # already held: nothing more


def test_an_operator_stop_seen_is_not_for_a_running_or_failed_unit() -> None:
    for state in (UnitState.READY, UnitState.FAILED):
        d = at(state)
        with pytest.raises(IllegalEvent):
            d.send(OperatorStopSeen())


XID79 = GpuFaultSeen("NVIDIA Xid 79 on GPU 0000:3b:00 (GPU has fallen off the bus)")


@pytest.mark.parametrize("state", [UnitState.STARTING, UnitState.LOADING, UnitState.READY])
def test_a_hardware_xid_of_a_running_unit_stops_it_and_fails_it_for_a_person(
    state: UnitState,
) -> None:
    d = at(state)
    actions = d.send(XID79)
    assert d.m.state is UnitState.FAILED and d.m.needs_person and not d.timers
    assert isinstance(only(actions, StopUnit), StopUnit)
    assert not [a for a in actions if isinstance(a, StartUnit)]
    assert (d.m.reason or "").startswith(XID79.summary + ": ")
    assert only(actions, NotifyStatus).severity is Severity.ERROR
    assert d.send(XID79) == ()  # the same fault read again: nothing more


@pytest.mark.parametrize("stop_by_supervisor", [True, False])
def test_a_reset_before_the_failed_run_is_down_is_not_undone_by_that_run_s_death(
    stop_by_supervisor: bool,
) -> None:
    """Seen in the chaos soak: the operator's reset came 16 ms after the Xid failed
    the unit, while its stop still ran; the run's death then carried the same Xid and
    failed the unit again, waiting for a second reset. That death is the end of the
    run the operator already reset: the new start goes on."""
    d = at(UnitState.READY)
    d.send(XID79)
    d.send(OperatorReset())
    assert d.m.state is UnitState.BACKOFF and not d.m.needs_person  # waits for the down
    death = (
        UnitStoppedBySupervisor("gpu-xid", needs_person=True)
        if stop_by_supervisor
        else UnitExited("gpu-xid", needs_person=True)
    )
    d.send(death)
    assert d.m.state is UnitState.WARMING and not d.m.needs_person
    assert d.m.last_exit_cause == "gpu-xid"
    d.send(WarmupOk(d.op(RunWarmup)))
    assert d.m.state is UnitState.STARTING
    d.send(UnitExited("gpu-xid", needs_person=True))  # the new run's own death: news
    assert d.m.state is UnitState.FAILED and d.m.needs_person


def test_a_run_taken_over_after_a_reset_dies_as_news_not_as_the_reset_run_s_end() -> None:
    """The reset waits for the failed run to go down. If instead someone else's start
    keeps it up (its stop job ended by an operator's ``systemctl start``), that run is
    supervised from then on: its later death is a failure to explain and count, not
    the end of the run the reset waited for."""
    d = at(UnitState.READY)
    d.send(XID79)
    stop = d.op(StopUnit)
    d.send(OperatorReset())
    d.send(JobDone(stop, "canceled"))
    d.send(UnitActive())
    assert d.m.state is UnitState.LOADING
    d.send(UnitExited("cuda-error"))
    assert d.m.state is UnitState.BACKOFF
    assert d.m.last_exit_cause == "cuda-error"
    assert d.m.failures_in_window(d.now) == 1


def test_a_hardware_xid_read_in_backoff_fails_the_unit_without_a_stop() -> None:
    """Read late, after the death it explains was counted as an ordinary failure:
    the restart that was due does not come."""
    d = at(UnitState.BACKOFF)
    actions = d.send(XID79)
    assert d.m.state is UnitState.FAILED and d.m.needs_person
    assert not [a for a in actions if isinstance(a, (StopUnit, StartUnit))]
    assert Timer.BACKOFF in [a.timer for a in actions if isinstance(a, CancelTimer)]


def test_a_hardware_xid_of_a_unit_an_operator_stopped_leaves_it_to_the_operator() -> None:
    d = at(UnitState.BACKOFF)
    d.send(OperatorStopSeen())
    assert d.send(XID79) == ()
    assert d.m.state is UnitState.STOPPED and d.m.held_by_operator and not d.m.needs_person


# --- backoff ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "delay"),
    [(0, 10.0), (1, 20.0), (2, 40.0), (3, 80.0), (4, 160.0), (5, 300.0), (50, 300.0)],
)
def test_backoff_doubles_from_10_s_to_5_min(step: int, delay: float) -> None:
    assert UnitPolicy().backoff_delay(step) == delay


def test_backoff_delay_is_configurable() -> None:
    policy = UnitPolicy(backoff_initial_s=1, backoff_factor=3, backoff_max_s=20)
    assert [policy.backoff_delay(i) for i in range(5)] == [1, 3, 9, 20, 20]


def crash_loop(d: Drive, delays: list[float], cause: str = "exit-code") -> None:
    """Crash once the unit is loading, then follow the backoff to the next start."""
    d.send(UnitExited(cause))
    assert d.m.state is UnitState.BACKOFF
    delays.append(d.timers[Timer.BACKOFF] - d.now)
    d.fire(Timer.BACKOFF)
    d.send(WarmupOk(d.op(RunWarmup)))
    d.send(UnitActive())


def test_consecutive_crashes_back_off_exponentially() -> None:
    d = at(UnitState.LOADING, UnitPolicy(max_failures=100, failure_window_s=1e9))
    delays: list[float] = []
    for _ in range(7):
        crash_loop(d, delays)
    assert delays == [10, 20, 40, 80, 160, 300, 300]
    assert d.m.restarts == 7


def test_backoff_resets_after_ten_minutes_ready() -> None:
    d = at(UnitState.LOADING, UnitPolicy(max_failures=100))
    delays: list[float] = []
    for _ in range(3):
        crash_loop(d, delays)
    d.send(HealthOk(d.op(WaitHealthy)))
    d.send(ProbeOk(d.op(SampledProbe), 5.0, 4))
    # Ready, probed every 30 s, for just under ten minutes: no reset yet.
    for _ in range(19):  # 570 s
        d.send(ProbeOk(only(d.fire(Timer.PROBE), SampledProbe).op, 5.0, 4))
    d.send(UnitExited("sigkill"))
    delays.append(d.timers[Timer.BACKOFF] - d.now)
    assert delays == [10, 20, 40, 80]

    d.fire(Timer.BACKOFF)
    d.send(WarmupOk(d.op(RunWarmup)))
    d.send(UnitActive())
    d.send(HealthOk(d.op(WaitHealthy)))
    d.send(ProbeOk(d.op(SampledProbe), 5.0, 4))
    d.send(UnitExited("sigkill"), at=d.now + 600)
    assert d.timers[Timer.BACKOFF] - d.now == 10


# --- failed ---------------------------------------------------------------------------


def test_too_many_failures_in_the_window_fail_the_unit_for_good() -> None:
    d = at(UnitState.LOADING)
    delays: list[float] = []
    for _ in range(POLICY.max_failures - 1):
        crash_loop(d, delays)
    actions = d.send(UnitExited("gpu-oom"))
    assert d.m.state is UnitState.FAILED
    note = only(actions, NotifyStatus)
    assert note.severity is Severity.ERROR
    assert "5 failures within 600 s" in note.message
    assert "operator" in note.message
    none_of(actions, StartUnit, RunWarmup, ScheduleTimer)
    assert d.timers == {}

    # Nothing the supervisor does restarts it.
    with pytest.raises(IllegalEvent):
        d.send(StartRequested(by=Initiator.SUPERVISOR))
    with pytest.raises(IllegalEvent):
        d.send(TimerFired(Timer.RETRY_PREFERRED))
    assert d.send(TimerFired(Timer.BACKOFF)) == ()
    assert d.m.state is UnitState.FAILED


def test_failures_spread_beyond_the_window_do_not_fail_the_unit() -> None:
    policy = UnitPolicy(max_failures=3, failure_window_s=100, backoff_max_s=10)
    d = at(UnitState.LOADING, policy)
    delays: list[float] = []
    for _ in range(6):
        d.now += 60
        crash_loop(d, delays)
    assert d.m.state is UnitState.LOADING
    assert d.m.failures_in_window(d.now) <= 2


def test_operator_reset_restarts_a_failed_unit_with_a_recheck() -> None:
    d = at(UnitState.FAILED)
    actions = d.send(OperatorReset())
    assert d.m.state is UnitState.BACKOFF  # the refused unit was still running
    assert actions == ()
    d.send(UnitExited("clean"))
    assert d.m.state is UnitState.WARMING
    assert d.last[RunWarmup] == RunWarmup(d.op(RunWarmup), recheck=True, patch_allowed=False)


def test_operator_start_of_a_failed_unit_resets_it() -> None:
    d = Drive(UnitPolicy(max_failures=1))
    d.to_loading().send(UnitExited("exit-code"))
    assert d.m.state is UnitState.FAILED
    actions = d.send(StartRequested(by=Initiator.OPERATOR))
    assert d.m.state is UnitState.WARMING
    assert only(actions, RunWarmup).recheck
    assert d.m.failures_in_window(d.now) == 0


def test_operator_reset_cuts_a_backoff_short() -> None:
    d = at(UnitState.BACKOFF)
    actions = d.send(OperatorReset())
    assert d.m.state is UnitState.WARMING
    assert CancelTimer(Timer.BACKOFF) in actions


# --- operator stops and starts ----------------------------------------------------------


@pytest.mark.parametrize("state", list(UnitState))
def test_an_operator_stop_is_respected_in_every_state(state: UnitState) -> None:
    d = at(state)
    pending_task = [a for a in d.last.values() if isinstance(a, (WaitHealthy, SampledProbe))]
    actions = d.send(UnitStoppedByOperator())
    none_of(actions, StartUnit, StopUnit, RunWarmup, ScheduleTimer)
    assert d.timers == {}
    assert not d.m.running
    if state is UnitState.FAILED:  # refused: still not ours to manage
        assert d.m.state is UnitState.FAILED
        return
    assert d.m.state is UnitState.STOPPED
    if state in (UnitState.LOADING, UnitState.PROBING):
        assert CancelOp(pending_task[-1].op) in actions
    # The answers to abandoned work and old timers change nothing.
    for kind, make in ((WaitHealthy, HealthOk), (SampledProbe, lambda op: ProbeOk(op, 1, 1))):
        if kind in d.last:
            assert d.send(make(d.op(kind))) == ()
    assert d.send(UnitExited("clean")) == ()
    assert d.m.state is UnitState.STOPPED


def test_operator_stop_then_start_is_adopted_without_warm_up() -> None:
    d = at(UnitState.READY)
    d.send(UnitStoppedByOperator())
    actions = d.send(UnitActive())
    assert d.m.state is UnitState.LOADING
    none_of(actions, StartUnit, RunWarmup)
    only(actions, WaitHealthy)


def test_unit_active_during_our_own_stop_is_not_an_operator_start() -> None:
    d = at(UnitState.READY)
    d.send(StopRequested(standby=True))
    assert d.send(UnitActive()) == ()
    assert d.m.state is UnitState.STANDBY


# --- flashinfer ---------------------------------------------------------------------------


def test_a_flashinfer_arch_exit_forces_a_recheck_and_allows_the_patch() -> None:
    d = at(UnitState.READY, UnitPolicy(allow_patch=True))
    d.send(UnitExited("flashinfer-arch"))
    actions = d.fire(Timer.BACKOFF)
    assert only(actions, RunWarmup) == RunWarmup(d.op(RunWarmup), recheck=True, patch_allowed=True)
    d.send(WarmupOk(d.op(RunWarmup)))
    d.send(JobDone(d.op(StartUnit), "done"))
    d.send(UnitExited("exit-code"))
    assert only(d.fire(Timer.BACKOFF), RunWarmup).recheck is False


def test_warm_up_failure_backs_off_and_retries_warm_up() -> None:
    d = at(UnitState.WARMING)
    actions = d.send(WarmupFailed(d.op(RunWarmup), "nvcc not found"))
    assert d.m.state is UnitState.BACKOFF
    assert "nvcc not found" in only(actions, NotifyStatus).message
    assert isinstance(d.fire(Timer.BACKOFF)[0], RunWarmup)


def test_arch_rejection_without_a_last_resort_fails_with_a_fix() -> None:
    d = at(UnitState.WARMING)
    actions = d.send(WarmupFailed(d.op(RunWarmup), "requires sm75+", arch_rejected=True))
    assert d.m.state is UnitState.FAILED
    message = only(actions, NotifyStatus).message
    assert "FLASHINFER_CUDA_ARCH_LIST" in message
    assert "pytorch_sampling_fallback" in message


def test_last_resort_pytorch_sampling_when_warm_up_cannot_succeed() -> None:
    policy = UnitPolicy(pytorch_sampling_fallback=True, warmup_attempts=2)
    d = at(UnitState.WARMING, policy)
    d.send(WarmupFailed(d.op(RunWarmup), "build failed"))
    assert d.m.state is UnitState.BACKOFF
    d.fire(Timer.BACKOFF)
    actions = d.send(WarmupFailed(d.op(RunWarmup), "build failed"))
    assert d.m.state is UnitState.STARTING
    start = only(actions, StartUnit)
    assert start.sampling_backend is SamplingBackend.PYTORCH
    note = only(actions, NotifyStatus)
    assert "LAST RESORT" in note.message and "--sampling-backend pytorch" in note.message
    assert d.m.sampling_backend is SamplingBackend.PYTORCH

    # Ready reports it, and restarts keep it without a pointless warm-up.
    d.send(UnitActive())
    d.send(HealthOk(d.op(WaitHealthy)))
    actions = d.send(ProbeOk(d.op(SampledProbe), 30.0, 4))
    assert "pytorch" in only(actions, NotifyStatus).message
    d.send(UnitExited("sigkill"))
    actions = d.fire(Timer.BACKOFF)
    assert only(actions, StartUnit).sampling_backend is SamplingBackend.PYTORCH


def test_arch_rejection_goes_straight_to_the_last_resort() -> None:
    d = at(UnitState.WARMING, UnitPolicy(pytorch_sampling_fallback=True))
    actions = d.send(WarmupFailed(d.op(RunWarmup), "rejected", arch_rejected=True))
    assert only(actions, StartUnit).sampling_backend is SamplingBackend.PYTORCH


def test_reset_returns_to_flashinfer_sampling() -> None:
    d = at(UnitState.WARMING, UnitPolicy(pytorch_sampling_fallback=True, max_failures=1))
    d.send(WarmupFailed(d.op(RunWarmup), "x", arch_rejected=True))
    d.send(UnitExited("exit-code"))
    assert d.m.state is UnitState.FAILED
    d.send(OperatorReset())
    assert d.m.sampling_backend is SamplingBackend.FLASHINFER
    assert d.m.state is UnitState.WARMING


# --- Restart= conflicts -------------------------------------------------------------


def test_a_refused_unit_is_left_alone_until_reset() -> None:
    d = at(UnitState.READY)
    actions = d.send(ManagementRefused("Restart=on-failure races the supervisor; set Restart=no"))
    assert d.m.state is UnitState.FAILED and d.m.refused
    assert "Restart=no" in only(actions, NotifyStatus).message
    none_of(actions, StopUnit, StartUnit)
    assert d.send(UnitExited("sigkill")) == ()
    assert d.send(UnitActive()) == ()  # systemd restarted it itself: still not ours
    assert d.m.state is UnitState.FAILED


# --- standby ------------------------------------------------------------------------


def test_standby_stops_a_running_unit_and_waits_for_it_before_starting() -> None:
    d = at(UnitState.READY)
    actions = d.send(StopRequested(standby=True))
    assert d.m.state is UnitState.STANDBY
    stop = only(actions, StopUnit)
    assert CancelTimer(Timer.PROBE) in actions
    assert d.send(StartRequested()) == ()
    assert d.m.state is UnitState.BACKOFF  # waiting for the old process to go
    actions = d.send(JobDone(stop.op, "done"))
    assert d.m.state is UnitState.WARMING
    only(actions, RunWarmup)


def test_standby_of_a_stopped_unit_needs_no_job() -> None:
    d = Drive()
    assert d.send(StopRequested(standby=True)) == ()
    assert d.m.state is UnitState.STANDBY


def test_stop_replaces_a_start_in_flight() -> None:
    d = at(UnitState.STARTING)
    start_op = d.op(StartUnit)
    actions = d.send(StopRequested())
    stop = only(actions, StopUnit)
    assert d.m.state is UnitState.STOPPED
    assert d.send(JobDone(start_op, "canceled")) == ()  # stale
    d.send(JobDone(stop.op, "done"))
    assert not d.m.running


# --- illegal and stale events ------------------------------------------------------------

PLAIN_EVENTS: list[Event] = [
    StartRequested(),
    StartRequested(by=Initiator.OPERATOR),
    StopRequested(),
    StopRequested(standby=True),
    OperatorReset(),
    ManagementRefused("x"),
    UnitActive(),
    UnitExited("sigkill"),
    UnitStoppedByOperator(),
]
LEGAL: dict[str, set[UnitState]] = {
    "StartRequested": {UnitState.STOPPED, UnitState.STANDBY},
    "StartRequested-operator": {UnitState.STOPPED, UnitState.STANDBY, UnitState.FAILED},
    "StopRequested": set(UnitState) - {UnitState.FAILED},
    "OperatorReset": {UnitState.FAILED, UnitState.BACKOFF, UnitState.STOPPED},
}


def _legal_states(event: Event) -> set[UnitState]:
    key = type(event).__name__
    if isinstance(event, StartRequested) and event.by is Initiator.OPERATOR:
        key += "-operator"
    return LEGAL.get(key, set(UnitState))


@pytest.mark.parametrize("state", list(UnitState))
@pytest.mark.parametrize("event", PLAIN_EVENTS, ids=repr)
def test_every_state_accepts_or_refuses_every_event(state: UnitState, event: Event) -> None:
    d = at(state)
    before = snapshot(d.m)
    if state in _legal_states(event):
        d.send(event)
    else:
        with pytest.raises(IllegalEvent) as info:
            d.send(event)
        assert info.value.state is state
        assert snapshot(d.m) == before  # nothing changed


@pytest.mark.parametrize("state", list(UnitState))
def test_answers_to_work_never_issued_are_illegal(state: UnitState) -> None:
    d = at(state)
    before = snapshot(d.m)
    for event in (
        WarmupOk(999),
        WarmupFailed(999, "x"),
        JobDone(999, "done"),
        HealthOk(999),
        ProbeOk(999, 1.0, 1),
        ProbeFailed(999, "timeout"),
        JobDone(0, "done"),
    ):
        with pytest.raises(IllegalEvent, match="never issued"):
            d.send(event)
    assert snapshot(d.m) == before


def test_an_answer_for_the_wrong_kind_of_work_is_illegal() -> None:
    d = at(STATE := UnitState.LOADING)
    before = snapshot(d.m)
    with pytest.raises(IllegalEvent, match="other work"):
        d.send(JobDone(d.op(WaitHealthy), "done"))
    with pytest.raises(IllegalEvent):
        d.send(WarmupOk(d.op(WaitHealthy)))
    assert snapshot(d.m) == before and d.m.state is STATE


def test_stale_answers_and_timers_are_ignored() -> None:
    d = at(UnitState.READY)
    probe = only(d.fire(Timer.PROBE), SampledProbe)
    d.send(UnitExited("sigkill"))  # the probe is abandoned
    before = snapshot(d.m)
    assert d.send(ProbeFailed(probe.op, "server-died")) == ()
    assert d.send(TimerFired(Timer.PROBE)) == ()  # cancelled
    assert d.send(TimerFired(Timer.BACKOFF)) == ()  # armed, but not due yet
    assert snapshot(d.m) == before
    assert d.m.state is UnitState.BACKOFF


def test_a_timer_may_fire_a_hair_early() -> None:
    d = at(UnitState.BACKOFF)
    due = d.timers[Timer.BACKOFF]
    assert d.send(TimerFired(Timer.BACKOFF), at=due - 0.001)
    assert d.m.state is UnitState.WARMING


def test_the_retry_timer_belongs_to_the_pair_policy() -> None:
    d = at(UnitState.STANDBY)
    with pytest.raises(IllegalEvent, match="not a unit timer"):
        d.send(TimerFired(Timer.RETRY_PREFERRED))


# --- rediscovery ---------------------------------------------------------------------------


def _rediscover(
    active_state: str, *, health_ok: bool = False, probe_ok: bool = False
) -> tuple[Machine, tuple[Action, ...]]:
    return Machine.rediscover(
        UNIT, POLICY, now=50.0, active_state=active_state, health_ok=health_ok, probe_ok=probe_ok
    )


def test_rediscover_keeps_a_healthy_unit_ready_without_touching_it() -> None:
    m, actions = _rediscover("active", health_ok=True, probe_ok=True)
    assert m.state is UnitState.READY and m.running
    assert actions == (
        Entered(UnitState.READY, UnitState.STOPPED),
        ScheduleTimer(Timer.PROBE, 80.0),
    )


def test_rediscover_probes_a_unit_whose_health_answers() -> None:
    m, actions = _rediscover("active", health_ok=True)
    assert m.state is UnitState.PROBING
    assert actions == (
        Entered(UnitState.PROBING, UnitState.STOPPED),
        SampledProbe(1, coverage=True),
    )
    m.handle(ProbeOk(1, 3.0, 4), 51.0)
    assert m.state is UnitState.READY


@pytest.mark.parametrize("active_state", ["active", "activating", "reloading"])
def test_rediscover_waits_for_a_unit_still_loading(active_state: str) -> None:
    m, actions = _rediscover(active_state)
    assert m.state is UnitState.LOADING
    assert actions == (
        Entered(UnitState.LOADING, UnitState.STOPPED),
        WaitHealthy(1),
        ScheduleTimer(Timer.LOAD_DEADLINE, 950.0),
    )


@pytest.mark.parametrize("active_state", ["inactive", "failed", "deactivating", "maintenance"])
def test_rediscover_leaves_a_down_unit_stopped(active_state: str) -> None:
    m, actions = _rediscover(active_state)
    assert m.state is UnitState.STOPPED
    assert actions == ()


def test_rediscover_remembers_the_pytorch_drop_in() -> None:
    m, _ = Machine.rediscover(
        UNIT,
        POLICY,
        now=0.0,
        active_state="inactive",
        sampling_backend=SamplingBackend.PYTORCH,
    )
    assert only(m.handle(StartRequested(), 1.0), StartUnit).sampling_backend == "pytorch"


def test_a_refused_unit_ignores_the_answer_to_its_old_start_job() -> None:
    d = at(UnitState.STARTING)
    start = d.op(StartUnit)
    d.send(ManagementRefused("Restart=always"))
    assert d.send(JobDone(start, "failed")) == ()
    assert d.m.state is UnitState.FAILED


def test_a_start_job_answer_after_the_unit_already_failed_changes_nothing() -> None:
    d = Drive().to_starting()
    start = d.op(StartUnit)
    d.send(UnitActive())
    d.send(UnitExited("sigkill"))
    assert d.m.state is UnitState.BACKOFF
    assert d.send(JobDone(start, "failed")) == ()
    assert d.m.state is UnitState.BACKOFF
    assert d.m.failures_in_window(d.now) == 1


# --- every state that waits has a deadline -----------------------------------------


def test_a_warm_up_that_never_answers_fails_at_its_deadline() -> None:
    d = at(UnitState.WARMING)
    warm = d.op(RunWarmup)
    actions = d.fire(Timer.WARMUP_DEADLINE)
    assert d.m.state is UnitState.BACKOFF
    assert CancelOp(warm) in actions
    assert "did not finish" in (d.m.reason or "")
    assert d.send(WarmupOk(warm)) == ()  # its late answer is stale, and changes nothing
    assert d.m.state is UnitState.BACKOFF


def test_a_start_job_that_never_answers_fails_at_its_deadline_and_is_stopped() -> None:
    d = at(UnitState.STARTING)
    actions = d.fire(Timer.START_DEADLINE)
    assert d.m.state is UnitState.BACKOFF
    assert only(actions, StopUnit)
    assert "start job" in (d.m.reason or "")


def test_every_asynchronous_action_has_a_failure_event_its_state_accepts() -> None:
    walks = {
        RunWarmup: UnitState.WARMING,
        StartUnit: UnitState.STARTING,
        WaitHealthy: UnitState.LOADING,
        SampledProbe: UnitState.PROBING,
    }
    for kind, state in walks.items():
        d = at(state)
        action = d.last[kind]
        event = failure_of(action, "KeyError: 'gate'")
        d.send(event)
        # Handled, and whatever comes next has a deadline: a retry timer or a backoff.
        assert d.timers, (kind, d.m.state)
        assert d.m.state in (UnitState.BACKOFF, UnitState.PROBING), (kind, d.m.state)
    stop = StopUnit(7)
    assert failure_of(stop, "x") == JobDone(7, "failed", "x")
    with pytest.raises(TypeError):
        failure_of(NotifyStatus(Severity.INFO, "no work"), "x")


# --- an operator's stop holds the unit ---------------------------------------------


def test_an_operator_stop_holds_the_unit_until_an_operator_acts() -> None:
    d = at(UnitState.READY)
    d.send(UnitStoppedByOperator("stopped"))
    assert d.m.state is UnitState.STOPPED and d.m.held_by_operator
    assert d.m.last_exit_cause == "stopped"
    assert "SIGUSR1" in (d.m.reason or "")
    # SIGUSR1 releases it: warm-up, then start.
    actions = d.send(OperatorReset())
    assert not d.m.held_by_operator and d.m.state is UnitState.WARMING
    assert only(actions, RunWarmup)


def test_an_operator_start_releases_the_hold() -> None:
    d = at(UnitState.READY)
    d.send(UnitStoppedByOperator())
    d.send(UnitActive())
    assert not d.m.held_by_operator and d.m.state is UnitState.LOADING


def test_a_rediscovered_hold_stays_down_while_the_unit_is() -> None:
    held, actions = Machine.rediscover(
        UNIT, POLICY, now=0.0, active_state="failed", operator_stopped=True
    )
    assert (held.state, held.held_by_operator, actions) == (UnitState.STOPPED, True, ())
    # A hold on a unit found running means nothing: someone started it since.
    up, _ = Machine.rediscover(
        UNIT, POLICY, now=0.0, active_state="active", probe_ok=True, operator_stopped=True
    )
    assert (up.state, up.held_by_operator) == (UnitState.READY, False)


# --- what each exit cause calls for ----------------------------------------------------


@pytest.mark.parametrize(
    "cause", ["sigkill", "oom-kill", "gpu-oom", "nccl", "cuda-error", "gpu-xid", "clean"]
)
def test_causes_a_restart_can_heal_back_off_and_restart(cause: str) -> None:
    """gpu-xid here is a program fault the process printed nothing for (needs_person
    False: Xid 13, 31, 43, 94); clean is an exit 0 no stop job asked for."""
    d = at(UnitState.READY)
    d.send(UnitExited(cause))
    assert d.m.state is UnitState.BACKOFF
    d.fire(Timer.BACKOFF)
    assert d.m.state is UnitState.WARMING


@pytest.mark.parametrize(
    ("cause", "needs_person"),
    [
        ("port-in-use", False),
        ("model-load", False),
        ("flashinfer-jit", False),
        ("gpu-xid", True),
        ("gpu-driver", True),
    ],
)
def test_causes_no_restart_heals_fail_at_once_saying_what_to_fix(
    cause: str, needs_person: bool
) -> None:
    d = at(UnitState.LOADING)
    actions = d.send(UnitExited(cause, needs_person=needs_person))
    assert d.m.state is UnitState.FAILED
    assert not d.timers and not [a for a in actions if isinstance(a, StartUnit)]
    assert cause in (d.m.reason or "") and "SIGUSR1" in (d.m.reason or "")
    assert d.m.needs_person is needs_person
    assert only(actions, NotifyStatus).severity is Severity.ERROR
    d.send(OperatorReset())  # a person fixed it
    assert d.m.state is UnitState.WARMING and not d.m.needs_person


def test_a_broken_driver_stack_fails_a_ready_unit_at_once_with_what_to_run() -> None:
    """Error 802 (no nvidia-fabricmanager) on a running unit: no backoff, no restart
    budget spent, and the reason says what a person runs on the host."""
    d = at(UnitState.READY)
    actions = d.send(UnitExited("gpu-driver", needs_person=True))
    assert d.m.state is UnitState.FAILED and d.m.needs_person
    assert not d.timers and not [a for a in actions if isinstance(a, StartUnit)]
    reason = d.m.reason or ""
    assert reason.startswith("exited (gpu-driver): the host's GPU driver stack is unusable")
    for what in ("nvidia-smi", "nvidia-fabricmanager", "reboot", "SIGUSR1"):
        assert what in reason, what
    assert only(actions, NotifyStatus).severity is Severity.ERROR


def test_an_arch_rejection_is_rechecked_by_the_next_warm_up() -> None:
    d = at(UnitState.READY)
    d.send(UnitExited("flashinfer-arch"))
    assert d.m.state is UnitState.BACKOFF
    actions = d.fire(Timer.BACKOFF)
    assert only(actions, RunWarmup).recheck is True


def test_a_start_that_polkit_denies_fails_at_once_and_says_where_to_look() -> None:
    d = at(UnitState.STARTING)
    denied = "start x: refused by systemd (Permission denied)"
    actions = d.send(JobDone(d.op(StartUnit), "failed", denied, denied=True))
    assert d.m.state is UnitState.FAILED and not d.timers
    assert denied in (d.m.reason or "") and "deploy/polkit" in (d.m.reason or "")
    assert only(actions, NotifyStatus).severity is Severity.ERROR


def test_a_program_fault_restarts_on_its_first_occurrence_and_escalates_only_past_the_window() -> (
    None
):
    """The incident: one request's device-side assert (cuda-error, Xid 43 as evidence) is
    restarted under backoff; only a burst past max_failures within the window fails it."""
    d = at(UnitState.READY, UnitPolicy(max_failures=3, failure_window_s=600.0))
    for _ in range(2):
        d.send(UnitExited("cuda-error"))
        assert d.m.state is UnitState.BACKOFF and not d.m.needs_person
        d.fire(Timer.BACKOFF)
        assert d.m.state is UnitState.WARMING
        d.send(WarmupOk(d.op(RunWarmup)))
        d.send(JobDone(d.op(StartUnit), "done"))
        d.send(HealthOk(d.op(WaitHealthy)), at=d.now + 30)
        d.send(ProbeOk(d.op(SampledProbe), 12.0, 4), at=d.now + 1)
        assert d.m.state is UnitState.READY
    d.send(UnitExited("cuda-error"))
    assert d.m.state is UnitState.FAILED and not d.m.needs_person
    assert "3 failures within 600 s, last: exited (cuda-error)" in (d.m.reason or "")


def test_a_stall_while_ready_leaves_ready_and_restarts() -> None:
    d = at(UnitState.READY)
    actions = d.send(ProgressStalled("2 requests running, no token for 60 s"))
    assert d.m.state is UnitState.BACKOFF
    assert [a for a in actions if isinstance(a, StopUnit)]
    assert "stalled while serving: 2 requests running" in (d.m.reason or "")
    with pytest.raises(IllegalEvent):
        at(UnitState.PROBING).send(ProgressStalled("x"))


def test_failures_without_getting_ready_are_counted_in_a_row_whatever_the_window() -> None:
    policy = UnitPolicy(max_failures=3, failure_window_s=10.0, startup_deadline_s=60.0)
    d = at(UnitState.LOADING, policy)
    for attempt in range(1, 4):
        d.fire(Timer.LOAD_DEADLINE)
        assert d.m.state is UnitState.BACKOFF and d.m.failures_unready == attempt
        d.send(UnitStoppedBySupervisor("stopped"))
        d.fire(Timer.BACKOFF)
        d.send(WarmupOk(d.op(RunWarmup)))
        d.send(JobDone(d.op(StartUnit), "done"))
    d.send(HealthOk(d.op(WaitHealthy)), at=d.now + 1)
    d.send(ProbeOk(d.op(SampledProbe), 12.0, 4), at=d.now + 1)
    assert d.m.state is UnitState.READY and d.m.failures_unready == 0


def test_failures_with_ready_runs_between_them_count_only_in_the_window() -> None:
    policy = UnitPolicy(max_failures=2, failure_window_s=10.0)
    d = at(UnitState.READY, policy)
    for _ in range(3):
        d.send(UnitExited("sigkill"), at=d.now + 60)  # far apart: the window is clear
        assert d.m.state is UnitState.BACKOFF
        d.fire(Timer.BACKOFF)
        d.send(WarmupOk(d.op(RunWarmup)))
        d.send(JobDone(d.op(StartUnit), "done"))
        d.send(HealthOk(d.op(WaitHealthy)), at=d.now + 1)
        d.send(ProbeOk(d.op(SampledProbe), 12.0, 4), at=d.now + 1)
        assert d.m.state is UnitState.READY
