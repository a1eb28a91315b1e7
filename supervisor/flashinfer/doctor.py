"""doctor: is the FlashInfer JIT cache for this venv, arch and workspace warm and valid?

"Warm and valid" means, for every configured module: FlashInfer's gate
accepts the arch; the ``.so`` exists, is a complete ELF, loads the way
FlashInfer loads it, and holds code that runs on the arch; a fingerprint
written by warm vouches for that exact file and for the builder (flashinfer,
torch, CUDA, nvcc, gate code) the venv has now; and no build lock is left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.core.errors import UnavailableError
from supervisor.flashinfer import cache, locks
from supervisor.flashinfer.models import CacheStatus, DoctorReport, Gate, ModuleReport
from supervisor.flashinfer.protocol import Identity, LoadAnswer, ModuleAnswer, Probe
from supervisor.flashinfer.venv import ServingEnv, answer

PROBE_TIMEOUT_S = 300.0


async def run_probe(
    serving: ServingEnv,
    modules: Sequence[str],
    *,
    load: bool = True,
    without_arch_list: bool = False,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> Probe:
    args = ["probe"]
    for name in modules:
        args += ["--module", name]
    if load:
        args.append("--load-compiled")
    if without_arch_list:
        args.append("--without-arch-list")
    return await answer(serving, Probe, args, timeout_s=timeout_s)


def fingerprint_state(
    recorded: cache.Fingerprint | None, identity: Identity, arch: str
) -> dict[str, Any]:
    if recorded is None:
        return {"state": "missing", "path": None, "differences": []}
    differences = cache.identity_differences(recorded.identity, identity.recorded())
    if recorded.arch != arch:
        differences.insert(0, f"arch: {recorded.arch!r} -> {arch!r}")
    return {
        "state": "mismatch" if differences else "matches",
        "path": str(recorded.path),
        "built_at": recorded.built_at,
        "differences": differences,
    }


def _module_report(
    name: str,
    raw: ModuleAnswer | None,
    loads: Mapping[str, LoadAnswer],
    target: tuple[int, int],
    recorded: cache.Fingerprint | None,
    fingerprint_matches: bool,
) -> ModuleReport:
    if raw is None:
        return ModuleReport(name, False, None, problems=("not inspected: the gate rejects",))
    if raw.error or raw.path is None:
        error = raw.error or "no library path"
        return ModuleReport(name, False, None, problems=(f"FlashInfer: {error}",))
    path = Path(raw.path)
    library = cache.inspect_library(path, target)
    problems: list[str] = []
    if raw.aot:
        problems.append("served from an AOT package, not the JIT cache")
    if not library.exists:
        return ModuleReport(name, False, str(path), problems=("not compiled",))
    if not library.complete:
        problems.append(f"{path.name} is corrupt or truncated: {library.error}")
    elif not library.runs_on_target:
        problems.append(str(library.error))
    load = loads.get(str(path))
    loaded: bool | None = None
    load_error = None
    if load is not None:
        loaded = load.ok
        load_error = load.error
        if not loaded:
            problems.append(f"does not load: {load_error}")
    else:
        problems.append("load not checked")
    vouched = False
    if recorded is not None and fingerprint_matches:
        entry = recorded.modules.get(name)
        if entry is None:
            problems.append("not covered by the fingerprint")
        elif entry.get("sha256") != library.sha256 or entry.get("size") != library.size:
            problems.append("changed since warm-up (size or sha256 differ from the fingerprint)")
        else:
            vouched = True
    return ModuleReport(
        name=name,
        compiled=True,
        path=str(path),
        complete=library.complete,
        loads=loaded,
        load_error=load_error,
        targets=tuple(dict.fromkeys(t.name for t in library.targets)),
        holds_target_arch=library.runs_on_target,
        fingerprint_ok=vouched,
        problems=tuple(problems),
    )


def assess(
    serving: ServingEnv,
    modules: Sequence[str],
    probe: Probe,
    *,
    proc: Path = Path("/proc"),
    started: float | None = None,
) -> DoctorReport:
    """Judge a probe's answer against the files on disk. Blocking file I/O."""
    identity = probe.identity
    problems: list[str] = []
    hints: list[str] = []
    torch = identity.torch
    versions: dict[str, str | None] = {
        "flashinfer": probe.flashinfer_version
        or (identity.flashinfer.version if identity.flashinfer else None),
        "torch": torch.version if torch else None,
        "torch_cuda": torch.cuda if torch else None,
        "cuda": probe.cuda_version or identity.nvcc.release,
        "nvcc": identity.nvcc.path,
    }
    gate = Gate.from_answer(probe.gate)
    without = probe.gate_without_arch_list
    gate_without = Gate.from_answer(without) if without is not None else None
    unknown = False
    if identity.flashinfer is None:
        problems.append(f"flashinfer is not installed for {identity.python}")
        unknown = True
    elif gate.verdict == "rejects":
        problems.append(f"FlashInfer's gate rejects {serving.arch}: {gate.error}")
        hints.append("`k26-supervisor flashinfer patch` can make this FlashInfer accept it")
    elif gate.verdict == "unknown":
        problems.append(f"FlashInfer's gate could not be run: {gate.error}")
        unknown = True
    if gate.verdict == "accepts" and gate_without is not None and gate_without.verdict == "rejects":
        hints.append(
            f"FlashInfer accepts {serving.arch} only when the arch list is set "
            "(FLASHINFER_CUDA_ARCH_LIST; TORCH_CUDA_ARCH_LIST for 0.2.x); "
            f"without it: {(gate_without.error or '').rstrip('.')}. Pin the arch in the "
            "unit's environment "
            "(a setting, not a patch)."
        )
    workspace_dir = probe.workspace_dir
    jit_dir = probe.jit_dir
    recorded = None
    fingerprint: dict[str, Any] = {"state": "missing", "path": None, "differences": []}
    if workspace_dir:
        recorded = cache.read_fingerprint(Path(workspace_dir) / cache.FINGERPRINT_NAME)
        fingerprint = fingerprint_state(recorded, identity, serving.arch)
    if fingerprint["state"] == "missing" and gate.verdict == "accepts":
        problems.append("no fingerprint: nothing vouches for who built this cache")
    elif fingerprint["state"] == "mismatch":
        problems.append(
            "fingerprint mismatch, the venv changed since warm-up: "
            + "; ".join(fingerprint["differences"][:4])
        )
    matches = fingerprint["state"] == "matches"
    reports = tuple(
        _module_report(
            name, probe.modules.get(name), probe.loads, serving.target, recorded, matches
        )
        for name in modules
    )
    for report in reports:
        problems += [f"{report.name}: {p}" for p in report.problems]
    found_locks: tuple[locks.LockInfo, ...] = ()
    if jit_dir:
        found_locks = tuple(
            locks.inspect_lock(p, proc) for p in locks.find_lock_files(Path(jit_dir))
        )
    # FlashInfer keeps its lock files after a normal release (filelock shares one
    # inode between waiters), and 0.6's build_and_load takes them on every load: a
    # server that loaded a warm module and then died leaves one. An unheld lock is
    # evidence of a half-built module only when the modules are not vouched for.
    vouched = matches and all(r.ok for r in reports)
    blocking = 0
    for lock in found_locks:
        if lock.state == "stale" and vouched:
            continue
        blocking += 1
        if lock.state == "held":
            problems.append(f"build in progress: {lock.path} {lock.detail}")
        elif lock.state == "stale":
            problems.append(f"stale lock left by a dead builder: {lock.path}")
        else:
            problems.append(f"lock {lock.path}: {lock.detail}")
    status: CacheStatus
    if unknown:
        status = "unknown"
    elif gate.verdict == "accepts" and vouched and not blocking:
        status = "warm"
    else:
        status = "needs-warmup"
    return DoctorReport(
        status=status,
        python=str(serving.python),
        arch=serving.arch,
        workspace=str(serving.workspace),
        versions=versions,
        arch_tag=probe.arch_tag,
        cache_dir=jit_dir,
        gate=gate,
        gate_without_arch_list=gate_without,
        modules=reports,
        locks=found_locks,
        fingerprint=fingerprint,
        problems=tuple(problems),
        hints=tuple(hints),
        duration_s=time.monotonic() - started if started is not None else 0.0,
    )


def unknown_report(serving: ServingEnv, error: str, started: float) -> DoctorReport:
    return DoctorReport(
        status="unknown",
        python=str(serving.python),
        arch=serving.arch,
        workspace=str(serving.workspace),
        problems=(error,),
        duration_s=time.monotonic() - started,
    )


async def doctor(
    python: Path,
    arch: str,
    workspace: Path,
    modules: Sequence[str] = ("sampling",),
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> DoctorReport:
    """Inspect the cache. Never changes it; "unknown" when the venv cannot answer.

    Raises InputError only for an arch string that is not ``N.M``.
    """
    started = time.monotonic()
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    try:
        probe = await run_probe(serving, modules, without_arch_list=True, timeout_s=timeout_s)
    except UnavailableError as exc:
        return unknown_report(serving, str(exc), started)
    return await asyncio.to_thread(assess, serving, modules, probe, started=started)
