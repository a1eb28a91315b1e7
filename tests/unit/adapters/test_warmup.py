"""The daemon's side of warm-up (``Warmup``): one at a time, recorded, patch only when allowed.

FlashInfer itself is replaced here by recording fakes of ``supervisor.flashinfer``'s
warm/doctor/patch; the real thing runs in tests/integration (test_flashinfer_*,
test_daemon_warmup).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from supervisor.adapters import warmup as warmup_module
from supervisor.adapters.warmup import Warmup
from supervisor.core.config import FlashInferSection
from supervisor.core.errors import CacheError
from supervisor.core.status import StatusBoard
from supervisor.flashinfer.models import DoctorReport, Gate, PatchResult, WarmResult

CFG = FlashInferSection(python=Path("/srv/venv/bin/python"), workspace=Path("/srv/ws"))
# No registry here: the record of accepted bundles (fleet/accepted.py) is never read.
RECORD = Path("/var/lib/k26-supervisor/k26-accepted-bundles.json")


def warmup(board: StatusBoard, cfg: FlashInferSection = CFG) -> Warmup:
    return Warmup(cfg, board, accepted_record=RECORD)


def report(verdict: str) -> DoctorReport:
    return DoctorReport(
        status="warm" if verdict == "accepts" else "needs-warmup",
        python="/srv/venv/bin/python",
        arch="12.0",
        workspace="/srv/ws",
        gate=Gate(verdict, None if verdict == "accepts" else "FlashInfer requires sm75+"),  # type: ignore[arg-type]
    )


class FakeFlashInfer:
    def __init__(self, warms: list[WarmResult], gate: str = "accepts") -> None:
        self.warms = list(warms)
        self.gate = gate
        self.calls: list[str] = []
        self.running = 0
        self.max_running = 0

    async def warm(self, *args: Any, **kw: Any) -> WarmResult:
        self.calls.append("warm")
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(0)  # let a second caller try to get in
        self.running -= 1
        return self.warms.pop(0)

    async def doctor(self, *args: Any, **kw: Any) -> DoctorReport:
        self.calls.append("doctor")
        return report(self.gate)

    async def patch(self, *args: Any, **kw: Any) -> PatchResult:
        self.calls.append("patch")
        self.gate = "accepts"
        return PatchResult(True, "native", "patched")


@pytest.fixture
def board() -> StatusBoard:
    return StatusBoard(version="t", config_path="c")


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeFlashInfer) -> None:
    for name in ("warm", "doctor", "patch"):
        monkeypatch.setattr(warmup_module.flashinfer, name, getattr(fake, name))


def ok(built: list[str] | None = None, gate: str = "accepts") -> WarmResult:
    return WarmResult(True, built or [], 1.0, report=report(gate))


def failed(error: str, gate: str) -> WarmResult:
    return WarmResult(False, [], 1.0, error=error, exit_code=74, report=report(gate))


async def test_a_warm_cache_is_ok_and_counted(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fake = FakeFlashInfer([ok()])
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert (outcome.ok, outcome.error, fake.calls) == (True, None, ["warm"])
    assert board.warmups[("12.0", "warm")] == 1 and board.warmup_last_ok["12.0"]


async def test_two_units_restarting_share_one_warm_up_at_a_time(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fake = FakeFlashInfer([ok(["sampling"]), ok()])
    install(monkeypatch, fake)
    warm = warmup(board)
    first, second = await asyncio.gather(
        warm.ensure(recheck=False, patch_allowed=False),
        warm.ensure(recheck=False, patch_allowed=False),
    )
    assert first.ok and second.ok and fake.max_running == 1
    assert first.built == ("sampling",)


async def test_a_rejecting_gate_is_patched_only_when_allowed(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    rejected = failed("FlashInfer's gate rejects 12.0", "rejects")
    fake = FakeFlashInfer([rejected], gate="rejects")
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert not outcome.ok and outcome.arch_rejected and "patch" not in fake.calls
    fake = FakeFlashInfer([rejected, ok(["sampling"])], gate="rejects")
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=True)
    assert outcome.ok and not outcome.arch_rejected
    assert fake.calls == ["warm", "doctor", "patch", "warm"]


async def test_a_recheck_runs_the_gate_even_on_a_warm_cache(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fake = FakeFlashInfer([ok()], gate="rejects")  # the cache looks warm, the gate says no
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=True, patch_allowed=False)
    assert not outcome.ok and outcome.arch_rejected and fake.calls == ["warm", "doctor"]
    assert "allow_patch is off" in (outcome.error or "")


async def test_an_adapter_error_is_a_failed_warm_up_with_its_words(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fake = FakeFlashInfer([])

    async def broken(*args: Any, **kw: Any) -> WarmResult:
        raise CacheError("workspace /srv/ws is not writable")

    install(monkeypatch, fake)
    monkeypatch.setattr(warmup_module.flashinfer, "warm", broken)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert (outcome.ok, outcome.error) == (False, "workspace /srv/ws is not writable")
    assert board.warmups[("12.0", "failed")] == 1
    assert board.snapshot().warmup is not None and board.snapshot().warmup.state == "failed"


async def test_disabled_warm_up_does_nothing(board: StatusBoard) -> None:
    cfg = FlashInferSection(enabled=False)
    assert (await warmup(board, cfg).ensure(recheck=True, patch_allowed=True)).ok
    assert board.snapshot().warmup is None


# --- the facts the core plans the next start on --------------------------------------


async def test_each_outcome_says_what_the_gate_said(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fake = FakeFlashInfer([ok(["sampling"])])
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert outcome.gate is not None
    assert (outcome.gate.verdict, outcome.gate.arch, outcome.gate.patched) == (
        "accepts",
        "12.0",
        False,
    )
    rejected = failed("FlashInfer's gate rejects 12.0", "rejects")
    fake = FakeFlashInfer([rejected, ok(["sampling"])], gate="rejects")
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=True)
    assert outcome.gate is not None and outcome.gate.patched is True
    assert outcome.gate.verdict == "accepts"
    fake = FakeFlashInfer([rejected], gate="rejects")
    install(monkeypatch, fake)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert outcome.gate is not None and outcome.gate.verdict == "rejects"
    assert board.snapshot().warmup is not None
    assert board.snapshot().warmup.duration_s is not None  # type: ignore[union-attr]


async def test_check_gate_asks_doctor_and_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fake = FakeFlashInfer([], gate="rejects")
    install(monkeypatch, fake)
    monkeypatch.setattr(warmup_module.cache, "check_workspace", lambda *_a: 1 << 40)
    facts = await warmup(board).check_gate()
    assert (facts.verdict, facts.arch) == ("rejects", "12.0")
    assert fake.calls == ["doctor"]

    async def silent(*args: Any, **kw: Any) -> DoctorReport:
        raise CacheError("no answer within 60 s")

    monkeypatch.setattr(warmup_module.flashinfer, "doctor", silent)
    facts = await warmup(board).check_gate()
    assert (facts.verdict, facts.error) == ("unknown", "no answer within 60 s")


async def test_a_build_another_process_holds_is_waited_for_then_verified(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard, tmp_path: Path
) -> None:
    """A server's own JIT (or an orphaned build) holds FlashInfer's lock: not a failure."""
    import fcntl
    import os

    lock = tmp_path / ".cache/flashinfer/0.7.4/120f/cached_ops/tmp/sampling.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # /proc/locks shows it held, as another builder's
    busy = failed(f"a live build holds {lock} (held by pid 1)", "accepts")
    fake = FakeFlashInfer([busy, ok()])
    install(monkeypatch, fake)
    monkeypatch.setattr(warmup_module, "LIVE_BUILD_POLL_S", 0.01)
    lines: list[str] = []
    monkeypatch.setattr(warmup_module.log, "info", lambda _fmt, line: lines.append(line))
    cfg = FlashInferSection(python=Path("/srv/venv/bin/python"), workspace=tmp_path)
    task = asyncio.create_task(warmup(board, cfg).ensure(recheck=False, patch_allowed=False))
    waiting = asyncio.get_running_loop().time() + 10
    while not any("another process is building" in line for line in lines):
        assert asyncio.get_running_loop().time() < waiting, lines
        await asyncio.sleep(0.01)
    assert not task.done() and fake.calls == ["warm"]
    os.close(fd)  # the other builder finished
    outcome = await asyncio.wait_for(task, 10)
    assert outcome.ok and fake.calls == ["warm", "warm"]


async def test_a_workspace_that_cannot_take_a_build_is_no_verdict_to_overlap_on(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard, tmp_path: Path
) -> None:
    fake = FakeFlashInfer([])
    install(monkeypatch, fake)
    (tmp_path / ".cache").write_text("a file where the cache root should be")
    cfg = FlashInferSection(python=Path("/srv/venv/bin/python"), workspace=tmp_path)
    facts = await warmup(board, cfg).check_gate()
    assert facts.verdict == "unknown" and "not writable" in (facts.error or "")
    assert fake.calls == []
