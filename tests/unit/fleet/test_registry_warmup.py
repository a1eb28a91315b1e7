"""The daemon's pull (``Warmup._pull``): before anything is built, never instead of it.

``distribute.pull`` and FlashInfer's warm are replaced by recording fakes; the real
pull from a real registry process is tests/integration/test_registry.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.adapters import warmup as warmup_module
from supervisor.adapters.warmup import Warmup
from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.config import FlashInferSection
from supervisor.core.errors import CacheError, InputError, UnavailableError
from supervisor.core.status import StatusBoard
from supervisor.flashinfer.models import DoctorReport, Gate, WarmResult
from supervisor.fleet import registry

URL = "http://registry.example:5000/k26/bundles"
CFG = FlashInferSection(
    python=Path("/srv/venv/bin/python"), workspace=Path("/srv/ws"), registry=URL
)
# The daemon's state directory's record (fleet/accepted.py): never the workspace.
RECORD = Path("/var/lib/k26-supervisor/k26-accepted-bundles.json")
REPORT = DoctorReport(
    status="warm",
    python="/srv/venv/bin/python",
    arch="12.0",
    workspace="/srv/ws",
    gate=Gate("accepts", None),
)
PULLED: dict[str, Any] = {
    "digest": "sha256:" + "a" * 64,
    "duration_s": 1.5,
    "installed": [{"cache": "flashinfer", "files": 9}, {"cache": "triton", "files": 30}],
    "coverage": {"unit": "sglang-k26.service", "at": "2026-12-01T10:00:00Z", "shapes": 4},
    "notes": ["inductor: the bundle carries none"],
    "created_at": "2026-12-01T09:00:00Z",
}
# The registry's bundle already here: it installs nothing.
CURRENT: dict[str, Any] = {**PULLED, "digest": "sha256:" + "b" * 64, "installed": []}


class Fakes:
    """``distribute.pull`` answering ``answer`` (or raising it), and a warm that
    builds ``built``; ``calls`` records the order."""

    def __init__(self, answer: dict[str, Any] | BaseException, built: list[str]) -> None:
        self.answer = answer
        self.built = built
        self.calls: list[str] = []
        self.pull_kwargs: dict[str, Any] = {}

    async def pull(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append("pull")
        self.pull_kwargs = kwargs
        kwargs["say"]("k26: pulling triton (100 bytes)")
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def warm(self, *args: Any, **kwargs: Any) -> WarmResult:
        self.calls.append("warm")
        return WarmResult(True, list(self.built), 1.0, report=REPORT)


def run_with(
    monkeypatch: pytest.MonkeyPatch, answer: dict[str, Any] | BaseException, built: list[str]
) -> Fakes:
    fakes = Fakes(answer, built)
    monkeypatch.setattr(warmup_module.distribute, "pull", fakes.pull)
    monkeypatch.setattr(warmup_module.flashinfer, "warm", fakes.warm)
    return fakes


def warmup(board: StatusBoard, cfg: FlashInferSection = CFG, **more: Any) -> Warmup:
    """The daemon's warm-up, its record of accepted bundles where the daemon keeps it."""
    return Warmup(cfg, board, accepted_record=RECORD, **more)


@pytest.fixture
def board() -> StatusBoard:
    return StatusBoard(version="t", config_path="c")


async def test_a_cold_node_pulls_first_then_warm_finds_nothing_to_build(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard, caplog: pytest.LogCaptureFixture
) -> None:
    fakes = run_with(monkeypatch, PULLED, [])
    with caplog.at_level(logging.INFO, logger="k26.warmup"):
        outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert fakes.calls == ["pull", "warm"]
    assert (outcome.ok, outcome.built, outcome.error) == (True, (), None)
    assert fakes.pull_kwargs["flashinfer"] == "if-cold"  # a warm cache is never replaced
    assert fakes.pull_kwargs["modules"] == CFG.modules
    assert fakes.pull_kwargs["accepted_record"] == RECORD  # the daemon's, not the workspace's
    said = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"k26: pulled {PULLED['digest']} from {URL} in 1.50 s: flashinfer (9 files)")
        and "its coverage passed on sglang-k26.service" in m
        for m in said
    ), said
    shown = board.snapshot().warmup
    assert shown is not None and shown.state == "warm" and shown.error is None


