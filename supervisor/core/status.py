"""The daemon's observable state: what /status shows and what /metrics counts.

Pure: frozen dataclasses for snapshots (their ``to_json()`` is the /status
schema in docs/architecture.md) and ``StatusBoard``, the one mutable holder the
daemon updates and the HTTP server and metrics collector read. No I/O here.

The board is not thread-safe: update it and read it from the event loop thread
(the HTTP server renders /status and /metrics there).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from supervisor.core.bundle_use import BundleUse, Served
from supervisor.core.causes import ExitCause
from supervisor.core.coverage import CoverageReport
from supervisor.core.events import UnitState
from supervisor.core.jit_caches import JitCache
from supervisor.core.timeline import StartTimeline

# Contract spellings (docs/architecture.md): alerts and dashboards key on them.
# The spellings /status and the metrics use: the enums' own, nothing to keep in step.
UNIT_STATES: tuple[UnitState, ...] = tuple(UnitState)
EXIT_CAUSES: tuple[ExitCause, ...] = tuple(ExitCause)
PROBE_FAILURE_REASONS: tuple[str, ...] = (
    "connect-refused",
    "http-status",
    "timeout",
    "malformed",
    "server-died",
    "coverage",  # a shape of the coverage warm-up failed (core/coverage.py)
)
# The JIT caches a unit writes (core/jit_caches.py), for k26_jit_after_ready_total.
JIT_CACHES: tuple[str, ...] = tuple(str(cache) for cache in JitCache)
JIT_AFTER_READY_KEPT = 20  # the newest artifacts shown per unit in /status
# A phase of a start: seconds (a probe) to half an hour (a cold load on 8 GPUs).
START_PHASE_BUCKETS_S: tuple[float, ...] = (
    0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
)  # fmt: skip


def phase_label(name: str) -> str:
    """A timeline phase as the metric's ``phase`` label: ``start job`` -> ``start_job``."""
    return name.replace("-", "").replace(" ", "_")


WARMUP_RESULTS: tuple[str, ...] = ("warm", "built", "failed")
# What a warm-up's registry pull came to (a pull the registry was not asked for, every
# cache warm, is none): caches installed; the registry's bundle already here; none for
# this node; refused (unsigned, mis-signed, rolled back, not this node's, a hostile
# archive: nothing written); failed (the registry, the disk).
BUNDLE_PULL_RESULTS: tuple[str, ...] = ("installed", "current", "absent", "refused", "failed")

# A sampled generation of a few tokens: milliseconds when healthy, seconds when not.
PROBE_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# A FlashInfer JIT build takes minutes; a warm cache check takes seconds.
WARMUP_DURATION_BUCKETS_S: tuple[float, ...] = (
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)  # fmt: skip


K = TypeVar("K")
V = TypeVar("V")


def utc_now() -> datetime:
    return datetime.now(UTC)


def iso8601(at: datetime | None) -> str | None:
    """UTC ISO 8601 with a 'Z'. Naive datetimes are taken to be UTC already."""
    if at is None:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class ExitInfo:
    cause: ExitCause
    at: datetime
    main_pid: int | None
    exit_code: int | None
    signal: int | None
    evidence: tuple[str, ...] = ()
    summary: str = ""  # the classifier's one line: what happened and what to do

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": str(self.cause),
            "summary": self.summary,
            "at": iso8601(self.at),
            "main_pid": self.main_pid,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "evidence": list(self.evidence),
        }


@dataclass(frozen=True, slots=True)
class ProbeInfo:
    ok: bool
    at: datetime
    latency_ms: float | None
    error: str | None = None
    completion_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "at": iso8601(self.at),
            "latency_ms": self.latency_ms,
            "error": self.error,
            "completion_tokens": self.completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class JitArtifactInfo:
    """A file a JIT cache gained while the unit was ready: something compiled under
    live traffic that READY should have covered."""

    cache: str
    kernel: str
    path: str
    at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "cache": self.cache,
            "kernel": self.kernel,
            "path": self.path,
            "at": iso8601(self.at),
        }


