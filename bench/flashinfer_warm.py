"""Benchmark: FlashInfer JIT warm-up of the sampling module for arch 12.0.

Prints three numbers:
  cold warm-up      warm() on an empty workspace: a real nvcc build of FlashInfer
                    0.7.4's sampling module (sm_120f), plus verification
  warm verification warm() on the warmed cache: fingerprint and file checks only,
                    median and max of --repeat runs (target: under 2 s)
  cache size        bytes on disk under the arch's cache directory after warm-up

Run it on an otherwise idle machine:
    .venv/bin/python bench/flashinfer_warm.py [--repeat 5] [--keep]
The serving venv comes from scripts/serving-venv.sh 0.7 (in the shared cache).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k26dev import shared_cache  # noqa: E402
from supervisor.flashinfer import read_env_file, warm  # noqa: E402


def disk_bytes(path: Path) -> int:
    """Allocated bytes (what du counts), so sparse or small files are not misread."""
    total = 0
    for directory, _dirs, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the workspace")
    args = parser.parse_args()
    venv = shared_cache.serving_venv("0.7")
    python = venv / "bin" / "python"
    env = read_env_file(venv / "k26-build.env")
    workspace = Path(tempfile.mkdtemp(prefix="k26-bench-"))
    try:
        cold = asyncio.run(warm(python, "12.0", workspace, env=env))
        if not cold.ok:
            print(f"cold warm-up failed: {cold.error}", file=sys.stderr)
            return 1
        again = []
        for _ in range(args.repeat):
            result = asyncio.run(warm(python, "12.0", workspace, env=env))
            assert result.ok and not result.built, result
            again.append(result.duration_s)
        arch_dir = workspace / ".cache" / "flashinfer" / "0.7.4" / "120f"
        module = arch_dir / "cached_ops" / "sampling" / "sampling.so"
        print(f"cold warm-up (sampling, 12.0 -> sm_120f, {os.cpu_count()} cores): "
              f"{cold.duration_s:.1f} s")  # fmt: skip
        print(f"warm-cache verification: median {statistics.median(again):.3f} s, "
              f"max {max(again):.3f} s over {len(again)} runs (target < 2 s)")  # fmt: skip
        print(f"warmed cache on disk: {disk_bytes(arch_dir) / 2**20:.1f} MiB under {arch_dir.name}/ "
              f"(sampling.so {module.stat().st_size / 2**20:.2f} MiB)")  # fmt: skip
    finally:
        if args.keep:
            print(f"workspace kept: {workspace}")
        else:
            shutil.rmtree(workspace, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
