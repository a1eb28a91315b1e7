"""What doctor, warm, patch and revert answer: frozen results, each with a JSON form
(``as_dict``) that their one base class makes from the keys each lists."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, ClassVar, Literal

from supervisor.core.errors import SupervisorError
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


class _Answer:
    """A result whose JSON form (``as_dict``) is its ``_JSON`` keys, fields and
    properties in that order: tuples as lists, dicts copied, the results in it as their
    own JSON forms, seconds rounded to the millisecond."""

    _JSON: ClassVar[str]

    def as_dict(self) -> dict[str, Any]:
        return {key: _json_value(getattr(self, key)) for key in self._JSON.split()}


def _json_value(value: Any) -> Any:
    if isinstance(value, _Answer):
        return value.as_dict()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, tuple | list):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, float):
        return round(value, 3)
    return value


LockState = Literal["stale", "held", "unknown"]


@dataclass(frozen=True)
class LockInfo(_Answer):
    """One of FlashInfer's build locks (``locks.py``): who holds it, or why nobody can."""

    _JSON = "path state holders detail"

    path: Path
    state: LockState
    holders: tuple[int, ...]
    detail: str


@dataclass(frozen=True)
class Gate(_Answer):
    """FlashInfer's own arch check, run inside the serving venv."""

    _JSON = "verdict error where arch_flags"

    verdict: GateVerdict
    error: str | None = None
    where: str | None = None
    arch_flags: tuple[str, ...] = ()

    @classmethod
    def from_answer(cls, answer: GateAnswer) -> Gate:
        return cls(answer.verdict, answer.error, answer.where, tuple(answer.arch_flags))


@dataclass(frozen=True)
class ModuleReport(_Answer):
    _JSON = (
        "name ok compiled path complete loads load_error targets holds_target_arch "
        "fingerprint_ok source source_detail problems"
    )

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


@dataclass(frozen=True)
class DoctorReport(_Answer):
    """Everything doctor found; ``status`` is the verdict the daemon acts on."""

    _JSON = (
        "status python arch workspace versions arch_tag cache_dir gate gate_without_arch_list "
        "modules locks fingerprint problems hints learned not_rebuildable others duration_s"
    )

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

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)


@dataclass(frozen=True)
class WarmResult(_Answer):
    """The outcome of a warm-up. ``ok`` only when doctor would now say warm."""

    _JSON = "ok built duration_s error quarantined removed_locks"

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


PatchStrategy = Literal["none", "native", "ptx-forward"]


@dataclass(frozen=True)
class PatchResult(_Answer):
    """What patch or revert did (or, with dry_run, would do)."""

    _JSON = (
        "changed strategy message flashinfer_version files dry_run diff gate_before gate_after "
        "manifest"
    )

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
