"""What the KV-alignment shapes cost beside a companion, and how many rounds they take.

    .venv/bin/python bench/coverage_alignment.py [--runs 20] [--json]

On a speculative server (sglang 0.5.17, EAGLE-3) every request's end hands KV slots
back and the allocator's offset starts over, so a prefill lands at an odd offset only
beside a streamed request (``Shape.beside``): right after its prompt's prefill (the
wave goes out on its first token, which the prefill makes), or after its decode steps.
The stand-in SGLang (``--eagle3 --kv-alignment``) models that allocator. Per run, on a
fresh server and cache:

- ``learned-align``: a learned unaligned variant (a 40-token prefill beside a running
  request), played as the daemon plays it, after a companion of ``UNALIGNING_SLOTS``
  ids: round after round until the variant is in the cache (``Shape.until``, at most
  ``ALIGN_ROUNDS``). Printed: the rounds it took (their spread over the runs) and the
  time. A round misses when the stand-in's 2 ms decode steps came between (a GPU's
  are longer).
- ``prefill-alignment``: the built-in shape (each size class ``ALIGNMENT_PLAYS`` times
  beside a companion), its time and how many of the 6 variants (3 size classes at
  both parities) it made.

The stand-in's decode step is 2 ms: these are the shapes' own overhead on this
machine; on a GPU a round is a flush, a companion's prefill and first step, the
batch's prefill and an abort.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import shutil
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from common import standin_server  # bench/common.py

from supervisor.adapters import coverage as play
from supervisor.adapters.learned_shapes import made
from supervisor.core import coverage
from supervisor.core import learned_shapes as ls

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--eagle3", "--kv-alignment", "--speculative-num-draft-tokens", "3",
        "--context-length", "1024"]  # fmt: skip
KERNEL = "set_kv_buffer_kernel"  # the stand-in's KV store, keyed on size class and parity
LINE = "Prefill batch, #new-seq: 1, #new-token: 40, #cached-token: 0, #running-req: 1"


async def once() -> dict[str, Any]:
    async with standin_server(ARGS, "k26-align-") as (url, tmp):
        return await _play(url, tmp / "triton")


async def _play(url: str, triton: Path) -> dict[str, Any]:
    variant = hashlib.sha256(f"triton:{KERNEL}@any-a8".encode()).hexdigest()[:32]
    batch = ls.parse_batch_line(LINE)
    assert batch is not None
    record = ls.LearnedShape("triton", KERNEL, variant, "t", "t", batches=(batch,),
                             signature=f"{KERNEL}(*i64, i32)")  # fmt: skip
    roots = {"triton": [triton]}

    async def produced(entries: Any) -> bool:
        return await asyncio.to_thread(made, roots, entries)

    async with httpx.AsyncClient(trust_env=False) as client:
        ctx = await play.server_context(url, coverage.ShapeContext(), client=client)
        (align,) = [s for s in ls.shapes([record], ctx) if s.name.startswith("learned-align")]
        learned = await play.play(url, [align], timeout_s=60, client=client, produced=produced)
        builtin = coverage.builtin_shape("prefill-alignment", ctx)
        await asyncio.to_thread(shutil.rmtree, triton)  # the built-in from an empty cache
        report = await play.play(url, [builtin], timeout_s=60, client=client)
    (outcome,) = learned.shapes
    found = re.search(r"round (\d+) of", outcome.detail or "")
    kv = await asyncio.to_thread(_variants, triton)
    return {
        "learned_ok": learned.ok and found is not None,
        "rounds": int(found.group(1)) if found else None,
        "learned_s": outcome.duration_ms / 1000.0,
        "builtin_ok": report.ok,
        "builtin_s": report.shapes[0].duration_ms / 1000.0,
        "builtin_variants": len(kv),
    }


def _variants(triton: Path) -> set[str]:
    return {json.loads(p.read_text())["shape"] for p in triton.rglob(f"{KERNEL}.json")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = [asyncio.run(once()) for _ in range(args.runs)]
    rounds = Counter(r["rounds"] for r in runs)
    summary = {
        "runs": args.runs,
        "align_rounds_max": ls.ALIGN_ROUNDS,
        "learned_made": sum(r["learned_ok"] for r in runs),
        "rounds": {str(k): v for k, v in sorted(rounds.items(), key=lambda kv: kv[0] or 99)},
        "learned_s_median": round(statistics.median(r["learned_s"] for r in runs), 3),
        "learned_s_max": round(max(r["learned_s"] for r in runs), 3),
        "builtin_plays_per_size": coverage.ALIGNMENT_PLAYS,
        "builtin_ok": sum(r["builtin_ok"] for r in runs),
        "builtin_s_median": round(statistics.median(r["builtin_s"] for r in runs), 3),
        "builtin_all_6_variants": sum(r["builtin_variants"] == 6 for r in runs),
    }
    if args.json:
        print(json.dumps({"summary": summary, "runs": runs}, indent=1))
        return
    print(f"runs: {args.runs} (fresh stand-in and cache each: {' '.join(ARGS)})")
    print(f"learned-align-1x40: made in {summary['learned_made']}/{args.runs} runs; rounds "
          f"taken {summary['rounds']} (at most {ls.ALIGN_ROUNDS}); time median "
          f"{summary['learned_s_median']} s, max {summary['learned_s_max']} s")  # fmt: skip
    print(f"prefill-alignment ({coverage.ALIGNMENT_PLAYS} plays a size beside a companion): "
          f"all 6 variants in {summary['builtin_all_6_variants']}/{args.runs} runs; time "
          f"median {summary['builtin_s_median']} s")  # fmt: skip


if __name__ == "__main__":
    main()
