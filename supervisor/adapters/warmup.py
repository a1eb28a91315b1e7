"""The daemon's side of FlashInfer warm-up: one at a time, recorded, patch when allowed.

Every start the supervisor makes goes through ``Warmup.ensure`` (before the
start, or alongside the load when ``core/warmup_plan.py`` says so). On a warm
cache that is a verification of well under two seconds; on a cold one it is a
real precompile in the serving venv. A gate that rejects the arch is patched
only where the config allows it. ``check_gate`` asks the gate without building.

Each outcome carries the gate's verdict (``GateFacts``), the fact the core
plans the next start on. A module another process is building (a server's own
JIT, or a build a SIGKILLed supervisor left running) is waited for under
FlashInfer's own lock, then verified: never a failure, never a cache two
builders wrote at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor import flashinfer
from supervisor.core.config import FlashInferSection
from supervisor.core.errors import SupervisorError
from supervisor.core.events import GateFacts
from supervisor.core.status import StatusBoard, WarmupInfo, utc_now
from supervisor.flashinfer import cache, learned, locks

log = logging.getLogger("k26.warmup")

# How often to look whether another process still holds a build lock: flock
# release sends no notification, and a build takes minutes.
LIVE_BUILD_POLL_S = 0.5


@dataclass(frozen=True)
class WarmOutcome:
    ok: bool
    error: str | None = None
    arch_rejected: bool = False
    built: tuple[str, ...] = ()
    gate: GateFacts | None = None


def held_build_locks(workspace: Path) -> list[Path]:
    """FlashInfer build locks under ``workspace`` that a live process holds. Blocking I/O."""
    root = cache.cache_root(workspace)
    if not root.is_dir():
        return []
    held: list[Path] = []
    # <version>/<arch>/cached_ops from 0.4 on; <arch>/cached_ops before.
    for jit_dir in [*root.glob("*/cached_ops"), *root.glob("*/*/cached_ops")]:
        for path in locks.find_lock_files(jit_dir):
            if locks.inspect_lock(path).state == "held":
                held.append(path)
    return held


class Warmup:
    def __init__(
        self,
        cfg: FlashInferSection,
        board: StatusBoard,
        on_progress: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.board = board
        self._lock = asyncio.Lock()
        # Each line of build output is progress, and so is each quarter minute in which
        # the build used the CPU (one nvcc step on a loaded host can print nothing for
        # minutes): it keeps systemd's start timeout extended (EXTEND_TIMEOUT_USEC)
        # while a cold build runs, and only then. A build that hangs extends nothing.
        self.on_progress = on_progress

    async def ensure(self, *, recheck: bool, patch_allowed: bool) -> WarmOutcome:
        """Warm and verify the cache; ``recheck`` after an arch exit also re-runs the gate."""
        if not self.cfg.enabled:
            return WarmOutcome(True)
        async with self._lock:  # two units restarting share one build
            return await self._ensure(recheck, patch_allowed)

    async def check_gate(self) -> GateFacts:
        """FlashInfer's verdict on the arch, from doctor (no build, a few seconds).

        A workspace that cannot take a build makes the verdict unknown: the
        warm-up would fail, and it should fail before the unit starts, as always.
        """
        cfg = self.cfg
        try:
            await asyncio.to_thread(cache.check_workspace, cfg.workspace)
            env = await self._env()
            report = await flashinfer.doctor(
                cfg.python, cfg.arch, cfg.workspace, cfg.modules, env=env
            )
        except SupervisorError as exc:
            return GateFacts("unknown", cfg.arch, error=str(exc))
        verdict = report.gate.verdict
        return GateFacts(
            verdict if verdict in ("accepts", "rejects") else "unknown",
            cfg.arch,
            report.versions.get("flashinfer"),
            error=report.gate.error,
        )

    async def learned(self) -> tuple[str, ...]:
        """Modules ready units built for this arch (``k26-learned-modules.json``)."""
        try:
            known = await asyncio.to_thread(learned.learned, self.cfg.workspace, self.cfg.arch)
        except SupervisorError as exc:  # a corrupt record: said, left alone, not fatal
            log.error("learned modules not used: %s", exc)
            return ()
        return tuple(known)

    async def learn(self, unit: str) -> list[str]:
        """After ``unit`` was ready: record the modules its FlashInfer built for the arch.

        Only the arch tags a fingerprint records for this arch count (the cache this
        supervisor warmed), so a unit on another arch's cache teaches nothing here.
        """
        cfg = self.cfg
        if not cfg.enabled:
            return []

        def work() -> list[str]:
            tags = {
                f.arch_tag for f in cache.find_fingerprints(cfg.workspace) if f.arch == cfg.arch
            }
            if not tags:
                return []
            return learned.learn_from_cache(cfg.workspace, cfg.arch, tags, unit=unit)

        try:
            new = await asyncio.to_thread(work)
        except (SupervisorError, OSError) as exc:
            log.error("could not record the modules %s used: %s", unit, exc)
            return []
        if new:
            log.info("learned FlashInfer modules from %s: %s", unit, ", ".join(new))
        return new

    def _say(self, line: str) -> None:
        log.info("%s", line)
        self.on_progress()

    async def _env(self) -> dict[str, str]:
        if not self.cfg.env_file:
            return {}
        return dict(await asyncio.to_thread(flashinfer.read_env_file, self.cfg.env_file))

    async def _warm(self, env: dict[str, str]) -> flashinfer.WarmResult:
        """``flashinfer.warm``, after waiting out any build another process runs here."""
        cfg = self.cfg
        known = await self.learned()
        while True:
            result = await flashinfer.warm(
                cfg.python,
                cfg.arch,
                cfg.workspace,
                cfg.modules,
                cfg.timeout_s,
                self._say,
                env=env,
                learned=known,
                alive=self.on_progress,  # a build that prints nothing for minutes, yet works
            )
            if result.ok:
                return result
            held = await asyncio.to_thread(held_build_locks, cfg.workspace)
            if not held:
                return result
            # FlashInfer serialises builders on this lock; wait our turn, then verify.
            self._say(f"k26: another process is building here ({held[0]}); waiting for it")
            while held:
                await asyncio.sleep(LIVE_BUILD_POLL_S)
                held = await asyncio.to_thread(held_build_locks, cfg.workspace)

    async def _ensure(self, recheck: bool, patch_allowed: bool) -> WarmOutcome:
        cfg = self.cfg
        started = time.monotonic()
        self.board.set_warmup(WarmupInfo(cfg.arch, "running", at=utc_now()))
        patched = False
        version: str | None = None
        try:
            env = await self._env()
            result = await self._warm(env)
            report = result.report
            gate = report.gate.verdict if report is not None else "unknown"
            if recheck or (not result.ok and gate == "rejects"):
                report = await flashinfer.doctor(
                    cfg.python, cfg.arch, cfg.workspace, cfg.modules, env=env
                )
                gate = report.gate.verdict
            version = report.versions.get("flashinfer") if report is not None else None
            if gate == "rejects" and patch_allowed:
                result_patch = await flashinfer.patch(cfg.python, cfg.arch, cfg.workspace, env=env)
                log.warning("FlashInfer gate patched: %s", result_patch.message)
                patched = result_patch.changed
                result = await self._warm(env)
                gate = "accepts" if result.ok else gate
        except Exception as exc:  # a SupervisorError says why; anything else is a bug here
            if not isinstance(exc, SupervisorError):
                log.exception("FlashInfer warm-up failed unexpectedly")
            why = str(exc) if isinstance(exc, SupervisorError) else f"{type(exc).__name__}: {exc}"
            duration = time.monotonic() - started
            self.board.record_warmup(cfg.arch, "failed", duration, ok=False, error=why)
            self.board.set_warmup(
                WarmupInfo(cfg.arch, "failed", at=utc_now(), error=why, duration_s=duration)
            )
            return WarmOutcome(False, why, arch_rejected=False)
        duration = time.monotonic() - started
        ok = result.ok and gate != "rejects"
        error = result.error if not ok else None
        if gate == "rejects" and not error:
            error = f"FlashInfer's gate rejects arch {cfg.arch}; allow_patch is off"
        label = "failed" if not ok else ("built" if result.built else "warm")
        self.board.record_warmup(cfg.arch, label, duration, ok=ok, error=error)
        self.board.set_warmup(
            WarmupInfo(
                cfg.arch, "warm" if ok else "failed", at=utc_now(), error=error, duration_s=duration
            )
        )
        # A warm, verified cache means the gate accepts the venv as it is now.
        verdict = "accepts" if ok else (gate if gate in ("accepts", "rejects") else "unknown")
        facts = GateFacts(verdict, cfg.arch, version, patched=patched, error=error)
        return WarmOutcome(
            ok, error, arch_rejected=gate == "rejects", built=tuple(result.built), gate=facts
        )
