"""The unit's life as a table: the code takes only the steps the table lists, the
table is printed in docs/architecture.md, and a step off the table changes nothing."""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest

from supervisor.core import machine as machine_module
from supervisor.core.causes import ExitCause
from supervisor.core.events import (
    Action,
    CancelOp,
    CancelTimer,
    CheckGate,
    Entered,
    Event,
    GateChecked,
    GateFacts,
    GpuFaultSeen,
    HealthOk,
    IllegalEvent,
    Initiator,
    JobDone,
    ManagementRefused,
    OperatorReset,
    OperatorStopSeen,
    ProbeFailed,
    ProbeOk,
    ProgressStalled,
    RunWarmup,
    SampledProbe,
    SamplingBackend,
    ScheduleTimer,
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
)
from supervisor.core.machine import (
    STEP_ENTERS,
    TRANSITIONS,
    Machine,
    Rediscovered,
    Step,
    UnitPolicy,
    format_table,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"
_WORK = (RunWarmup, CheckGate, StartUnit, StopUnit, WaitHealthy, SampledProbe)
_OFF_TABLE = re.compile(r"table has no step|does not ask for|a second step")


def _answer(rng: random.Random, action: Action) -> Event:
    op: int = action.op  # type: ignore[attr-defined]
    if isinstance(action, RunWarmup):
        if rng.random() < 0.6:
            return WarmupOk(op, GateFacts("accepts", "sm_90", "0.6.1"))
        return WarmupFailed(
            op, "nvcc failed", arch_rejected=rng.random() < 0.4, gate=GateFacts("rejects", "sm_120")
        )
    if isinstance(action, CheckGate):
        return GateChecked(
            op,
            rng.choice(
                [
                    GateFacts("accepts", "sm_90", "0.6.1"),
                    GateFacts("rejects", "sm_120"),
                    GateFacts("unknown", "", error="no venv"),
                    None,
                ]
            ),
        )
    if isinstance(action, (StartUnit, StopUnit)):
        result = rng.choice(["done", "done", "failed", "canceled", "timeout"])
        return JobDone(op, result, denied=rng.random() < 0.1)
    if isinstance(action, WaitHealthy):
        return rng.choice([HealthOk(op), ProbeFailed(op, "timeout")])
    return rng.choice([ProbeOk(op, 12.0, 4), ProbeOk(op, 12.0, 4), ProbeFailed(op, "http")])


def _fact(rng: random.Random) -> Event:
    cause = rng.choice(list(ExitCause))
    return rng.choice(
        [
            UnitActive(),
            UnitExited(cause, needs_person=rng.random() < 0.15),
            UnitStoppedBySupervisor(cause, needs_person=rng.random() < 0.15),
            UnitStoppedByOperator(cause),
            GpuFaultSeen("Xid 79"),
            OperatorStopSeen(),
            ProgressStalled("no tokens"),
            StartRequested(),
            StartRequested(by=Initiator.OPERATOR),
            StopRequested(),
            StopRequested(standby=True),
            OperatorReset(),
            ManagementRefused("Restart= is set"),
        ]
    )


def _walk(seed: int, steps: int) -> set[tuple[object, UnitState, UnitState]]:
    """A random life: answers to the work in flight, timers, facts and requests in any
    order. Any refusal is fine (a state that does not accept the event) except one
    that says the code took a step its row does not list."""
    rng = random.Random(seed)
    policy = UnitPolicy(
        warmup_enabled=rng.random() < 0.8,
        allow_patch=rng.random() < 0.5,
        pytorch_sampling_fallback=rng.random() < 0.4,
        warmup_attempts=rng.choice([1, 2]),
        overlap=rng.choice(["never", "auto"]),
        max_failures=rng.choice([2, 3, 5]),
        probe_failures_to_fail=rng.choice([1, 2]),
        failure_window_s=rng.choice([50.0, 600.0]),
        backoff_reset_after_s=rng.choice([5.0, 600.0]),
    )
    now = 100.0
    if rng.random() < 0.3:
        machine, actions = Machine.rediscover(
            "sglang-k26.service",
            policy,
            now=now,
            active_state=rng.choice(["active", "activating", "reloading", "inactive", "failed"]),
            health_ok=rng.random() < 0.5,
            probe_ok=rng.random() < 0.5,
            operator_stopped=rng.random() < 0.3,
            cache_unverified=rng.random() < 0.5,
            sampling_backend=rng.choice(list(SamplingBackend)),
        )
    else:
        machine, actions = Machine("sglang-k26.service", policy, now=now), ()
    work: dict[int, Action] = {}
    timers: dict[Timer, float] = {}
    seen: set[tuple[object, UnitState, UnitState]] = {
        (Rediscovered, UnitState.STOPPED, machine.state)
    }
    for _ in range(steps):
        for action in actions:
            if isinstance(action, _WORK):
                work[action.op] = action
            elif isinstance(action, CancelOp):
                work.pop(action.op, None)
            elif isinstance(action, ScheduleTimer):
                timers[action.timer] = action.at
            elif isinstance(action, CancelTimer):
                timers.pop(action.timer, None)
        now += rng.choice([0.1, 1.0, 5.0, 30.0, 200.0])
        menu: list[Any] = [*work.values(), *timers, None, None, None]
        pick = rng.choice(menu)
        if isinstance(pick, Timer):
            now = max(now, timers.pop(pick))
            event: Event = TimerFired(pick)
        elif pick is not None:
            event = _answer(rng, work.pop(pick.op))
        else:
            event = _fact(rng)
        before = machine.state
        try:
            actions = machine.handle(event, now)
        except IllegalEvent as exc:
            assert not _OFF_TABLE.search(str(exc)), f"seed {seed}: {exc}"
            actions = ()
            continue
        if actions or machine.state is not before:  # not a stale answer, ignored
            trigger = event.timer if isinstance(event, TimerFired) else type(event)
            seen.add((trigger, before, machine.state))
    return seen


def test_a_random_life_takes_only_steps_the_table_lists() -> None:
    seen: set[tuple[object, UnitState, UnitState]] = set()
    for seed in range(150):
        seen |= _walk(seed, 300)
    # Every (event, state, next state) the walks saw is one the table can reach...
    for trigger, before, after in seen:
        reachable = {
            STEP_ENTERS[step] or before
            for step in TRANSITIONS[trigger][before]  # type: ignore[index]
        }
        assert after in reachable, (trigger, before, after)
    # ...and the walks are no toy: most changes of state the table lists were taken
    # (a stay that asks for nothing looks like a stale answer, so it is not counted).
    moves = {
        (trigger, state, enters)
        for trigger, row in TRANSITIONS.items()
        for state, steps in row.items()
        for step in steps
        if (enters := STEP_ENTERS[step]) not in (None, state)
    }
    taken = len(seen & moves)
    assert taken >= 0.85 * len(moves), f"{taken} of {len(moves)}"


def test_a_step_off_the_table_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine = Machine("sglang-k26.service", UnitPolicy(), now=10.0)
    before = copy.deepcopy(vars(machine))
    table = dict(TRANSITIONS)
    table[StartRequested] = {UnitState.STOPPED: frozenset({Step.STAY})}
    monkeypatch.setattr(machine_module, "TRANSITIONS", table)
    with pytest.raises(IllegalEvent, match="the table has no step warm-up"):
        machine.handle(StartRequested(), 11.0)
    assert vars(machine) == before


def test_an_action_the_step_does_not_ask_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = Machine("sglang-k26.service", UnitPolicy(), now=10.0)
    before = copy.deepcopy(vars(machine))
    asks = dict(machine_module.STEP_ASKS)
    asks[Step.WARM_UP] = frozenset({ScheduleTimer})
    monkeypatch.setattr(machine_module, "STEP_ASKS", asks)
    with pytest.raises(IllegalEvent, match="step warm-up does not ask for RunWarmup"):
        machine.handle(StartRequested(), 11.0)
    assert vars(machine) == before


def test_each_change_of_state_is_an_entered_action_in_order() -> None:
    machine = Machine("sglang-k26.service", UnitPolicy(), now=0.0)
    entered: list[Entered] = []

    def send(event: Event) -> tuple[Action, ...]:
        actions = machine.handle(event, 1.0)
        entered.extend(a for a in actions if isinstance(a, Entered))
        return actions

    warm = send(StartRequested())
    start = send(WarmupOk(next(a for a in warm if isinstance(a, RunWarmup)).op))
    load = send(JobDone(next(a for a in start if isinstance(a, StartUnit)).op, "done"))
    probe = send(HealthOk(next(a for a in load if isinstance(a, WaitHealthy)).op))
    send(ProbeOk(next(a for a in probe if isinstance(a, SampledProbe)).op, 10.0, 4))
    send(UnitExited(ExitCause.SIGKILL))
    s = UnitState
    assert entered == [
        Entered(s.WARMING, s.STOPPED),
        Entered(s.STARTING, s.WARMING),
        Entered(s.LOADING, s.STARTING),
        Entered(s.PROBING, s.LOADING),
        Entered(s.READY, s.PROBING),
        Entered(s.BACKOFF, s.READY),
    ]


def test_every_state_is_entered_by_some_step_and_every_event_has_a_row() -> None:
    assert set(STEP_ENTERS.values()) - {None} == set(UnitState)
    handled = {t for t in TRANSITIONS if isinstance(t, type)}
    assert Timer.RETRY_PREFERRED not in TRANSITIONS  # the pair policy's, not a unit's
    assert {t for t in TRANSITIONS if isinstance(t, Timer)} == set(Timer) - {Timer.RETRY_PREFERRED}
    assert {UnitActive, UnitExited, JobDone, ManagementRefused, GpuFaultSeen} <= handled


def test_the_architecture_doc_shows_the_table_as_the_code_has_it() -> None:
    text = DOC.read_text(encoding="utf-8")
    begin, end = "<!-- transitions: begin -->\n", "<!-- transitions: end -->"
    assert begin in text and end in text, f"{DOC} lacks the transition table's markers"
    shown = text.split(begin, 1)[1].split(end, 1)[0]
    assert shown == format_table(), (
        "docs/architecture.md's transition table differs from the code; regenerate it "
        "with: python -m supervisor.core.machine"
    )
