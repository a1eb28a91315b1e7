"""What the pulled bundle's verdict costs: listing the caches at the pull and at READY.

``adapters/warmup.list_artifacts`` walks every cache the pull filled and stats each
artifact (size and mtime, so that a module rebuilt in place counts); ``judge``
compares two listings. Both run in a worker thread, once after a pull and once per
unit's READY. This lays out Triton caches of N kernels (4 files each, as Triton 3.x
writes them) beside a FlashInfer cache of 6 modules, and prints, per size, the
median of ``--runs`` listings, a names-only walk of the same tree for comparison
(what the listing cost before it stat'ed), and one judge.

    .venv/bin/python bench/bundle_verdict.py [--kernels 250,2500,12500] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from statistics import median

from supervisor.adapters.warmup import list_artifacts
from supervisor.core.bundle_use import BundleUse, judge


def lay_out(base: Path, kernels: int) -> dict[str, Path]:
    triton = base / "triton"
    for i in range(kernels):
        entry = triton / f"{i:032x}"
        entry.mkdir(parents=True)
        for suffix in (".cubin", ".json", ".source", ".ttir"):
            (entry / f"kernel_{i}{suffix}").write_bytes(b"k" * 64)
    flashinfer = base / "flashinfer" / ".cache" / "flashinfer"
    tag = flashinfer / "0.7.4" / "90a"
    for name in ("norm", "sampling", "page", "rope", "quantization", "topk"):
        build = tag / "cached_ops" / name
        build.mkdir(parents=True)
        for file in (f"{name}.so", f"{name}.cuda.o", "build.ninja", ".ninja_log"):
            (build / file).write_bytes(b"m" * 256)
        (tag / "generated" / name).mkdir(parents=True)
        (tag / "generated" / name / f"{name}.cu").write_text("// rendered")
    (tag / "k26-fingerprint.json").write_text("{}")
    return {"flashinfer": flashinfer, "triton": triton}


def names_only(roots: dict[str, Path]) -> int:
    return sum(len(files) for root in roots.values() for _d, _s, files in os.walk(root))


def timed(call: object, runs: int) -> float:
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        call()  # type: ignore[operator]
        seconds.append(time.perf_counter() - started)
    return median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernels", default="250,2500,12500", help="Triton kernels, comma separated"
    )
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    use = BundleUse("sha256:" + "0" * 64, "http://registry:5000/k26/b", "2026-12-05T00:00:00Z")
    print(f"{'kernels':>8} {'files':>7} {'listing ms':>11} {'names only ms':>14} {'judge ms':>9}")
    for kernels in (int(k) for k in args.kernels.split(",")):
        with tempfile.TemporaryDirectory(prefix="k26-verdict-") as tmp:
            roots = lay_out(Path(tmp), kernels)
            listing = list_artifacts(roots)
            files = sum(len(v) for v in listing.values())
            list_s = timed(lambda r=roots: list_artifacts(r), args.runs)
            walk_s = timed(lambda r=roots: names_only(r), args.runs)
            judge_s = timed(lambda lst=listing: judge(use, "u.service", lst, lst), args.runs)
            print(f"{kernels:>8} {files:>7} {list_s * 1e3:>11.1f} {walk_s * 1e3:>14.1f} "
                  f"{judge_s * 1e3:>9.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
