"""Whether a start warms FlashInfer first, or starts the unit and warms while it loads.

A cold warm-up (a real nvcc build) and a model load each take minutes; run one
after the other, a restart costs their sum. The unit may be started at once,
with the warm-up alongside its load, when the serving venv's FlashInfer gate
accepts the arch as its files are now: the server imports the same code the
warm-up builds with. When a patch is still to be written (the gate rejects),
the server must not import FlashInfer before it lands, so the warm-up (and
patch) goes first, as before. Either way the unit is ``ready`` only after the
warm-up succeeded and a sampled probe passed after it (``machine.py``).

Pure: facts in (the config's knob, the last gate verdict the adapters saw,
whether the venv must be re-checked), a mode and the reason for it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from supervisor.core.events import GateFacts


class WarmupMode(StrEnum):
    SEQUENTIAL = "sequential"  # warm-up, then start
    OVERLAPPED = "overlapped"  # start at once; warm while it loads
    CHECK_GATE = "checking-gate"  # ask the gate first (no verdict known), then decide


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    mode: WarmupMode
    why: str


def plan_warmup(
    overlap: str, gate: GateFacts | None, *, recheck: bool, cut_short: bool = False
) -> WarmupPlan:
    """The plan for the next start of a unit that warms FlashInfer.

    ``overlap`` is ``flashinfer.overlap`` (auto or never); ``gate`` the latest
    verdict (None: none since the supervisor started); ``recheck`` that the
    venv may have changed since (a flashinfer-arch exit, an operator reset);
    ``cut_short`` that the last start's overlapped warm-up was cancelled by the
    unit's exit. A build cancelled leaves nothing a next one can use, so a unit
    that dies while loading would cancel every overlapped warm-up and never get a
    warm cache (on the H200, fp8 K2 dying at CUDA-graph capture rebuilt FlashInfer's
    ``norm`` at each of 8 restarts): its next start warms first.
    """
    if overlap == "never":
        return WarmupPlan(WarmupMode.SEQUENTIAL, 'flashinfer.overlap = "never"')
    if recheck:
        return WarmupPlan(
            WarmupMode.SEQUENTIAL,
            "the serving venv may have changed (a flashinfer-arch exit or an operator "
            "reset): FlashInfer's gate is re-checked before the unit starts",
        )
    if cut_short:
        return WarmupPlan(
            WarmupMode.SEQUENTIAL,
            "the last start's overlapped warm-up was cut short when the unit exited: "
            "this one warms FlashInfer before the start, so a unit that dies while "
            "loading cannot keep its cache cold",
        )
    if gate is None:
        return WarmupPlan(
            WarmupMode.CHECK_GATE,
            "FlashInfer's gate verdict is not known yet: asking it (no build) first",
        )
    name = f"FlashInfer {gate.flashinfer_version}" if gate.flashinfer_version else "FlashInfer"
    if gate.verdict == "accepts":
        how = "with the supervisor's patch in place" if gate.patched else "as installed"
        return WarmupPlan(
            WarmupMode.OVERLAPPED,
            f"{name}'s gate accepts {gate.arch} {how}: no patch to wait for",
        )
    if gate.verdict == "rejects":
        return WarmupPlan(
            WarmupMode.SEQUENTIAL,
            f"{name}'s gate rejects {gate.arch}: the warm-up (and any patch) must finish "
            "before the server imports FlashInfer",
        )
    detail = f" ({gate.error})" if gate.error else ""
    return WarmupPlan(
        WarmupMode.SEQUENTIAL,
        f"{name}'s gate could not be asked{detail}: warming up before the start",
    )