@dataclass(frozen=True, slots=True)
class UnitStatus:
    name: str
    role: str
    state: UnitState
    ready: bool
    since: datetime
    restarts: int = 0
    main_pid: int | None = None
    active_state: str = "unknown"
    fallback_engaged: bool = False
    sampling_backend: str = "flashinfer"
    last_exit: ExitInfo | None = None
    last_probe: ProbeInfo | None = None
    # Why the unit is in its state, for a person (None when there is nothing to say).
    reason: str | None = None
    # An operator stopped it: the supervisor leaves it down until an operator acts.
    held_by_operator: bool = False
    # Failed for a fault of the GPUs' own: a person must act, and its fallback (on the
    # same GPUs) is not started meanwhile.
    needs_person: bool = False
    # Monotonic seconds when the unit last stopped being ready; None while ready.
    not_ready_since: float | None = None
    # The warm-up plan of its latest start (core/warmup_plan.py) and why.
    warmup_mode: str | None = None
    warmup_why: str | None = None
    # The last coverage warm-up (core/coverage.py), and what compiled after READY.
    coverage: CoverageReport | None = None
    jit_after_ready: tuple[JitArtifactInfo, ...] = ()
    jit_after_ready_count: int = 0
    jit_watched: tuple[str, ...] = ()  # the cache directories watched while ready
    # What compiled after READY on earlier starts, replayed by the coverage
    # (adapters/learned_shapes.py status_json); None before the record is read.
    learned_shapes: Mapping[str, Any] | None = None
    # Where the last start's time went, and the last recovery's (exit to READY).
    last_start: StartTimeline | None = None
    last_recovery: StartTimeline | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "state": str(self.state),
            "ready": self.ready,
            "since": iso8601(self.since),
            "restarts": self.restarts,
            "main_pid": self.main_pid,
            "active_state": self.active_state,
            "fallback_engaged": self.fallback_engaged,
            "sampling_backend": self.sampling_backend,
            "reason": self.reason,
            "held_by_operator": self.held_by_operator,
            "needs_person": self.needs_person,
            "warmup": (
                None
                if self.warmup_mode is None
                else {"mode": self.warmup_mode, "why": self.warmup_why}
            ),
            "last_exit": None if self.last_exit is None else self.last_exit.to_json(),
            "last_probe": None if self.last_probe is None else self.last_probe.to_json(),
            "coverage": None if self.coverage is None else self.coverage.to_json(),
            "jit_after_ready": {
                "count": self.jit_after_ready_count,
                "watched": list(self.jit_watched),
                "latest": [a.to_json() for a in self.jit_after_ready],
            },
            "learned_shapes": None if self.learned_shapes is None else dict(self.learned_shapes),
            "last_start": None if self.last_start is None else self.last_start.to_json(),
            "last_recovery": None if self.last_recovery is None else self.last_recovery.to_json(),
        }


@dataclass(frozen=True, slots=True)
class WarmupInfo:
    arch: str
    state: str
    at: datetime | None = None
    error: str | None = None
    duration_s: float | None = None  # a finished warm-up's wall time
    # The plan of the latest start that warms (overlapped, sequential, ...), and why.
    mode: str | None = None
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "state": self.state,
            "at": iso8601(self.at),
            "error": self.error,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
            "mode": self.mode,
            "why": self.why,
        }


@dataclass(frozen=True, slots=True)
class ServingInfo:
    """One group that should serve (a unit, with its fallback if it has one): whether
    one of its units is ready now, and the seconds it has had none since start-up."""

    units: tuple[str, ...]
    serving: bool
    unserved_s: float
    unserved_since: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "units": list(self.units),
            "serving": self.serving,
            "unserved_s": round(self.unserved_s, 3),
            "unserved_since": iso8601(self.unserved_since),
        }


@dataclass(slots=True)
class _Unserved:
    units: tuple[str, ...]
    total_s: float = 0.0
    since: float | None = None  # monotonic, while nothing of the group serves
    since_wall: datetime | None = None


@dataclass(frozen=True, slots=True)
class SupervisorStatus:
    ready: bool
    version: str
    started_at: datetime
    pid: int
    config_path: str
    units: Mapping[str, UnitStatus]
    warmup: WarmupInfo | None = None
    serving: Mapping[str, ServingInfo] = field(default_factory=dict)
    bundle: BundleUse | None = None  # the latest pulled bundle, and whether it was used

    def to_json(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "supervisor": {
                "version": self.version,
                "started_at": iso8601(self.started_at),
                "pid": self.pid,
                "config": self.config_path,
            },
            "units": {name: unit.to_json() for name, unit in self.units.items()},
            "serving": {name: info.to_json() for name, info in self.serving.items()},
            "warmup": None if self.warmup is None else self.warmup.to_json(),
            "bundle": None if self.bundle is None else self.bundle.to_json(),
        }


