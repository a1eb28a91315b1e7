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

import asyncio
import itertools
import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.waiting import wait_until

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


def _second_start(
    first: Supervisor, unit: StandinUnit, supervise: Callable[[Path], Supervisor], config: Path
) -> tuple[Supervisor, dict[str, Any]]:
    """Between the starts the daemon and the unit stop and every JIT cache is wiped,
    the learned record kept; then the daemon starts again: it, once the unit is READY."""
    first.stop()
    unit.systemctl("stop", unit.name)
    for cache in unit.caches.iterdir():
        shutil.rmtree(cache) if cache.is_dir() else cache.unlink()
    assert not _files(unit)
    second = supervise(config)
    status = second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    return second, status


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
    # Start 2: the coverage replays the batch before READY; the client compiles nothing.
    second, status = _second_start(first, unit, supervise, config)
    shapes = {s["name"]: s["result"] for s in unit_status(status, unit.name)["coverage"]["shapes"]}
    replayed = [n for n in shapes if n.startswith(f"learned-prefill-{BATCH}x")]
    assert replayed and all(shapes[n] == "ok" for n in replayed), shapes
    assert (unit.cache("TRITON_CACHE_DIR") / draft["variant"]).is_dir()  # before READY
    second.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)
    ready_files = _files(unit)
    _client_batch(unit.url)
    assert _files(unit) == ready_files
    assert unit_status(second.status(), unit.name)["jit_after_ready"]["count"] == 0


ODD = "any-a8"  # the stand-in's KV store of a 40-token prefill at an odd slot offset


_CALLS = itertools.count()


async def _beside(url: str) -> None:
    """A client's prefill while another request decodes: its KV slots start where the
    decoding one's steps left the allocator's offset (odd about half the time). The
    decoding request is then aborted and its end read, so the next call starts on an
    idle server."""
    rid = f"client-{uuid.uuid4().hex}"
    call = next(_CALLS)
    decoding = {"input_ids": [100 + call % 256, 322, 323], "stream": True, "rid": rid,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}  # fmt: skip
    # 321: an id no coverage prompt repeats, so nothing the coverage played is cached.
    prefill = {"input_ids": [100 + call % 256] + [321] * 39,  # nothing cached: 40 new
               "sampling_params": {"max_new_tokens": 1, "temperature": 0.7}}  # fmt: skip
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
        client.stream("POST", f"{url}/generate", json=decoding) as stream,
    ):
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith("data:"):
                break  # decoding: the prefill goes in beside it
        answer = await client.post(f"{url}/generate", json=prefill)
        assert answer.status_code == 200, answer.text
        aborted = await client.post(f"{url}/abort_request", json={"rid": rid})
        assert aborted.status_code == 200, aborted.text
        async for line in lines:
            if line == "data: [DONE]":
                break


def _odd_variants(unit: StandinUnit) -> set[str]:
    return {
        p.parent.name
        for p in unit.cache("TRITON_CACHE_DIR").rglob("set_kv_buffer_kernel.json")
        if json.loads(p.read_text())["shape"] == ODD
    }


def test_an_unaligned_variant_made_beside_a_decoding_request_is_made_before_ready_next_time(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    """On the H200 (tiny EAGLE-3, 2026-12-04) a client's prefill compiled
    write_req_to_token_pool_triton with an unaligned KV-slot pointer after READY, on
    three starts that had replayed its batch: with EAGLE every request's end hands
    slots back and resets the allocator's offset, so a replay alone always starts
    at 0. The stand-in's allocator does the same (sglang 0.5.17's). Start 1 learns
    the variant from a client's prefill beside a decoding request; start 2, its
    caches wiped, makes it before READY (played beside a companion until it is in
    the cache), and the same clients then compile nothing."""
    unit = standin_unit("--eagle3", "--kv-alignment", "--max-running-requests", "4",
                        "--context-length", "1024")  # fmt: skip
    config = write_config(tmp_path, [(unit, "autoregressive", None)], coverage=COVERAGE)
    # No periodic probe beside the clients: its prefill, sent while a client's request
    # decodes, would compile its own class's odd variant, which no client here makes.
    text = config.read_text()
    assert "interval_s = 1\n" in text
    config.write_text(text.replace("interval_s = 1\n", "interval_s = 3600\n", 1))

    first = supervise(config)
    first.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    first.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)

    def odd_after_ready() -> set[str] | None:
        asyncio.run(_beside(unit.url))
        return _odd_variants(unit) or None

    (variant,) = wait_until(odd_after_ready, 60, f"a client's prefill at an odd offset ({ODD})")

    def learned_with_batch(status: dict[str, Any]) -> bool:
        records = [r for r in _learned(status, unit.name).get("latest", [])
                   if r["variant"] == variant]  # fmt: skip
        return (
            bool(records)
            and bool(records[0]["signature"])
            and any(b["kind"] == "prefill" and b["running_req"] >= 1 for b in records[0]["batches"])
        )

    status = first.wait_status(learned_with_batch, 15)
    record = next(r for r in _learned(status, unit.name)["latest"] if r["variant"] == variant)
    assert "learned-align-1x40" in record["replay"], record
    second, status = _second_start(first, unit, supervise, config)
    shapes = {s["name"]: s for s in unit_status(status, unit.name)["coverage"]["shapes"]}
    align = shapes["learned-align-1x40"]
    assert align["result"] == "ok", align
    # Made in one of its rounds, or by a shape before it (another learned alignment
    # replay of the same size class, such as the clients' 3-token prompts'): then it
    # is not played at all.
    assert align["detail"].startswith("made what it is played for in round") or (
        align["requests"] == 0 and "in the unit's caches already" in align["detail"]
    ), align
    assert _odd_variants(unit) == {variant}  # before READY
    second.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)
    ready_files = _files(unit)
    for _ in range(8):
        asyncio.run(_beside(unit.url))
    late = {p.read_text() for p in _files(unit) - ready_files if p.suffix == ".json"}
    assert not late, (late, shapes)
    assert unit_status(second.status(), unit.name)["jit_after_ready"]["count"] == 0
