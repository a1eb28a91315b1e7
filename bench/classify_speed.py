"""How long the exit classifier takes on the longest tail the daemon hands it.

    .venv/bin/python bench/classify_speed.py [--runs 200]

The daemon reads at most 2000 lines of a dead unit's output; kill -> classified
has a 50 ms budget, of which this is the pure part. Prints min/median/p99 in ms
for a healthy tail ending in a CUDA OOM, and for a tail where every line is an
error (the worst case for the line rules).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from supervisor.core.classify import ExitSnapshot, classify

SAMPLES = Path(__file__).resolve().parents[1] / "tests" / "unit" / "samples"


def _time(lines: list[str], runs: int) -> list[float]:
    snap = ExitSnapshot("sglang-k26.service", "signal", 2, 9, 4242, "/system.slice/x.service")
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        classify(snap, [], lines)
        out.append((time.perf_counter() - started) * 1000)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    oom = (SAMPLES / "torch_cuda_oom_h200.txt").read_text().splitlines()
    healthy = [
        f"[2025-01-01 10:00:{i % 60:02d} TP0] Decode batch. #running-req: 12, #token: 5000, "
        "token usage: 0.05, gen throughput (token/s): 1200.00, #queue-req: 0"
        for i in range(2000 - len(oom))
    ]
    errors = [
        f"RuntimeError: CUDA error: an illegal memory access was encountered {i}"
        for i in range(2000)
    ]
    for label, lines in (
        ("healthy tail + CUDA OOM", [*healthy, *oom]),
        ("2000 error lines", errors),
    ):
        ms = _time(lines, args.runs)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        print(
            f"{label:28s} min {ms[0]:6.2f} ms  median {statistics.median(ms):6.2f} ms  "
            f"p99 {p99:6.2f} ms  ({args.runs} runs, {len(lines)} lines)"
        )


if __name__ == "__main__":
    main()