def _served(board: StatusBoard, digest: str, created_at: str) -> None:
    """The board holds what the registry gave, and when it was asked: just now."""
    served = board.bundle_served
    assert served is not None and (served.digest, served.created_at) == (digest, created_at)
    assert abs(time.time() - served.pulled_at) < 60


async def test_a_pull_that_installs_shows_the_bundle_s_age(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    run_with(monkeypatch, PULLED, [])
    await warmup(board).ensure(recheck=False, patch_allowed=False)
    use = board.bundle
    assert use is not None and use.digest == PULLED["digest"]
    assert use.created_at == "2026-12-01T09:00:00Z" and use.effective is None
    assert board.snapshot().to_json()["bundle"]["created_at"] == "2026-12-01T09:00:00Z"
    _served(board, PULLED["digest"], "2026-12-01T09:00:00Z")


async def test_a_pull_that_installs_nothing_shows_the_age_and_keeps_the_verdict(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    """The registry was asked and gave a bundle: its age counts. The verdict stays the
    one of the pull that installed the caches (a pull of nothing has none)."""
    run_with(monkeypatch, PULLED, [])
    warm = warmup(board)
    await warm.ensure(recheck=False, patch_allowed=False)
    installed = board.bundle
    assert installed is not None
    judged = dataclasses.replace(installed, effective=False, checked_units=("u.service",))
    board.set_bundle(judged)
    run_with(monkeypatch, {**CURRENT, "created_at": "2026-12-02T09:00:00Z"}, [])
    await warm.ensure(recheck=False, patch_allowed=False)
    assert board.bundle_pulls["current"] == 1
    assert board.bundle is judged
    _served(board, CURRENT["digest"], "2026-12-02T09:00:00Z")


async def test_a_cold_node_that_finds_the_bundle_here_has_no_verdict_but_its_age(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    run_with(monkeypatch, CURRENT, [])
    warm = warmup(board)
    await warm.ensure(recheck=False, patch_allowed=False)
    assert board.bundle is None and await warm.check_bundle("u.service") is None
    _served(board, CURRENT["digest"], "2026-12-01T09:00:00Z")


async def test_an_unasked_registry_tells_no_age(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    run_with(monkeypatch, {**CURRENT, "digest": None, "created_at": None}, [])
    await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert board.bundle is None and board.bundle_served is None
    assert sum(board.bundle_pulls.values()) == 0


async def test_no_bundle_for_this_node_builds_here_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard, caplog: pytest.LogCaptureFixture
) -> None:
    missing = registry.NotInRegistry(f"registry {URL} holds no bundle for this node")
    fakes = run_with(monkeypatch, missing, ["sampling"])
    with caplog.at_level(logging.INFO, logger="k26.warmup"):
        outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert fakes.calls == ["pull", "warm"]
    assert (outcome.ok, outcome.built) == (True, ("sampling",))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        "holds no bundle for this node; building here" in r.getMessage() for r in caplog.records
    )
    shown = board.snapshot().warmup
    assert shown is not None and shown.error is None


@pytest.mark.parametrize(
    ("raised", "shown"),
    [
        (
            UnavailableError(f"registry {URL}: manifest k26-12.0-x: unreachable (ConnectError)"),
            f"registry pull failed: registry {URL}: manifest k26-12.0-x: unreachable "
            "(ConnectError); warmed here",
        ),
        (
            InputError(f"{URL}@sha256:ab: triton.ptxas.release: bundle 12.8, this node 12.9"),
            "registry bundle refused, the cache left as it was: "
            f"{URL}@sha256:ab: triton.ptxas.release: bundle 12.8, this node 12.9; warmed here",
        ),
        (
            CacheError("cannot install into /var/cache/triton: No space left on device"),
            "registry pull failed: cannot install into /var/cache/triton: No space left on "
            "device; warmed here",
        ),
        (
            RuntimeError("a bug"),
            "registry pull failed: RuntimeError: a bug; warmed here",
        ),
    ],
    ids=["registry down", "bundle refused", "disk", "a bug"],
)
async def test_a_failed_pull_warns_then_the_node_builds_here(
    monkeypatch: pytest.MonkeyPatch,
    board: StatusBoard,
    caplog: pytest.LogCaptureFixture,
    raised: BaseException,
    shown: str,
) -> None:
    fakes = run_with(monkeypatch, raised, ["sampling"])
    with caplog.at_level(logging.WARNING, logger="k26.warmup"):
        outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert fakes.calls == ["pull", "warm"]  # the local build follows, whatever happened
    assert (outcome.ok, outcome.built, outcome.error) == (True, ("sampling",), None)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{shown.removesuffix('; warmed here')}; warming here instead" in warned, warned
    info = board.snapshot().warmup
    assert info is not None and info.state == "warm" and info.error == shown


async def test_a_failed_build_after_a_failed_pull_says_both(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fakes = run_with(monkeypatch, UnavailableError(f"registry {URL}: unreachable"), [])

    async def broken(*args: Any, **kwargs: Any) -> WarmResult:
        fakes.calls.append("warm")
        raise CacheError("workspace /srv/ws is not writable")

    monkeypatch.setattr(warmup_module.flashinfer, "warm", broken)
    outcome = await warmup(board).ensure(recheck=False, patch_allowed=False)
    assert fakes.calls == ["pull", "warm"] and not outcome.ok
    info = board.snapshot().warmup
    assert info is not None and info.state == "failed"
    assert info.error == (
        f"workspace /srv/ws is not writable (and registry pull failed: registry {URL}: unreachable)"
    )


async def test_without_a_registry_nothing_is_pulled(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard
) -> None:
    fakes = run_with(monkeypatch, PULLED, [])
    cfg = CFG.model_copy(update={"registry": None})
    outcome = await warmup(board, cfg).ensure(recheck=False, patch_allowed=False)
    assert outcome.ok and fakes.calls == ["warm"]


# --- where the daemon fills the other caches: the units' own environment -------------


def unit(name: str, *environment: str, load_state: str = "loaded") -> UnitSnapshot:
    props = {"LoadState": load_state, "Environment": list(environment), "User": "root"}
    return UnitSnapshot.from_props(name, props, 0.0)


async def test_the_units_own_environment_says_where_each_cache_is_filled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    units = {
        "a.service": unit(
            "a.service",
            "TRITON_CACHE_DIR=/var/cache/k26/triton",
            "TORCHINDUCTOR_CACHE_DIR=/var/cache/k26/inductor",
            "SGLANG_CACHE_DIR=/var/cache/k26/sglang",  # not a cache a bundle carries
        ),
        "b.service": unit(
            "b.service",
            "TRITON_CACHE_DIR=/var/cache/k26-b/triton",
            "TVM_FFI_CACHE_DIR=/var/cache/k26/tvm-ffi",
        ),
        "gone.service": unit("gone.service", "TRITON_CACHE_DIR=/x", load_state="not-found"),
    }

    async def snapshot(name: str) -> UnitSnapshot:
        if name == "broken.service":
            raise UnavailableError("the bus said no")
        return units[name]

    with caplog.at_level(logging.INFO, logger="k26.warmup"):
        found = await warmup_module.unit_cache_locations(
            snapshot, ["broken.service", "gone.service", "a.service", "b.service"]
        )
    assert found == {
        "triton": Path("/var/cache/k26/triton"),  # the first unit's, in config order
        "inductor": Path("/var/cache/k26/inductor"),
        "tvm-ffi": Path("/var/cache/k26/tvm-ffi"),
    }
    said = [r.getMessage() for r in caplog.records]
    assert "registry pull: cannot read broken.service's environment: the bus said no" in said
    assert (
        "registry pull: b.service keeps its triton cache at /var/cache/k26-b/triton; "
        "only /var/cache/k26/triton is filled"
    ) in said


async def test_the_units_locations_win_over_the_env_files(
    monkeypatch: pytest.MonkeyPatch, board: StatusBoard, tmp_path: Path
) -> None:
    env_file = tmp_path / "units.env"
    env_file.write_text("TRITON_CACHE_DIR=/srv/old/triton\nTVM_FFI_CACHE_DIR=/srv/tvm\n")
    fakes = run_with(monkeypatch, PULLED, [])

    async def locations() -> dict[str, Path]:
        return {"triton": Path("/var/cache/k26/triton")}

    cfg = CFG.model_copy(update={"env_file": env_file})
    await warmup(board, cfg, cache_locations=locations).ensure(recheck=False, patch_allowed=False)
    assert fakes.pull_kwargs["caches"] == {
        "triton": Path("/var/cache/k26/triton"),
        "tvm-ffi": Path("/srv/tvm"),
    }
