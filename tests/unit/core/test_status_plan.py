"""/status shows each unit's warm-up plan and why, and the latest one beside the warm-up."""

from __future__ import annotations

from supervisor.core.status import StatusBoard, WarmupInfo


def test_the_plan_and_its_reason_are_in_status() -> None:
    board = StatusBoard(version="t", config_path="c")
    board.add_unit("a.service", "autoregressive")
    assert board.snapshot().to_json()["units"]["a.service"]["warmup"] is None
    why = "FlashInfer 0.7.4's gate accepts 12.0 as installed: no patch to wait for"
    board.set_warmup_plan("a.service", "overlapped", why)
    board.set_warmup(WarmupInfo("12.0", "running"))
    shown = board.snapshot().to_json()
    assert shown["units"]["a.service"]["warmup"] == {"mode": "overlapped", "why": why}
    assert (shown["warmup"]["state"], shown["warmup"]["mode"], shown["warmup"]["why"]) == (
        "running",
        "overlapped",
        why,
    )
    board.record_warmup("12.0", "built", 123.4, ok=True)
    assert board.snapshot().to_json()["warmup"]["duration_s"] == 123.4
