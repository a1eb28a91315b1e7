"""What listing a unit's JIT caches costs, once before and once after each coverage shape.

    .venv/bin/python bench/coverage_census.py [--runs 20] [--json]

Each coverage shape says what the unit's caches gained while it played
(``ShapeOutcome.compiled``): the daemon lists every cache root at each shape's end,
off the event loop (``adapters/learned_shapes.census``). Built here, in a temporary
directory, at three sizes: the tiny EAGLE-3 pair's caches after a learned start on the
H100 (2026-12-05: 706 Triton variants of 8 files, inductor's 10 files, FlashInfer's 16
modules), then ten and fifty times as many (a host that served many configurations).
Printed per size: the files, and the census's median and worst time over the runs.
A coverage of N shapes pays it about N times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from supervisor.adapters.learned_shapes import census

TRITON_FILES = ("k.source", "k.ttir", "k.ttgir", "k.llir", "k.ptx", "k.cubin", "k.json",
                "__grp__k.json")  # fmt: skip
FLASHINFER_FILES = ("m.so", "m.cuda.o", "build.ninja", "m.cu")


def build(root: Path, scale: int) -> dict[str, list[Path]]:
    triton, inductor, flashinfer = root / "triton", root / "inductor", root / "flashinfer"
    for i in range(706 * scale):
        entry = triton / f"V{i:06d}"
        entry.mkdir(parents=True)
        for name in TRITON_FILES:
            (entry / name).write_bytes(b"")
    for i in range(10 * scale):
        shard = inductor / f"{i % 97:02x}"
        shard.mkdir(parents=True, exist_ok=True)
        (shard / f"c{i:06d}.py").write_bytes(b"")
    for i in range(16 * scale):
        module = flashinfer / "cached_ops" / f"mod{i}"
        module.mkdir(parents=True)
        for name in FLASHINFER_FILES:
            (module / name).write_bytes(b"")
    return {"triton": [triton], "inductor": [inductor], "flashinfer": [flashinfer]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for scale in (1, 10, 50):
        with tempfile.TemporaryDirectory() as tmp:
            roots = build(Path(tmp), scale)
            files = sum(1 for p in Path(tmp).rglob("*") if p.is_file())
            took = []
            for _ in range(args.runs):
                tic = time.perf_counter()
                seen = census(roots)
                took.append((time.perf_counter() - tic) * 1000.0)
            entries = sum(len(v) for v in seen.values())
            rows.append({"scale": scale, "files": files, "entries": entries,
                         "median_ms": round(statistics.median(took), 2),
                         "max_ms": round(max(took), 2)})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'caches':>8} {'files':>8} {'entries':>8} {'median':>9} {'worst':>9}")
    for r in rows:
        print(f"{'x' + str(r['scale']):>8} {r['files']:>8} {r['entries']:>8} "
              f"{r['median_ms']:>7.2f}ms {r['max_ms']:>7.2f}ms")  # fmt: skip


if __name__ == "__main__":
    main()
