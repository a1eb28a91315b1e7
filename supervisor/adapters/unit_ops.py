"""The work a unit's machine asks for, each piece ending in exactly one event.

``UnitOps.run(unit, action)`` carries out one asynchronous action (a warm-up, a
start or stop job, the wait for /health, a sampled probe) and returns the
completion event the machine waits for. It never raises for a failure: an
adapter error, or any exception at all, becomes that action's failure event
(``core.events.failure_of``), so no unit can wait forever on work that died.
Cancellation (the machine abandoned the work) is the one thing that propagates.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from supervisor.adapters import learned_shapes as learned_store
from supervisor.adapters import sampling_env
from supervisor.adapters.bus import Bus, JobVerb
from supervisor.adapters.coverage import Census, Produced, play, server_context
from supervisor.adapters.probe import (
    ProbeFailure,
    ProbeParams,
    ProbeResult,
    sampled_probe,
    wait_healthy,
)
from supervisor.adapters.warmup import Warmup
from supervisor.core import learned_shapes
from supervisor.core.config import Config
from supervisor.core.coverage import CoverageReport, ShapeContext, ShapeOutcome, expand
from supervisor.core.errors import BusRefused, SupervisorError
from supervisor.core.events import (
    Action,
    CheckGate,
    Event,
    GateChecked,
    HealthOk,
    JobDone,
    ProbeFailed,
    ProbeOk,
    RunWarmup,
    SampledProbe,
    SamplingBackend,
    StartUnit,
    StopUnit,
    WaitHealthy,
    WarmupFailed,
    WarmupOk,
    failure_of,
)
from supervisor.core.exits import ExitTracker
from supervisor.core.learned_shapes import LearnedShape
from supervisor.core.status import ProbeInfo, StatusBoard

log = logging.getLogger("k26.ops")


class UnitOps:
    """Runs actions against systemd, the server and the serving venv."""

    def __init__(
        self,
        config: Config,
        bus: Bus,
        board: StatusBoard,
        warmup: Warmup,
        tracker: ExitTracker,
        *,
        on_progress: Callable[[], None] = lambda: None,
        learned: Callable[[str], Sequence[LearnedShape]] = lambda unit: (),
        cache_roots: Callable[[str], Awaitable[Mapping[str, Sequence[Path]]]] | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.board = board
        self.warmup = warmup
        self.tracker = tracker
        self.on_progress = on_progress  # start-up is alive: EXTEND_TIMEOUT_USEC
        self.learned = learned  # a unit's learned shapes (adapters/learned_shapes.py)
        # A unit's JIT cache roots (cache name -> paths), from its own environment: the
        # coverage skips a learned shape whose variant is there, and plays one again
        # until it is (adapters/learned_shapes.made).
        self.cache_roots = cache_roots
        self.http: httpx.AsyncClient | None = None
        # The coverage warm-up of each unit's latest start, until the timeline takes it.
        self.last_coverage: dict[str, CoverageReport] = {}
        # Per unit: held from a job's issue until systemd has queued it (see _job).
        self._issue_order: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def open(self) -> None:
        # One client for every probe: building one (SSL context, CA bundle) costs
        # the event loop 16-33 ms each time.
        self.http = await asyncio.to_thread(
            lambda: httpx.AsyncClient(trust_env=False, follow_redirects=False)
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def run(self, unit: str, action: Action) -> Event:
        """Carry out ``action`` for ``unit``; its completion event, success or failure."""
        try:
            return await self._run(unit, action)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an unmapped error: the unit must not hang on it
            log.exception("%s: %s failed unexpectedly", unit, type(action).__name__)
            return failure_of(action, f"{type(exc).__name__}: {exc}")

    async def _run(self, unit: str, action: Action) -> Event:
        url = self.config.unit(unit).url
        match action:
            case RunWarmup():
                return await self._warm(action)
            case CheckGate(op=op):
                self.on_progress()
                return GateChecked(op, await self.warmup.check_gate())
            case StartUnit():
                return await self._start(unit, action)
            case StopUnit(op=op):
                return await self._job(unit, op, "stop")
            case WaitHealthy(op=op):
                return await self._wait_healthy(url, op)
            case SampledProbe(op=op, coverage=cover):
                return await self._probe(unit, url, op, coverage=cover)
        raise TypeError(f"{type(action).__name__} is not an asynchronous action")

    async def _warm(self, action: RunWarmup) -> Event:
        self.on_progress()
        result = await self.warmup.ensure(
            recheck=action.recheck, patch_allowed=action.patch_allowed
        )
        if result.ok:
            return WarmupOk(action.op, result.gate)
        return WarmupFailed(
            action.op, result.error or "warm-up failed", result.arch_rejected, result.gate
        )

    async def _start(self, unit: str, action: StartUnit) -> Event:
        # In the machine's order: a stop issued after this start must not reach systemd
        # first (it would find the unit down, and the start would then bring it up).
        order = self._issue_order[unit]
        await order.acquire()
        try:
            # The units read this file at start: no daemon-reload needed.
            await sampling_env.apply(
                self.config.supervisor.bus,
                unit,
                action.sampling_backend is SamplingBackend.PYTORCH,
            )
        except BaseException:
            order.release()
            raise
        self.board.set_sampling_backend(unit, str(action.sampling_backend))
        if action.restart:
            self.board.record_restart(unit)
        self.on_progress()
        log.info(
            "start issued: unit=%s restart=%s monotonic=%.6f",
            unit,
            action.restart,
            time.monotonic(),
        )
        return await self._job(unit, action.op, "start", holding=True)

    async def _job(self, unit: str, op: int, verb: JobVerb, *, holding: bool = False) -> Event:
        """Start or stop ``unit``. Jobs reach systemd in the order the machine issued
        them: each holds the unit's issue lock (``holding``: taken already) until
        systemd has queued it, not until it ends."""
        order = self._issue_order[unit]
        if not holding:
            await order.acquire()
        released = False

        def enqueued() -> None:
            nonlocal released
            if not released:
                released = True
                order.release()

        timeout = self.config.supervisor.job_timeout_s
        self.tracker.expect_job(unit)  # before the call: systemd may publish the job first
        try:
            job = await self.bus.job(verb, unit, timeout_s=timeout, enqueued=enqueued)
        except SupervisorError as exc:
            self.tracker.job_answered(unit)
            log.error("%s: %s failed: %s", unit, verb, exc)
            return JobDone(op, "failed", str(exc), denied=isinstance(exc, BusRefused))
        except BaseException:
            self.tracker.job_answered(unit)
            raise
        finally:
            enqueued()
        self.tracker.job_answered(unit, job.job_path)
        return JobDone(op, job.result)

    async def _wait_healthy(self, url: str, op: int) -> Event:
        # No deadline of its own: the machine's load deadline is the one deadline,
        # so a reload cannot leave two that disagree.
        result = await wait_healthy(url, math.inf, lambda _p: self.on_progress(), client=self.http)
        if result.ok:
            return HealthOk(op)
        return ProbeFailed(op, str(result.reason or "timeout"), result.error or "")

    async def _probe(self, unit: str, url: str, op: int, *, coverage: bool) -> Event:
        result = await self.sampled(url)
        log.debug("probe: unit=%s ok=%s monotonic=%.6f", unit, result.ok, time.monotonic())
        self.record_probe(unit, result)
        if not result.ok:
            return ProbeFailed(op, str(result.reason), result.error or "")
        if coverage:
            report = await self.cover(unit, url)
            if report is not None and not report.ok:
                failed = report.failed
                assert failed is not None
                why = f"coverage shape {failed.name} failed: {failed.detail}"
                return ProbeFailed(op, str(ProbeFailure.COVERAGE), why)
        return ProbeOk(op, result.latency_ms or 0.0, result.completion_tokens or 0)

    async def cover(self, unit: str, url: str) -> CoverageReport | None:
        """The unit's coverage warm-up (None when it has no shapes): recorded on the
        board, each shape logged with its time."""
        names = self.config.coverage_names(unit)
        if not names:
            return None
        section = self.config.coverage
        assert self.http is not None
        base = ShapeContext(
            prompt=self.config.probe.prompt,
            seed=self.config.probe.seed,
            max_new_tokens=section.max_new_tokens,
            descent_cap=section.max_decode_batch,
        )
        ctx = await server_context(url, base, client=self.http)
        shapes = expand(names, section.custom_shapes(), ctx)
        if section.learned:
            descends = any(s.descent is not None for s in shapes)
            aligns = any(s.name == "prefill-alignment" for s in shapes)
            shapes += learned_shapes.shapes(
                self.learned(unit), ctx, descends=descends, aligns=aligns
            )
        log.info("coverage: unit=%s %d shapes monotonic=%.6f", unit, len(shapes), time.monotonic())

        def progress(outcome: ShapeOutcome) -> None:
            self.on_progress()
            compiled = ""
            if outcome.compiled:
                compiled = ", compiled " + ", ".join(f"{c} {n}" for c, n in outcome.compiled)
            log.info(
                "coverage: unit=%s shape=%s %s in %.1f ms%s%s",
                unit,
                outcome.name,
                outcome.result,
                outcome.duration_ms,
                compiled,
                f": {outcome.detail}" if outcome.detail else "",
            )

        roots = await self._roots(unit)
        report = await play(
            url, shapes, timeout_s=section.timeout_s, client=self.http, progress=progress,
            produced=self._produced(unit, roots) if any(s.until for s in shapes) else None,
            census=None if roots is None else self._census(unit, roots),
        )  # fmt: skip
        self.board.record_coverage(unit, report)
        self.last_coverage[unit] = report
        log.info("coverage: unit=%s %s monotonic=%.6f", unit, report.summary(), time.monotonic())
        return report

    async def _roots(self, unit: str) -> Mapping[str, Sequence[Path]] | None:
        """The unit's cache roots, for the coverage; None where its environment cannot
        be read (then learned shapes are each played once, as listed, and what each
        shape compiled is not said)."""
        if self.cache_roots is None:
            return None
        try:
            return await self.cache_roots(unit)
        except SupervisorError as exc:
            log.warning("coverage: unit=%s cannot read its cache roots (%s): learned shapes "
                        "are each played once", unit, exc)  # fmt: skip
            return None

    def _census(self, unit: str, roots: Mapping[str, Sequence[Path]]) -> Census:
        warned = False

        async def census() -> Mapping[str, frozenset[str]] | None:
            nonlocal warned
            try:
                return await asyncio.to_thread(learned_store.census, roots)
            except Exception:  # a bug here must not keep a unit from READY
                if not warned:
                    warned = True
                    log.exception("coverage: unit=%s listing its caches failed", unit)
                return None

        return census

    def _produced(self, unit: str, roots: Mapping[str, Sequence[Path]] | None) -> Produced | None:
        """The check of what a shape is played for, against the unit's caches; None
        when the roots are unknown (then each is played once, as listed)."""
        if roots is None:
            return None

        async def produced(entries: Sequence[tuple[str, str, str]]) -> bool:
            try:
                return await asyncio.to_thread(learned_store.made, roots, entries)
            except Exception:  # a bug here must not keep a unit from READY: played as listed
                log.exception("coverage: unit=%s checking its caches failed", unit)
                return False

        return produced

    async def sampled(self, url: str, timeout_s: float | None = None) -> ProbeResult:
        params = ProbeParams.from_config(self.config.probe)
        timeout = self.config.probe.timeout_s if timeout_s is None else timeout_s
        return await sampled_probe(url, params, timeout, client=self.http)

    async def healthy(self, url: str, within_s: float) -> bool:
        return (await wait_healthy(url, within_s, client=self.http)).ok

    def record_probe(self, unit: str, result: Any) -> None:
        error = result.error
        if not result.ok:
            # Say the typed reason in /status too, not only in the metric.
            error = f"{result.reason}: {result.error or 'probe failed'}"
        info = ProbeInfo(
            ok=result.ok,
            at=result.at,
            latency_ms=result.latency_ms,
            error=error,
            completion_tokens=result.completion_tokens,
        )
        self.board.record_probe(
            unit, info, failure_reason=None if result.ok else str(result.reason)
        )
