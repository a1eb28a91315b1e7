"""The vocabulary of a unit's life: states, events, actions.

Events are what can happen to a unit (from D-Bus, the probe, warm-up, timers,
the operator); actions are what the state machine in ``machine.py`` asks the
adapters to do. All are frozen dataclasses, so they compare by value and can be
logged, queued and asserted on in tests. Pure: no I/O.

Asynchronous work starts with an action carrying an ``op`` number, and the event
that reports its outcome carries the same number.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from supervisor.core.causes import ExitCause


class UnitState(StrEnum):
    STOPPED = "stopped"
    WARMING = "warming"
    STARTING = "starting"
    LOADING = "loading"
    PROBING = "probing"
    READY = "ready"
    BACKOFF = "backoff"
    FAILED = "failed"
    STANDBY = "standby"


class Initiator(StrEnum):
    SUPERVISOR = "supervisor"
    OPERATOR = "operator"


class SamplingBackend(StrEnum):
    FLASHINFER = "flashinfer"
    PYTORCH = "pytorch"


class Timer(StrEnum):
    BACKOFF = "backoff"
    WARMUP_DEADLINE = "warmup-deadline"
    START_DEADLINE = "start-deadline"
    LOAD_DEADLINE = "load-deadline"
    PROBE = "probe"
    RETRY_PREFERRED = "retry-preferred"  # the pair policy's, see policy.py


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


JOB_OK = "done"
# JobRemoved's result for a job another job replaced (a stop enqueued over a start).
JOB_CANCELED = "canceled"


class IllegalEvent(RuntimeError):
    """An event the machine's current state does not accept. Nothing changed."""

    def __init__(self, state: UnitState, event: Event, why: str = "") -> None:
        self.state = state
        self.event = event
        super().__init__(f"{type(event).__name__} is not accepted in state {state}{why}")


# --- events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """Base of everything that can happen to a unit."""


@dataclass(frozen=True, slots=True)
class StartRequested(Event):
    """Run the unit (daemon start-up, the pair policy, or an operator command)."""

    by: Initiator = Initiator.SUPERVISOR


@dataclass(frozen=True, slots=True)
class StopRequested(Event):
    """The supervisor wants the unit down: ``standby`` parks a preferred unit."""

    standby: bool = False


@dataclass(frozen=True, slots=True)
class OperatorReset(Event):
    """An operator (SIGUSR1) clears ``failed``, cuts a backoff short, or releases a
    unit that an operator stopped, and wants it run."""


@dataclass(frozen=True, slots=True)
class ManagementRefused(Event):
    """The unit cannot be managed safely (e.g. systemd ``Restart=`` is set)."""

    reason: str


@dataclass(frozen=True, slots=True)
class GateFacts:
    """What the serving venv's FlashInfer says about the target arch, as the
    adapters saw it (a warm-up or a gate check). ``verdict`` is the gate as the
    venv's files are now: accepts, rejects or unknown (it could not be asked)."""

    verdict: str
    arch: str
    flashinfer_version: str | None = None
    patched: bool = False  # known to accept because the supervisor's patch is in place
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WarmupOk(Event):
    op: int
    gate: GateFacts | None = None


@dataclass(frozen=True, slots=True)
class WarmupFailed(Event):
    op: int
    error: str
    arch_rejected: bool = False  # FlashInfer refused the target arch: retrying cannot help
    gate: GateFacts | None = None


@dataclass(frozen=True, slots=True)
class GateChecked(Event):
    """The answer to CheckGate: FlashInfer's gate, asked without building."""

    op: int
    gate: GateFacts


@dataclass(frozen=True, slots=True)
class JobDone(Event):
    """systemd's JobRemoved for a job the machine asked for; result 'done' is success.
    ``error`` says why a job could not even be asked for (polkit refused it, the
    bus is gone)."""

    op: int
    result: str
    error: str = ""
    denied: bool = False  # permission denied (polkit): no retry can succeed


@dataclass(frozen=True, slots=True)
class HealthOk(Event):
    op: int


@dataclass(frozen=True, slots=True)
class ProbeOk(Event):
    op: int
    latency_ms: float
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class ProbeFailed(Event):
    """A sampled probe, or the wait for /health, failed (reason: a ProbeFailure)."""

    op: int
    reason: str
    error: str = ""


@dataclass(frozen=True, slots=True)
class UnitActive(Event):
    """systemd says the unit is active (whoever started it)."""


@dataclass(frozen=True, slots=True)
class UnitExited(Event):
    """The unit reached inactive/failed on its own; ``cause`` is the classified ExitCause,
    ``needs_person`` the verdict's: the GPUs' own fault, which no restart heals."""

    cause: ExitCause
    needs_person: bool = False


@dataclass(frozen=True, slots=True)
class GpuFaultSeen(Event):
    """The kernel logged a hardware or driver NVIDIA Xid naming a process of this unit,
    read the moment it was logged (a death, and a stall before it, come later): the
    GPUs' own fault. The unit is stopped and failed for a person, and its fallback, on
    the same GPUs, is not run. ``summary`` says which Xid and what to do."""

    summary: str