@dataclass(slots=True)
class HistogramCounts:
    """Bucket counts for one histogram series, kept as plain numbers."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, last one is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing: {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, ending with (inf, count)."""
        running = 0
        pairs: list[tuple[float, int]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            pairs.append((bound, running))
        return pairs


def _check(value: str, allowed: Iterable[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


class _ReadOnly(Generic[K, V]):
    """``board.NAME``: a read-only view of the board's own ``board._NAME``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._own = f"_{name}"

    def __get__(self, board: object, owner: type | None = None) -> Mapping[K, V]:
        return MappingProxyType(getattr(board, self._own))


class StatusBoard:
    """The daemon's state and counters. The daemon writes; /status and /metrics read."""

    def __init__(
        self,
        *,
        version: str,
        config_path: str,
        pid: int | None = None,
        started_at: datetime | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = utc_now,
        probe_latency_buckets_s: tuple[float, ...] = PROBE_LATENCY_BUCKETS_S,
        warmup_duration_buckets_s: tuple[float, ...] = WARMUP_DURATION_BUCKETS_S,
    ) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self.version = version
        self.config_path = config_path
        self.pid = os.getpid() if pid is None else pid
        self.started_at = wall() if started_at is None else started_at
        self._ready = False
        self._units: dict[str, UnitStatus] = {}
        self._warmup: WarmupInfo | None = None
        self._bundle: BundleUse | None = None
        self._bundle_served: Served | None = None
        self._plan: tuple[str, str | None] | None = None
        self._probe_buckets = probe_latency_buckets_s
        self._warmup_buckets = warmup_duration_buckets_s
        # Counters: keys exist from the moment a unit or arch is known, at zero,
        # so that increase() in alerts works from the first scrape.
        self._exits: dict[tuple[str, str], int] = {}
        self._probe_failures: dict[tuple[str, str], int] = {}
        self._probe_latency: dict[str, HistogramCounts] = {}
        self._warmups: dict[tuple[str, str], int] = {}
        self._bundle_pulls: dict[str, int] = {}
        self._warmup_duration: dict[str, HistogramCounts] = {}
        self._warmup_last_ok: dict[str, bool] = {}
        self._jit_after_ready: dict[tuple[str, str], int] = {}
        self._start_phases: dict[tuple[str, str], HistogramCounts] = {}
        self._unserved: dict[str, _Unserved] = {}

    # --- units ---------------------------------------------------------------

    def add_unit(self, name: str, role: str, *, state: UnitState = UnitState.STOPPED) -> None:
        _check(state, UNIT_STATES, "unit state")
        if name in self._units:
            raise ValueError(f"unit {name!r} is already on the board")
        self._units[name] = UnitStatus(
            name=name,
            role=role,
            state=UnitState(state),
            ready=False,
            since=self._wall(),
            not_ready_since=self._monotonic(),
        )
        for cause in EXIT_CAUSES:
            self._exits[(name, cause)] = 0
        for reason in PROBE_FAILURE_REASONS:
            self._probe_failures[(name, reason)] = 0
        self._probe_latency[name] = HistogramCounts(self._probe_buckets)
        for cache in JIT_CACHES:
            self._jit_after_ready[(name, cache)] = 0

    def unit(self, name: str) -> UnitStatus:
        try:
            return self._units[name]
        except KeyError:
            raise KeyError(f"unit {name!r} is not on the board") from None

    def set_state(self, name: str, state: UnitState) -> None:
        """Enter a state; ``since`` moves only when the state actually changes."""
        _check(state, UNIT_STATES, "unit state")
        state = UnitState(state)
        current = self.unit(name)
        if current.state != state:
            self._replace(name, state=state, since=self._wall())

    def set_systemd(self, name: str, *, active_state: str, main_pid: int | None) -> None:
        """What systemd last said about the unit (ActiveState, MainPID; 0 means none)."""
        self._replace(name, active_state=active_state, main_pid=main_pid or None)

    def set_fallback_engaged(self, name: str, engaged: bool) -> None:
        self._replace(name, fallback_engaged=engaged)

    def set_reason(
        self,
        name: str,
        reason: str | None,
        *,
        held_by_operator: bool,
        needs_person: bool = False,
    ) -> None:
        current = self.unit(name)
        now = (reason, held_by_operator, needs_person)
        if (current.reason, current.held_by_operator, current.needs_person) != now:
            self._replace(
                name, reason=reason, held_by_operator=held_by_operator, needs_person=needs_person
            )

    def set_serving(self, group: str, units: Iterable[str], serving: bool) -> None:
        """Whether a unit of ``group`` (named by its preferred unit) is ready now. The
        time with none is summed from the first call on (the daemon's start-up)."""
        entry = self._unserved.setdefault(group, _Unserved(tuple(units)))
        now = self._monotonic()
        if serving and entry.since is not None:
            entry.total_s += now - entry.since
            entry.since = entry.since_wall = None
        elif not serving and entry.since is None:
            entry.since, entry.since_wall = now, self._wall()

    def unserved_seconds(self, group: str) -> float:
        entry = self._unserved[group]
        running = 0.0 if entry.since is None else max(0.0, self._monotonic() - entry.since)
        return entry.total_s + running

    @property
    def serving(self) -> Mapping[str, ServingInfo]:
        return {
            group: ServingInfo(
                entry.units, entry.since is None, self.unserved_seconds(group), entry.since_wall
            )
            for group, entry in self._unserved.items()
        }

    def set_warmup_plan(self, name: str, mode: str | None, why: str | None) -> None:
        """The unit's warm-up plan; the latest one is also shown beside the warm-up."""
        current = self.unit(name)
        if (current.warmup_mode, current.warmup_why) == (mode, why):
            return
        self._replace(name, warmup_mode=mode, warmup_why=why)
        if mode is not None:
            self._plan = (mode, why)

    def set_sampling_backend(self, name: str, backend: str) -> None:
        self._replace(name, sampling_backend=backend)

    def record_exit(self, name: str, exit_info: ExitInfo) -> None:
        _check(exit_info.cause, EXIT_CAUSES, "exit cause")
        exit_info = dataclasses.replace(exit_info, cause=ExitCause(exit_info.cause))
        self._replace(name, last_exit=exit_info)
        self._exits[(name, exit_info.cause)] += 1

    def record_restart(self, name: str) -> None:
        self._replace(name, restarts=self.unit(name).restarts + 1)

    def record_probe(
        self, name: str, probe: ProbeInfo, *, failure_reason: str | None = None
    ) -> None:
        """A sampled probe's outcome. Failed probes need one of PROBE_FAILURE_REASONS."""
        self.unit(name)
        if probe.ok:
            if probe.latency_ms is not None:
                self._probe_latency[name].observe(probe.latency_ms / 1000.0)
        else:
            if failure_reason is None:
                raise ValueError("a failed probe needs a failure_reason")
            _check(failure_reason, PROBE_FAILURE_REASONS, "probe failure reason")
            self._probe_failures[(name, failure_reason)] += 1
        self._replace(name, last_probe=probe)

    def record_coverage(self, name: str, report: CoverageReport) -> None:
        self._replace(name, coverage=report)

    def set_jit_watched(self, name: str, directories: Iterable[str]) -> None:
        self._replace(name, jit_watched=tuple(directories))

    def set_learned_shapes(self, name: str, learned: Mapping[str, Any]) -> None:
        self._replace(name, learned_shapes=learned)

    def record_jit_after_ready(self, name: str, cache: str, kernel: str, path: str) -> None:
        _check(cache, JIT_CACHES, "JIT cache")
        unit = self.unit(name)
        artifact = JitArtifactInfo(cache, kernel, path, self._wall())
        kept = (*unit.jit_after_ready, artifact)[-JIT_AFTER_READY_KEPT:]
        self._jit_after_ready[(name, cache)] += 1
        self._replace(
            name, jit_after_ready=kept, jit_after_ready_count=unit.jit_after_ready_count + 1
        )

    def record_start(
        self, name: str, start: StartTimeline | None, recovery: StartTimeline | None
    ) -> None:
        """A start that ended in READY (and the recovery it closed): shown, and each
        known phase observed into ``k26_start_phase_seconds``."""
        changes: dict[str, Any] = {}
        if start is not None:
            changes["last_start"] = start
            for phase, seconds in start.all_phases().items():
                if seconds is not None:
                    self._observe_phase(name, phase, seconds)
        if recovery is not None:
            changes["last_recovery"] = recovery
            backoff = recovery.phases.get("backoff")
            if backoff is not None:
                self._observe_phase(name, "backoff", backoff)
        if changes:
            self._replace(name, **changes)

    def _observe_phase(self, name: str, phase: str, seconds: float) -> None:
        key = (name, phase_label(phase))
        if key not in self._start_phases:
            self._start_phases[key] = HistogramCounts(START_PHASE_BUCKETS_S)
        self._start_phases[key].observe(seconds)

    def _replace(self, name: str, **changes: Any) -> None:
        old = self.unit(name)
        new = dataclasses.replace(old, **changes)
        ready = new.state is UnitState.READY and new.last_probe is not None and new.last_probe.ok
        if ready:
            not_ready_since = None
        elif old.ready or old.not_ready_since is None:
            not_ready_since = self._monotonic()
        else:
            not_ready_since = old.not_ready_since
        self._units[name] = dataclasses.replace(new, ready=ready, not_ready_since=not_ready_since)

    # --- supervisor and warm-up ------------------------------------------------

    def set_ready(self, ready: bool) -> None:
        """Whether every serving unit is ready now (READY=1 is sent the first time)."""
        self._ready = ready

    def set_warmup(self, info: WarmupInfo) -> None:
        """Show a warm-up's progress (e.g. state 'running') without counting it."""
        self._declare_arch(info.arch)
        self._warmup = info

    def record_warmup(
        self, arch: str, result: str, duration_s: float, *, ok: bool, error: str | None = None
    ) -> None:
        """A finished warm-up: result is one of WARMUP_RESULTS; ok is the verification."""
        _check(result, WARMUP_RESULTS, "warm-up result")
        self._declare_arch(arch)
        self._warmups[(arch, result)] += 1
        self._warmup_duration[arch].observe(duration_s)
        self._warmup_last_ok[arch] = ok
        self._warmup = WarmupInfo(
            arch=arch, state=result, at=self._wall(), error=error, duration_s=duration_s
        )

    def declare_bundle_pulls(self) -> None:
        """A registry is configured: its pull results exist from now on, at zero."""
        for result in BUNDLE_PULL_RESULTS:
            self._bundle_pulls.setdefault(result, 0)

    def record_bundle_pull(self, result: str) -> None:
        """A registry pull's end: ``result`` is one of BUNDLE_PULL_RESULTS."""
        _check(result, BUNDLE_PULL_RESULTS, "bundle pull result")
        self.declare_bundle_pulls()
        self._bundle_pulls[result] += 1

    def set_bundle(self, use: BundleUse) -> None:
        """The latest pulled bundle, then its verdict (core/bundle_use.py)."""
        self._bundle = use

    @property
    def bundle(self) -> BundleUse | None:
        return self._bundle

    def set_bundle_served(self, served: Served) -> None:
        """What the registry gave at the latest pull that got a bundle, installed or
        already here. Apart from ``set_bundle``: a pull that installs nothing leaves
        the verdict of the pull that did alone."""
        self._bundle_served = served

    @property
    def bundle_served(self) -> Served | None:
        return self._bundle_served

    def _declare_arch(self, arch: str) -> None:
        if arch in self._warmup_duration:
            return
        for result in WARMUP_RESULTS:
            self._warmups[(arch, result)] = 0
        self._warmup_duration[arch] = HistogramCounts(self._warmup_buckets)
        self._warmup_last_ok[arch] = False

    # --- reading -------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    units = _ReadOnly[str, UnitStatus]()
    exits = _ReadOnly[tuple[str, str], int]()
    probe_failures = _ReadOnly[tuple[str, str], int]()
    probe_latency = _ReadOnly[str, HistogramCounts]()
    warmups = _ReadOnly[tuple[str, str], int]()
    bundle_pulls = _ReadOnly[str, int]()
    warmup_duration = _ReadOnly[str, HistogramCounts]()
    start_phases = _ReadOnly[tuple[str, str], HistogramCounts]()
    jit_after_ready = _ReadOnly[tuple[str, str], int]()
    warmup_last_ok = _ReadOnly[str, bool]()

    def not_ready_seconds(self, name: str) -> float:
        """Seconds since the unit was last ready; 0 while ready or in standby."""
        unit = self.unit(name)
        if unit.ready or unit.state is UnitState.STANDBY or unit.not_ready_since is None:
            return 0.0
        return max(0.0, self._monotonic() - unit.not_ready_since)

    def snapshot(self) -> SupervisorStatus:
        return SupervisorStatus(
            ready=self._ready,
            version=self.version,
            started_at=self.started_at,
            pid=self.pid,
            config_path=self.config_path,
            units=MappingProxyType(dict(self._units)),
            warmup=self._warmup_shown(),
            serving=MappingProxyType(dict(self.serving)),
            bundle=self._bundle,
        )

    def _warmup_shown(self) -> WarmupInfo | None:
        if self._plan is None:
            return self._warmup
        mode, why = self._plan
        base = self._warmup or WarmupInfo(arch="", state="pending")
        return dataclasses.replace(base, mode=mode, why=why)
