"""The supervisor's policy across units: EAGLE-3 and its autoregressive fallback.

``Supervisor`` owns one ``Machine`` per configured unit and the rules that tie a
preferred (EAGLE-3) unit to its fallback. The two share the GPUs, so:

- Never both running. Every ``StartUnit`` for one unit of a pair is held back
  while the other may still have a process; the other is asked to stop (the
  preferred one into ``standby``), and the held start goes out once it is down.
  systemd's ``Conflicts=`` enforces the same, but the supervisor does not lean
  on it: a conflict-stop would look like an operator's stop.
- After ``oom_exits`` exits of the preferred unit caused by ``oom-kill`` or
  ``gpu-oom`` within ``window_s``, or when it becomes ``failed`` for any cause, the
  fallback is started and the preferred unit waits in ``standby``: something serves
  whenever something can. The one exception is a fault of the GPUs' own (a hardware
  or driver Xid, the driver stack: the machine's ``needs_person``): the fallback
  shares those GPUs, so it stays stopped until an operator resets the unit.
- A preferred unit that fails ``max_failures`` times in a row without getting ready
  hands over too, even when each attempt outlasts the failure window (a load past
  its deadline, which the window alone would restart forever).
- ``RetryPreferred`` (after ``retry_preferred_after_s``, or from an operator)
  warms the preferred unit up while the fallback still serves, then swaps. The
  retried unit is on probation: if it fails before it is ``ready`` again, the
  fallback comes straight back instead of waiting out another backoff.
- If the fallback becomes ``failed`` while it serves, the preferred unit is
  retried at once.

Pure, like ``machine``: events and ``now`` in, ``Command`` (unit, action) out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from supervisor.core.causes import CAUSES
from supervisor.core.events import (
    Action,
    CancelTimer,
    Event,
    GpuFaultSeen,
    IllegalEvent,
    Initiator,
    NotifyStatus,
    SamplingBackend,
    ScheduleTimer,
    Severity,
    StartRequested,
    StartUnit,
    StopRequested,
    Timer,
    TimerFired,
    UnitExited,
    UnitState,
    UnitStoppedBySupervisor,
)
from supervisor.core.machine import Machine, UnitPolicy

_TIMER_SLACK_S = 0.01


class StartupVerdict(StrEnum):
    """Where the supervisor's own start-up stands, for READY=1 and for failing fast.

    ``waiting``: some group may still come up. ``ready``: every group is ready, or
    held down by an operator. ``degraded``: every group is ready, held or failed for
    good, and at least one serves. ``hopeless``: nothing serves, and every group that
    is not held is failed for good: no restart will bring one up.
    """

    WAITING = "waiting"
    READY = "ready"
    DEGRADED = "degraded"
    HOPELESS = "hopeless"


def _up(group: list[Machine]) -> bool:
    return any(m.state is UnitState.READY or m.held_by_operator for m in group)


# The states a unit sits in until something starts it.
_DORMANT = frozenset({UnitState.FAILED, UnitState.STOPPED, UnitState.STANDBY})


class Role(StrEnum):
    EAGLE3 = "eagle3"
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True, slots=True)
class PairPolicy:
    oom_exits: int = 2
    window_s: float = 900.0
    retry_preferred_after_s: float = 3600.0  # 0: only an operator's RetryPreferred


@dataclass(frozen=True, slots=True)
class UnitSpec:
    name: str
    role: Role
    fallback: str | None = None


@dataclass(frozen=True, slots=True)
class Observed:
    """What the daemon found for a unit at start-up, for ``Supervisor.rediscover``."""

    active_state: str
    health_ok: bool = False
    probe_ok: bool = False
    sampling_backend: SamplingBackend = SamplingBackend.FLASHINFER
    operator_stopped: bool = False  # an operator stopped it and nobody has started it since
    # This supervisor has not seen the FlashInfer cache warm yet (see Machine.rediscover).
    cache_unverified: bool = False


@dataclass(frozen=True, slots=True)
class Command:
    """An action for one unit."""

    unit: str
    action: Action


@dataclass(frozen=True, slots=True)
class RetryPreferred(Event):
    """Try the preferred unit again (send it with the preferred unit's name)."""

    by: Initiator = Initiator.SUPERVISOR


@dataclass(frozen=True, slots=True)
class SwitchToFallback(Action):
    """The preferred unit went to standby and its fallback is being started."""

    from_: str
    to: str
    reason: str


@dataclass(frozen=True, slots=True)
class SwitchToPreferred(Action):
    """The preferred unit is being tried again; its fallback will be stopped."""

    from_: str
    to: str
    by: Initiator


@dataclass(slots=True)
class _Pair:
    preferred: str
    fallback: str
    oom_exits: deque[float] = field(default_factory=deque)
    engaged: bool = False
    probation: bool = False
    retry_at: float | None = None
    held: dict[str, StartUnit] = field(default_factory=dict)

    def partner(self, unit: str) -> str:
        return self.fallback if unit == self.preferred else self.preferred


class Supervisor:
    """Every managed unit's machine, and the preferred/fallback rules between them."""

    def __init__(
        self,
        specs: Iterable[UnitSpec],
        unit_policy: UnitPolicy,
        pair_policy: PairPolicy,
        *,
        now: float = 0.0,
        machines: Mapping[str, Machine] | None = None,
    ) -> None:
        self.specs = tuple(specs)
        self.pair_policy = pair_policy
        self._machines = {
            s.name: (machines or {}).get(s.name) or Machine(s.name, unit_policy, now=now)
            for s in self.specs
        }
        self._pairs: dict[str, _Pair] = {}
        for spec in self.specs:
            if spec.fallback is not None:
                if spec.fallback not in self._machines:
                    raise ValueError(f"{spec.name}: fallback {spec.fallback!r} is not a unit")
                pair = _Pair(spec.name, spec.fallback)
                self._pairs[spec.name] = self._pairs[spec.fallback] = pair

    @classmethod
    def rediscover(
        cls,
        specs: Iterable[UnitSpec],
        unit_policy: UnitPolicy,
        pair_policy: PairPolicy,
        observed: Mapping[str, Observed],
        *,
        now: float,
    ) -> tuple[Supervisor, tuple[Command, ...]]:
        """Rebuild from what systemd and the probe say now; restart nothing healthy.

        A fallback found running while its preferred unit is down means the
        fallback was engaged: the preferred unit goes to standby. Call
        ``start(now)`` afterwards to start the units that should run and do not.
        """
        specs = tuple(specs)
        machines: dict[str, Machine] = {}
        out: list[Command] = []
        for spec in specs:
            seen = observed.get(spec.name, Observed("inactive"))
            machine, actions = Machine.rediscover(
                spec.name,
                unit_policy,
                now=now,
                active_state=seen.active_state,
                health_ok=seen.health_ok,
                probe_ok=seen.probe_ok,
                sampling_backend=seen.sampling_backend,
                operator_stopped=seen.operator_stopped,
                cache_unverified=seen.cache_unverified,
            )
            machines[spec.name] = machine
            out.extend(Command(spec.name, a) for a in actions)
        supervisor = cls(specs, unit_policy, pair_policy, now=now, machines=machines)
        for pair in supervisor._unique_pairs():
            pref, fb = machines[pair.preferred], machines[pair.fallback]
            if fb.running and not pref.running:
                out.extend(supervisor._feed(pref, StopRequested(standby=True), now))
                pair.engaged = True
                out.extend(supervisor._arm_retry(pair, now))
            elif fb.running and pref.running:
                out.append(
                    Command(
                        pair.preferred,
                        NotifyStatus(
                            Severity.ERROR,
                            f"{pair.preferred} and its fallback {pair.fallback} are both "
                            "running; stopping the fallback (check Conflicts= in the units)",
                        ),
                    )
                )
                out.extend(supervisor._feed(fb, StopRequested(), now))
        return supervisor, tuple(out)

    # --- reading --------------------------------------------------------------

    @property
    def machines(self) -> Mapping[str, Machine]:
        return MappingProxyType(self._machines)

    def fallback_engaged(self, unit: str) -> bool:
        """True while ``unit`` (a preferred unit) is set aside for its fallback."""
        pair = self._pairs.get(unit)
        return pair is not None and pair.preferred == unit and pair.engaged

    def _groups(self) -> list[list[Machine]]:
        """Each unit that should serve, with its fallback: either of them serves."""
        fallbacks = {s.fallback for s in self.specs if s.fallback}
        return [
            [self._machines[n] for n in (s.name, s.fallback) if n]
            for s in self.specs
            if s.name not in fallbacks
        ]

    def groups_serving(self) -> dict[str, tuple[tuple[str, ...], bool]]:
        """Each group that should serve, by its preferred unit: its units, and whether
        one of them is ready now."""
        return {
            g[0].name: (tuple(m.name for m in g), any(m.state is UnitState.READY for m in g))
            for g in self._groups()
        }

    def serving_ready(self) -> bool:
        """Every unit that should serve is ready (for a pair, either of the two)."""
        return all(any(m.state is UnitState.READY for m in g) for g in self._groups())

    def startup_verdict(self) -> StartupVerdict:
        """Where start-up stands (see ``StartupVerdict``). A group is *failed for good*
        when only an operator (SIGUSR1, a start, a reset) brings one of its units back
        (``_failed_for_good``): waiting for it would only wait out systemd's
        TimeoutStartSec."""
        groups = self._groups()
        if all(_up(g) for g in groups):
            return StartupVerdict.READY
        if not all(_up(g) or self._failed_for_good(g) for g in groups):
            return StartupVerdict.WAITING
        if any(m.state is UnitState.READY for g in groups for m in g):
            return StartupVerdict.DEGRADED
        return StartupVerdict.HOPELESS

    def failed_for_good(self) -> list[tuple[str, str]]:
        """(unit, reason) for each failed unit of a group that is failed for good."""
        return [
            (m.name, m.reason or "failed")
            for g in self._groups()
            if self._failed_for_good(g)
            for m in g
            if m.state is UnitState.FAILED
        ]

    def _failed_for_good(self, group: list[Machine]) -> bool:
        """No unit of ``group`` will start again unless an operator acts: each is failed,
        or idle with nothing to start it (a fallback the supervisor will not engage onto
        a driver that needs a person, say), and no retry or held start is pending."""
        if not any(m.state is UnitState.FAILED for m in group):
            return False
        if any(m.held_by_operator or m.state not in _DORMANT for m in group):
            return False
        pair = self._pairs.get(group[0].name)
        return pair is None or (pair.retry_at is None and not pair.held)

    def update_policies(self, unit_policy: UnitPolicy, pair_policy: PairPolicy) -> None:
        """Adopt reloaded numbers (SIGHUP). They apply from each machine's next
        decision; timers already armed keep the deadlines they were armed with."""
        for machine in self._machines.values():
            machine.policy = unit_policy
        self.pair_policy = pair_policy

    # --- driving --------------------------------------------------------------

    def start(self, now: float) -> tuple[Command, ...]:
        """Start every stopped unit that should serve: not fallbacks, not standby,
        not one an operator stopped."""
        out: list[Command] = []
        for spec in self.specs:
            pair = self._pairs.get(spec.name)
            machine = self._machines[spec.name]
            if machine.state is not UnitState.STOPPED or machine.running:
                continue
            if machine.held_by_operator:
                continue
            if pair is not None and (spec.name == pair.fallback or pair.engaged):
                continue
            out.extend(self._feed(machine, StartRequested(), now))
        return self._settle(out, now)

    def handle(self, unit: str, event: Event, now: float) -> tuple[Command, ...]:
        """Apply ``event`` to ``unit`` and to the pair rules; return the commands."""
        machine = self._machines.get(unit)
        if machine is None:
            raise KeyError(f"unknown unit {unit!r}")
        pair = self._pairs.get(unit)
        if isinstance(event, RetryPreferred):
            if pair is None or pair.preferred != unit:
                raise IllegalEvent(machine.state, event, f": {unit} has no fallback")
            if machine.state is not UnitState.STANDBY:
                raise IllegalEvent(machine.state, event, ": the preferred unit is not in standby")
            return self._settle(self._retry(pair, now, event.by), now)
        if isinstance(event, TimerFired) and event.timer is Timer.RETRY_PREFERRED:
            if pair is None or pair.preferred != unit:
                raise IllegalEvent(machine.state, event, f": {unit} has no fallback")
            due = pair.retry_at
            if due is None or now < due - _TIMER_SLACK_S:
                return ()  # cancelled or re-armed: a stale timer
            pair.retry_at = None
            if machine.state is not UnitState.STANDBY:
                return ()
            return self._settle(self._retry(pair, now, Initiator.SUPERVISOR), now)
        out = list(self._feed(machine, event, now))
        if pair is not None:
            out.extend(self._react(pair, unit, event, now))
        return self._settle(out, now)

    # --- pair rules -----------------------------------------------------------

    def _react(self, pair: _Pair, unit: str, event: Event, now: float) -> list[Command]:
        pref, fb = self._machines[pair.preferred], self._machines[pair.fallback]
        out: list[Command] = []
        if unit == pair.preferred:
            if pair.engaged and pref.state not in (UnitState.STANDBY, UnitState.FAILED):
                pair.engaged = False  # an operator brought it back (start, reset or stop)
                out.extend(self._disarm_retry(pair))
            if pref.state is UnitState.FAILED and pref.needs_person:
                return out + self._gpus_down(pair, event, now)
            if pair.probation and pref.state is UnitState.READY:
                pair.probation = False
            elif pair.probation and pref.state in (UnitState.BACKOFF, UnitState.FAILED):
                pair.probation = False
                out.extend(self._engage(pair, now, "it failed again after a retry"))
                return out
            if isinstance(event, UnitExited) and CAUSES[event.cause].oom:
                window = self.pair_policy.window_s
                pair.oom_exits.append(now)
                while pair.oom_exits and pair.oom_exits[0] <= now - window:
                    pair.oom_exits.popleft()
                count = len(pair.oom_exits)
                if count >= self.pair_policy.oom_exits and not pair.engaged:
                    why = f"{count} {event.cause} exits within {window:g} s"
                    out.extend(self._engage(pair, now, why))
                    return out
            limit = pref.policy.max_failures
            if (
                pref.state is UnitState.BACKOFF
                and pref.failures_unready >= limit
                and not pair.engaged
            ):
                # Each attempt outlasts what the failure window holds (a load past its
                # deadline): the window never fails it, and nothing would serve.
                why = f"{pref.failures_unready} failures in a row without getting ready"
                out.extend(self._engage(pair, now, why))
                return out
            if pref.state is UnitState.FAILED and not pref.refused and not pair.engaged:
                out.extend(self._engage(pair, now, "it is failed"))
        elif fb.state is UnitState.FAILED and fb.needs_person:
            # The same GPUs: the preferred unit would die there too. No retry either.
            out.extend(self._disarm_retry(pair))
        elif pair.engaged and fb.state is UnitState.FAILED and pref.state is UnitState.STANDBY:
            out.extend(self._retry(pair, now, Initiator.SUPERVISOR))
        return out

    def _gpus_down(self, pair: _Pair, event: Event, now: float) -> list[Command]:
        """The preferred unit failed for a fault of the GPUs' own: its fallback, on the
        same GPUs, is neither started nor left running, until an operator resets it."""
        fb = self._machines[pair.fallback]
        out: list[Command] = []
        if isinstance(event, (UnitExited, UnitStoppedBySupervisor, GpuFaultSeen)):
            what = event.summary if isinstance(event, GpuFaultSeen) else event.cause
            msg = (
                f"{pair.preferred}: failed for a fault of the GPUs' own ({what}); "
                f"its fallback {pair.fallback} shares those GPUs and is not run until an "
                "operator resets the unit (SIGUSR1)"
            )
            out.append(Command(pair.preferred, NotifyStatus(Severity.ERROR, msg)))
        pair.probation = False
        pair.held.pop(pair.fallback, None)
        if pair.engaged or fb.running:
            pair.engaged = False
            out.extend(self._disarm_retry(pair))
            if fb.state not in (UnitState.FAILED, UnitState.STOPPED) or fb.running:
                out.extend(self._feed(fb, StopRequested(), now))
        return out

    def _engage(self, pair: _Pair, now: float, why: str) -> list[Command]:
        pref, fb = self._machines[pair.preferred], self._machines[pair.fallback]
        if fb.state is UnitState.FAILED:
            msg = f"{pair.preferred}: {why}, but its fallback {pair.fallback} is failed"
            return [Command(pair.preferred, NotifyStatus(Severity.ERROR, msg))]
        out: list[Command] = []
        if pref.state is not UnitState.FAILED:
            out.extend(self._feed(pref, StopRequested(standby=True), now))
        pair.engaged = True
        pair.oom_exits.clear()
        out.append(Command(pair.preferred, SwitchToFallback(pair.preferred, pair.fallback, why)))
        out.append(
            Command(
                pair.preferred,
                NotifyStatus(
                    Severity.WARNING,
                    f"{pair.preferred}: {why}; switching to fallback {pair.fallback}",
                ),
            )
        )
        if fb.state in (UnitState.STOPPED, UnitState.STANDBY) and not fb.running:
            out.extend(self._feed(fb, StartRequested(), now))
        if pref.state is UnitState.STANDBY:
            out.extend(self._arm_retry(pair, now))
        return out

    def _retry(self, pair: _Pair, now: float, by: Initiator) -> list[Command]:
        out = list(self._disarm_retry(pair))
        pair.engaged = False
        pair.probation = True
        out.append(Command(pair.preferred, SwitchToPreferred(pair.preferred, pair.fallback, by)))
        # Warm-up runs while the fallback still serves; the gate in _settle
        # stops the fallback only when the preferred unit's start is due.
        out.extend(self._feed(self._machines[pair.preferred], StartRequested(by), now))
        return out

    def _arm_retry(self, pair: _Pair, now: float) -> list[Command]:
        after = self.pair_policy.retry_preferred_after_s
        if after <= 0:
            return []
        pair.retry_at = now + after
        return [Command(pair.preferred, ScheduleTimer(Timer.RETRY_PREFERRED, pair.retry_at))]

    def _disarm_retry(self, pair: _Pair) -> list[Command]:
        if pair.retry_at is None:
            return []
        pair.retry_at = None
        return [Command(pair.preferred, CancelTimer(Timer.RETRY_PREFERRED))]

    # --- the gate: never both units of a pair running ---------------------------

    def _settle(self, commands: list[Command], now: float) -> tuple[Command, ...]:
        """Hold back starts whose partner may be running; release those now clear."""
        out: list[Command] = []
        queue = list(commands)
        while queue:
            cmd = queue.pop(0)
            pair = self._pairs.get(cmd.unit)
            if pair is None or not isinstance(cmd.action, StartUnit):
                out.append(cmd)
                continue
            partner = self._machines[pair.partner(cmd.unit)]
            if not partner.running:
                out.append(cmd)
                continue
            pair.held[cmd.unit] = cmd.action
            if partner.state is not UnitState.FAILED:
                standby = partner.name == pair.preferred
                queue.extend(self._feed(partner, StopRequested(standby=standby), now))
            elif partner.refused:
                msg = (
                    f"{cmd.unit}: not starting while {partner.name} runs outside the "
                    f"supervisor's control ({partner.reason})"
                )
                out.append(Command(cmd.unit, NotifyStatus(Severity.ERROR, msg)))
        for pair in self._unique_pairs():
            for unit, start in list(pair.held.items()):
                machine = self._machines[unit]
                if machine.state is not UnitState.STARTING or not machine.running:
                    del pair.held[unit]  # the start was abandoned meanwhile
                elif not self._machines[pair.partner(unit)].running:
                    del pair.held[unit]
                    out.append(Command(unit, start))
        return tuple(out)

    def _feed(self, machine: Machine, event: Event, now: float) -> list[Command]:
        return [Command(machine.name, a) for a in machine.handle(event, now)]

    def _unique_pairs(self) -> list[_Pair]:
        seen: dict[int, _Pair] = {}
        for pair in self._pairs.values():
            seen.setdefault(id(pair), pair)
        return list(seen.values())
