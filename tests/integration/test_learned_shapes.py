"""What compiled after READY is learned, and the next start compiles it before READY.

Real systemd (the sandbox), the real daemon, the stand-in serving EAGLE-3 and
printing SGLang 0.5.17's batch lines (the prefill's after its forward). Start 1
plays only a sampled single request before READY, so a client's batch of five
compiles the draft path's variants for five sequences under traffic: the JIT watch
sees them, the daemon records each with the batch lines around it, in its state
directory. Then the daemon and the unit stop, every JIT cache is wiped and the
learned record kept: start 2's coverage replays the batch, compiling those variants
before READY, and the same client batch compiles nothing after it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

DEADLINE_S = 60.0
BATCH = 5
COVERAGE = 'enabled = true\nshapes = ["greedy", "temperature"]'


def _client_batch(url: str) -> None:
    prompts = [f"Client question {i}" for i in range(BATCH)]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0.7}}
    answer = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()) == BATCH


def _files(unit: StandinUnit) -> set[Path]:
    return {p for p in unit.caches.rglob("*") if p.is_file()}


def _learned(status: dict[str, Any], unit: str) -> dict[str, Any]:
    return unit_status(status, unit)["learned_shapes"] or {}


def _settled(status: dict[str, Any], unit: str) -> bool:
    """Every draft-path variant recorded, with the prefill of the client's batch."""
    latest = _learned(status, unit).get("latest", [])
    drafts = [r for r in latest if r["kernel"] == "generate_draft_decode_kv_indices"]
    return bool(drafts) and all(
        any(b["kind"] == "prefill" and b["new_seq"] == BATCH for b in r["batches"])
        and r["signature"]
        for r in drafts
    )


def test_a_variant_compiled_after_ready_is_compiled_before_ready_on_the_next_start(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--eagle3")
    config = write_config(tmp_path, [(unit, "autoregressive", None)], coverage=COVERAGE)
    state = tmp_path / "daemon-state" / "k26-learned-shapes.json"

    # Start 1: READY without the batch; the client's batch compiles after it.
    first = supervise(config)
    first.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    first.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)
    assert _learned(first.status(), unit.name)["count"] == 0
    before = _files(unit)
    _client_batch(unit.url)
    compiled = _files(unit) - before
    assert any("generate_draft_decode_kv_indices" in str(p) for p in compiled), compiled
    status = first.wait_status(lambda s: _settled(s, unit.name), 15)
    learned = _learned(status, unit.name)
    assert learned["path"] == str(state)
    draft = next(r for r in learned["latest"] if r["kernel"] == "generate_draft_decode_kv_indices")
    # The variant as Triton names it: its cache entry and its TTIR signature.
    assert (unit.cache("TRITON_CACHE_DIR") / draft["variant"]).is_dir(), draft
    assert draft["signature"].startswith("generate_draft_decode_kv_indices(*i64:16"), draft
    assert f"learned-prefill-{BATCH}x" in " ".join(draft["replay"]), draft
    assert "learned shape: unit=" in first.log.read_text()
    on_disk = json.loads(state.read_text())
    assert on_disk["schema"] == 1 and unit.name in on_disk["units"], on_disk
    first.stop()

    # Between the starts: the unit stopped, every JIT cache wiped, the record kept.
    unit.systemctl("stop", unit.name)
    for cache in unit.caches.iterdir():
        shutil.rmtree(cache) if cache.is_dir() else cache.unlink()
    assert not _files(unit)

    # Start 2: the coverage replays the batch before READY; the client compiles nothing.
    second = supervise(config)
    status = second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    shapes = {s["name"]: s["result"] for s in unit_status(status, unit.name)["coverage"]["shapes"]}
    replayed = [n for n in shapes if n.startswith(f"learned-prefill-{BATCH}x")]
    assert replayed and all(shapes[n] == "ok" for n in replayed), shapes
    assert (unit.cache("TRITON_CACHE_DIR") / draft["variant"]).is_dir()  # before READY
    second.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)
    ready_files = _files(unit)
    _client_batch(unit.url)
    assert _files(unit) == ready_files
    assert unit_status(second.status(), unit.name)["jit_after_ready"]["count"] == 0
