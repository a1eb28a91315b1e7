"""The decode descent's cost: time, requests and sizes held, per server configuration.

    .venv/bin/python bench/coverage_descent.py [--runs 3] [--json]

For each configuration the stand-in SGLang (``python -m k26dev.standin``) starts with
its JIT caches in a fresh temporary directory, and the coverage's ``decode-descent``
shape is played against it, as the daemon plays it: its facts from ``/server_info``,
then one streamed batch per set of requests, a request aborted at each clock chunk.
Printed per configuration: the batch sizes played (and what capped them), the prompts
sent (a set's requests are as many as its largest size), and the time (median of
``--runs``, each on a fresh
server and cache). The stand-in's decode step is 2 ms; a real server's differs, so
these numbers are the descent's own overhead on this machine, not a GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import httpx
from common import standin_server  # bench/common.py

from supervisor.adapters import coverage as play
from supervisor.core import coverage

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    # The tiny EAGLE-3 server of the GPU runs: SGLang sets 48 running requests for
    # speculative decoding; 3 draft tokens a step; an 8192-token KV pool.
    "eagle3-48": ["--eagle3", "--speculative-num-draft-tokens", "3", "--context-length", "1024"],
    # The tiny autoregressive server: 4096 running requests, the same KV pool: the pool
    # caps the descent.
    "ar-kv8192": ["--context-length", "1024"],
    # K2 as the GPU script serves it: 64 running requests, context 4096.
    "ar-64": ["--max-running-requests", "64", "--context-length", "4096"],
}


async def once(args: list[str]) -> dict[str, object]:
    async with (
        standin_server(args, "k26-descent-") as (url, _),
        httpx.AsyncClient(trust_env=False) as client,
    ):
        ctx = await play.server_context(url, coverage.ShapeContext(), client=client)
        (shape,) = coverage.expand(("decode-descent",), (), ctx)
        report = await play.play(url, [shape], timeout_s=120, client=client)
    (outcome,) = report.shapes
    plan = shape.descent
    assert plan is not None
    return {
        "ok": report.ok,
        "top": plan.top,
        "capped": plan.cap_why or None,
        "prompts": outcome.requests,
        "seconds": report.duration_s,
        "detail": outcome.detail,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    for name, flags in CONFIGS.items():
        runs = [asyncio.run(once(flags)) for _ in range(args.runs)]
        seconds = statistics.median(float(str(r["seconds"])) for r in runs)
        results[name] = {**runs[0], "seconds_median": round(seconds, 2),
                         "seconds_all": [round(float(str(r["seconds"])), 2) for r in runs],
                         "prompts_all": [r["prompts"] for r in runs]}  # fmt: skip
        r = results[name]
        print(
            f"{name:10} sizes {r['top']:>4}..1  prompts {r['prompts_all']}  time median {r['seconds_median']:.2f} s "
            f"{r['seconds_all']}  ok {r['ok']}  capped: {r['capped'] or '-'}",
            flush=True,
        )
        if r["detail"]:
            print(f"{'':10} detail: {r['detail']}", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
