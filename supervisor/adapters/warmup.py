"""The daemon's side of FlashInfer warm-up: one at a time, recorded, patch when allowed.

Every start the supervisor makes goes through ``Warmup.ensure`` first. On a warm
cache that is a verification of well under two seconds; on a cold one it is a
real precompile in the serving venv. A gate that rejects the arch is patched
only where the config allows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor import flashinfer
from supervisor.core.config import FlashInferSection
from supervisor.core.errors import SupervisorError
from supervisor.core.status import StatusBoard, WarmupInfo, utc_now

log = logging.getLogger("k26.warmup")


@dataclass(frozen=True)
class WarmOutcome:
    ok: bool
    error: str | None = None
    arch_rejected: bool = False
    built: tuple[str, ...] = ()


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
        # Each line of build output is progress: it keeps systemd's start timeout
        # extended (EXTEND_TIMEOUT_USEC) while a cold build runs, and only then.
        self.on_progress = on_progress

    async def ensure(self, *, recheck: bool, patch_allowed: bool) -> WarmOutcome:
        """Warm and verify the cache; ``recheck`` after an arch exit also re-runs the gate."""
        if not self.cfg.enabled:
            return WarmOutcome(True)
        async with self._lock:  # two units restarting share one build
            return await self._ensure(recheck, patch_allowed)

    def _say(self, line: str) -> None:
        log.info("%s", line)
        self.on_progress()

    async def _ensure(self, recheck: bool, patch_allowed: bool) -> WarmOutcome:
        cfg = self.cfg
        started = time.monotonic()
        self.board.set_warmup(WarmupInfo(cfg.arch, "running", at=utc_now()))
        try:
            env = (
                await asyncio.to_thread(flashinfer.read_env_file, cfg.env_file)
                if cfg.env_file
                else {}
            )
            result = await flashinfer.warm(
                cfg.python, cfg.arch, cfg.workspace, cfg.modules, cfg.timeout_s, self._say, env=env
            )
            gate = result.report.gate.verdict if result.report is not None else "unknown"
            if recheck or (not result.ok and gate == "rejects"):
                report = await flashinfer.doctor(
                    cfg.python, cfg.arch, cfg.workspace, cfg.modules, env=env
                )
                gate = report.gate.verdict
            if gate == "rejects" and patch_allowed:
                patched = await flashinfer.patch(cfg.python, cfg.arch, cfg.workspace, env=env)
                log.warning("FlashInfer gate patched: %s", patched.message)
                result = await flashinfer.warm(
                    cfg.python,
                    cfg.arch,
                    cfg.workspace,
                    cfg.modules,
                    cfg.timeout_s,
                    self._say,
                    env=env,
                )
                gate = "accepts" if result.ok else gate
        except Exception as exc:  # a SupervisorError says why; anything else is a bug here
            if not isinstance(exc, SupervisorError):
                log.exception("FlashInfer warm-up failed unexpectedly")
            why = str(exc) if isinstance(exc, SupervisorError) else f"{type(exc).__name__}: {exc}"
            duration = time.monotonic() - started
            self.board.record_warmup(cfg.arch, "failed", duration, ok=False, error=why)
            self.board.set_warmup(WarmupInfo(cfg.arch, "failed", at=utc_now(), error=why))
            return WarmOutcome(False, why, arch_rejected=False)
        duration = time.monotonic() - started
        ok = result.ok and gate != "rejects"
        error = result.error if not ok else None
        if gate == "rejects" and not error:
            error = f"FlashInfer's gate rejects arch {cfg.arch}; allow_patch is off"
        label = "failed" if not ok else ("built" if result.built else "warm")
        self.board.record_warmup(cfg.arch, label, duration, ok=ok, error=error)
        self.board.set_warmup(
            WarmupInfo(cfg.arch, "warm" if ok else "failed", at=utc_now(), error=error)
        )
        return WarmOutcome(ok, error, arch_rejected=gate == "rejects", built=tuple(result.built))
