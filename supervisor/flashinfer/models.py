"""What doctor, warm, patch and revert answer: frozen results with a JSON form."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from supervisor.core.errors import SupervisorError
from supervisor.flashinfer.locks import LockInfo
from supervisor.flashinfer.protocol import GateAnswer, GateVerdict

CacheStatus = Literal["warm", "needs-warmup", "unknown"]

# Exit codes of `flashinfer doctor` (warm's failures use errors.py's codes).
EXIT_WARM = 0
EXIT_NEEDS_WARMUP = 2
EXIT_UNKNOWN = 3
STATUS_EXIT: dict[str, int] = {
    "warm": EXIT_WARM,
    "needs-warmup": EXIT_NEEDS_WARMUP,
    "unknown": EXIT_UNKNOWN,
}


@dataclass(frozen=True)
class Gate:
    """FlashInfer's own arch check, run inside the serving venv."""

    verdict: GateVerdict
    error: str | None = None
    where: str | None = None
    arch_flags: tuple[str, ...] = ()

    @classmethod
    def from_answer(cls, answer: GateAnswer) -> Gate:
        return cls(answer.verdict, answer.error, answer.where, tuple(answer.arch_flags))

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "error": self.error,
            "where": self.where,
            "arch_flags": list(self.arch_flags),
        }


@dataclass(frozen=True)
class ModuleReport:
    name: str
    compiled: bool
    path: str | None
    complete: bool = False
    loads: bool | None = None
    load_error: str | None = None
    targets: tuple[str, ...] = ()
    holds_target_arch: bool = False
    fingerprint_ok: bool = False
    problems: tuple[str, ...] = ()
    # Where FlashInfer loads it from: "jit" (the workspace this code warms),
    # "provider" (a flashinfer-jit-cache wheel) or "package" (its data/aot).
    source: str = "jit"
    source_detail: str | None = None

    @property
    def prebuilt(self) -> bool:
        """Served by an installed wheel: nothing for warm to build."""
        return self.source != "jit"

    @property
    def ok(self) -> bool:
        return (
            self.compiled
            and self.complete
            and self.loads is True
            and self.holds_target_arch
            and self.fingerprint_ok
            and not self.problems
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "compiled": self.compiled,
            "path": self.path,
            "complete": self.complete,
            "loads": self.loads,
            "load_error": self.load_error,
            "targets": list(self.targets),
            "holds_target_arch": self.holds_target_arch,
            "fingerprint_ok": self.fingerprint_ok,
            "source": self.source,
            "source_detail": self.source_detail,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class DoctorReport:
    """Everything doctor found; ``status`` is the verdict the daemon acts on."""

    status: CacheStatus
    python: str
    arch: str
    workspace: str
    versions: dict[str, str | None] = field(default_factory=dict)
    arch_tag: str | None = None
    cache_dir: str | None = None
    gate: Gate = Gate("unknown", "not run")
    gate_without_arch_list: Gate | None = None
    modules: tuple[ModuleReport, ...] = ()
    locks: tuple[LockInfo, ...] = ()
    fingerprint: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()
    duration_s: float = 0.0
    # Modules learned from a ready unit's cache (beyond the configured ones), and
    # those of them FlashInfer cannot rebuild from a name (they need arguments).
    learned: tuple[str, ...] = ()
    not_rebuildable: dict[str, str] = field(default_factory=dict)
    # Every other module in the cache (neither asked for nor learned): name -> its file.
    others: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return STATUS_EXIT[self.status]

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "python": self.python,
            "arch": self.arch,
            "workspace": self.workspace,
            "versions": dict(self.versions),
            "arch_tag": self.arch_tag,
            "cache_dir": self.cache_dir,
            "gate": self.gate.as_dict(),
            "gate_without_arch_list": (
                self.gate_without_arch_list.as_dict() if self.gate_without_arch_list else None
            ),
            "modules": [m.as_dict() for m in self.modules],
            "locks": [lock.as_dict() for lock in self.locks],
            "fingerprint": dict(self.fingerprint),
            "problems": list(self.problems),
            "hints": list(self.hints),
            "learned": list(self.learned),
            "not_rebuildable": dict(self.not_rebuildable),
            "others": dict(self.others),
            "duration_s": round(self.duration_s, 3),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)


@dataclass(frozen=True)
class WarmResult:
    """The outcome of a warm-up. ``ok`` only when doctor would now say warm."""

    ok: bool
    built: list[str]
    duration_s: float
    error: str | None = None
    exit_code: int = 0
    quarantined: list[str] = field(default_factory=list)
    removed_locks: list[str] = field(default_factory=list)
    report: DoctorReport | None = None

    @classmethod
    def failed(
        cls, error: SupervisorError, duration_s: float, built: list[str] | None = None
    ) -> WarmResult:
        return cls(False, built or [], duration_s, str(error), error.exit_code)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "built": list(self.built),
            "duration_s": round(self.duration_s, 3),
            "error": self.error,
            "quarantined": list(self.quarantined),
            "removed_locks": list(self.removed_locks),
        }


PatchStrategy = Literal["none", "native", "ptx-forward"]


@dataclass(frozen=True)
class PatchResult:
    """What patch or revert did (or, with dry_run, would do)."""

    changed: bool
    strategy: PatchStrategy
    message: str
    flashinfer_version: str | None = None
    files: tuple[str, ...] = ()
    diff: str = ""
    dry_run: bool = False
    gate_before: Gate | None = None
    gate_after: Gate | None = None
    manifest: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "strategy": self.strategy,
            "message": self.message,
            "flashinfer_version": self.flashinfer_version,
            "files": list(self.files),
            "dry_run": self.dry_run,
            "diff": self.diff,
            "gate_before": self.gate_before.as_dict() if self.gate_before else None,
            "gate_after": self.gate_after.as_dict() if self.gate_after else None,
            "manifest": self.manifest,
        }
