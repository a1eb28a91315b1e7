"""One unit's life, as a pure state machine: events in, actions out.

Everything that decides what happens to a single unit lives here: the states,
the events that move between them, the actions asked of the adapters, the
Kubernetes-style restart backoff, the failure window that ends in ``failed``,
respect for an operator's stop, warm-up before every start, and the last-resort
``--sampling-backend pytorch`` restart. What happens across a preferred/fallback
pair is in ``policy.py``. No I/O and no clock: the caller passes ``now``
(monotonic seconds) with every event and carries out the actions it gets back,
in order.

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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.core.causes import CAUSES, ExitCause, gpus_own_reason
from supervisor.core.events import (
    JOB_CANCELED,
    JOB_OK,
    Action,
    CancelOp,
    CancelTimer,
    CheckGate,
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


_ALL = frozenset(UnitState)
_RUNNING = frozenset({UnitState.STARTING, UnitState.LOADING, UnitState.PROBING, UnitState.READY})
# The legality table: which states accept which events. Op-carrying events and
# timers are first matched against the work and timers the machine is waiting on.
_ACCEPTS: Mapping[type[Event], frozenset[UnitState]] = {
    StartRequested: frozenset({UnitState.STOPPED, UnitState.STANDBY, UnitState.FAILED}),
    StopRequested: _ALL - {UnitState.FAILED},
    OperatorReset: frozenset({UnitState.FAILED, UnitState.BACKOFF, UnitState.STOPPED}),
    ManagementRefused: _ALL,
    # An overlapped warm-up also ends while the unit is starting or loading.
    WarmupOk: frozenset({UnitState.WARMING, UnitState.STARTING, UnitState.LOADING}),
    WarmupFailed: frozenset({UnitState.WARMING, UnitState.STARTING, UnitState.LOADING}),
    GateChecked: frozenset({UnitState.WARMING}),
    JobDone: _ALL,
    HealthOk: frozenset({UnitState.LOADING}),
    ProbeOk: frozenset({UnitState.PROBING, UnitState.READY}),
    ProbeFailed: frozenset({UnitState.LOADING, UnitState.PROBING, UnitState.READY}),
    ProgressStalled: frozenset({UnitState.READY}),
    GpuFaultSeen: _ALL,
    UnitActive: _ALL,
    UnitExited: _ALL,
    UnitStoppedByOperator: _ALL,
    UnitStoppedBySupervisor: _ALL,
    # Between runs only: a failed unit is never started on its own anyway.
    OperatorStopSeen: frozenset(
        {UnitState.WARMING, UnitState.BACKOFF, UnitState.STANDBY, UnitState.STOPPED}
    ),
}
_TIMER_STATES: Mapping[Timer, frozenset[UnitState]] = {
    Timer.BACKOFF: frozenset({UnitState.BACKOFF}),
    Timer.WARMUP_DEADLINE: frozenset({UnitState.WARMING, UnitState.STARTING, UnitState.LOADING}),
    Timer.START_DEADLINE: frozenset({UnitState.STARTING}),
    Timer.LOAD_DEADLINE: frozenset({UnitState.LOADING}),
    Timer.PROBE: frozenset({UnitState.PROBING, UnitState.READY}),
}
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
        self._task: int | None = None  # health wait or probe in flight
        # A warm-up (or gate check) in flight; alongside _task when overlapped.
        self._warm: int | None = None
        self._warm_is_gate = False
        self._overlap = False  # this start's warm-up runs while the unit is up
        self._gate: GateFacts | None = None  # the last verdict the adapters reported
        self.warmup_mode: str | None = None  # the plan for the latest start, for /status
        self.warmup_why: str | None = None
        self._job: int | None = None  # systemd start/stop job in flight
        self._job_is_stop = False
        self._timers: dict[Timer, float] = {}
        self._running = False  # the unit may have a process: started, not yet seen down
        self._failures: deque[float] = deque()
        self._failures_unready = 0  # failures since the unit was last ready
        self._backoff_step = 0
        self._backoff_elapsed = False
        self._restart_pending = False  # the next start follows a failure
        self._ready_since: float | None = None
        self._probe_failures = 0
        self._warmup_failures = 0
        self._recheck = False
        self._backend = sampling_backend
        self.restarts = 0
        self.last_exit_cause: ExitCause | None = None
        self.reason: str | None = None
        self.refused = False
        # Stopped by an operator: stays down until an operator starts it (systemctl
        # start, seen as UnitActive) or resets it (SIGUSR1); the daemon persists it.
        self.held_by_operator = False
        # Failed in a way only a person can fix (a hardware or driver Xid, the host's
        # driver stack): its fallback is not started onto the same GPUs either.
        self.needs_person = False
        # An operator reset the unit while the run it failed for was still going down:
        # that run's end (with the fault the operator reset) is not news.
        self._reset_run_ending = False

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
        return self._running

    @property
    def sampling_backend(self) -> SamplingBackend:
        return self._backend

    @property
    def gate(self) -> GateFacts | None:
        return self._gate

    @property
    def failures_unready(self) -> int:
        """Failures since the unit was last ready (in a row, whatever the window)."""
        return self._failures_unready

    def failures_in_window(self, now: float) -> int:
        """Failures counted within the failure window ending at ``now``."""
        horizon = now - self.policy.failure_window_s
        return sum(1 for at in self._failures if at > horizon)

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
        out: list[Action] = []
        if operator_stopped and active_state in ("inactive", "failed"):
            machine.held_by_operator = True
            machine.reason = _OPERATOR_STOPPED
            return machine, ()
        if active_state in ("active", "reloading", "activating", "deactivating"):
            machine._running = True
        up = active_state in ("active", "reloading", "activating")
        if up and cache_unverified and sampling_backend is SamplingBackend.FLASHINFER:
            machine._overlap = True
            machine.warmup_mode = str(WarmupMode.OVERLAPPED)
            machine.warmup_why = (
                "found running: the cache is verified while it runs, before any probe counts"
            )
            machine._run_warmup(now, out, recheck=False, patch_allowed=False)
            if active_state != "activating" and (health_ok or probe_ok):
                machine._enter(UnitState.WARMING, now)
            else:
                machine._enter_loading(now, out)
        elif active_state in ("active", "reloading"):
            if probe_ok:
                machine._enter(UnitState.READY, now)
                machine._ready_since = now
                machine._set_timer(Timer.PROBE, now + policy.probe_interval_s, out)
            elif health_ok:
                machine._enter(UnitState.PROBING, now)
                machine._probe(out)
            else:
                machine._enter_loading(now, out)
        elif active_state == "activating":
            machine._enter_loading(now, out)
        return machine, tuple(out)

    # --- events -----------------------------------------------------------------

    def handle(self, event: Event, now: float) -> tuple[Action, ...]:
        """Apply ``event`` at monotonic time ``now``; return the actions to run, in order."""
        if not self._expected(event, now):
            return ()
        out: list[Action] = []
        match event:
            case StartRequested():
                if self._state is UnitState.FAILED:
                    self._reset_history()
                self._begin_start(now, out)
            case StopRequested(standby=standby):
                self._stop(now, out, standby=standby)
            case OperatorReset():
                self._reset_run_ending = self._running and self._state is UnitState.FAILED
                self._reset_history()
                self.held_by_operator = False
                self._cancel_timer(Timer.BACKOFF, out)
                self._backoff_elapsed = True
                self._begin_start(now, out)
            case ManagementRefused(reason=reason):
                self._drop_work(out)
                self._job = None  # whatever systemd does with it is not ours to act on
                self.refused = True
                self._to_failed(now, out, reason)
            case WarmupOk(gate=gate):
                self._warm = None
                self._cancel_timer(Timer.WARMUP_DEADLINE, out)
                self._learn(gate)
                self._warmup_failures = 0
                self._recheck = False
                if not self._overlap:
                    self._issue_start(now, out)
                elif self._state is UnitState.WARMING:  # loaded, and waited for this
                    self._enter(UnitState.PROBING, now)
                    self._probe(out)
                # else still starting or loading: /health will lead to the probe
            case GateChecked(gate=gate):
                self._warm = None
                self._cancel_timer(Timer.WARMUP_DEADLINE, out)
                self._learn(gate)
                self._warm_or_start(now, out)
            case WarmupFailed(gate=gate):
                self._warm = None
                self._cancel_timer(Timer.WARMUP_DEADLINE, out)
                self._learn(gate)
                self._on_warmup_failed(event, now, out)
            case JobDone():
                self._on_job_done(event, now, out)
            case HealthOk():
                self._task = None
                self._cancel_timer(Timer.LOAD_DEADLINE, out)
                if self._warm is not None:
                    # Loaded before the warm-up ended: no probe may count until it has.
                    self._enter(UnitState.WARMING, now)
                else:
                    self._enter(UnitState.PROBING, now)
                    self._probe(out)
            case ProbeOk():
                self._task = None
                self._on_probe_ok(event, now, out)
            case ProbeFailed():
                self._task = None
                self._on_probe_failed(event, now, out)
            case UnitActive():
                self._on_active(now, out)
            case UnitExited(cause=cause) | UnitStoppedBySupervisor(cause=cause) if (
                self._reset_run_ending
            ):
                # Seen in the chaos soak: a reset 16 ms after a hardware Xid failed the
                # unit, then the stopped run's death (carrying that Xid) failed it again.
                self._reset_run_ending = False
                self._on_own_stop(cause, now, out)
            case UnitExited(cause=cause, needs_person=needs_person):
                self._on_exited(cause, needs_person, now, out)
            case ProgressStalled(why=why):
                self._fail(now, out, f"stalled while serving: {why}", stop=True)
            case GpuFaultSeen(summary=summary):
                if not self.held_by_operator and not (
                    self.needs_person and self._state is UnitState.FAILED
                ):
                    self._stop_unit(out)  # its answers on a broken GPU are not to be trusted
                    self._fail_for_gpus(
                        now, out, f"{summary}: {gpus_own_reason(ExitCause.GPU_XID)}"
                    )
            case UnitStoppedBySupervisor(cause=cause, needs_person=True):
                # A stop it asked for (a stall, a probe failure, a standby) met a death
                # whose verdict is the GPUs' own: no restart, and nothing onto them.
                self._record_exit(cause)
                self._running = False
                self._job = None
                self._fail_for_gpus(now, out, f"exited ({cause}): {gpus_own_reason(cause)}")
            case UnitStoppedBySupervisor(cause=cause):
                self._on_own_stop(cause, now, out)
            case UnitStoppedByOperator(cause=cause):
                self._reset_run_ending = False
                self.last_exit_cause = cause
                self._job = None
                if self.refused:
                    self._drop_work(out)
                    self._running = self._restart_pending = False
                else:
                    self._hold_for_operator(now, out)
            case OperatorStopSeen():
                if not self.held_by_operator and not self._running:
                    self._hold_for_operator(now, out, " (it was stopped between runs)")
            case TimerFired(timer=timer):
                self._on_timer(timer, now, out)
        return tuple(out)

    def _expected(self, event: Event, now: float) -> bool:
        """Check ``event`` against the state; False for a stale answer or timer.

        Raises IllegalEvent, before anything changes, for an event the state
        does not accept or an op the machine never issued.
        """
        if isinstance(event, TimerFired):
            allowed = _TIMER_STATES.get(event.timer)
            if allowed is None:
                raise IllegalEvent(self._state, event, ": not a unit timer")
            due = self._timers.get(event.timer)
            if due is None or now < due - _TIMER_SLACK_S:
                return False
        elif isinstance(event, (*_TASK_EVENTS, JobDone)):
            op = event.op
            if isinstance(event, JobDone):
                mine = self._job
            elif isinstance(event, _WARM_EVENTS):
                mine = self._warm
            else:
                mine = self._task
            if op != mine:
                if op >= self._next_op or op < 1:
                    raise IllegalEvent(self._state, event, f": op {op} was never issued")
                if op in (self._task, self._job, self._warm):
                    raise IllegalEvent(self._state, event, f": op {op} is other work")
                return False
            if isinstance(event, GateChecked) != self._warm_is_gate:
                raise IllegalEvent(self._state, event, f": op {op} is other work")
            allowed = _ACCEPTS[type(event)]
        else:
            allowed = _ACCEPTS[type(event)]
        if self._state not in allowed:
            raise IllegalEvent(self._state, event)
        if (
            isinstance(event, StartRequested)
            and self._state is UnitState.FAILED
            and event.by is not Initiator.OPERATOR
        ):
            raise IllegalEvent(self._state, event, ": only an operator restarts a failed unit")
        if isinstance(event, TimerFired):
            del self._timers[event.timer]
        return True

    def _on_warmup_failed(self, event: WarmupFailed, now: float, out: list[Action]) -> None:
        """The same outcomes whether the unit waited for the warm-up or was loading
        beside it; a unit that is up is stopped first (it imported FlashInfer as it
        was, so it cannot serve with what a retry or patch would bring)."""
        self._warmup_failures += 1
        hopeless = event.arch_rejected or self._warmup_failures >= self.policy.warmup_attempts
        if hopeless and self.policy.pytorch_sampling_fallback:
            self._backend = SamplingBackend.PYTORCH
            out.append(
                NotifyStatus(
                    Severity.WARNING,
                    f"{self.name}: FlashInfer warm-up cannot succeed ({event.error}); "
                    "LAST RESORT: starting with --sampling-backend pytorch (runtime drop-in); "
                    "reset the unit once FlashInfer is fixed",
                )
            )
            if self._running:  # started with FlashInfer sampling: down first, then restart
                self._drop_work(out)
                self._stop_unit(out)
                self._enter(UnitState.BACKOFF, now)
                self._backoff_elapsed = True
                self.reason = "restarting with --sampling-backend pytorch (last resort)"
            else:
                self._issue_start(now, out)
        elif event.arch_rejected and self._overlap and self.policy.allow_patch:
            # It accepted when the start was planned; now a patch is due, and it must
            # land before a server imports FlashInfer: stop, then warm first.
            self._recheck = True
            self._fail(
                now,
                out,
                f"FlashInfer's gate now rejects the arch ({event.error}); restarting with "
                "the warm-up (and patch) before the start",
                stop=self._running,
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
            self._fail(now, out, f"FlashInfer warm-up failed: {event.error}", stop=self._running)

    def _on_job_done(self, event: JobDone, now: float, out: list[Action]) -> None:
        was_stop, self._job = self._job_is_stop, None
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
                self._running = False
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
            self._fail(now, out, why, stop=self._running)

    def _on_probe_ok(self, event: ProbeOk, now: float, out: list[Action]) -> None:
        self._probe_failures = 0
        if self._state is UnitState.PROBING:
            self._enter(UnitState.READY, now)
            self._ready_since = now
            self._failures_unready = 0
            self.reason = None
            backend = (
                " (LAST RESORT: sampling backend pytorch)"
                if self._backend is SamplingBackend.PYTORCH
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
        self._probe_failures += 1
        limit = self.policy.probe_failures_to_fail
        if self._probe_failures >= limit:
            self._fail(
                now, out, f"{limit} sampled probes failed in a row, last: {detail}", stop=True
            )
        else:
            self._set_timer(Timer.PROBE, now + self.policy.probe_interval_s, out)

    def _on_active(self, now: float, out: list[Action]) -> None:
        if self._unit_up_expected():
            self._running = True
            if self._state is UnitState.STARTING:
                self._enter_loading(now, out)
            return
        if self._running and self._job is not None and self._job_is_stop:
            return  # still up because our stop job has not finished
        self._running = True
        if self.refused:
            return
        # Someone else (an operator, systemctl start) brought it up: supervise it.
        self.held_by_operator = False
        self._drop_work(out)
        self._job = None
        if self._state is UnitState.FAILED:
            self._reset_history()
        self._enter_loading(now, out)

    def _record_exit(self, cause: ExitCause) -> None:
        self.last_exit_cause = cause
        if CAUSES[cause].recheck_arch:
            self._recheck = True

    def _on_exited(
        self, cause: ExitCause, needs_person: bool, now: float, out: list[Action]
    ) -> None:
        self._record_exit(cause)
        self._running = False
        if self._job is not None and (self._job_is_stop or self._state is UnitState.STARTING):
            self._job = None  # its answer no longer matters: the unit is down
        # An overlapped warm-up in flight is cancelled with the rest of the work
        # (_drop_work): its build's process group ends and its output is quarantined.
        up = self._unit_up_expected()
        if needs_person and not self.held_by_operator:
            # The GPUs' own fault, whatever the machine was doing (even failed for
            # something else already, its fallback engaged: found by the chaos soak):
            # no restart, and nothing onto those GPUs.
            self._fail_for_gpus(now, out, f"exited ({cause}): {gpus_own_reason(cause)}")
        elif up and (unhealable := CAUSES[cause].unhealable) is not None:
            self._drop_work(out)
            self._restart_pending = True
            self._to_failed(now, out, f"exited ({cause}): {unhealable}")
        elif up:
            self._fail(now, out, f"exited ({cause})", stop=False)
        elif self._state is UnitState.BACKOFF:
            self._on_down(now, out)

    def _on_own_stop(self, cause: ExitCause, now: float, out: list[Action]) -> None:
        """The end of a run this supervisor stopped (or restarted): never a failure."""
        self._record_exit(cause)
        if self._job is not None and not self._job_is_stop:
            # A start is in flight: this is the previous run's end, under a restart
            # job or reported after the stop job's own answer. The start goes on.
            return
        if self._job is None and self._unit_up_expected():
            return  # the next run is already up (a late report of the old one)
        self._running = False
        self._job = None  # the stop's answer, if still to come, no longer matters
        if self._state is UnitState.BACKOFF:
            self._on_down(now, out)

    def _on_timer(self, timer: Timer, now: float, out: list[Action]) -> None:
        if timer is Timer.BACKOFF:
            self._backoff_elapsed = True
            if not self._running:
                self._begin_start(now, out)
        elif timer is Timer.WARMUP_DEADLINE:
            limit = self.policy.warmup_deadline_s
            self._fail(
                now,
                out,
                f"FlashInfer warm-up did not finish within {limit:g} s",
                stop=self._running,
            )
        elif timer is Timer.START_DEADLINE:
            # systemd still owns the start job; stop the unit so no half-started
            # process survives, then back off as for any failed start.
            self._job = None
            limit = self.policy.start_deadline_s
            self._fail(now, out, f"the start job did not finish within {limit:g} s", stop=True)
        elif timer is Timer.LOAD_DEADLINE:
            limit = self.policy.startup_deadline_s
            self._fail(now, out, f"not healthy within the {limit:g} s startup deadline", stop=True)
        else:
            self._probe(out)

    # --- transitions ------------------------------------------------------------

    def _begin_start(self, now: float, out: list[Action]) -> None:
        """Warm up (when enabled), then start; first wait for any old process to go."""
        if self._running:
            self._enter(UnitState.BACKOFF, now)
            self._backoff_elapsed = True
            return
        self._overlap = False
        if self.policy.warmup_enabled and self._backend is SamplingBackend.FLASHINFER:
            self._warm_or_start(now, out)
        else:
            self.warmup_mode = self.warmup_why = None
            self._issue_start(now, out)

    def _warm_or_start(self, now: float, out: list[Action]) -> None:
        """Carry out the warm-up plan: ask the gate, warm then start, or both at once."""
        plan = plan_warmup(self.policy.overlap, self._gate, recheck=self._recheck)
        self.warmup_mode, self.warmup_why = str(plan.mode), plan.why
        if plan.mode is WarmupMode.CHECK_GATE:
            self._enter(UnitState.WARMING, now)
            self._warm, self._warm_is_gate = self._new_op(), True
            out.append(CheckGate(self._warm))
            self._set_timer(Timer.WARMUP_DEADLINE, now + self.policy.warmup_deadline_s, out)
        elif plan.mode is WarmupMode.SEQUENTIAL:
            self._enter(UnitState.WARMING, now)
            self._run_warmup(now, out, recheck=self._recheck, patch_allowed=self.policy.allow_patch)
        else:
            # No patch: a patch now could not reach a server that already imported
            # FlashInfer. Should the gate reject after all, _on_warmup_failed restarts.
            self._overlap = True
            self._issue_start(now, out)
            self._run_warmup(now, out, recheck=False, patch_allowed=False)

    def _run_warmup(
        self, now: float, out: list[Action], *, recheck: bool, patch_allowed: bool
    ) -> None:
        self._warm, self._warm_is_gate = self._new_op(), False
        out.append(RunWarmup(self._warm, recheck, patch_allowed))
        self._set_timer(Timer.WARMUP_DEADLINE, now + self.policy.warmup_deadline_s, out)

    def _learn(self, gate: GateFacts | None) -> None:
        if gate is None:
            return
        if gate.flashinfer_version is None and self._gate is not None:
            gate = GateFacts(
                gate.verdict, gate.arch, self._gate.flashinfer_version, gate.patched, gate.error
            )
        self._gate = gate

    def _unit_up_expected(self) -> bool:
        """The unit runs by the supervisor's own start (or was found running)."""
        return self._state in _RUNNING or (self._state is UnitState.WARMING and self._overlap)

    def _stop_unit(self, out: list[Action]) -> None:
        if self._running and not (self._job is not None and self._job_is_stop):
            self._job, self._job_is_stop = self._new_op(), True
            out.append(StopUnit(self._job))

    def _issue_start(self, now: float, out: list[Action]) -> None:
        self._enter(UnitState.STARTING, now)
        self._job, self._job_is_stop = self._new_op(), False
        self._running = True
        out.append(StartUnit(self._job, self._backend, self._restart_pending))
        self._set_timer(Timer.START_DEADLINE, now + self.policy.start_deadline_s, out)
        if self._restart_pending:
            self.restarts += 1
            self._restart_pending = False

    def _enter_loading(self, now: float, out: list[Action]) -> None:
        self._cancel_timer(Timer.START_DEADLINE, out)
        self._enter(UnitState.LOADING, now)
        self._probe_failures = 0
        self._task = self._new_op()
        out.append(WaitHealthy(self._task))
        self._set_timer(Timer.LOAD_DEADLINE, now + self.policy.startup_deadline_s, out)

    def _probe(self, out: list[Action]) -> None:
        self._task = self._new_op()
        # Before READY the probe carries the coverage warm-up; once ready, probes
        # only check that sampling still works.
        out.append(SampledProbe(self._task, coverage=self._state is UnitState.PROBING))

    def _on_down(self, now: float, out: list[Action]) -> None:
        self._running = False
        if self._state is UnitState.BACKOFF and self._backoff_elapsed:
            self._begin_start(now, out)

    def _stop(self, now: float, out: list[Action], *, standby: bool) -> None:
        self._drop_work(out)
        if self._running and not (self._job is not None and self._job_is_stop):
            self._job, self._job_is_stop = self._new_op(), True
            out.append(StopUnit(self._job))
        self._restart_pending = False
        if standby:
            self._enter(UnitState.STANDBY, now)
            self.reason = "standby: its fallback serves"
        else:
            self._enter(UnitState.STOPPED, now)
            self.reason = "stopped by the supervisor"

    def _hold_for_operator(self, now: float, out: list[Action], how: str = "") -> None:
        """An operator's stop, however it landed: down, and never started again by the
        supervisor until an operator starts or resets the unit."""
        self._drop_work(out)
        self._running = self._restart_pending = False
        self._enter(UnitState.STOPPED, now)
        self.held_by_operator = True
        self.reason = _OPERATOR_STOPPED + how
        out.append(NotifyStatus(Severity.WARNING, f"{self.name}: {self.reason}"))

    def _fail(self, now: float, out: list[Action], why: str, *, stop: bool) -> None:
        """A failure of a started unit: count it, then back off or give up."""
        self._drop_work(out)
        policy = self.policy
        if (
            self._ready_since is not None
            and now - self._ready_since >= policy.backoff_reset_after_s
        ):
            self._backoff_step = 0
        self._ready_since = None
        self._probe_failures = 0
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - policy.failure_window_s:
            self._failures.popleft()
        # A start that never gets ready (a load past its deadline, each attempt longer
        # than the window can hold max_failures of) flaps too slowly for the window to
        # fail it: the pair policy counts these in a row to hand over to the fallback.
        self._failures_unready += 1
        self._restart_pending = True
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

        delay = policy.backoff_delay(self._backoff_step)
        self._backoff_step += 1
        self._enter(UnitState.BACKOFF, now)
        self._backoff_elapsed = False
        self._set_timer(Timer.BACKOFF, now + delay, out)
        self.reason = why
        out.append(NotifyStatus(Severity.WARNING, f"{self.name}: {why}; restart in {delay:g} s"))

    def _fail_for_gpus(self, now: float, out: list[Action], reason: str) -> None:
        """The GPUs' own fault: failed for a person, never restarted on its own (the
        pair policy keeps the fallback, on the same GPUs, off too). Failed for it
        already (its Xid was read before the death that carries it): said once."""
        if self.needs_person and self._state is UnitState.FAILED:
            self._drop_work(out)
            return
        self.needs_person = True
        self._restart_pending = True
        self._to_failed(now, out, reason)

    def _to_failed(self, now: float, out: list[Action], reason: str) -> None:
        self._drop_work(out)
        self._enter(UnitState.FAILED, now)
        self.reason = reason
        out.append(NotifyStatus(Severity.ERROR, f"{self.name} FAILED: {reason}"))

    def _reset_history(self) -> None:
        self.held_by_operator = False
        self.needs_person = False
        self._failures.clear()
        self._failures_unready = 0
        self._backoff_step = 0
        self._warmup_failures = 0
        self._probe_failures = 0
        self._recheck = True  # an operator may have changed the serving venv
        self._backend = SamplingBackend.FLASHINFER
        self.refused = False
        self.reason = None

    # --- bookkeeping ------------------------------------------------------------

    def _enter(self, state: UnitState, now: float) -> None:
        if state is not self._state:
            self._state = state
            self._since = now
        if state is not UnitState.READY:
            self._ready_since = None

    def _new_op(self) -> int:
        op, self._next_op = self._next_op, self._next_op + 1
        return op

    def _set_timer(self, timer: Timer, at: float, out: list[Action]) -> None:
        self._timers[timer] = at
        out.append(ScheduleTimer(timer, at))

    def _cancel_timer(self, timer: Timer, out: list[Action]) -> None:
        if self._timers.pop(timer, None) is not None:
            out.append(CancelTimer(timer))

    def _drop_work(self, out: list[Action]) -> None:
        """Abandon the work in flight and every timer (jobs run on: systemd owns them)."""
        for op in (self._task, self._warm):
            if op is not None:
                out.append(CancelOp(op))
        self._task = self._warm = None
        for timer in list(self._timers):
            self._cancel_timer(timer, out)
