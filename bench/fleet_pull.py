"""A simulated fleet pulling its JIT caches from one registry at once; prints numbers.

One build host pushes a bundle (FlashInfer's cache, Triton's, inductor's) to a real
OCI registry (Debian's docker-registry, bench/fleet_registry.py) on loopback; then
N nodes pull it at the same moment, each a real ``k26-supervisor flashinfer bundle
pull`` process in a mount namespace of its own where its own directory is mounted
at the one path every node uses (a node is another disk at the same path: the
FlashInfer and inductor caches must be restored where they were built). Each node's
files are checked against the build host's, byte for byte and mtime for mtime.

The FlashInfer cache is a real nvcc-built module (tests/unit/flashinfer/data) with
its fingerprint written for the real serving venv's identity (as warm writes it),
its build dir padded with object files to a realistic size; Triton's is laid out as
Triton 3.x lays it out, inductor's as inductor does. What is measured is the pull:
asking the serving venv who it is, the manifest, the layers, the check and the
install. Needs root (mount namespaces), scripts/tools.sh (docker-registry) and the
0.7 serving venv (scripts/serving-venv.sh 0.7).

    .venv/bin/python bench/fleet_pull.py [--nodes 1,4,8] [--triton-kernels 200] [--fi-mib 8]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any

from fleet_registry import RegistryProcess

from k26dev import shared_cache
from supervisor.flashinfer import cache, read_env_file
from supervisor.flashinfer.venv import ServingEnv
from supervisor.fleet import bundle
from supervisor.fleet.archive import utc_stamp

ROOT = Path(__file__).resolve().parents[1]
SO = ROOT / "tests/unit/flashinfer/data/k_sm_120f.so"
CLI = str(Path(sys.executable).with_name("k26-supervisor"))
ARCH = "12.0"
MiB = 1 << 20


def kernel_bytes(size: int, seed: int) -> bytes:
    """Half incompressible, half zeros: about what a cubin compresses to."""
    noise = hashlib.shake_256(seed.to_bytes(8, "little")).digest(size // 2)
    return noise + bytes(size - len(noise))


def build_host(node: Path, python: Path, env: dict[str, str], kernels: int, fi_mib: int) -> None:
    """The caches a build host has after a warm-up and a coverage warm-up."""
    workspace = node / "ws"
    arch_dir = cache.cache_root(workspace) / "0.7.4" / "120f"
    build_dir = arch_dir / "cached_ops" / "sampling"
    build_dir.mkdir(parents=True)
    so = build_dir / "sampling.so"
    shutil.copy(SO, so)
    for n in range(4):
        (build_dir / f"csrc_sampling_{n}.cuda.o").write_bytes(kernel_bytes(fi_mib * MiB // 4, n))
    (build_dir / "build.ninja").write_text(f"build {so}: link\n")
    identity = asyncio.run(bundle.host_identity(ServingEnv(python, ARCH, workspace, env)))
    data = so.read_bytes()
    cache.write_fingerprint(
        cache.Fingerprint(
            arch=ARCH,
            arch_tag="120f",
            identity=identity,
            modules={
                "sampling": {
                    "path": str(so),
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "targets": ["sm_120f"],
                }
            },
            built_at=utc_stamp(),
            path=arch_dir / cache.FINGERPRINT_NAME,
        )
    )
    triton = node / "triton"
    for n in range(kernels):
        key = triton / hashlib.sha256(f"kernel{n}".encode()).hexdigest()[:52].upper()
        key.mkdir(parents=True)
        (key / "_kernel.cubin").write_bytes(kernel_bytes(48 << 10, 1000 + n))
        (key / "_kernel.json").write_text(json.dumps({"name": "_kernel", "num_warps": 4}))
        children = {f: str(key / f) for f in ("_kernel.cubin", "_kernel.json")}
        (key / "__grp___kernel.json").write_text(json.dumps({"child_paths": children}))
    inductor = node / "inductor"
    for n in range(kernels // 4):
        code = inductor / f"{n % 256:02x}" / f"c{n:08x}.py"
        code.parent.mkdir(parents=True, exist_ok=True)
        code.write_text(f"# kernel path: {code}\n" + "x = 1\n" * 1000)


# What a node carries, hashed; run in the node's own namespace by check_in (no imports
# of ours there: a plain interpreter).
CARRIED = """
import hashlib, json, sys
from pathlib import Path
node = Path(sys.argv[1])
out = {}
for root in (node / "ws/.cache/flashinfer/0.7.4/120f/cached_ops", node / "triton", node / "inductor"):
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(node))] = [hashlib.sha256(path.read_bytes()).hexdigest(),
                                                path.stat().st_mtime_ns]
print(json.dumps(out))
"""


def carried(node: Path) -> dict[str, list[Any]]:
    done = subprocess.run(
        [sys.executable, "-c", CARRIED, str(node)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def pull_command(mine: Path, mountpoint: Path, args: list[str]) -> list[str]:
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "node",
        str(mine), str(mountpoint), *args,
    ]  # fmt: skip


def check_in(mine: Path, mountpoint: Path, expected: dict[str, list[Any]]) -> bool:
    """The node's files, seen at the shared path inside its own namespace."""
    argv = [sys.executable, "-c", CARRIED, str(mountpoint)]
    done = subprocess.run(
        pull_command(mine, mountpoint, argv), capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout) == expected  # type: ignore[no-any-return]


