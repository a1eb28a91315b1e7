"""One unit's life, as a pure state machine: events in, actions out.

Everything that decides what happens to a single unit lives here: the states,
the events that move between them, the actions asked of the adapters, the
Kubernetes-style restart backoff, the failure window that ends in ``failed``,
respect for an operator's stop, warm-up before every start, and the last-resort
``--sampling-backend pytorch`` restart. What happens across a preferred/fallback
pair is in ``policy.py``. No I/O and no clock: the caller passes ``now``
(monotonic seconds) with every event and carries out the actions it gets back,
in order.

The unit's life is a table, in h11's manner (``TRANSITIONS``): for each event and
each state that accepts it, the steps it may take; each ``Step`` enters one state
(``STEP_ENTERS``) and may ask for certain work (``STEP_ASKS``). The code below only
decides which of a row's steps the facts call for (a failure counted past the
window gives up, one inside it backs off); a step or an action its row does not
list is a bug, and the event is then refused with the machine left exactly as it
was. ``format_table()`` prints it; docs/architecture.md shows it, and a test keeps
the two the same. Each change of state is itself an action (``Entered``), which
the daemon carries out.

Asynchronous work (a warm-up, a systemd job, a health wait, a probe) starts with
an action carrying an ``op`` number; its completion event carries the same
number. A completion for work the machine has since abandoned is stale and is
ignored, as is a timer that was cancelled or re-armed: those are races, not
mistakes. Any other event the current state does not accept raises
``IllegalEvent`` and leaves the machine exactly as it was. Observations of the
unit itself (``UnitActive``, ``UnitExited``, ``UnitStoppedByOperator``,
``UnitStoppedBySupervisor``) are facts and are accepted in every state.

    stopped ─start─▶ warming ─ok─▶ starting ─job done / active─▶ loading
    loading ─/health ok─▶ probing ─sampled probe ok─▶ ready
    warming ─failed, warm-up deadline─▶ backoff (or failed)
    overlapped (warmup_plan.py): stopped ─start─▶ starting (warm-up alongside) ▶ loading
      ─/health ok, warm-up still running─▶ warming ─ok─▶ probing ─ok─▶ ready
      (warm-up failed or past its deadline while the unit runs: stop it, as a failed
      warm-up; the unit's death cancels the warm-up)
    starting..ready ─exit, N failed probes, start/load deadline─▶ backoff (or failed)
    backoff ─timer, once the unit is down─▶ warming ...
    failed ─operator reset─▶ warming         any ─operator stop─▶ stopped (held)
    stopped (held) ─operator start (seen active) or reset─▶ loading / warming
    any but failed ─park─▶ standby (the preferred unit while its fallback serves)

The machine's fields are four small frozen records (``Work``, ``Record``,
``Standing``, ``Plan``), each replaced whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from supervisor.core.causes import CAUSES, ExitCause, gpus_own_reason
from supervisor.core.events import (
    JOB_CANCELED,
    JOB_OK,
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
)
from supervisor.core.warmup_plan import WarmupMode, plan_warmup

# asyncio may run a timer callback up to its clock resolution early; a stale
# timer is seconds early, so this slack cannot confuse the two.
_TIMER_SLACK_S = 0.01
_OPERATOR_STOPPED = (
    "stopped by an operator; the supervisor will not start it until an operator "
    "does (systemctl start) or sends SIGUSR1"
)


@dataclass(frozen=True, slots=True)
class UnitPolicy:
    """The numbers a machine works with; ``core.config.unit_policy(config)`` builds one."""

    warmup_enabled: bool = True
    allow_patch: bool = False
    pytorch_sampling_fallback: bool = False
    warmup_attempts: int = 2
    # flashinfer.overlap: auto warms while the unit loads when that is safe
    # (warmup_plan.py). The config's default is auto; a bare UnitPolicy keeps the
    # plain order, warm-up then start.
    overlap: str = "never"
    # WARMING and STARTING wait on work that could hang (a warm-up stuck behind a
    # lock, a start job systemd never finishes); past these they count as failed.
    warmup_deadline_s: float = 960.0
    start_deadline_s: float = 150.0
    startup_deadline_s: float = 900.0
    probe_interval_s: float = 30.0
    probe_failures_to_fail: int = 3
    backoff_initial_s: float = 10.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 300.0
    backoff_reset_after_s: float = 600.0
    max_failures: int = 5
    failure_window_s: float = 600.0

    def backoff_delay(self, step: int) -> float:
        """Delay before restart number ``step`` (0-based): 10, 20, 40, ... capped."""
        delay = self.backoff_initial_s
        for _ in range(step):
            delay *= self.backoff_factor
            if delay >= self.backoff_max_s:
                break
        return min(delay, self.backoff_max_s)


# --- the table --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rediscovered(Event):
    """The supervisor found the unit as it is (``Machine.rediscover``): the first
    event of a machine made for a unit that may already be up."""


class Step(StrEnum):
    """What an event led to. Each step enters one state (``STEP_ENTERS``)."""

    STAY = "stay"  # accepted; the state does not change
    CHECK_GATE = "check-gate"  # ask FlashInfer's gate (no build) before planning
    WARM_UP = "warm-up"  # warm the cache, then start
    START = "start"  # start the unit (an overlapped warm-up alongside)
    LOAD = "load"  # the unit is up: wait for /health
    AWAIT_WARMUP = "await-warm-up"  # loaded before its overlapped warm-up ended
    PROBE = "probe"  # sampled probe, with the coverage warm-up
    READY = "ready"
    BACK_OFF = "back-off"  # a failure inside the window: restart after a delay
    AWAIT_DOWN = "await-down"  # a start waits for the old process to go
    GIVE_UP = "give-up"  # failed: only an operator (or its fix) brings it back
    STOP = "stop"
    STANDBY = "standby"  # parked while its fallback serves
    HOLD = "hold"  # an operator's stop: down until an operator says otherwise


STEP_ENTERS: Mapping[Step, UnitState | None] = {
    Step.STAY: None,
    Step.CHECK_GATE: UnitState.WARMING,
    Step.WARM_UP: UnitState.WARMING,
    Step.START: UnitState.STARTING,
    Step.LOAD: UnitState.LOADING,
    Step.AWAIT_WARMUP: UnitState.WARMING,
    Step.PROBE: UnitState.PROBING,
    Step.READY: UnitState.READY,
    Step.BACK_OFF: UnitState.BACKOFF,
    Step.AWAIT_DOWN: UnitState.BACKOFF,
    Step.GIVE_UP: UnitState.FAILED,
    Step.STOP: UnitState.STOPPED,
    Step.STANDBY: UnitState.STANDBY,
    Step.HOLD: UnitState.STOPPED,
}
# The work each step may ask for. Any step may also abandon work (CancelOp,
# CancelTimer), tell people (NotifyStatus) and enter its state (Entered).
_ALWAYS: frozenset[type[Action]] = frozenset({CancelOp, CancelTimer, NotifyStatus, Entered})
STEP_ASKS: Mapping[Step, frozenset[type[Action]]] = {
    Step.STAY: frozenset({SampledProbe, ScheduleTimer}),
    Step.CHECK_GATE: frozenset({CheckGate, ScheduleTimer}),
    Step.WARM_UP: frozenset({RunWarmup, ScheduleTimer}),
    Step.START: frozenset({StartUnit, RunWarmup, ScheduleTimer}),
    Step.LOAD: frozenset({WaitHealthy, RunWarmup, ScheduleTimer}),
    Step.AWAIT_WARMUP: frozenset({RunWarmup, ScheduleTimer}),
    Step.PROBE: frozenset({SampledProbe}),
    Step.READY: frozenset({ScheduleTimer}),
    Step.BACK_OFF: frozenset({StopUnit, ScheduleTimer}),
    Step.AWAIT_DOWN: frozenset({StopUnit}),
    Step.GIVE_UP: frozenset({StopUnit}),
    Step.STOP: frozenset({StopUnit}),
    Step.STANDBY: frozenset({StopUnit}),
    Step.HOLD: frozenset(),
}

Trigger = type[Event] | Timer
_S = UnitState
_ALL_STATES = tuple(UnitState)
_UP = (_S.STARTING, _S.LOADING, _S.PROBING, _S.READY)
_BEGIN = frozenset({Step.CHECK_GATE, Step.WARM_UP, Step.START})  # a start, warm-up first
_FAIL = frozenset({Step.BACK_OFF, Step.GIVE_UP})  # a failure counted in the window


def _rows(
    states: Iterable[UnitState], *steps: Step | frozenset[Step]
) -> dict[UnitState, frozenset[Step]]:
    flat: set[Step] = set()
    for s in steps:
        flat |= s if isinstance(s, frozenset) else {s}
    return {state: frozenset(flat) for state in states}


# For each event (a timer by its name), the states that accept it and the steps it
# may take from each. A state missing from an event's row does not accept it.
TRANSITIONS: Mapping[Trigger, Mapping[UnitState, frozenset[Step]]] = {
    Rediscovered: _rows(
        [_S.STOPPED], Step.STAY, Step.HOLD, Step.LOAD, Step.AWAIT_WARMUP, Step.PROBE, Step.READY
    ),
    StartRequested: {
        **_rows([_S.STOPPED, _S.STANDBY], _BEGIN, Step.AWAIT_DOWN),
        # An operator's start of a failed unit re-checks the gate: no gate question.
        **_rows([_S.FAILED], Step.WARM_UP, Step.START, Step.AWAIT_DOWN),
    },
    StopRequested: _rows(set(_ALL_STATES) - {_S.FAILED}, Step.STOP, Step.STANDBY),
    OperatorReset: _rows(
        [_S.FAILED, _S.BACKOFF, _S.STOPPED], Step.WARM_UP, Step.START, Step.AWAIT_DOWN
    ),
    ManagementRefused: _rows(_ALL_STATES, Step.GIVE_UP),
    GateChecked: _rows([_S.WARMING], _BEGIN),
    WarmupOk: {
        **_rows([_S.WARMING], Step.START, Step.PROBE),
        # An overlapped warm-up that ends while the unit starts or loads.
        **_rows([_S.STARTING, _S.LOADING], Step.STAY),
    },
    WarmupFailed: {
        **_rows([_S.WARMING], Step.START, Step.AWAIT_DOWN, _FAIL),
        **_rows([_S.STARTING, _S.LOADING], Step.AWAIT_DOWN, _FAIL),
    },
    JobDone: {
        **_rows([_S.STOPPED, _S.WARMING, _S.FAILED, _S.STANDBY], Step.STAY),
        **_rows([_S.BACKOFF], Step.STAY, _BEGIN),
        **_rows([_S.STARTING], Step.LOAD, Step.HOLD, _FAIL),
        **_rows([_S.LOADING, _S.PROBING, _S.READY], Step.STAY, Step.HOLD, _FAIL),
    },
    HealthOk: _rows([_S.LOADING], Step.PROBE, Step.AWAIT_WARMUP),
    ProbeOk: {**_rows([_S.PROBING], Step.READY), **_rows([_S.READY], Step.STAY)},
    ProbeFailed: {
        **_rows([_S.LOADING], _FAIL),
        **_rows([_S.PROBING, _S.READY], Step.STAY, _FAIL),
    },
    ProgressStalled: _rows([_S.READY], _FAIL),
    GpuFaultSeen: _rows(_ALL_STATES, Step.STAY, Step.GIVE_UP),
    UnitActive: {
        # Someone else brought it up (an operator's start): supervised from /health on.
        **_rows([_S.STOPPED, _S.WARMING, _S.BACKOFF, _S.FAILED, _S.STANDBY], Step.STAY, Step.LOAD),
        **_rows([_S.STARTING], Step.LOAD),
        **_rows([_S.LOADING, _S.PROBING, _S.READY], Step.STAY),
    },
    UnitExited: {
        **_rows([_S.STOPPED, _S.STANDBY, _S.FAILED], Step.STAY, Step.GIVE_UP),
        **_rows([_S.WARMING, *_UP], Step.STAY, _FAIL),
        **_rows([_S.BACKOFF], Step.STAY, Step.GIVE_UP, _BEGIN),
    },
    UnitStoppedBySupervisor: {
        **_rows(set(_ALL_STATES) - {_S.BACKOFF}, Step.STAY, Step.GIVE_UP),
        **_rows([_S.BACKOFF], Step.STAY, Step.GIVE_UP, _BEGIN),
    },
    UnitStoppedByOperator: {
        **_rows(set(_ALL_STATES) - {_S.FAILED}, Step.HOLD),
        # Only a unit whose management was refused (failed) is left as it is.
        **_rows([_S.FAILED], Step.STAY, Step.HOLD),
    },
    # Between runs only: a failed unit is never started on its own anyway.
    OperatorStopSeen: _rows([_S.WARMING, _S.BACKOFF, _S.STANDBY, _S.STOPPED], Step.STAY, Step.HOLD),
    Timer.BACKOFF: _rows([_S.BACKOFF], Step.STAY, _BEGIN),
    Timer.WARMUP_DEADLINE: _rows([_S.WARMING, _S.STARTING, _S.LOADING], _FAIL),
    Timer.START_DEADLINE: _rows([_S.STARTING], _FAIL),
    Timer.LOAD_DEADLINE: _rows([_S.LOADING], _FAIL),
    Timer.PROBE: _rows([_S.PROBING, _S.READY], Step.STAY),
}


def _trigger_name(trigger: Trigger) -> str:
    return f"timer {trigger}" if isinstance(trigger, Timer) else trigger.__name__


def format_table() -> str:
    """The transition table as Markdown: event, state, step, the state it enters and
    the work it may ask for."""
    lines = [
        "| event | in state | step | enters | may ask for |",
        "|---|---|---|---|---|",
    ]
    order = {step: i for i, step in enumerate(Step)}
    for trigger, rows in TRANSITIONS.items():
        for state in (s for s in UnitState if s in rows):
            for step in sorted(rows[state], key=order.__getitem__):
                enters = STEP_ENTERS[step]
                asks = ", ".join(sorted(a.__name__ for a in STEP_ASKS[step])) or "—"
                lines.append(
                    f"| {_trigger_name(trigger)} | {state} | {step} | "
                    f"{enters if enters is not None else '(same)'} | {asks} |"
                )
    return "\n".join(lines) + "\n"


# --- the records ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Work:
    """What the machine waits on, each piece by the op its answer will carry, and
    whether the unit may have a process (started or seen up, not yet seen down)."""

    running: bool = False
    job: int | None = None  # a systemd start or stop job
    job_is_stop: bool = False
    task: int | None = None  # a health wait or a probe
    warm: int | None = None  # a warm-up or gate check (beside task when overlapped)
    warm_is_gate: bool = False
    overlap: bool = False  # this start's warm-up runs while the unit is up
    timers: tuple[tuple[Timer, float], ...] = ()

    def due(self, timer: Timer) -> float | None:
        return next((at for t, at in self.timers if t is timer), None)

    def stopping(self) -> bool:
        return self.job is not None and self.job_is_stop


@dataclass(frozen=True, slots=True)
class Record:
    """The failures that backoff and the failure window read."""

    failures: tuple[float, ...] = ()
    unready: int = 0  # failures since the unit was last ready
    backoff_step: int = 0
    backoff_elapsed: bool = False
    restart_pending: bool = False  # the next start follows a failure
    ready_since: float | None = None
    probe_failures: int = 0
    warmup_failures: int = 0
    recheck: bool = False  # the serving venv may have changed: re-check the gate
    restarts: int = 0
    # The last start's overlapped warm-up was cancelled by the unit's exit: the next
    # start warms first (warmup_plan.py), until a warm-up succeeds.
    warm_cut_short: bool = False


@dataclass(frozen=True, slots=True)
class Standing:
    """What the machine tells people, and what it owes them."""

    reason: str | None = None
    # Stopped by an operator: stays down until an operator starts it (systemctl
    # start, seen as UnitActive) or resets it (SIGUSR1); the daemon persists it.
    held_by_operator: bool = False
    # Failed in a way only a person can fix (a hardware or driver Xid, the host's
    # driver stack): its fallback is not started onto the same GPUs either.
    needs_person: bool = False
    refused: bool = False
    # An operator reset the unit while the run it failed for was still going down:
    # that run's end (with the fault the operator reset) is not news.
    reset_run_ending: bool = False
    last_exit_cause: ExitCause | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """How the unit starts: its sampling backend, the gate's last verdict and the
    warm-up plan of the latest start (for /status)."""

    backend: SamplingBackend = SamplingBackend.FLASHINFER
    gate: GateFacts | None = None
    warmup_mode: str | None = None
    warmup_why: str | None = None


_RUNNING = frozenset(_UP)
_WARM_EVENTS = (WarmupOk, WarmupFailed, GateChecked)
_TASK_EVENTS = (*_WARM_EVENTS, HealthOk, ProbeOk, ProbeFailed)


class Machine:
    """The state machine of one managed unit. Feed it events with ``handle``."""

    def __init__(
        self,
        name: str,
        policy: UnitPolicy,
        *,
        now: float = 0.0,
        sampling_backend: SamplingBackend = SamplingBackend.FLASHINFER,
    ) -> None:
        self.name = name
        self.policy = policy
        self._state = UnitState.STOPPED
        self._since = now
        self._next_op = 1
        self._work = Work()
        self._record = Record()
        self._standing = Standing()
        self._plan = Plan(backend=sampling_backend)
        # The event being handled: its row of the table, and the step it took.
        self._row: frozenset[Step] = frozenset()
        self._step: Step | None = None

    # --- reading --------------------------------------------------------------

    @property
    def state(self) -> UnitState:
        return self._state

    @property
    def since(self) -> float:
        """Monotonic time the current state was entered."""
        return self._since

    @property
    def running(self) -> bool:
        """True from a start (or a sighting) until the unit is seen down."""
        return self._work.running

    @property
    def sampling_backend(self) -> SamplingBackend:
        return self._plan.backend

    @property
    def gate(self) -> GateFacts | None:
        return self._plan.gate

    @property
    def warmup_mode(self) -> str | None:
        return self._plan.warmup_mode

    @property
    def warmup_why(self) -> str | None:
        return self._plan.warmup_why

    @property
    def reason(self) -> str | None:
        return self._standing.reason

    @property
    def held_by_operator(self) -> bool:
        return self._standing.held_by_operator

    @property
    def needs_person(self) -> bool:
        return self._standing.needs_person

    @property
    def refused(self) -> bool:
        return self._standing.refused

    @property
    def last_exit_cause(self) -> ExitCause | None:
        return self._standing.last_exit_cause

    @property
    def restarts(self) -> int:
        return self._record.restarts

    @property
    def failures_unready(self) -> int:
        """Failures since the unit was last ready (in a row, whatever the window)."""
        return self._record.unready

    def failures_in_window(self, now: float) -> int:
        """Failures counted within the failure window ending at ``now``."""
        horizon = now - self.policy.failure_window_s
        return sum(1 for at in self._record.failures if at > horizon)

    # --- rediscovery ------------------------------------------------------------

    @classmethod
    def rediscover(
        cls,
        name: str,
        policy: UnitPolicy,
        *,
        now: float,
        active_state: str,
        health_ok: bool = False,
        probe_ok: bool = False,
        sampling_backend: SamplingBackend = SamplingBackend.FLASHINFER,
        operator_stopped: bool = False,
        cache_unverified: bool = False,
    ) -> tuple[Machine, tuple[Action, ...]]:
        """A machine for a unit found as it is when the supervisor (re)starts.

        A unit that is up is never restarted: an active unit that passes a
        sampled probe is ``ready``; one whose /health answers is ``probing``;
        anything else still coming up is ``loading``, with a fresh deadline. A
        unit that is down is ``stopped``: whether to start it is the caller's
        call, except that one an operator stopped (``operator_stopped``, which the
        daemon kept across its restart) stays held until an operator releases it.

        ``cache_unverified``: this supervisor has not yet seen the FlashInfer cache
        warm (it may have been killed mid-warm-up, with the unit loading beside
        it). A unit found up then gets a warm-up alongside and is ``ready`` only
        after it and a fresh sampled probe: a probe that passed before counts not.
        """
        machine = cls(name, policy, now=now, sampling_backend=sampling_backend)
        found = _Found(active_state, health_ok, probe_ok, operator_stopped, cache_unverified)
        return machine, machine._transact(Rediscovered(), Rediscovered, now, found)

    def _on_found(self, found: _Found, now: float, out: list[Action]) -> None:
        active_state = found.active_state
        if found.operator_stopped and active_state in ("inactive", "failed"):
            self._stand(held_by_operator=True, reason=_OPERATOR_STOPPED)
            self._go(Step.HOLD, now, out)
            return
        if active_state in ("active", "reloading", "activating", "deactivating"):
            self._set_work(running=True)
        up = active_state in ("active", "reloading", "activating")
        if up and found.cache_unverified and self._plan.backend is SamplingBackend.FLASHINFER:
            self._set_work(overlap=True)
            self._set_plan(
                warmup_mode=str(WarmupMode.OVERLAPPED),
                warmup_why="found running: the cache is verified while it runs, before any "
                "probe counts",
            )
            self._run_warmup(now, out, recheck=False, patch_allowed=False)
            if active_state != "activating" and (found.health_ok or found.probe_ok):
                self._go(Step.AWAIT_WARMUP, now, out)
            else:
                self._enter_loading(now, out)
        elif active_state in ("active", "reloading"):
            if found.probe_ok:
                self._go(Step.READY, now, out)
                self._set_record(ready_since=now)
                self._set_timer(Timer.PROBE, now + self.policy.probe_interval_s, out)
            elif found.health_ok:
                self._go(Step.PROBE, now, out)
                self._probe(out)
            else:
                self._enter_loading(now, out)
        elif active_state == "activating":
            self._enter_loading(now, out)

    # --- events -----------------------------------------------------------------

    def handle(self, event: Event, now: float) -> tuple[Action, ...]:
        """Apply ``event`` at monotonic time ``now``; return the actions to run, in order."""
        if not self._expected(event, now):
            return ()
        trigger: Trigger = event.timer if isinstance(event, TimerFired) else type(event)
        return self._transact(event, trigger, now, None)

    def _transact(
        self, event: Event, trigger: Trigger, now: float, found: _Found | None
    ) -> tuple[Action, ...]:
        """Run one event through the table; a step or an action its row does not list
        puts everything back and refuses the event."""
        saved = self._saved()
        self._row, self._step = TRANSITIONS[trigger][self._state], None
        out: list[Action] = []
        try:
            if found is not None:
                self._on_found(found, now, out)
            else:
                self._on(event, now, out)
            step = self._step or Step.STAY
            if step not in self._row:
                raise _OffTable(f"the table has no step {step} for it")
            stray = [a for a in out if type(a) not in STEP_ASKS[step] | _ALWAYS]
            if stray:
                raise _OffTable(f"step {step} does not ask for {type(stray[0]).__name__}")
        except _OffTable as exc:
            self._restore(saved)
            raise IllegalEvent(saved[0], event, f": {exc}") from None
        finally:
            self._row, self._step = frozenset(), None
        return tuple(out)

    # Everything an event may change: put back whole when a step leaves the table.
    _FIELDS = ("_state", "_since", "_next_op", "_work", "_record", "_standing", "_plan")

    def _saved(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def _restore(self, saved: tuple[Any, ...]) -> None:
        for name, value in zip(self._FIELDS, saved, strict=True):
            setattr(self, name, value)

    def _on(self, event: Event, now: float, out: list[Action]) -> None:
        match event:
            case StartRequested():
                if self._state is UnitState.FAILED:
                    self._reset_history()
                self._begin_start(now, out)
            case StopRequested(standby=standby):
                self._stop(now, out, standby=standby)
            case OperatorReset():
                self._stand(reset_run_ending=self._work.running and self._state is UnitState.FAILED)
                self._reset_history()
                self._cancel_timer(Timer.BACKOFF, out)
                self._set_record(backoff_elapsed=True)
                self._begin_start(now, out)
            case ManagementRefused(reason=reason):
                self._drop_work(out)
                self._set_work(job=None)  # what systemd does with it is not ours to act on
                self._stand(refused=True)
                self._to_failed(now, out, reason)
            case WarmupOk(gate=gate):
                self._warm_ended(gate, out)
                self._set_record(warmup_failures=0, recheck=False, warm_cut_short=False)
                if not self._work.overlap:
                    self._issue_start(now, out)
                elif self._state is UnitState.WARMING:  # loaded, and waited for this
                    self._go(Step.PROBE, now, out)
                    self._probe(out)
                # else still starting or loading: /health will lead to the probe
            case GateChecked(gate=gate):
                self._warm_ended(gate, out)
                self._warm_or_start(now, out)
            case WarmupFailed(gate=gate):
                self._warm_ended(gate, out)
                self._on_warmup_failed(event, now, out)
            case JobDone():
                self._on_job_done(event, now, out)
            case HealthOk():
                self._set_work(task=None)
                self._cancel_timer(Timer.LOAD_DEADLINE, out)
                if self._work.warm is not None:
                    # Loaded before the warm-up ended: no probe may count until it has.
                    self._go(Step.AWAIT_WARMUP, now, out)
                else:
                    self._go(Step.PROBE, now, out)
                    self._probe(out)
            case ProbeOk():
                self._set_work(task=None)
                self._on_probe_ok(event, now, out)
            case ProbeFailed():
                self._set_work(task=None)
                self._on_probe_failed(event, now, out)
            case UnitActive():
                self._on_active(now, out)
            case UnitExited(cause=cause) | UnitStoppedBySupervisor(cause=cause) if (
                self._standing.reset_run_ending
            ):
                # Seen in the chaos soak: a reset 16 ms after a hardware Xid failed the
                # unit, then the stopped run's death (carrying that Xid) failed it again.
                self._stand(reset_run_ending=False)
                self._on_own_stop(cause, now, out)
            case UnitExited(cause=cause, needs_person=needs_person):
                self._on_exited(cause, needs_person, now, out)
            case ProgressStalled(why=why):
                self._fail(now, out, f"stalled while serving: {why}", stop=True)
            case GpuFaultSeen(summary=summary):
                standing = self._standing
                if not standing.held_by_operator and not (
                    standing.needs_person and self._state is UnitState.FAILED
                ):
                    self._stop_unit(out)  # its answers on a broken GPU are not to be trusted
                    self._fail_for_gpus(
                        now, out, f"{summary}: {gpus_own_reason(ExitCause.GPU_XID)}"
                    )
            case UnitStoppedBySupervisor(cause=cause, needs_person=True):
                # A stop it asked for (a stall, a probe failure, a standby) met a death
                # whose verdict is the GPUs' own: no restart, and nothing onto them.
                self._record_exit(cause)
                self._set_work(running=False, job=None)
                self._fail_for_gpus(now, out, f"exited ({cause}): {gpus_own_reason(cause)}")
            case UnitStoppedBySupervisor(cause=cause):
                self._on_own_stop(cause, now, out)
            case UnitStoppedByOperator(cause=cause):
                self._stand(reset_run_ending=False, last_exit_cause=cause)
                self._set_work(job=None)
                if self._standing.refused:
                    self._drop_work(out)
                    self._set_work(running=False)
                    self._set_record(restart_pending=False)
                else:
                    self._hold_for_operator(now, out)
            case OperatorStopSeen():
                if not self._standing.held_by_operator and not self._work.running:
                    self._hold_for_operator(now, out, " (it was stopped between runs)")
            case TimerFired(timer=timer):
                self._set_work(
                    timers=tuple((t, at) for t, at in self._work.timers if t is not timer)
                )
                self._on_timer(timer, now, out)

    def _expected(self, event: Event, now: float) -> bool:
        """Check ``event`` against the state; False for a stale answer or timer.

        Raises IllegalEvent, before anything changes, for an event the state
        does not accept or an op the machine never issued.
        """
        work = self._work
        if isinstance(event, TimerFired):
            rows = TRANSITIONS.get(event.timer)
            if rows is None:
                raise IllegalEvent(self._state, event, ": not a unit timer")
            due = work.due(event.timer)
            if due is None or now < due - _TIMER_SLACK_S:
                return False
        elif isinstance(event, (*_TASK_EVENTS, JobDone)):
            op = event.op
            if isinstance(event, JobDone):
                mine = work.job
            elif isinstance(event, _WARM_EVENTS):
                mine = work.warm
            else:
                mine = work.task
            if op != mine:
                if op >= self._next_op or op < 1:
                    raise IllegalEvent(self._state, event, f": op {op} was never issued")
                if op in (work.task, work.job, work.warm):
                    raise IllegalEvent(self._state, event, f": op {op} is other work")
                return False
            if isinstance(event, GateChecked) != work.warm_is_gate:
                raise IllegalEvent(self._state, event, f": op {op} is other work")
            rows = TRANSITIONS[type(event)]
        else:
            rows = TRANSITIONS.get(type(event), {})
        if self._state not in rows:
            raise IllegalEvent(self._state, event)
        if (
            isinstance(event, StartRequested)
            and self._state is UnitState.FAILED
            and event.by is not Initiator.OPERATOR
        ):
            raise IllegalEvent(self._state, event, ": only an operator restarts a failed unit")
        return True

    def _warm_ended(self, gate: GateFacts | None, out: list[Action]) -> None:
        self._set_work(warm=None)
        self._cancel_timer(Timer.WARMUP_DEADLINE, out)
        self._learn(gate)

    def _on_warmup_failed(self, event: WarmupFailed, now: float, out: list[Action]) -> None:
        """The same outcomes whether the unit waited for the warm-up or was loading
        beside it; a unit that is up is stopped first (it imported FlashInfer as it
        was, so it cannot serve with what a retry or patch would bring)."""
        failures = self._record.warmup_failures + 1
        self._set_record(warmup_failures=failures)
        hopeless = event.arch_rejected or failures >= self.policy.warmup_attempts
        if hopeless and self.policy.pytorch_sampling_fallback:
            self._set_plan(backend=SamplingBackend.PYTORCH)
            out.append(
                NotifyStatus(
                    Severity.WARNING,
                    f"{self.name}: FlashInfer warm-up cannot succeed ({event.error}); "
                    "LAST RESORT: starting with --sampling-backend pytorch (runtime drop-in); "
                    "reset the unit once FlashInfer is fixed",
                )
            )
            if self._work.running:  # started with FlashInfer sampling: down first, then restart
                self._drop_work(out)
                self._stop_unit(out)
                self._go(Step.AWAIT_DOWN, now, out)
                self._set_record(backoff_elapsed=True)
                self._stand(reason="restarting with --sampling-backend pytorch (last resort)")
            else:
                self._issue_start(now, out)
        elif event.arch_rejected and self._work.overlap and self.policy.allow_patch:
            # It accepted when the start was planned; now a patch is due, and it must
            # land before a server imports FlashInfer: stop, then warm first.
            self._set_record(recheck=True)
            self._fail(
                now,
                out,
                f"FlashInfer's gate now rejects the arch ({event.error}); restarting with "
                "the warm-up (and patch) before the start",
                stop=self._work.running,
            )
        elif event.arch_rejected:
            self._drop_work(out)
            self._stop_unit(out)
            fix = (
                "the allowed patch did not help"
                if self.policy.allow_patch
                else "pin FLASHINFER_CUDA_ARCH_LIST in the unit or set flashinfer.allow_patch"
            )
            self._to_failed(
                now,
                out,
                f"FlashInfer rejects the GPU arch ({event.error}); {fix}, or set "
                "flashinfer.pytorch_sampling_fallback; then reset the unit",
            )
        else:
            self._fail(
                now, out, f"FlashInfer warm-up failed: {event.error}", stop=self._work.running
            )

    def _on_job_done(self, event: JobDone, now: float, out: list[Action]) -> None:
        was_stop = self._work.job_is_stop
        self._set_work(job=None)
        if was_stop:
            if event.result == JOB_OK:
                self._on_down(now, out)
            else:
                out.append(
                    NotifyStatus(
                        Severity.ERROR,
                        f"{self.name}: stop job ended {event.result!r}"
                        f"{': ' + event.error if event.error else ''}; "
                        "waiting for the unit to go down",
                    )
                )
        elif event.result == JOB_OK:
            if self._state is UnitState.STARTING:
                self._enter_loading(now, out)
        elif event.result == JOB_CANCELED and self._state in _RUNNING:
            # Our start was replaced by a job the supervisor never asked for: an
            # operator's `systemctl stop` (or a conflicting unit) landed first. That is
            # an operator's stop; restarting would override it.
            self._hold_for_operator(now, out, " (it cancelled the supervisor's start)")
        elif self._state in _RUNNING:
            if self._state is UnitState.STARTING:
                self._set_work(running=False)
            why = f"start job ended {event.result!r}" + (f": {event.error}" if event.error else "")
            if event.denied:
                # Permission does not come back by retrying: say so at once.
                self._drop_work(out)
                self._to_failed(
                    now,
                    out,
                    f"{why}; fix what the supervisor's user may do (deploy/polkit/), "
                    "then reset the unit (SIGUSR1)",
                )
                return
            self._fail(now, out, why, stop=self._work.running)

    def _on_probe_ok(self, event: ProbeOk, now: float, out: list[Action]) -> None:
        self._set_record(probe_failures=0)
        if self._state is UnitState.PROBING:
            self._go(Step.READY, now, out)
            self._set_record(ready_since=now, unready=0)
            self._stand(reason=None)
            backend = (
                " (LAST RESORT: sampling backend pytorch)"
                if self._plan.backend is SamplingBackend.PYTORCH
                else ""
            )
            out.append(
                NotifyStatus(
                    Severity.INFO,
                    f"{self.name}: ready, sampled probe passed in {event.latency_ms:.0f} ms"
                    f"{backend}",
                )
            )
        self._set_timer(Timer.PROBE, now + self.policy.probe_interval_s, out)

    def _on_probe_failed(self, event: ProbeFailed, now: float, out: list[Action]) -> None:
        detail = f"{event.reason}: {event.error}" if event.error else event.reason
        if self._state is UnitState.LOADING:
            self._fail(now, out, f"/health never answered ({detail})", stop=True)
            return
        failures = self._record.probe_failures + 1
        self._set_record(probe_failures=failures)
        limit = self.policy.probe_failures_to_fail
        if failures >= limit:
            self._fail(
                now, out, f"{limit} sampled probes failed in a row, last: {detail}", stop=True
            )
        else:
            self._set_timer(Timer.PROBE, now + self.policy.probe_interval_s, out)

    def _on_active(self, now: float, out: list[Action]) -> None:
        if self._unit_up_expected():
            self._set_work(running=True)
            if self._state is UnitState.STARTING:
                self._enter_loading(now, out)
            return
        if self._work.running and self._work.stopping():
            return  # still up because our stop job has not finished
        self._set_work(running=True)
        if self._standing.refused:
            return
        # Someone else (an operator, systemctl start) brought it up: supervise it.
        # Its death is news, even when a reset was waiting for the last run's end.
        self._stand(held_by_operator=False, reset_run_ending=False)
        self._drop_work(out)
        self._set_work(job=None)
        if self._state is UnitState.FAILED:
            self._reset_history()
        self._enter_loading(now, out)

    def _record_exit(self, cause: ExitCause) -> None:
        self._stand(last_exit_cause=cause)
        if CAUSES[cause].recheck_arch:
            self._set_record(recheck=True)

    def _on_exited(
        self, cause: ExitCause, needs_person: bool, now: float, out: list[Action]
    ) -> None:
        self._record_exit(cause)
        self._set_work(running=False)
        self._mark_warm_cut()  # cancelled below, with the rest of the work
        if self._work.job is not None and (
            self._work.job_is_stop or self._state is UnitState.STARTING
        ):
            self._set_work(job=None)  # its answer no longer matters: the unit is down
        # An overlapped warm-up in flight is cancelled with the rest of the work
        # (_drop_work): its build's process group ends and its output is quarantined.
        up = self._unit_up_expected()
        if needs_person and not self._standing.held_by_operator:
            # The GPUs' own fault, whatever the machine was doing (even failed for
            # something else already, its fallback engaged: found by the chaos soak):
            # no restart, and nothing onto those GPUs.
            self._fail_for_gpus(now, out, f"exited ({cause}): {gpus_own_reason(cause)}")
        elif up and (unhealable := CAUSES[cause].unhealable) is not None:
            self._drop_work(out)
            self._set_record(restart_pending=True)
            self._to_failed(now, out, f"exited ({cause}): {unhealable}")
        elif up:
            self._fail(now, out, f"exited ({cause})", stop=False)
        elif self._state is UnitState.BACKOFF:
            self._on_down(now, out)

    def _on_own_stop(self, cause: ExitCause, now: float, out: list[Action]) -> None:
        """The end of a run this supervisor stopped (or restarted): never a failure."""
        self._record_exit(cause)
        if self._work.job is not None and not self._work.job_is_stop:
            # A start is in flight: this is the previous run's end, under a restart
            # job or reported after the stop job's own answer. The start goes on.
            return
        if self._work.job is None and self._unit_up_expected():
            return  # the next run is already up (a late report of the old one)
        # The stop's answer, if still to come, no longer matters.
        self._set_work(running=False, job=None)
        if self._state is UnitState.BACKOFF:
            self._on_down(now, out)

    def _on_timer(self, timer: Timer, now: float, out: list[Action]) -> None:
        if timer is Timer.BACKOFF:
            self._set_record(backoff_elapsed=True)
            if not self._work.running:
                self._begin_start(now, out)
        elif timer is Timer.WARMUP_DEADLINE:
            limit = self.policy.warmup_deadline_s
            self._fail(
                now,
                out,
                f"FlashInfer warm-up did not finish within {limit:g} s",
                stop=self._work.running,
                cut_warm=False,  # its own deadline: not cut short by the unit
            )
        elif timer is Timer.START_DEADLINE:
            # systemd still owns the start job; stop the unit so no half-started
            # process survives, then back off as for any failed start.
            self._set_work(job=None)
            limit = self.policy.start_deadline_s
            self._fail(now, out, f"the start job did not finish within {limit:g} s", stop=True)
        elif timer is Timer.LOAD_DEADLINE:
            limit = self.policy.startup_deadline_s
            self._fail(now, out, f"not healthy within the {limit:g} s startup deadline", stop=True)
        else:
            self._probe(out)

    # --- steps ------------------------------------------------------------------

    def _begin_start(self, now: float, out: list[Action]) -> None:
        """Warm up (when enabled), then start; first wait for any old process to go."""
        if self._work.running:
            self._go(Step.AWAIT_DOWN, now, out)
            self._set_record(backoff_elapsed=True)
            return
        self._set_work(overlap=False)
        if self.policy.warmup_enabled and self._plan.backend is SamplingBackend.FLASHINFER:
            self._warm_or_start(now, out)
        else:
            self._set_plan(warmup_mode=None, warmup_why=None)
            self._issue_start(now, out)

    def _warm_or_start(self, now: float, out: list[Action]) -> None:
        """Carry out the warm-up plan: ask the gate, warm then start, or both at once."""
        plan = plan_warmup(
            self.policy.overlap,
            self._plan.gate,
            recheck=self._record.recheck,
            cut_short=self._record.warm_cut_short,
        )
        self._set_plan(warmup_mode=str(plan.mode), warmup_why=plan.why)
        if plan.mode is WarmupMode.CHECK_GATE:
            self._go(Step.CHECK_GATE, now, out)
            op = self._new_op()
            self._set_work(warm=op, warm_is_gate=True)
            out.append(CheckGate(op))
            self._set_timer(Timer.WARMUP_DEADLINE, now + self.policy.warmup_deadline_s, out)
        elif plan.mode is WarmupMode.SEQUENTIAL:
            self._go(Step.WARM_UP, now, out)
            self._run_warmup(
                now, out, recheck=self._record.recheck, patch_allowed=self.policy.allow_patch
            )
        else:
            # No patch: a patch now could not reach a server that already imported
            # FlashInfer. Should the gate reject after all, _on_warmup_failed restarts.
            self._set_work(overlap=True)
            self._issue_start(now, out)
            self._run_warmup(now, out, recheck=False, patch_allowed=False)

    def _run_warmup(
        self, now: float, out: list[Action], *, recheck: bool, patch_allowed: bool
    ) -> None:
        op = self._new_op()
        self._set_work(warm=op, warm_is_gate=False)
        out.append(RunWarmup(op, recheck, patch_allowed))
        self._set_timer(Timer.WARMUP_DEADLINE, now + self.policy.warmup_deadline_s, out)

    def _learn(self, gate: GateFacts | None) -> None:
        if gate is None:
            return
        known = self._plan.gate
        if gate.flashinfer_version is None and known is not None:
            gate = replace(gate, flashinfer_version=known.flashinfer_version)
        self._set_plan(gate=gate)

    def _unit_up_expected(self) -> bool:
        """The unit runs by the supervisor's own start (or was found running)."""
        return self._state in _RUNNING or (self._state is UnitState.WARMING and self._work.overlap)

    def _stop_unit(self, out: list[Action]) -> None:
        if self._work.running and not self._work.stopping():
            op = self._new_op()
            self._set_work(job=op, job_is_stop=True)
            out.append(StopUnit(op))

    def _issue_start(self, now: float, out: list[Action]) -> None:
        self._go(Step.START, now, out)
        op = self._new_op()
        self._set_work(job=op, job_is_stop=False, running=True)
        restart = self._record.restart_pending
        out.append(StartUnit(op, self._plan.backend, restart))
        self._set_timer(Timer.START_DEADLINE, now + self.policy.start_deadline_s, out)
        if restart:
            self._set_record(restarts=self._record.restarts + 1, restart_pending=False)

    def _enter_loading(self, now: float, out: list[Action]) -> None:
        self._cancel_timer(Timer.START_DEADLINE, out)
        self._go(Step.LOAD, now, out)
        self._set_record(probe_failures=0)
        op = self._new_op()
        self._set_work(task=op)
        out.append(WaitHealthy(op))
        self._set_timer(Timer.LOAD_DEADLINE, now + self.policy.startup_deadline_s, out)

    def _probe(self, out: list[Action]) -> None:
        op = self._new_op()
        self._set_work(task=op)
        # Before READY the probe carries the coverage warm-up; once ready, probes
        # only check that sampling still works.
        out.append(SampledProbe(op, coverage=self._state is UnitState.PROBING))

    def _on_down(self, now: float, out: list[Action]) -> None:
        self._set_work(running=False)
        if self._state is UnitState.BACKOFF and self._record.backoff_elapsed:
            self._begin_start(now, out)

    def _stop(self, now: float, out: list[Action], *, standby: bool) -> None:
        self._drop_work(out)
        self._stop_unit(out)
        self._set_record(restart_pending=False)
        if standby:
            self._go(Step.STANDBY, now, out)
            self._stand(reason="standby: its fallback serves")
        else:
            self._go(Step.STOP, now, out)
            self._stand(reason="stopped by the supervisor")

    def _hold_for_operator(self, now: float, out: list[Action], how: str = "") -> None:
        """An operator's stop, however it landed: down, and never started again by the
        supervisor until an operator starts or resets the unit."""
        self._drop_work(out)
        self._set_work(running=False)
        self._set_record(restart_pending=False)
        self._go(Step.HOLD, now, out)
        self._stand(held_by_operator=True, reason=_OPERATOR_STOPPED + how)
        out.append(NotifyStatus(Severity.WARNING, f"{self.name}: {self._standing.reason}"))

    def _fail(
        self, now: float, out: list[Action], why: str, *, stop: bool, cut_warm: bool = True
    ) -> None:
        """A failure of a started unit: count it, then back off or give up. An
        overlapped warm-up still running is cancelled with the rest: unless the
        failure is its own (``cut_warm`` False), the next start warms first."""
        if cut_warm:
            self._mark_warm_cut()
        self._drop_work(out)
        policy = self.policy
        record = self._record
        step = record.backoff_step
        if record.ready_since is not None and now - record.ready_since >= (
            policy.backoff_reset_after_s
        ):
            step = 0
        # A start that never gets ready (a load past its deadline, each attempt longer
        # than the window can hold max_failures of) flaps too slowly for the window to
        # fail it: the pair policy counts these in a row to hand over to the fallback.
        horizon = now - policy.failure_window_s
        self._record = replace(
            record,
            backoff_step=step,
            ready_since=None,
            probe_failures=0,
            failures=(*(at for at in record.failures if at > horizon), now),
            unready=record.unready + 1,
            restart_pending=True,
        )
        if stop:
            self._stop_unit(out)
        failures = self.failures_in_window(now)
        if failures >= policy.max_failures:
            self._to_failed(
                now,
                out,
                f"{failures} failures within {policy.failure_window_s:g} s, "
                f"last: {why}; no more restarts until an operator resets it",
            )
            return

        delay = policy.backoff_delay(step)
        self._go(Step.BACK_OFF, now, out)
        self._set_record(backoff_step=step + 1, backoff_elapsed=False)
        self._set_timer(Timer.BACKOFF, now + delay, out)
        self._stand(reason=why)
        out.append(NotifyStatus(Severity.WARNING, f"{self.name}: {why}; restart in {delay:g} s"))

    def _mark_warm_cut(self) -> None:
        """An overlapped warm-up (not a gate check) is in flight and about to be
        cancelled: the next start warms first (warmup_plan.py)."""
        if self._work.overlap and self._work.warm is not None and not self._work.warm_is_gate:
            self._set_record(warm_cut_short=True)

    def _fail_for_gpus(self, now: float, out: list[Action], reason: str) -> None:
        """The GPUs' own fault: failed for a person, never restarted on its own (the
        pair policy keeps the fallback, on the same GPUs, off too). Failed for it
        already (its Xid was read before the death that carries it): said once."""
        if self._standing.needs_person and self._state is UnitState.FAILED:
            self._drop_work(out)
            return
        self._stand(needs_person=True)
        self._set_record(restart_pending=True)
        self._to_failed(now, out, reason)

    def _to_failed(self, now: float, out: list[Action], reason: str) -> None:
        self._drop_work(out)
        self._go(Step.GIVE_UP, now, out)
        self._stand(reason=reason)
        out.append(NotifyStatus(Severity.ERROR, f"{self.name} FAILED: {reason}"))

    def _reset_history(self) -> None:
        # An operator may have changed the serving venv: the gate is re-checked.
        self._set_record(
            failures=(),
            unready=0,
            backoff_step=0,
            warmup_failures=0,
            probe_failures=0,
            recheck=True,
        )
        self._standing = replace(
            self._standing, held_by_operator=False, needs_person=False, refused=False, reason=None
        )
        self._set_plan(backend=SamplingBackend.FLASHINFER)

    # --- bookkeeping ------------------------------------------------------------

    def _go(self, step: Step, now: float, out: list[Action]) -> None:
        """Take ``step``: one per event, from its row of the table."""
        if self._step is not None:
            raise _OffTable(f"a second step {step} after {self._step}")
        if step not in self._row:
            raise _OffTable(f"the table has no step {step} for it")
        self._step = step
        state = STEP_ENTERS[step]
        if state is None:
            return
        if state is not self._state:
            out.append(Entered(state, self._state))
            self._state = state
            self._since = now
        if state is not UnitState.READY:
            self._set_record(ready_since=None)

    def _set_work(self, **changes: Any) -> None:
        self._work = replace(self._work, **changes)

    def _set_record(self, **changes: Any) -> None:
        self._record = replace(self._record, **changes)

    def _stand(self, **changes: Any) -> None:
        self._standing = replace(self._standing, **changes)

    def _set_plan(self, **changes: Any) -> None:
        self._plan = replace(self._plan, **changes)

    def _new_op(self) -> int:
        op, self._next_op = self._next_op, self._next_op + 1
        return op

    def _set_timer(self, timer: Timer, at: float, out: list[Action]) -> None:
        timers = self._work.timers
        if self._work.due(timer) is None:
            timers = (*timers, (timer, at))
        else:  # re-armed where it stood, as the order of their cancels shows
            timers = tuple((t, at if t is timer else due) for t, due in timers)
        self._set_work(timers=timers)
        out.append(ScheduleTimer(timer, at))

    def _cancel_timer(self, timer: Timer, out: list[Action]) -> None:
        if self._work.due(timer) is not None:
            self._set_work(timers=tuple((t, at) for t, at in self._work.timers if t is not timer))
            out.append(CancelTimer(timer))

    def _drop_work(self, out: list[Action]) -> None:
        """Abandon the work in flight and every timer (jobs run on: systemd owns them)."""
        for op in (self._work.task, self._work.warm):
            if op is not None:
                out.append(CancelOp(op))
        for timer, _at in self._work.timers:
            out.append(CancelTimer(timer))
        self._set_work(task=None, warm=None, timers=())


class _OffTable(Exception):
    """A step or an action the table does not list for the event: a bug, caught by
    ``_transact``, which puts the machine back and refuses the event."""


@dataclass(frozen=True, slots=True)
class _Found:
    """What ``rediscover`` was told about the unit."""

    active_state: str
    health_ok: bool
    probe_ok: bool
    operator_stopped: bool
    cache_unverified: bool


if __name__ == "__main__":  # python -m supervisor.core.machine: the table, as the docs show it
    print(format_table(), end="")
