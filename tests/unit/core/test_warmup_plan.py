"""The overlap decision: facts in, a mode and the reason for it out."""

from __future__ import annotations

import pytest

from supervisor.core.events import GateFacts
from supervisor.core.warmup_plan import WarmupMode, plan_warmup

ACCEPTS = GateFacts("accepts", "12.0", "0.7.4")


def test_a_gate_that_accepts_unpatched_overlaps_and_says_why() -> None:
    plan = plan_warmup("auto", ACCEPTS, recheck=False)
    assert plan.mode is WarmupMode.OVERLAPPED
    assert plan.why == "FlashInfer 0.7.4's gate accepts 12.0 as installed: no patch to wait for"


def test_a_patch_already_in_place_overlaps_too() -> None:
    plan = plan_warmup("auto", GateFacts("accepts", "12.0", "0.7.0", patched=True), recheck=False)
    assert plan.mode is WarmupMode.OVERLAPPED
    assert "with the supervisor's patch in place" in plan.why


def test_a_gate_that_rejects_warms_and_patches_first() -> None:
    plan = plan_warmup("auto", GateFacts("rejects", "12.0", "0.7.0"), recheck=False)
    assert plan.mode is WarmupMode.SEQUENTIAL
    assert plan.why.startswith("FlashInfer 0.7.0's gate rejects 12.0")
    assert "before the server imports FlashInfer" in plan.why


@pytest.mark.parametrize(
    ("overlap", "gate", "recheck", "mode", "needle"),
    [
        ("never", ACCEPTS, False, WarmupMode.SEQUENTIAL, 'flashinfer.overlap = "never"'),
        ("auto", ACCEPTS, True, WarmupMode.SEQUENTIAL, "re-checked"),
        ("auto", None, False, WarmupMode.CHECK_GATE, "not known yet"),
        (
            "auto",
            GateFacts("unknown", "12.0", error="no answer within 60 s"),
            False,
            WarmupMode.SEQUENTIAL,
            "could not be asked (no answer within 60 s)",
        ),
    ],
)
def test_everything_else_keeps_the_warm_up_first(
    overlap: str, gate: GateFacts | None, recheck: bool, mode: WarmupMode, needle: str
) -> None:
    plan = plan_warmup(overlap, gate, recheck=recheck)
    assert plan.mode is mode
    assert needle in plan.why


@pytest.mark.parametrize("gate", [ACCEPTS, None])
def test_a_warm_up_cut_short_by_the_unit_s_exit_goes_first_next_time(
    gate: GateFacts | None,
) -> None:
    plan = plan_warmup("auto", gate, recheck=False, cut_short=True)
    assert plan.mode is WarmupMode.SEQUENTIAL
    assert "cut short when the unit exited" in plan.why
    assert plan_warmup("never", gate, recheck=False, cut_short=True).why.startswith(
        "flashinfer.overlap"
    )