def fleet(n: int, base: Path, mountpoint: Path, pull: list[str], expected: Any) -> dict[str, Any]:
    nodes = [base / f"n{n}-{i}" for i in range(n)]
    for mine in nodes:
        mine.mkdir()
    started = time.monotonic()
    procs = []
    for mine in nodes:  # all started before any is waited for: at once
        command = pull_command(mine, mountpoint, [CLI, *pull])
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append((mine, time.monotonic(), proc))

    def finish(item: tuple[Path, float, subprocess.Popen[str]]) -> dict[str, Any]:
        mine, began, proc = item
        out, err = proc.communicate(timeout=600)
        wall = time.monotonic() - began  # this node's own end, not when it was read
        if proc.returncode != 0:
            raise SystemExit(f"node {mine.name}: pull exited {proc.returncode}: {err.strip()}")
        return {"node": mine.name, "wall_s": wall, **json.loads(out)}

    with ThreadPoolExecutor(max_workers=n) as pool:
        rows = list(pool.map(finish, procs))
    total = time.monotonic() - started
    ok = all(check_in(mine, mountpoint, expected) for mine in nodes)
    for mine in nodes:
        shutil.rmtree(mine)
    return {"nodes": n, "rows": rows, "total_s": total, "identical": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,4,8", help="fleet sizes, comma separated")
    parser.add_argument("--triton-kernels", type=int, default=200)
    parser.add_argument("--fi-mib", type=int, default=8, help="FlashInfer module objects, MiB")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("fleet_pull needs root: each node is a mount namespace")
    venv = shared_cache.serving_venv("0.7")
    python = venv / "bin" / "python"
    env_file = venv / "k26-build.env"
    base = Path(tempfile.mkdtemp(prefix="k26-fleet-"))
    try:
        mountpoint = base / "node"  # the path every node uses
        env = read_env_file(env_file)
        units_env = base / "units.env"
        pinned = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
        lines = {**env, **{k: str(mountpoint / v) for k, v in pinned.items()}}
        units_env.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        build_host(mountpoint, python, env, args.triton_kernels, args.fi_mib)
        expected = carried(mountpoint)
        common = ["--python", str(python), "--arch", ARCH, "--workspace", str(mountpoint / "ws"),
                  "--env-file", str(units_env)]  # fmt: skip
        with RegistryProcess(base / "registry") as reg:
            began = time.monotonic()
            done = subprocess.run(
                [CLI, "flashinfer", "bundle", "push", *common, "--registry", reg.url, "--json"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"push failed: {done.stderr.strip()}")
            pushed = json.loads(done.stdout)
            push_s = time.monotonic() - began
            layers = ", ".join(
                f"{c['cache']} {c['size_bytes'] / MiB:.1f} MiB ({c['files']} files)"
                for c in pushed["caches"]
            )
            size = sum(c["size_bytes"] for c in pushed["caches"])
            print(
                f"build host: pushed {size / MiB:.1f} MiB in {push_s:.2f} s "
                f"(CLI process; layers: {layers})"
            )
            shutil.rmtree(mountpoint)
            mountpoint.mkdir()
            pull = ["flashinfer", "bundle", "pull", *common, "--registry", reg.url, "--json"]
            print(f"cores: {os.cpu_count()}; registry: docker-registry on loopback")
            print(
                f"{'nodes':>5} {'node':>6} {'wall_s':>7} {'pull_s':>7} {'ident_s':>7} "
                f"{'fetch_s':>7} {'inst_s':>7} {'MiB':>6}"
            )
            for n in (int(x) for x in args.nodes.split(",")):
                run = fleet(n, base, mountpoint, pull, expected)
                for row in run["rows"]:
                    phases = row["phases_s"]
                    print(
                        f"{n:>5} {row['node'].split('-')[-1]:>6} {row['wall_s']:>7.2f} "
                        f"{row['duration_s']:>7.2f} {phases['identity']:>7.2f} "
                        f"{phases.get('fetch', 0):>7.2f} {phases.get('install', 0):>7.2f} "
                        f"{row['bytes_fetched'] / MiB:>6.1f}"
                    )
                fetched = sum(r["bytes_fetched"] for r in run["rows"])
                walls = sorted(r["wall_s"] for r in run["rows"])
                medians = {
                    "wall": median(r["wall_s"] for r in run["rows"]),
                    "pull": median(r["duration_s"] for r in run["rows"]),
                    **{
                        phase: median(r["phases_s"].get(phase, 0.0) for r in run["rows"])
                        for phase in ("identity", "fetch", "install")
                    },
                }
                print(
                    f"{n:>5} total {run['total_s']:.2f} s (first start to last done) for "
                    f"{fetched / MiB:.1f} MiB fetched; per node median "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items())
                    + f", max wall {walls[-1]:.2f} s; every node identical to the build "
                    f"host: {run['identical']}"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
