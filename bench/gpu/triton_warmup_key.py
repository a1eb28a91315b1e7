"""Does a Triton variant compiled by ``JITFunction.warmup`` in a process of its own
land in the same cache entry as the server's own launch of it? (docs/gpu.md, "What
issue 37 still needs": compiling the descent's variants beside the load rests on it.)

On the lent GPU host, after ``bench/gpu/kit_setup.sh`` and ``. /tmp/k26kit/env.sh``:

    python3 bench/gpu/triton_warmup_key.py --out $OUT/warmup-key.json

For each case (batch size, int64 offset of the step's KV slots into the free list),
one child launches SGLang 0.5.17's ``assign_req_to_token_pool_func`` on real tensors
with ``TRITON_CACHE_DIR=launch/``, another compiles the same variant with
``assign_req_to_token_pool.warmup(...)`` (pointer stand-ins: a dtype and a
``data_ptr``) with ``TRITON_CACHE_DIR=warmup/``; the cache directories they wrote
(Triton names each by its key) are compared. Prints and writes JSON. Each child
imports SGLang (20 to 30 s on the H100): give the call about 250 s.

On the H100 (2026-12-05, cut at 140 s after 3 cases; the output is in
bench/gpu/results/h100-2026-12-05-triton-warmup-key.txt): batch 3 at offset 1 and
batch 33 at offset 1 (the unaligned variants) wrote the same entry both ways; batch
3 at offset 0 wrote two entries both ways, and the launch a third.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [(3, 0), (3, 1), (33, 1), (48, 2)]  # (batch size, offset in int64 slots)
POOL_LEN = 4096


def launch(bs: int, offset: int) -> None:
    import torch
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    dev = "cuda"
    free = torch.arange(1, 4096, dtype=torch.int64, device=dev)
    assign_req_to_token_pool_func(
        torch.arange(bs, dtype=torch.int64, device=dev),
        torch.zeros((64, POOL_LEN), dtype=torch.int32, device=dev),
        torch.zeros(bs, dtype=torch.int32, device=dev),
        torch.ones(bs, dtype=torch.int32, device=dev),
        free[offset : offset + bs],
        bs,
    )
    torch.cuda.synchronize()


def warmup(bs: int, offset: int) -> None:
    import torch
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    class Pointer:
        def __init__(self, dtype: object, address: int) -> None:
            self.dtype, self.address = dtype, address

        def data_ptr(self) -> int:
            return self.address

    base = 1 << 20  # any 16-byte aligned address
    assign_req_to_token_pool.warmup(
        Pointer(torch.int64, base),
        Pointer(torch.int32, base),
        Pointer(torch.int32, base),
        Pointer(torch.int32, base),
        Pointer(torch.int64, base + 8 * offset),
        POOL_LEN,
        1 << (bs - 1).bit_length(),
        grid=(bs,),
    )


def child(mode: str, bs: int, offset: int, cache: Path) -> dict[str, object]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    before = set(os.listdir(cache)) if cache.exists() else set()
    tic = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(bs), str(offset)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    after = set(os.listdir(cache)) if cache.exists() else set()
    return {
        "rc": done.returncode,
        "s": round(time.monotonic() - tic, 2),
        "new_entries": sorted(after - before),
        "stderr_tail": done.stderr[-1500:] if done.returncode else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "BS", "OFFSET"))
    args = parser.parse_args()
    if args.child:
        mode, bs, offset = args.child[0], int(args.child[1]), int(args.child[2])
        (launch if mode == "launch" else warmup)(bs, offset)
        return 0
    work = Path(tempfile.mkdtemp(prefix="k26-warmup-key-"))
    results = []
    for bs, offset in CASES:
        got = {m: child(m, bs, offset, work / m) for m in ("launch", "warmup")}
        same = got["launch"]["new_entries"] == got["warmup"]["new_entries"] != []
        results.append({"bs": bs, "offset": offset, "same_entry": same, **got})
        print(json.dumps(results[-1]), flush=True)
        # Saved after every case: each child imports SGLang (20 to 30 s on the H100),
        # and a call cut at its limit still brings back what it measured.
        report = {"cases": results, "all_same": all(r["same_entry"] for r in results)}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"all_same": report["all_same"]}))
    return 0 if report["all_same"] else 1


if __name__ == "__main__":
    sys.exit(main())