@dataclass(frozen=True, slots=True)
class ProgressStalled(Event):
    """A ready unit's server reports requests in flight while it produces no tokens
    (adapters/progress.py): it leaves READY and is restarted."""

    why: str


@dataclass(frozen=True, slots=True)
class UnitStoppedByOperator(Event):
    """A stop (or restart) job the supervisor did not issue took the unit down,
    whatever the exit cause that followed (real SGLang SIGKILLs itself on SIGTERM).
    ``cause`` is the classified exit cause, for the record."""

    cause: ExitCause = ExitCause.STOPPED


@dataclass(frozen=True, slots=True)
class OperatorStopSeen(Event):
    """A job the supervisor did not issue ended with the unit down and no process
    exit: an operator's ``systemctl stop`` while the unit was between runs (backoff,
    warm-up, standby). Starting it again would override the operator."""


@dataclass(frozen=True, slots=True)
class UnitStoppedBySupervisor(Event):
    """The unit's process ended while a stop (or restart) job the supervisor issued
    ran: the end it asked for, never a failure (what made it stop was counted then).
    Its news can arrive after that job's own answer, even after the next start was
    issued. ``cause`` is the classified exit cause, for the record. ``needs_person``:
    its verdict found the GPUs' own fault (a hardware Xid logged while it died): that
    outranks why it was being stopped."""

    cause: ExitCause = ExitCause.STOPPED
    needs_person: bool = False


@dataclass(frozen=True, slots=True)
class TimerFired(Event):
    timer: Timer


# --- actions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Action:
    """Base of everything the machine asks the adapters to do."""


@dataclass(frozen=True, slots=True)
class RunWarmup(Action):
    """FlashInfer warm-up; answer WarmupOk/WarmupFailed(op)."""

    op: int
    recheck: bool  # verify the built modules load for the arch, even if the cache looks warm
    patch_allowed: bool


@dataclass(frozen=True, slots=True)
class CheckGate(Action):
    """Ask FlashInfer's gate about the arch without building; answer GateChecked(op)."""

    op: int


@dataclass(frozen=True, slots=True)
class StartUnit(Action):
    """Start the unit; answer JobDone(op). The runtime drop-in that adds
    ``--sampling-backend pytorch`` must be present exactly when the backend is
    PYTORCH (write or remove it, daemon-reload, then start)."""

    op: int
    sampling_backend: SamplingBackend
    restart: bool  # a restart after a failure (k26_unit_restarts_total)


@dataclass(frozen=True, slots=True)
class StopUnit(Action):
    """Stop the unit; answer JobDone(op)."""

    op: int


@dataclass(frozen=True, slots=True)
class WaitHealthy(Action):
    """Poll /health until it answers 200; answer HealthOk(op) or ProbeFailed(op)."""

    op: int


@dataclass(frozen=True, slots=True)
class SampledProbe(Action):
    """One sampled /generate; answer ProbeOk(op) or ProbeFailed(op). ``coverage``: the
    probe that would make the unit ready, so the coverage warm-up follows it and a
    failed shape is a failed probe (reason ``coverage``)."""

    op: int
    coverage: bool = False


@dataclass(frozen=True, slots=True)
class CancelOp(Action):
    """Abandon the work started under ``op``; any answer to it will be ignored."""

    op: int


@dataclass(frozen=True, slots=True)
class ScheduleTimer(Action):
    """Deliver TimerFired(timer) at monotonic ``at``; replaces any earlier one."""

    timer: Timer
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer(Action):
    timer: Timer


@dataclass(frozen=True, slots=True)
class NotifyStatus(Action):
    """Something an operator should read: log it, and use it for sd_notify STATUS=."""

    severity: Severity
    message: str


@dataclass(frozen=True, slots=True)
class Entered(Action):
    """The unit entered ``state`` from ``left`` (the machine's table says why). The
    daemon carries it out: READY starts the learning and the watches a ready unit gets,
    leaving READY ends them, and every entry goes to the log and the start timeline."""

    state: UnitState
    left: UnitState


# Why a probe-like action ended without an answer from the server: the work
# itself broke (a bug, an unmapped error), not the server.
INTERNAL_ERROR = "internal-error"


def failure_of(action: Action, error: str) -> Event:
    """The completion event that reports ``action`` as failed with ``error``.

    Every action that starts asynchronous work has one, so the adapters can end
    any such work in an event, whatever went wrong.
    """
    match action:
        case RunWarmup(op=op):
            return WarmupFailed(op, error)
        case CheckGate(op=op):
            return GateChecked(op, GateFacts("unknown", "", error=error))
        case StartUnit(op=op) | StopUnit(op=op):
            return JobDone(op, "failed", error)
        case WaitHealthy(op=op) | SampledProbe(op=op):
            return ProbeFailed(op, INTERNAL_ERROR, error)
    raise TypeError(f"{type(action).__name__} starts no asynchronous work")
