"""The preferred/fallback pair policy, driven through a simulated systemd.

``World`` plays systemd, the warm-up and the probe: it carries out each command
at once and answers with the events a real host would send, and it checks the
one invariant that matters most, that the two units of a pair never run at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import pytest

from supervisor.core.config import pair_policy, parse_config, unit_policy, unit_specs
from supervisor.core.events import (
    Action,
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
    ProbeOk,
    ProgressStalled,
    RunWarmup,
    SampledProbe,
    ScheduleTimer,
    StartRequested,
    StartUnit,
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
)
from supervisor.core.machine import UnitPolicy
from supervisor.core.policy import (
    Command,
    Observed,
    PairPolicy,
    RetryPreferred,
    Role,
    StartupVerdict,
    Supervisor,
    SwitchToFallback,
    SwitchToPreferred,
    UnitSpec,
)

EAGLE = "sglang-k26-eagle3.service"
AR = "sglang-k26.service"
OTHER = "sglang-other.service"
SPECS = (
    UnitSpec(EAGLE, Role.EAGLE3, AR),
    UnitSpec(AR, Role.AUTOREGRESSIVE),
    UnitSpec(OTHER, Role.AUTOREGRESSIVE),
)
PAIR = PairPolicy(oom_exits=2, window_s=900, retry_preferred_after_s=3600)


class World:
    """A fake host: systemd jobs, warm-up and probes that answer at once."""

    def __init__(self, supervisor: Supervisor, now: float = 0.0) -> None:
        self.sup = supervisor
        self.now = now
        self.up: set[str] = set()
        self.timers: dict[tuple[str, Timer], float] = {}
        self.log: list[Command] = []
        self.queue: deque[tuple[str, Event]] = deque()
        self.auto_start = True  # answer StartUnit with the job and activation
        self.unhealthy: set[str] = set()  # units whose /health never answers

    def run(self, commands: Iterable[Command]) -> None:
        for cmd in commands:
            self.log.append(cmd)
            self.apply(cmd.unit, cmd.action)
        while self.queue:
            unit, event = self.queue.popleft()
            self.run(self.sup.handle(unit, event, self.now))

    def send(self, unit: str, event: Event) -> None:
        self.run(self.sup.handle(unit, event, self.now))

    def apply(self, unit: str, action: Action) -> None:
        if isinstance(action, StartUnit):
            partner = {EAGLE: AR, AR: EAGLE}.get(unit)
            assert partner not in self.up, f"{unit} started while {partner} runs"
            if self.auto_start:
                self.up.add(unit)
                self.queue.append((unit, JobDone(action.op, "done")))
        elif isinstance(action, StopUnit):
            self.up.discard(unit)
            self.queue.append((unit, JobDone(action.op, "done")))
        elif isinstance(action, RunWarmup):
            self.queue.append((unit, WarmupOk(action.op)))
        elif isinstance(action, WaitHealthy):
            if unit not in self.unhealthy:
                self.queue.append((unit, HealthOk(action.op)))
        elif isinstance(action, SampledProbe):
            self.queue.append((unit, ProbeOk(action.op, 10.0, 4)))
        elif isinstance(action, ScheduleTimer):
            self.timers[(unit, action.timer)] = action.at
        elif isinstance(action, CancelTimer):
            self.timers.pop((unit, action.timer), None)

    def crash(self, unit: str, cause: str, *, needs_person: bool | None = None) -> None:
        """``needs_person`` defaults to the verdict a hardware Xid or a driver gets."""
        if needs_person is None:
            needs_person = cause in ("gpu-xid", "gpu-driver")
        self.up.discard(unit)
        self.send(unit, UnitExited(cause, needs_person=needs_person))

    def advance(self, seconds: float) -> None:
        """Let time pass, firing due timers in order."""
        end = self.now + seconds
        while True:
            due = [(at, key) for key, at in self.timers.items() if at <= end]
            if not due:
                break
            at, (unit, timer) = min(due)
            del self.timers[(unit, timer)]
            self.now = max(self.now, at)
            self.send(unit, TimerFired(timer))
        self.now = end

    def state(self, unit: str) -> UnitState:
        return self.sup.machines[unit].state

    def actions(self, kind: type[Action], unit: str | None = None) -> list[Action]:
        return [
            c.action
            for c in self.log
            if isinstance(c.action, kind) and (unit is None or c.unit == unit)
        ]


def started_world(policy: UnitPolicy | None = None, pair: PairPolicy = PAIR) -> World:
    sup = Supervisor(SPECS, policy or UnitPolicy(), pair)
    world = World(sup)
    world.run(sup.start(world.now))
    return world


def test_start_runs_the_preferred_and_standalone_units_not_the_fallback() -> None:
    world = started_world()
    assert world.state(EAGLE) is UnitState.READY
    assert world.state(OTHER) is UnitState.READY
    assert world.state(AR) is UnitState.STOPPED
    assert world.up == {EAGLE, OTHER}
    assert not world.sup.fallback_engaged(EAGLE)


def test_one_oom_exit_just_restarts_the_preferred_unit() -> None:
    world = started_world()
    world.crash(EAGLE, "oom-kill")
    assert world.state(EAGLE) is UnitState.BACKOFF
    world.advance(10)
    assert world.state(EAGLE) is UnitState.READY
    assert world.state(AR) is UnitState.STOPPED


def test_k_oom_exits_in_the_window_switch_to_the_fallback() -> None:
    world = started_world()
    world.crash(EAGLE, "oom-kill")
    world.advance(10)
    world.log.clear()
    world.crash(EAGLE, "gpu-oom")

    assert world.state(EAGLE) is UnitState.STANDBY
    assert world.state(AR) is UnitState.READY
    assert world.up == {AR, OTHER}
    assert world.sup.fallback_engaged(EAGLE)
    switch = world.actions(SwitchToFallback)
    assert switch == [SwitchToFallback(EAGLE, AR, "2 gpu-oom exits within 900 s")]
    assert world.timers[(EAGLE, Timer.RETRY_PREFERRED)] == world.now + 3600
    assert (EAGLE, Timer.BACKOFF) not in world.timers  # standby: no restart of its own
    # The fallback's start went through warm-up too.
    assert world.actions(RunWarmup, AR)


def test_oom_exits_spread_beyond_the_window_do_not_switch() -> None:
    world = started_world()
    world.crash(EAGLE, "oom-kill")
    world.advance(1000)
    world.crash(EAGLE, "oom-kill")
    world.advance(20)
    assert world.state(EAGLE) is UnitState.READY
    assert world.state(AR) is UnitState.STOPPED


def test_other_exit_causes_do_not_switch() -> None:
    world = started_world()
    for _ in range(3):
        world.crash(EAGLE, "sigkill")
        world.advance(400)
    assert world.state(EAGLE) is UnitState.READY
    assert not world.sup.fallback_engaged(EAGLE)


def engaged_world(policy: UnitPolicy | None = None) -> World:
    world = started_world(policy)
    world.crash(EAGLE, "oom-kill")
    world.advance(10)
    world.crash(EAGLE, "oom-kill")
    assert world.sup.fallback_engaged(EAGLE)
    world.log.clear()
    return world


def test_retry_after_the_interval_warms_up_first_then_swaps() -> None:
    world = engaged_world()
    world.auto_start = False
    world.advance(3600)
    # The preferred unit warmed up while the fallback still served, and only
    # then was the fallback stopped; the preferred start waited for that stop.
    kinds = [(c.unit, type(c.action).__name__) for c in world.log]
    assert kinds.index((EAGLE, "RunWarmup")) < kinds.index((AR, "StopUnit"))
    assert kinds.index((AR, "StopUnit")) < kinds.index((EAGLE, "StartUnit"))
    assert world.actions(SwitchToPreferred) == [SwitchToPreferred(EAGLE, AR, Initiator.SUPERVISOR)]
    assert world.state(AR) is UnitState.STOPPED
    assert world.state(EAGLE) is UnitState.STARTING
    assert not world.sup.fallback_engaged(EAGLE)


def test_retry_full_cycle_returns_to_the_preferred_unit() -> None:
    world = engaged_world()
    world.advance(3600)
    assert world.state(EAGLE) is UnitState.READY
    assert world.state(AR) is UnitState.STOPPED
    assert world.up == {EAGLE, OTHER}


def test_a_held_start_waits_for_the_partner_stop_to_finish() -> None:
    world = engaged_world()
    sup = world.sup
    commands = sup.handle(EAGLE, RetryPreferred(by=Initiator.OPERATOR), world.now)
    warmup = next(c.action for c in commands if isinstance(c.action, RunWarmup))
    commands = sup.handle(EAGLE, WarmupOk(warmup.op), world.now)
    stop = next(c for c in commands if isinstance(c.action, StopUnit))
    assert stop.unit == AR
    assert not [c for c in commands if isinstance(c.action, StartUnit)]
    commands = sup.handle(AR, JobDone(stop.action.op, "done"), world.now)
    assert [c.unit for c in commands if isinstance(c.action, StartUnit)] == [EAGLE]


def test_operator_retry_works_before_the_interval() -> None:
    world = engaged_world()
    world.send(EAGLE, RetryPreferred(by=Initiator.OPERATOR))
    assert world.state(EAGLE) is UnitState.READY
    assert (EAGLE, Timer.RETRY_PREFERRED) not in world.timers
    # The cancelled interval timer, if it still fires, does nothing.
    assert world.sup.handle(EAGLE, TimerFired(Timer.RETRY_PREFERRED), world.now + 3600) == ()


def test_a_retried_unit_that_fails_again_goes_straight_back_to_the_fallback() -> None:
    world = engaged_world()
    world.advance(3600)
    assert world.state(EAGLE) is UnitState.READY
    # Ready again: probation is over, so one OOM is an ordinary restart.
    world.crash(EAGLE, "oom-kill")
    assert world.state(EAGLE) is UnitState.BACKOFF

    world = engaged_world()
    world.auto_start = False
    world.advance(3600)
    assert world.state(EAGLE) is UnitState.STARTING
    world.up.add(EAGLE)
    world.auto_start = True
    world.crash(EAGLE, "oom-kill")  # before it was ever ready
    assert world.state(EAGLE) is UnitState.STANDBY
    assert world.state(AR) is UnitState.READY
    assert world.sup.fallback_engaged(EAGLE)


def test_retry_is_illegal_unless_the_preferred_unit_is_in_standby() -> None:
    world = started_world()
    with pytest.raises(IllegalEvent, match="not in standby"):
        world.sup.handle(EAGLE, RetryPreferred(), world.now)
    with pytest.raises(IllegalEvent, match="has no fallback"):
        world.sup.handle(OTHER, RetryPreferred(), world.now)
    with pytest.raises(KeyError):
        world.sup.handle("nope.service", UnitActive(), world.now)


def test_a_failed_preferred_unit_engages_the_fallback() -> None:
    world = started_world(UnitPolicy(max_failures=2))
    world.crash(EAGLE, "exit-code")
    world.advance(10)
    world.crash(EAGLE, "exit-code")
    assert world.state(EAGLE) is UnitState.FAILED
    assert world.state(AR) is UnitState.READY
    assert world.sup.fallback_engaged(EAGLE)
    assert (EAGLE, Timer.RETRY_PREFERRED) not in world.timers  # failed needs an operator


def test_a_failed_fallback_brings_the_preferred_unit_back() -> None:
    world = engaged_world()
    world.send(AR, ManagementRefused("Restart=always"))
    assert world.state(AR) is UnitState.FAILED
    # AR is refused and still running: EAGLE must not start next to it.
    assert world.state(EAGLE) is UnitState.STARTING
    assert EAGLE not in world.up
    assert any(isinstance(a, NotifyStatus) for a in world.actions(NotifyStatus, EAGLE))


def test_a_fallback_that_fails_by_crashing_hands_back_to_the_preferred_unit() -> None:
    world = engaged_world(UnitPolicy(max_failures=3))
    for _ in range(3):
        world.crash(AR, "exit-code")
        if world.state(AR) is UnitState.FAILED:
            break
        world.advance(60)
    assert world.state(AR) is UnitState.FAILED
    assert world.state(EAGLE) is UnitState.READY
    assert world.up == {EAGLE, OTHER}


def test_operator_stop_of_the_preferred_unit_is_not_a_reason_to_switch() -> None:
    world = started_world()
    world.up.discard(EAGLE)
    world.send(EAGLE, UnitStoppedByOperator())
    assert world.state(EAGLE) is UnitState.STOPPED
    assert world.state(AR) is UnitState.STOPPED
    world.advance(5000)
    assert world.state(EAGLE) is UnitState.STOPPED


def test_operator_start_of_the_preferred_unit_ends_the_fallback() -> None:
    world = engaged_world()
    # systemctl start EAGLE: Conflicts= stops AR, which looks like an operator stop.
    world.up.discard(AR)
    world.send(AR, UnitStoppedByOperator())
    world.up.add(EAGLE)
    world.send(EAGLE, UnitActive())
    assert world.state(EAGLE) is UnitState.READY
    assert not world.sup.fallback_engaged(EAGLE)
    assert (EAGLE, Timer.RETRY_PREFERRED) not in world.timers


def test_the_pair_is_never_both_running_through_a_long_story() -> None:
    world = started_world(UnitPolicy(max_failures=50))
    for cause in ["oom-kill", "gpu-oom", None, "oom-kill", "sigkill", "oom-kill", "gpu-oom"]:
        running = next(u for u in (EAGLE, AR) if u in world.up)
        if cause is not None:
            world.crash(running, cause)
        world.advance(1800)
        assert len({EAGLE, AR} & world.up) <= 1
    assert len({EAGLE, AR} & world.up) == 1


# --- rediscovery ---------------------------------------------------------------


def test_rediscover_a_running_fallback_means_standby_for_the_preferred() -> None:
    sup, commands = Supervisor.rediscover(
        SPECS,
        UnitPolicy(),
        PAIR,
        {AR: Observed("active", health_ok=True, probe_ok=True), OTHER: Observed("inactive")},
        now=100.0,
    )
    assert sup.machines[EAGLE].state is UnitState.STANDBY
    assert sup.machines[AR].state is UnitState.READY
    assert sup.fallback_engaged(EAGLE)
    assert Command(EAGLE, ScheduleTimer(Timer.RETRY_PREFERRED, 3700.0)) in commands
    assert not [c for c in commands if isinstance(c.action, (StartUnit, StopUnit))]
    start = sup.start(100.0)
    # only the unit that is down and should run
    assert [c.unit for c in start if not isinstance(c.action, (ScheduleTimer, Entered))] == [OTHER]


def test_rediscover_never_restarts_a_healthy_preferred_unit() -> None:
    observed = {EAGLE: Observed("active", True, True), OTHER: Observed("active", True, True)}
    sup, commands = Supervisor.rediscover(SPECS, UnitPolicy(), PAIR, observed, now=0.0)
    assert sup.machines[EAGLE].state is UnitState.READY
    assert sup.machines[AR].state is UnitState.STOPPED
    assert not [c for c in commands if isinstance(c.action, (StartUnit, StopUnit, RunWarmup))]
    assert sup.start(0.0) == ()


def test_rediscover_both_running_stops_the_fallback() -> None:
    observed = {EAGLE: Observed("active", True, True), AR: Observed("active", True, True)}
    sup, commands = Supervisor.rediscover(SPECS, UnitPolicy(), PAIR, observed, now=0.0)
    assert [c.unit for c in commands if isinstance(c.action, StopUnit)] == [AR]
    assert sup.machines[AR].state is UnitState.STOPPED
    assert not sup.fallback_engaged(EAGLE)


def test_no_automatic_retry_when_the_interval_is_zero() -> None:
    world = started_world(pair=PairPolicy(retry_preferred_after_s=0))
    world.crash(EAGLE, "oom-kill")
    world.advance(10)
    world.crash(EAGLE, "oom-kill")
    assert (EAGLE, Timer.RETRY_PREFERRED) not in world.timers
    world.advance(100_000)
    assert world.state(EAGLE) is UnitState.STANDBY
    world.send(EAGLE, RetryPreferred(by=Initiator.OPERATOR))
    assert world.state(EAGLE) is UnitState.READY


def test_policies_come_from_the_config() -> None:
    config = parse_config(
        {
            "flashinfer": {"enabled": False},
            "restart": {"backoff_initial_s": 1, "max_failures": 9},
            "fallback": {"oom_exits": 3},
            "units": [
                {"name": EAGLE, "role": "eagle3", "url": "http://127.0.0.1:1", "fallback": AR},
                {"name": AR, "role": "autoregressive", "url": "http://127.0.0.1:1"},
            ],
        }
    )
    policy = unit_policy(config)
    assert not policy.warmup_enabled and policy.backoff_initial_s == 1
    assert policy.max_failures == 9
    assert pair_policy(config).oom_exits == 3
    assert unit_specs(config)[0] == UnitSpec(EAGLE, Role.EAGLE3, AR)
    sup = Supervisor(unit_specs(config), unit_policy(config), pair_policy(config))
    commands = sup.start(0.0)
    assert [(c.unit, type(c.action)) for c in commands] == [
        (EAGLE, Entered),
        (EAGLE, StartUnit),
        (EAGLE, ScheduleTimer),
    ]
    assert StartRequested() == StartRequested(by=Initiator.SUPERVISOR)


def test_a_retry_whose_warm_up_fails_leaves_the_fallback_serving() -> None:
    world = engaged_world()
    sup = world.sup
    commands = sup.handle(EAGLE, RetryPreferred(by=Initiator.OPERATOR), world.now)
    warmup = next(c.action for c in commands if isinstance(c.action, RunWarmup))
    commands = sup.handle(EAGLE, WarmupFailed(warmup.op, "nvcc: not found"), world.now)
    assert not [c for c in commands if isinstance(c.action, (StopUnit, StartUnit))]
    assert sup.machines[EAGLE].state is UnitState.STANDBY
    assert sup.machines[AR].state is UnitState.READY
    assert sup.fallback_engaged(EAGLE)
    assert Command(EAGLE, CancelTimer(Timer.BACKOFF)) in commands


@pytest.mark.parametrize("cause", ["gpu-xid", "gpu-driver"])
def test_a_preferred_unit_that_needs_a_person_does_not_drag_its_fallback_onto_the_gpus(
    cause: str,
) -> None:
    """An Xid, or the host's driver stack (the fallback shares the GPUs and the driver):
    the fallback is not started onto them."""
    world = started_world()
    world.crash(EAGLE, cause)
    assert world.state(EAGLE) is UnitState.FAILED
    assert world.state(AR) is UnitState.STOPPED and AR not in world.up
    assert not world.sup.fallback_engaged(EAGLE)
    assert not world.actions(SwitchToFallback) and not world.actions(StartUnit, AR)
    assert f"exited ({cause})" in (world.sup.machines[EAGLE].reason or "")


def test_a_preferred_unit_whose_model_will_not_load_falls_back() -> None:
    world = started_world()
    world.crash(EAGLE, "model-load")
    assert world.state(EAGLE) is UnitState.FAILED
    assert world.sup.fallback_engaged(EAGLE)
    assert world.state(AR) is UnitState.READY


def test_readiness_and_a_settled_start_up_with_a_unit_an_operator_holds() -> None:
    world = started_world()
    sup = world.sup
    assert sup.serving_ready() and (sup.startup_verdict() is StartupVerdict.READY)
    world.send(OTHER, UnitStoppedByOperator())
    # Not serving: /status says not ready; but start-up waits for nothing (READY=1).
    assert not sup.serving_ready() and (sup.startup_verdict() is StartupVerdict.READY)
    world.crash(EAGLE, "sigkill")
    assert sup.startup_verdict() is not StartupVerdict.READY  # the pair is neither ready nor held


# --- start-up's verdict: READY=1, degraded, or a start that cannot succeed -----------


def _fail_for_good(world: World, unit: str, cause: str = "exit-code") -> None:
    for _ in range(10):
        world.crash(unit, cause)
        if world.state(unit) is UnitState.FAILED:
            return
        world.advance(30)  # past the backoff: restarted, within the failure window
    raise AssertionError(f"{unit} never failed: {world.state(unit)}")


def test_start_up_is_ready_when_every_group_serves() -> None:
    world = started_world()
    assert world.sup.startup_verdict() is StartupVerdict.READY
    assert world.sup.failed_for_good() == []


def test_start_up_waits_while_a_unit_is_in_backoff_or_a_fallback_is_coming_up() -> None:
    world = started_world(UnitPolicy(max_failures=3))
    world.auto_start = False  # the restart's job never answers: still coming up
    world.crash(OTHER, "exit-code")
    assert world.state(OTHER) is UnitState.BACKOFF
    assert world.sup.startup_verdict() is StartupVerdict.WAITING
    world.advance(11)  # the backoff is over: its start job runs, not yet answered
    assert world.state(OTHER) is UnitState.STARTING
    assert world.sup.startup_verdict() is StartupVerdict.WAITING


def test_one_group_failed_for_good_beside_a_serving_one_is_degraded() -> None:
    world = started_world(UnitPolicy(max_failures=2))
    _fail_for_good(world, OTHER)
    assert world.sup.startup_verdict() is StartupVerdict.DEGRADED
    [(unit, reason)] = world.sup.failed_for_good()
    assert unit == OTHER and "2 failures" in reason


def test_every_group_failed_for_good_is_hopeless_naming_each_unit() -> None:
    world = started_world(UnitPolicy(max_failures=2))
    _fail_for_good(world, OTHER)
    _fail_for_good(world, EAGLE)  # the fallback engages...
    assert world.state(AR) is UnitState.READY
    assert world.sup.startup_verdict() is StartupVerdict.DEGRADED
    _fail_for_good(world, AR)  # ...fails too, and EAGLE stays failed: nothing serves
    assert {world.state(u) for u in (EAGLE, AR, OTHER)} == {UnitState.FAILED}
    assert world.sup.startup_verdict() is StartupVerdict.HOPELESS
    assert {u for u, _ in world.sup.failed_for_good()} == {EAGLE, AR, OTHER}


def test_a_driver_gone_leaves_the_fallback_idle_and_its_group_failed_for_good() -> None:
    """gpu-driver: the fallback is never started onto the same driver, so it sits
    stopped; nothing starts the pair again without a person."""
    world = started_world()
    world.crash(EAGLE, "gpu-driver")
    assert world.state(EAGLE) is UnitState.FAILED and world.state(AR) is UnitState.STOPPED
    assert world.sup.startup_verdict() is StartupVerdict.DEGRADED  # OTHER still serves
    assert [u for u, _ in world.sup.failed_for_good()] == [EAGLE]
    world.crash(OTHER, "gpu-driver")
    assert world.sup.startup_verdict() is StartupVerdict.HOPELESS


def test_a_pending_retry_or_an_operators_hold_is_not_failed_for_good() -> None:
    world = engaged_world()  # EAGLE in standby, its retry armed; AR serves
    _fail_for_good(world, AR)
    # The failed fallback hands back to the preferred unit: not hopeless, it starts.
    assert world.state(EAGLE) is not UnitState.FAILED
    assert world.sup.startup_verdict() is not StartupVerdict.HOPELESS
    held = started_world(UnitPolicy(max_failures=2))
    held.send(OTHER, UnitStoppedByOperator())
    _fail_for_good(held, EAGLE)
    _fail_for_good(held, AR)
    # Nothing serves, but OTHER is the operator's: its group is held, not failed.
    assert held.sup.startup_verdict() is StartupVerdict.HOPELESS
    assert {u for u, _ in held.sup.failed_for_good()} == {EAGLE, AR}


def test_a_preferred_unit_that_never_gets_ready_hands_over_though_the_window_never_fills() -> None:
    """A load past its deadline (900 s by default) outlasts what the failure window
    (600 s) can hold max_failures of: the window alone would restart it forever while
    nothing serves. max_failures in a row without getting ready hand over instead."""
    world = started_world()
    world.unhealthy.add(EAGLE)
    world.crash(EAGLE, "sigkill")
    policy = world.sup.machines[EAGLE].policy
    for _ in range(policy.max_failures + 2):
        if world.sup.fallback_engaged(EAGLE):
            break
        world.advance(policy.startup_deadline_s + policy.backoff_max_s)
    assert world.sup.fallback_engaged(EAGLE)
    assert world.state(AR) is UnitState.READY and world.state(EAGLE) is UnitState.STANDBY
    [switch] = world.actions(SwitchToFallback)
    assert switch.reason == f"{policy.max_failures} failures in a row without getting ready"
    assert world.sup.machines[EAGLE].failures_in_window(world.now) < policy.max_failures


def test_a_hardware_xid_found_in_a_death_the_supervisor_asked_for_still_calls_a_person() -> None:
    """Seen in the chaos soak: a stall (or failed probes) made the supervisor stop the
    unit, and the death it asked for carried a hardware Xid (the GPU broke while the
    server hung). Its own stop must not hide it: failed, a person, no fallback."""
    world = started_world()
    world.send(EAGLE, ProgressStalled("1 requests running, no token"))
    assert world.state(EAGLE) is UnitState.BACKOFF and EAGLE not in world.up
    world.send(EAGLE, UnitStoppedBySupervisor("gpu-xid", needs_person=True))
    machine = world.sup.machines[EAGLE]
    assert machine.state is UnitState.FAILED and machine.needs_person
    assert "hardware or driver NVIDIA Xid" in (machine.reason or "")
    world.advance(3600)
    assert world.state(EAGLE) is UnitState.FAILED and world.state(AR) is UnitState.STOPPED
    assert not world.actions(StartUnit, AR)


def test_a_hardware_xid_of_a_parked_preferred_unit_stops_its_fallback_too() -> None:
    """The preferred unit was being parked for its fallback when its death showed the
    GPUs broken: the fallback, on the same GPUs, is stopped again, and neither runs."""
    world = engaged_world()
    assert world.state(AR) is UnitState.READY
    world.send(EAGLE, UnitStoppedBySupervisor("gpu-xid", needs_person=True))
    assert world.state(EAGLE) is UnitState.FAILED and world.sup.machines[EAGLE].needs_person
    assert world.state(AR) is UnitState.STOPPED and AR not in world.up
    assert not world.sup.fallback_engaged(EAGLE)
    world.advance(7200)
    assert AR not in world.up and EAGLE not in world.up


def test_a_hardware_xid_death_of_a_unit_already_failed_stops_the_engaged_fallback() -> None:
    """Seen in the chaos soak: a stall spent the failure budget, the unit failed and
    its fallback started; then the death came in, and it carried an Xid 48 (the
    scheduler hung because the GPU broke). The GPUs' own fault decides even now."""
    world = started_world(UnitPolicy(max_failures=1))
    world.send(EAGLE, ProgressStalled("1 requests running, no token"))
    assert world.state(EAGLE) is UnitState.FAILED and world.sup.fallback_engaged(EAGLE)
    assert AR in world.up
    world.send(EAGLE, UnitExited("gpu-xid", needs_person=True))
    machine = world.sup.machines[EAGLE]
    assert machine.state is UnitState.FAILED and machine.needs_person
    assert "hardware or driver NVIDIA Xid" in (machine.reason or "")
    assert AR not in world.up and world.state(AR) is UnitState.STOPPED
    world.advance(7200)
    assert AR not in world.up and EAGLE not in world.up


