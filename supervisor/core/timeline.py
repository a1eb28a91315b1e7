"""Where a start's time goes: one timeline per start, from the supervisor's side (pure).

The daemon tells ``Timelines`` every state a unit enters, with the monotonic and
wall clocks, and every exit. When the unit becomes ready, ``ready`` hands back
the start that just ended, phase by phase:

- ``backoff``: waiting out the restart backoff (a recovery only);
- ``warm-up``: the FlashInfer warm-up before the start, or the wait for an
  overlapped one after the load;
- ``start job``: systemd's start job;
- ``load``: from the start until ``/health`` answers (the model loading);
- ``probe``: the sampled probe;
- ``coverage``: the coverage warm-up's request shapes.

and, when the unit was ready before and an exit ended that, the recovery: from
the exit to READY again, with its cause. The server's own account of the load
(``core.startup_log``) is joined in by the daemon, which reads the unit's output.
Unknown phases are ``None``, never zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from supervisor.core.causes import ExitCause
from supervisor.core.events import UnitState
from supervisor.core.startup_log import ServerTimings

SUPERVISOR_PHASES = ("backoff", "warm-up", "start job", "load", "probe", "coverage")
# Which state's time is which phase (probing holds the probe and the coverage).
_STATE_PHASE = {
    UnitState.BACKOFF: "backoff",
    UnitState.WARMING: "warm-up",
    UnitState.STARTING: "start job",
    UnitState.LOADING: "load",
    UnitState.PROBING: "probe",
}
# States a start begins from: the time before them is not part of the start.
_IDLE = frozenset({UnitState.STOPPED, UnitState.FAILED, UnitState.STANDBY, UnitState.BACKOFF})


@dataclass(frozen=True, slots=True)
class StartTimeline:
    unit: str
    kind: str  # "start" (from the start's first step) or "recovery" (from the exit)
    began_at: datetime
    ready_at: datetime
    total_s: float
    phases: dict[str, float | None]
    cause: ExitCause | None = None  # the exit a recovery recovered from
    overlapped_warmup_s: float | None = None  # a warm-up that ran beside the load
    server: ServerTimings | None = None

    def with_server(self, server: ServerTimings) -> StartTimeline:
        return replace(self, server=server)

    def all_phases(self) -> dict[str, float | None]:
        """The supervisor's phases, then the server's own (``server_*``)."""
        out = dict(self.phases)
        if self.server is not None:
            out.update(self.server.phases())
        return out

    def to_json(self) -> dict[str, Any]:
        def stamp(at: datetime) -> str:
            return at.astimezone(UTC).isoformat().replace("+00:00", "Z")

        return {
            "kind": self.kind,
            "began_at": stamp(self.began_at),
            "ready_at": stamp(self.ready_at),
            "total_s": round(self.total_s, 3),
            "cause": None if self.cause is None else str(self.cause),
            "phases_s": {k: None if v is None else round(v, 3) for k, v in self.phases.items()},
            "overlapped_warmup_s": (
                None if self.overlapped_warmup_s is None else round(self.overlapped_warmup_s, 3)
            ),
            "server": None if self.server is None else self.server.to_json(),
        }


@dataclass
class _Segment:
    state: UnitState
    mono: float
    wall: datetime


@dataclass
class _Unit:
    segments: list[_Segment] = field(default_factory=list)
    was_ready: bool = False
    exit_cause: ExitCause | None = None
    exit_mono: float | None = None
    exit_wall: datetime | None = None


class Timelines:
    """Per unit, the states since it was last ready; a timeline at each READY."""

    def __init__(self) -> None:
        self._units: dict[str, _Unit] = {}

    def entered(self, unit: str, state: UnitState, mono: float, wall: datetime) -> None:
        u = self._units.setdefault(unit, _Unit())
        if u.segments and u.segments[-1].state is UnitState.READY and state is not UnitState.READY:
            u.segments = []  # a new life after READY
        u.segments.append(_Segment(state, mono, wall))

    def exited(self, unit: str, cause: ExitCause, mono: float, wall: datetime) -> None:
        """An exit; it starts a recovery only when it ended a ready unit."""
        u = self._units.setdefault(unit, _Unit())
        ready = bool(u.segments) and u.segments[-1].state is UnitState.READY
        if ready or (u.was_ready and u.exit_mono is None):
            u.exit_cause, u.exit_mono, u.exit_wall = cause, mono, wall

    def ready(
        self,
        unit: str,
        mono: float,
        wall: datetime,
        *,
        coverage_s: float | None = None,
        overlapped_warmup_s: float | None = None,
    ) -> tuple[StartTimeline | None, StartTimeline | None]:
        """The start that just ended in READY, and the recovery it closes (if any)."""
        u = self._units.setdefault(unit, _Unit())
        segments = [s for s in u.segments if s.state is not UnitState.READY]
        start = _start(unit, segments, mono, wall, coverage_s, overlapped_warmup_s)
        recovery = None
        if u.exit_mono is not None and u.exit_wall is not None:
            since = [s for s in segments if s.mono >= u.exit_mono]
            recovery = _timeline(
                unit, "recovery", since, u.exit_mono, u.exit_wall, mono, wall,
                coverage_s, overlapped_warmup_s, cause=u.exit_cause,
            )  # fmt: skip
        u.was_ready = True
        u.exit_cause = u.exit_mono = u.exit_wall = None
        u.segments = [_Segment(UnitState.READY, mono, wall)]
        return start, recovery


def _start(
    unit: str,
    segments: list[_Segment],
    mono: float,
    wall: datetime,
    coverage_s: float | None,
    overlapped_warmup_s: float | None,
) -> StartTimeline | None:
    """From the first step of the last start (after the last idle state) to READY."""
    begin = None
    for index, segment in enumerate(segments):
        if segment.state in _IDLE:
            begin = None
        elif begin is None:
            begin = index
    if begin is None:
        return None
    first = segments[begin]
    return _timeline(
        unit, "start", segments[begin:], first.mono, first.wall, mono, wall,
        coverage_s, overlapped_warmup_s,
    )  # fmt: skip


def _timeline(
    unit: str,
    kind: str,
    segments: list[_Segment],
    began_mono: float,
    began_wall: datetime,
    mono: float,
    wall: datetime,
    coverage_s: float | None,
    overlapped_warmup_s: float | None,
    *,
    cause: ExitCause | None = None,
) -> StartTimeline:
    spent: dict[str, float] = {}
    bounds = [*(s.mono for s in segments[1:]), mono]
    before = segments[0].mono - began_mono if segments else mono - began_mono
    for segment, end in zip(segments, bounds, strict=True):
        phase = _STATE_PHASE.get(segment.state)
        if phase is None:
            continue
        spent[phase] = spent.get(phase, 0.0) + max(0.0, end - max(segment.mono, began_mono))
    if kind == "recovery" and before > 0:
        spent["backoff"] = spent.get("backoff", 0.0) + before  # the exit to the first state
    # A phase the start did not go through took no time; the coverage warm-up is
    # left out where none ran, and the probe's share is what the coverage did not take.
    phases: dict[str, float | None] = {}
    for name in SUPERVISOR_PHASES:
        if name == "backoff" and kind == "start":
            continue
        if name == "coverage":
            if coverage_s is not None:
                phases[name] = coverage_s
            continue
        phases[name] = spent.get(name, 0.0)
    if coverage_s is not None:
        phases["probe"] = max(0.0, (phases.get("probe") or 0.0) - coverage_s)
    return StartTimeline(
        unit=unit,
        kind=kind,
        began_at=began_wall,
        ready_at=wall,
        total_s=max(0.0, mono - began_mono),
        phases=phases,
        cause=cause,
        overlapped_warmup_s=overlapped_warmup_s,
    )


def compact(timeline: Mapping[str, Any]) -> list[str]:
    """One short line per phase of a ``to_json()`` timeline, for ``k26-supervisor status``."""
    lines = []
    phases = timeline.get("phases_s") or {}
    for name, seconds in phases.items():
        lines.append(f"{name:<10} {'unknown' if seconds is None else f'{seconds:8.2f} s'}")
    if timeline.get("overlapped_warmup_s") is not None:
        lines.append(f"{'warm-up beside the load':<10} {timeline['overlapped_warmup_s']:8.2f} s")
    server = timeline.get("server") or {}
    if server:
        labels = (
            ("load_weight_s", "server: weights"),
            ("kv_cache_allocation_s", "server: KV cache"),
            ("scheduler_e2e_s", "server: scheduler"),
            ("tokenizer_e2e_s", "server: tokenizer"),
        )
        for key, label in labels:
            value = server.get(key)
            lines.append(f"{label:<10} {'unknown' if value is None else f'{value:8.2f} s'}")
        for kind, value in (server.get("cuda_graph_s") or {}).items():
            if value:
                lines.append(f"{'server: graph ' + kind:<10} {value:8.2f} s")
        for line in (server.get("jit_lines") or [])[:5]:
            lines.append(f"server JIT: {line[:100]}")
    return lines
