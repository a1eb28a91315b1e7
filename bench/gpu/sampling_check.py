"""Prove on a real GPU that a FlashInfer `sampling` module warmed on a GPU-less machine works.

One command, on any host with an NVIDIA GPU, python3 + torch (CUDA), apache-tvm-ffi and
(for the cold build) flashinfer-python + nvcc:

    python3 bench/gpu/sampling_check.py --cache bench/gpu/.work/cache --arch 9.0 --out OUTDIR

(`bench/gpu/run.sh` wraps it for a bare GPU host: it installs the carried wheels first.)

`--cache` is the FLASHINFER_WORKSPACE_BASE that `k26-supervisor flashinfer warm` filled on the
build machine. Each phase runs in a fresh Python process, so CUDA context, page cache of the
module aside, every phase starts equal:

  env     versions: GPU, driver, CUDA, nvcc, torch, apache-tvm-ffi, flashinfer, python
  warm    FLASHINFER_DISABLE_JIT=1, CUDA_DISABLE_PTX_JIT=1, an empty TVM_FFI_CACHE_DIR:
          tvm_ffi.load_module(<carried sampling.so>) then the first sampled call, timed;
          then the correctness checks against a float64 torch reference (first run only).
          Run --warm-runs times (fresh processes); the first is the headline number.
  loader  what FlashInfer's own loader does with the carried cache (no timing, no build):
          build_and_load() under FLASHINFER_DISABLE_JIT=1, and `ninja -n -d explain` on a copy
          to show whether it would rebuild without that variable.
  cold    an empty workspace, no FLASHINFER_DISABLE_JIT: FlashInfer's own JIT build of the
          same module (JitSpec.build(), then .load()), then the first sampled call, timed.
          Its samples for a fixed input are compared with the warm module's.

The sampled call is the raw kernel `top_k_top_p_sampling_from_probs(probs, samples, valid,
indices, top_k_arr, top_k, top_p_arr, top_p, deterministic, seed_arr, seed, offset_arr, offset)`,
which applies top-k and top-p jointly on the original probabilities: token i is eligible iff
fewer than k tokens have a larger probability AND their probability mass is below top_p; it is
drawn with probability proportional to p_i among the eligible tokens.

Writes OUTDIR/result.json (everything) and prints a summary table. Exit 0 only if every check
passed and both timings were taken.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

MARK = "K26-PHASE-RESULT "
HERE = Path(__file__).resolve().parent

# The first (timed) call: a realistic decode batch.
FIRST_BATCH, FIRST_VOCAB, FIRST_K, FIRST_P, FIRST_SEED = 8, 151936, 50, 0.9, 7
# Membership test: rows x vocab, repeated with different seeds.
MEMBER_ROWS, MEMBER_REPEATS = 64, 50
MEMBER_VOCABS = (1000, 151936)
# Frequency test: (vocab, top_k, target top_p, logit scale); top_k == vocab means no top-k.
FREQ_ROWS = (
    (1000, 20, 0.8, 2.0),
    (1000, 1000, 0.9, 1.5),
    (1000, 10, 1.0, 1.0),
    (32000, 100, 0.95, 2.5),
    (151936, 50, 0.9, 3.0),
)
ABS_TOL = 0.005  # max |frequency - renormalised probability|, any token
CHI2_MIN_P = 1e-4  # chi-square goodness-of-fit p-value must be at least this
BOUNDARY_EPS = 1e-4  # |mass above token - top_p| below this: float32 vs float64 may disagree
DEVICE = "cuda"  # the checks run on the CPU only in the checker's own self-test


# ----------------------------------------------------------------------------- helpers


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_text(cmd: list[str], timeout: float = 60) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def verify_flashinfer_record() -> dict[str, Any] | None:
    """Check the installed flashinfer files against its wheel's RECORD (a subset may be present)."""
    import base64
    import csv

    try:
        dist = importlib.metadata.distribution("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None
    record = dist.read_text("RECORD") or ""
    root = Path(str(dist.locate_file("")))
    checked = mismatched = absent = 0
    for row in csv.reader(record.splitlines()):
        if len(row) < 2 or not row[1].startswith("sha256=") or not row[0].startswith("flashinfer/"):
            continue
        path = root / row[0]
        if not path.exists():
            absent += 1
            continue
        want = row[1][len("sha256=") :]
        got = (
            base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
            .rstrip(b"=")
            .decode()
        )
        checked += 1
        mismatched += got != want
    return {"root": str(root), "files_match_record": checked - mismatched, "mismatched": mismatched,
            "in_record_not_present": absent}  # fmt: skip


def find_module_so(workspace: Path) -> Path:
    hits = sorted(
        glob.glob(str(workspace / ".cache/flashinfer/*/*/cached_ops/sampling/sampling.so"))
    )
    if len(hits) != 1:
        raise SystemExit(f"expected one sampling.so under {workspace}, found {hits}")
    return Path(hits[0])


def import_flashinfer_jit() -> tuple[Any, str]:
    """Import flashinfer.jit without running flashinfer/__init__.py.

    flashinfer/__init__.py imports every kernel family's Python API, which pulls in
    nvidia-cutlass-dsl, nvidia-cudnn-frontend, cuda-tile, ... (about 600 MB) that the sampling
    build never uses. The JIT machinery itself (flashinfer.jit: JitSpec, ninja generation,
    nvcc flags, cache paths) is what a cold build runs, and it is imported unchanged.
    """
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("flashinfer is not installed")
    pkg = types.ModuleType("flashinfer")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = spec.origin
    sys.modules["flashinfer"] = pkg
    sampling = importlib.import_module("flashinfer.jit.sampling")
    return sampling, str(pkg.__path__[0])


def cuda_build_env() -> dict[str, Any]:
    """What FlashInfer's nvcc build needs on this host that it does not find by itself."""
    added: dict[str, str] = {}
    notes: list[str] = []
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if not cuda_home and nvcc:
        cuda_home = str(Path(os.path.realpath(nvcc)).parent.parent)
        added["CUDA_HOME"] = cuda_home
    if not cuda_home:
        return {"ok": False, "added": added, "notes": ["no nvcc on PATH and no CUDA_HOME"]}
    home = Path(cuda_home)
    if not (home / "include" / "curand.h").exists():
        found = [p for d in sys.path for p in glob.glob(f"{d}/nvidia/*/include/curand.h")]
        if found:
            inc = str(Path(found[0]).parent)
            added["CPATH"] = ":".join(x for x in [inc, os.environ.get("CPATH")] if x)
            notes.append(f"curand.h not in {home}/include; using {inc}")
        else:
            notes.append("curand.h not found")
    if not any((home / d / "libcudart.so").exists() for d in ("lib64", "lib")):
        notes.append("libcudart.so not in CUDA_HOME/lib64")
    libcuda = [home / "lib64/stubs/libcuda.so", Path("/usr/lib/x86_64-linux-gnu/libcuda.so")]
    if not any(p.exists() for p in libcuda):
        real = sorted(
            glob.glob("/usr/local/nvidia/lib64/libcuda.so*")
            + glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so*")
        )
        notes.append(f"no libcuda.so for -lcuda in {[str(p) for p in libcuda]}; driver has {real}")
        if real:
            link_dir = Path(tempfile.mkdtemp(prefix="k26-libcuda-"))
            (link_dir / "libcuda.so").symlink_to(real[0])
            added["LIBRARY_PATH"] = ":".join(
                x for x in [str(link_dir), os.environ.get("LIBRARY_PATH")] if x
            )
    return {"ok": True, "cuda_home": cuda_home, "added": added, "notes": notes}


# ----------------------------------------------------------------------------- torch side


def cuda_ready() -> tuple[Any, float]:
    """Import torch and create the CUDA context, outside any timed region."""
    t0 = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    return torch, time.perf_counter() - t0


def make_probs(torch: Any, rows: int, vocab: int, scale: Any, seed: int) -> Any:
    """Float32 probability rows from softmax(N(0,1) * scale), on the GPU."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    scale_t = torch.as_tensor(scale, dtype=torch.float64).reshape(-1, 1)
    probs = torch.softmax(logits * scale_t, dim=-1).to(torch.float32)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(DEVICE).contiguous()


def sample(
    module_fn: Any,
    torch: Any,
    probs: Any,
    *,
    top_k: Any,
    top_p: Any,
    seed: int,
    offset: int = 0,
    indices: Any = None,
) -> tuple[Any, Any]:
    """One call of the raw kernel. top_k / top_p: a number or a per-row CUDA tensor."""
    n = indices.numel() if indices is not None else probs.shape[0]
    dtype = indices.dtype if indices is not None else torch.int32
    out = torch.empty(n, dtype=dtype, device=probs.device)
    valid = torch.empty(n, dtype=torch.bool, device=probs.device)
    k_arr = top_k if isinstance(top_k, torch.Tensor) else None
    p_arr = top_p if isinstance(top_p, torch.Tensor) else None
    k_val = 0.0 if k_arr is not None else float(top_k)
    p_val = 0.0 if p_arr is not None else float(top_p)
    module_fn(
        probs, out, valid, indices, k_arr, k_val, p_arr, p_val, True, None, seed, None, offset
    )
    return out, valid


def reference_sets(torch: Any, probs: Any, top_k: Any, top_p: Any) -> dict[str, Any]:
    """Float64 reference on the CPU: the joint top-k/top-p set of each row.

    Returns boolean masks in vocabulary order: `member` (in the set), `boundary` (the mass above
    the token is within BOUNDARY_EPS of top_p, where the kernel's float32 sums may decide
    either way), and the renormalised probabilities over the set.
    """
    p = probs.detach().to("cpu", torch.float64)
    rows = p.shape[0]
    k = torch.as_tensor(top_k, dtype=torch.float64).reshape(-1, 1).expand(rows, 1).cpu()
    tp = (
        torch.as_tensor(top_p, dtype=torch.float32)
        .to(torch.float64)
        .reshape(-1, 1)
        .expand(rows, 1)
        .cpu()
    )
    s, order = torch.sort(p, dim=-1, descending=True)
    cum_before = torch.cumsum(s, dim=-1) - s  # mass of the tokens sorted before j
    # Ties: "strictly greater" means the mass and count before the first of the tie group.
    first = torch.searchsorted((-s).contiguous(), (-s).contiguous(), right=False)
    greater_count = first.to(torch.float64)
    greater_sum = torch.gather(cum_before, 1, first)
    member_sorted = (greater_count < k) & (greater_sum < tp)
    boundary_sorted = (greater_count < k) & ((greater_sum - tp).abs() < BOUNDARY_EPS)
    member = torch.zeros_like(member_sorted).scatter_(1, order, member_sorted)
    boundary = torch.zeros_like(boundary_sorted).scatter_(1, order, boundary_sorted)
    renorm = torch.where(member, p, torch.zeros_like(p))
    renorm = renorm / renorm.sum(dim=-1, keepdim=True)
    return {"member": member, "boundary": boundary, "renorm": renorm, "set_size": member.sum(-1)}


def midpoint_top_p(torch: Any, row: Any, top_k: int, target: float) -> float:
    """A top_p near `target` that lies halfway between two cumulative masses of the row, so
    that no token sits at the float32/float64 boundary."""
    if target >= 1.0:
        return 1.0
    s, _ = torch.sort(row.detach().cpu().to(torch.float64), descending=True)
    before = torch.cumsum(s, 0) - s
    j = int((before < target).sum())  # tokens 0..j-1 eligible at `target`
    j = max(1, min(j, s.numel() - 1))
    return float((before[j - 1] + before[j]) / 2)


def chi2_sf(stat: float, dof: int) -> float:
    try:
        from scipy.stats import chi2  # type: ignore[import-not-found]

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty approximation
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def check_membership(fn: Any, torch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": []}
    ok = True
    for vocab in MEMBER_VOCABS:
        gen = torch.Generator(device="cpu").manual_seed(vocab)
        scale = 0.5 + 3.5 * torch.rand(MEMBER_ROWS, generator=gen, dtype=torch.float64)
        probs = make_probs(torch, MEMBER_ROWS, vocab, scale, seed=1000 + vocab)
        k = torch.randint(1, 201, (MEMBER_ROWS,), generator=gen, dtype=torch.int32)
        p = (0.1 + 0.89 * torch.rand(MEMBER_ROWS, generator=gen)).to(torch.float32)
        k[::8] = vocab  # rows with no top-k
        p[1::8] = 1.0  # rows with no top-p
        ref = reference_sets(torch, probs, k, p)
        k_cuda, p_cuda = k.to(DEVICE), p.to(DEVICE)
        draws, outside, on_boundary, invalid = 0, 0, 0, 0
        for rep in range(MEMBER_REPEATS):
            ids, valid = sample(fn, torch, probs, top_k=k_cuda, top_p=p_cuda, seed=10_000 + rep)
            ids = ids.long().cpu().reshape(-1, 1)
            invalid += int((~valid).sum())
            in_set = torch.gather(ref["member"], 1, ids).squeeze(1)
            at_edge = torch.gather(ref["boundary"], 1, ids).squeeze(1)
            outside += int((~in_set & ~at_edge).sum())
            on_boundary += int((~in_set & at_edge).sum())
            draws += ids.numel()
        case_ok = outside == 0 and invalid == 0
        ok &= case_ok
        out["cases"].append({
            "vocab": vocab, "rows": MEMBER_ROWS, "draws": draws, "outside_set": outside,
            "outside_but_within_boundary_eps": on_boundary, "invalid_rows": invalid,
            "set_size_min": int(ref["set_size"].min()), "set_size_max": int(ref["set_size"].max()),
            "ok": case_ok,
        })  # fmt: skip
    out["ok"] = ok
    return out


def check_frequencies(fn: Any, torch: Any, draws: int) -> dict[str, Any]:
    out: dict[str, Any] = {"draws_per_row": draws, "abs_tol": ABS_TOL, "chi2_min_p": CHI2_MIN_P,
                           "rows": []}  # fmt: skip
    ok = True
    indices = torch.zeros(draws, dtype=torch.int32, device=DEVICE)
    for n, (vocab, k, target, scale) in enumerate(FREQ_ROWS):
        probs = make_probs(torch, 1, vocab, scale, seed=2000 + n)
        top_p = midpoint_top_p(torch, probs[0], k, target)
        ref = reference_sets(torch, probs, k, top_p)
        ids, valid = sample(fn, torch, probs, top_k=k, top_p=top_p, seed=555 + n, indices=indices)
        counts = torch.bincount(ids.long().cpu(), minlength=vocab).to(torch.float64)
        expected = ref["renorm"][0]
        member = ref["member"][0]
        freq = counts / draws
        outside = int(counts[~member].sum())
        max_abs = float((freq - expected).abs().max())
        # chi-square over the set; tokens with expected count < 5 pooled into one bin
        e = expected[member] * draws
        c = counts[member]
        big = e >= 5
        obs = torch.cat([c[big], c[~big].sum().reshape(1)]) if (~big).any() else c[big]
        exp = torch.cat([e[big], e[~big].sum().reshape(1)]) if (~big).any() else e[big]
        stat = float(((obs - exp) ** 2 / exp).sum())
        dof = max(1, obs.numel() - 1)
        pval = chi2_sf(stat, dof) if obs.numel() > 1 else 1.0
        se = (expected * (1 - expected) / draws).sqrt()
        z = ((freq - expected).abs() / torch.where(se > 0, se, torch.ones_like(se)))[member]
        row_ok = outside == 0 and bool(valid.all()) and max_abs <= ABS_TOL and pval >= CHI2_MIN_P
        ok &= row_ok
        out["rows"].append({
            "vocab": vocab, "top_k": k, "top_p": round(top_p, 6), "set_size": int(member.sum()),
            "set_mass": float(probs[0].double().cpu()[member].sum()),
            "outside_set": outside, "max_abs_err": max_abs, "max_abs_z": float(z.max()),
            "chi2": stat, "chi2_dof": dof, "chi2_p": pval, "ok": row_ok,
        })  # fmt: skip
    out["ok"] = ok
    return out


def fixed_case(torch: Any) -> tuple[Any, dict[str, Any]]:
    probs = make_probs(torch, FIRST_BATCH, FIRST_VOCAB, 3.0, seed=FIRST_SEED)
    return probs, {"top_k": FIRST_K, "top_p": FIRST_P, "seed": FIRST_SEED}


# ----------------------------------------------------------------------------- phases


def phase_env(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "torch_has_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
        "cuda_available": torch.cuda.is_available(),
        "packages": {n: dist_version(n) for n in (
            "torch", "apache-tvm-ffi", "flashinfer-python", "numpy", "ninja", "scipy",
            "cuda-bindings", "nvidia-ml-py", "filelock", "jinja2", "requests")},
        "nvidia_smi": run_text(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                                "--format=csv,noheader"]),
        "nvidia_smi_cuda": next((ln.strip() for ln in run_text(["nvidia-smi"]).splitlines()
                                 if "CUDA Version" in ln), None),
        "nvcc": run_text(["nvcc", "--version"]).splitlines()[-2:] if shutil.which("nvcc") else None,
        "nvcc_path": shutil.which("nvcc"), "ninja": shutil.which("ninja"),
        "cxx": run_text(["c++", "--version"]).splitlines()[:1],
        "cpus": os.cpu_count(),
    }  # fmt: skip
    info["brought_to_this_host"] = os.environ.get("K26_BROUGHT", "nothing (run.sh not used)")
    info["flashinfer_record_check"] = verify_flashinfer_record()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    so = find_module_so(Path(args.cache))
    info["carried_module"] = {"path": str(so), "size": so.stat().st_size, "sha256": sha256(so)}
    fp = so.parents[2] / "k26-fingerprint.json"
    if fp.exists():
        recorded = json.loads(fp.read_text())["modules"]["sampling"]
        info["carried_module"]["fingerprint_sha256"] = recorded["sha256"]
        info["carried_module"]["fingerprint_targets"] = recorded.get("targets")
        info["carried_module"]["matches_fingerprint"] = (
            recorded["sha256"] == info["carried_module"]["sha256"]
        )
    if shutil.which("cuobjdump"):
        info["cuobjdump_list_elf"] = run_text(["cuobjdump", "--list-elf", str(so)]).splitlines()[
            :12
        ]
        info["cuobjdump_list_ptx"] = run_text(["cuobjdump", "--list-ptx", str(so)]).splitlines()[
            :12
        ]
    return info


def phase_warm(args: argparse.Namespace) -> dict[str, Any]:
    so = find_module_so(Path(args.cache))
    before = sha256(so)
    t_imp = time.perf_counter()
    torch, t_ctx = cuda_ready()
    import tvm_ffi

    import_s = time.perf_counter() - t_imp
    probs, case = fixed_case(torch)
    torch.cuda.synchronize()

    t0 = time.perf_counter()
    module = tvm_ffi.load_module(str(so))
    t1 = time.perf_counter()
    ids, valid = sample(module.top_k_top_p_sampling_from_probs, torch, probs,
                        top_k=case["top_k"], top_p=case["top_p"], seed=case["seed"])  # fmt: skip
    torch.cuda.synchronize()
    t2 = time.perf_counter()

    result: dict[str, Any] = {
        "load_s": t1 - t0, "first_call_s": t2 - t1, "total_s": t2 - t0,
        "outside_timer": {"import_torch_tvm_ffi_and_cuda_context_s": import_s, "cuda_context_s": t_ctx},
        "module": str(so), "first_call_valid": bool(valid.all()),
        "first_call_samples": ids.cpu().tolist(),
    }  # fmt: skip
    # second call, for scale
    t3 = time.perf_counter()
    sample(module.top_k_top_p_sampling_from_probs, torch, probs, top_k=case["top_k"],
           top_p=case["top_p"], seed=case["seed"] + 1)  # fmt: skip
    torch.cuda.synchronize()
    result["second_call_s"] = time.perf_counter() - t3
    ref = reference_sets(torch, probs, case["top_k"], case["top_p"])
    result["first_call_in_set"] = bool(
        torch.gather(ref["member"], 1, ids.long().cpu().reshape(-1, 1)).all()
    )
    if args.checks:
        fn = module.top_k_top_p_sampling_from_probs
        t4 = time.perf_counter()
        result["membership"] = check_membership(fn, torch)
        result["frequencies"] = check_frequencies(fn, torch, args.draws)
        result["checks_s"] = time.perf_counter() - t4
    tvm_cache = Path(os.environ["TVM_FFI_CACHE_DIR"])
    result["no_jit"] = {
        "FLASHINFER_DISABLE_JIT": os.environ.get("FLASHINFER_DISABLE_JIT"),
        "CUDA_DISABLE_PTX_JIT": os.environ.get("CUDA_DISABLE_PTX_JIT"),
        "module_sha256_unchanged": sha256(so) == before,
        "tvm_ffi_cache_dir_empty": not any(tvm_cache.rglob("*")),
        "flashinfer_imported": any(m == "flashinfer" or m.startswith("flashinfer.") for m in sys.modules),
        "child_processes_spawned": "none (see phase code: no subprocess in this phase)",
    }  # fmt: skip
    return result


def phase_loader(args: argparse.Namespace) -> dict[str, Any]:
    """FlashInfer's own loader against the carried cache (copies; nothing is built)."""
    result: dict[str, Any] = {}
    sampling, fi_dir = import_flashinfer_jit()
    core = importlib.import_module("flashinfer.jit.core")
    env_mod = importlib.import_module("flashinfer.jit.env")
    result["flashinfer_dir"] = fi_dir
    result["jit_dir"] = str(env_mod.FLASHINFER_JIT_DIR)
    spec = sampling.gen_sampling_module()
    result["jit_library_path"] = str(spec.jit_library_path)
    result["is_compiled"] = bool(spec.is_compiled)
    result["is_aot"] = bool(spec.is_aot)
    try:
        spec.build_and_load()
        result["build_and_load_with_DISABLE_JIT"] = "loaded"
    except core.MissingJITCacheError as exc:
        result["build_and_load_with_DISABLE_JIT"] = f"MissingJITCacheError: {str(exc)[:160]}"
    except Exception as exc:
        result["build_and_load_with_DISABLE_JIT"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    # Without FLASHINFER_DISABLE_JIT, build_and_load() regenerates build.ninja and runs ninja;
    # ask ninja (dry run) whether that would recompile here.
    spec.write_ninja()
    ninja = shutil.which("ninja") or "ninja"
    proc = subprocess.run([ninja, "-C", str(spec.build_dir), "-n", "-d", "explain"],
                          capture_output=True, text=True)  # fmt: skip
    lines = (proc.stdout + proc.stderr).splitlines()
    result["ninja_dry_run"] = {
        "rc": proc.returncode,
        "would_run_steps": sum(1 for ln in lines if ln.startswith("[")),
        "explain": [ln[:300] for ln in lines if ln.startswith("ninja explain")][:8],
    }
    return result


def phase_cold(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    t_imp = time.perf_counter()
    sampling, fi_dir = import_flashinfer_jit()
    result["flashinfer_jit_import_s"] = time.perf_counter() - t_imp
    result["flashinfer_dir"] = fi_dir
    torch, t_ctx = cuda_ready()
    import tvm_ffi  # noqa: F401  (already imported by flashinfer.jit)

    probs, case = fixed_case(torch)
    torch.cuda.synchronize()
    spec = sampling.gen_sampling_module()
    result["jit_library_path"] = str(spec.jit_library_path)
    assert not spec.jit_library_path.exists(), "cold phase needs an empty workspace"

    t0 = time.perf_counter()
    spec.build()  # FlashInfer's JIT: write build.ninja, run ninja (nvcc x3, link)
    t1 = time.perf_counter()
    module = spec.load()
    t2 = time.perf_counter()
    ids, valid = sample(module.top_k_top_p_sampling_from_probs, torch, probs,
                        top_k=case["top_k"], top_p=case["top_p"], seed=case["seed"])  # fmt: skip
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    built = spec.jit_library_path
    ninja_text = (built.parent / "build.ninja").read_text()
    result.update({
        "build_s": t1 - t0, "load_s": t2 - t1, "first_call_s": t3 - t2, "total_s": t3 - t0,
        "outside_timer": {"cuda_context_s": t_ctx},
        "built_module": {"size": built.stat().st_size, "sha256": sha256(built),
                         "arch_flags": [ln.strip() for ln in ninja_text.splitlines()
                                        if ln.startswith("cuda_arch_flags")]},
        "first_call_valid": bool(valid.all()),
        "first_call_samples": ids.cpu().tolist(),
    })  # fmt: skip
    if shutil.which("cuobjdump"):
        result["built_module"]["cuobjdump_list_elf"] = run_text(
            ["cuobjdump", "--list-elf", str(built)]
        ).splitlines()[:12]
    return result


def self_test(draws: int) -> int:
    """CPU-only check of the checker: a sampler with the kernel's joint semantics must pass, one
    that renormalises after top-k first (the Python API's default order) must fail."""
    global DEVICE
    DEVICE = "cpu"
    import torch

    def fake(order: str) -> Any:
        def fn(
            probs, out, valid, indices, k_arr, k_val, p_arr, p_val, det, s_arr, seed, o_arr, off
        ):  # type: ignore[no-untyped-def]
            rows = probs.shape[0]
            k = k_arr if k_arr is not None else torch.full((rows,), int(k_val))
            p = p_arr if p_arr is not None else torch.full((rows,), float(p_val))
            if order == "joint":
                renorm = reference_sets(torch, probs, k, p)["renorm"]
            else:
                topk = reference_sets(torch, probs, k, torch.ones(rows))["renorm"]
                renorm = reference_sets(
                    torch, topk.float(), torch.full((rows,), probs.shape[1]), p
                )["renorm"]
            gen = torch.Generator().manual_seed(int(seed))
            idx = indices.long() if indices is not None else torch.arange(rows)
            counts = torch.bincount(idx, minlength=rows)
            for r in range(rows):
                if counts[r]:
                    where = (idx == r).nonzero().squeeze(1)
                    out[where] = torch.multinomial(
                        renorm[r].float(), int(counts[r]), True, generator=gen
                    ).to(out.dtype)
            valid.fill_(True)

        return fn

    ok = True
    for order, expect in (("joint", True), ("top_k_first", False)):
        freq = check_frequencies(fake(order), torch, draws)
        got = freq["ok"]
        print(f"self-test {order}: frequencies ok={got} (expected {expect}); max|f-p| "
              f"{[round(r['max_abs_err'], 4) for r in freq['rows']]}")  # fmt: skip
        ok &= got == expect
    member = check_membership(fake("joint"), torch)
    print(f"self-test joint: membership ok={member['ok']}")
    ok &= member["ok"]
    return 0 if ok else 1


PHASES = {"env": phase_env, "warm": phase_warm, "loader": phase_loader, "cold": phase_cold}


def run_phase(name: str, args: argparse.Namespace, env: dict[str, str], extra: list[str],
              timeout: float) -> dict[str, Any]:  # fmt: skip
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--phase", name,
           "--cache", args.cache, "--arch", args.arch, "--draws", str(args.draws), *extra]  # fmt: skip
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "error": f"timed out after {timeout} s",
                "tail": str(exc.stdout or "")[-3000:]}  # fmt: skip
    wall = time.perf_counter() - started
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    log = (proc.stdout + "\n" + proc.stderr).strip()
    if found:
        data: dict[str, Any] = json.loads(found[-1][len(MARK) :])
    else:
        data = {"ok": False, "error": f"no result (rc {proc.returncode})"}
    data["process_wall_s"] = wall
    data["log_tail"] = "\n".join(ln for ln in log.splitlines() if not ln.startswith(MARK))[-2500:]
    return data


def base_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("FLASHINFER_DISABLE_JIT", "CUDA_DISABLE_PTX_JIT", "FLASHINFER_WORKSPACE_BASE"):
        env.pop(key, None)
    env["FLASHINFER_CUDA_ARCH_LIST"] = args.arch
    env["PYTHONUNBUFFERED"] = "1"
    bindir = str(Path(sys.executable).parent)  # the venv's ninja
    if bindir not in env.get("PATH", "").split(":"):
        env["PATH"] = bindir + ":" + env.get("PATH", "")
    return env


def orchestrate(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="k26-gpu-"))
    report: dict[str, Any] = {"arch": args.arch, "cache": str(Path(args.cache).resolve()),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip

    def save() -> None:
        (out_dir / "result.json").write_text(json.dumps(report, indent=1, default=str))

    env = base_env(args)
    report["env"] = run_phase("env", args, env, [], 120)
    save()

    report["warm_runs"] = []
    for i in range(args.warm_runs):
        wenv = dict(env, FLASHINFER_DISABLE_JIT="1", CUDA_DISABLE_PTX_JIT="1",
                    TVM_FFI_CACHE_DIR=str(scratch / f"tvm-ffi-cache-{i}"))  # fmt: skip
        Path(wenv["TVM_FFI_CACHE_DIR"]).mkdir()
        report["warm_runs"].append(
            run_phase("warm", args, wenv, ["--checks"] if i == 0 else [], 480)
        )
        save()

    if not args.skip_loader:
        copy = scratch / "loader-workspace"
        shutil.copytree(args.cache, copy, symlinks=True)
        lenv = dict(env, FLASHINFER_DISABLE_JIT="1", FLASHINFER_WORKSPACE_BASE=str(copy))
        report["loader"] = run_phase("loader", args, lenv, [], 300)
        empty = scratch / "empty-workspace"
        empty.mkdir()
        eenv = dict(env, FLASHINFER_DISABLE_JIT="1", FLASHINFER_WORKSPACE_BASE=str(empty))
        report["loader_empty_workspace"] = run_phase("loader", args, eenv, [], 300)
        save()

    if not args.skip_cold:
        build_env = cuda_build_env()
        report["cold_build_env"] = build_env
        cold_ws = scratch / "cold-workspace"
        cold_ws.mkdir()
        cenv = dict(env, FLASHINFER_WORKSPACE_BASE=str(cold_ws), **build_env.get("added", {}))
        report["cold"] = run_phase("cold", args, cenv, [], args.cold_timeout)
        save()

    summarize(report)
    save()
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nwritten: {out_dir / 'result.json'}")
    return 0 if report["summary"]["all_ok"] else 1


def summarize(report: dict[str, Any]) -> None:
    warm = report.get("warm_runs") or [{}]
    w0, cold = warm[0], report.get("cold", {})
    summary: dict[str, Any] = {}
    if "total_s" in w0:
        summary["warm_load_s"] = w0["load_s"]
        summary["warm_first_call_s"] = w0["first_call_s"]
        summary["warm_total_s"] = w0["total_s"]
        summary["warm_total_all_runs_s"] = [r.get("total_s") for r in warm]
    if "total_s" in cold:
        summary["cold_build_s"] = cold["build_s"]
        summary["cold_load_s"] = cold["load_s"]
        summary["cold_first_call_s"] = cold["first_call_s"]
        summary["cold_total_s"] = cold["total_s"]
    if "warm_total_s" in summary and "cold_total_s" in summary:
        summary["ratio_cold_over_warm"] = summary["cold_total_s"] / summary["warm_total_s"]
        summary["cold_and_warm_samples_identical"] = cold.get("first_call_samples") == w0.get(
            "first_call_samples"
        )
    checks = {
        "warm_timed": "warm_total_s" in summary,
        "warm_first_call_valid_and_in_set": bool(w0.get("first_call_valid") and w0.get("first_call_in_set")),
        "membership": bool(w0.get("membership", {}).get("ok")),
        "frequencies": bool(w0.get("frequencies", {}).get("ok")),
        "no_jit_warm": bool(w0.get("no_jit", {}).get("module_sha256_unchanged")
                            and w0.get("no_jit", {}).get("tvm_ffi_cache_dir_empty")
                            and not w0.get("no_jit", {}).get("flashinfer_imported")),
        "cold_timed": "cold_total_s" in summary or "cold" not in report,
    }  # fmt: skip
    summary["checks"] = checks
    summary["all_ok"] = all(checks.values())
    report["summary"] = summary

    env = report.get("env", {})
    print("\n=== FlashInfer sampling: carried warm cache vs cold JIT on this GPU ===")
    print(
        f"GPU {env.get('gpu')} (cc {env.get('capability')}); {env.get('nvidia_smi')}; {env.get('nvidia_smi_cuda')}"
    )
    print(f"python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
          f"packages {env.get('packages')}")  # fmt: skip
    rows = [("warm: load carried sampling.so", summary.get("warm_load_s")),
            ("warm: first sampled call", summary.get("warm_first_call_s")),
            ("warm: total", summary.get("warm_total_s")),
            ("cold: FlashInfer JIT build", summary.get("cold_build_s")),
            ("cold: load built .so", summary.get("cold_load_s")),
            ("cold: first sampled call", summary.get("cold_first_call_s")),
            ("cold: total", summary.get("cold_total_s"))]  # fmt: skip
    for label, value in rows:
        print(f"  {label:34s} {'-' if value is None else f'{value:10.4f} s'}")
    if "ratio_cold_over_warm" in summary:
        print(f"  {'ratio cold/warm':34s} {summary['ratio_cold_over_warm']:10.0f} x")
    for case in w0.get("membership", {}).get("cases", []):
        print(f"  membership vocab {case['vocab']}: {case['draws']} draws, outside set {case['outside_set']}, "
              f"boundary {case['outside_but_within_boundary_eps']}, invalid {case['invalid_rows']}")  # fmt: skip
    for row in w0.get("frequencies", {}).get("rows", []):
        print(f"  freq vocab {row['vocab']} k={row['top_k']} p={row['top_p']:.4f} |set|={row['set_size']}: "
              f"max|f-p|={row['max_abs_err']:.5f} chi2 p={row['chi2_p']:.3g} outside={row['outside_set']} "
              f"{'ok' if row['ok'] else 'FAIL'}")  # fmt: skip
    print(f"  checks: {checks}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache",
        default=str(HERE / ".work" / "cache"),
        help="the warmed FLASHINFER_WORKSPACE_BASE carried from the build machine",
    )
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / ".work" / "out"))
    parser.add_argument("--draws", type=int, default=200_000, help="draws per row, frequency test")
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--cold-timeout", type=float, default=420)
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument("--self-test", action="store_true", help="check the checker on the CPU")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--checks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.self_test:
        return self_test(args.draws)
    if not args.phase:
        return orchestrate(args)
    try:
        data = PHASES[args.phase](args)
        data.setdefault("ok", True)
    except BaseException as exc:  # report, never hang the orchestrator
        data = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-3000:],
        }
    with contextlib.suppress(BrokenPipeError):
        print(MARK + json.dumps(data, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