XID48 = GpuFaultSeen("NVIDIA Xid 48 on GPU 0000:3b:00 (double-bit ECC error)")


@pytest.mark.parametrize("window_full", [False, True])
def test_a_hardware_xid_read_for_a_units_process_fails_it_before_any_stall_or_death(
    window_full: bool,
) -> None:
    """Seen in the chaos soak: the faulting request holds the scheduler for a moment
    before the death, the stall was called first, and with the failure window full it
    failed the unit and started the fallback on the broken GPUs. The Xid, read the
    moment it names the unit's process, now decides first: stopped, failed for a
    person, the fallback never started, a stall or death after it changes nothing."""
    world = started_world(UnitPolicy(max_failures=1) if window_full else None)
    world.send(EAGLE, XID48)
    machine = world.sup.machines[EAGLE]
    assert machine.state is UnitState.FAILED and machine.needs_person
    reason = machine.reason or ""
    assert reason.startswith("NVIDIA Xid 48 on GPU 0000:3b:00 (double-bit ECC error): ")
    assert "SIGUSR1" in reason
    assert world.actions(StopUnit, EAGLE) and EAGLE not in world.up
    notes = [a.message for a in world.actions(NotifyStatus, EAGLE)]
    assert any(f"its fallback {AR} shares those GPUs" in n for n in notes), notes
    with pytest.raises(IllegalEvent):  # the daemon logs it and goes on
        world.send(EAGLE, ProgressStalled("1 requests running, no token"))
    world.send(EAGLE, UnitStoppedBySupervisor("gpu-xid", needs_person=True))
    world.advance(7200)
    assert world.state(EAGLE) is UnitState.FAILED and world.state(AR) is UnitState.STOPPED
    assert not world.actions(StartUnit, AR) and not world.sup.fallback_engaged(EAGLE)


def test_a_hardware_xid_read_for_the_serving_fallback_stops_it_and_the_retry() -> None:
    """The fallback serves on the same GPUs the preferred unit would be retried on:
    its hardware Xid fails it for a person and disarms the preferred unit's retry."""
    world = engaged_world()
    retries = len(world.actions(StartUnit, EAGLE))
    world.send(AR, XID48)
    assert world.state(AR) is UnitState.FAILED and world.sup.machines[AR].needs_person
    assert AR not in world.up
    world.advance(PAIR.retry_preferred_after_s * 2)
    assert world.state(EAGLE) is UnitState.STANDBY
    assert len(world.actions(StartUnit, EAGLE)) == retries and EAGLE not in world.up


def test_a_fallback_failed_for_the_gpus_own_fault_does_not_hand_back_onto_them() -> None:
    world = engaged_world()
    world.crash(AR, "gpu-xid")
    assert world.state(AR) is UnitState.FAILED and world.sup.machines[AR].needs_person
    assert world.state(EAGLE) is UnitState.STANDBY and EAGLE not in world.up
