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
from supervisor.flashinfer import cache, headers, locks
from supervisor.flashinfer.models import CacheStatus, DoctorReport, Gate, LockInfo, ModuleReport
from supervisor.flashinfer.protocol import Identity, LoadAnswer, ModuleAnswer, Probe, Resolution
from supervisor.flashinfer.venv import ServingEnv, answer

PROBE_TIMEOUT_S = 300.0
NOT_REBUILDABLE = (
    "FlashInfer has no generator that builds it from its name alone (a variant made "
    "from the server's own parameters, such as an attention kernel): the server "
    "JIT-builds it on first use, and warm cannot"
)


async def run_probe(
    serving: ServingEnv,
    modules: Sequence[str],
    *,
    load: bool = True,
    without_arch_list: bool = False,
    check_headers: bool = False,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> Probe:
    args = ["probe"]
    for name in modules:
        args += ["--module", name]
    if load:
        args.append("--load-compiled")
    if without_arch_list:
        args.append("--without-arch-list")
    if check_headers:
        args.append("--check-headers")
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


def runtime_mismatch(library: cache.LibraryCheck, units_cuda: str | None) -> str | None:
    """Why a module's CUDA runtime cannot be the units' (flashinfer #5145), or None.

    The units' CUDA is the one their torch is built for: a module linking another
    major's libcudart puts two CUDA runtimes in one process, and a driver for the
    older one refuses the newer (cudaErrorInsufficientDriver at the first call).
    """
    if library.cudart_major is None or not units_cuda:
        return None
    major = units_cuda.split(".")[0]
    if not major.isdigit() or int(major) == library.cudart_major:
        return None
    m = library.cudart_major
    return (
        f"{library.path.name} links the CUDA {m} runtime (libcudart.so.{m}) but the units' "
        f"torch is built for CUDA {units_cuda}: their process would load two CUDA runtimes, "
        f"and a driver for CUDA {major} refuses {m}'s (flashinfer #5145); build it with a "
        f"CUDA {major} toolkit (CUDA_HOME in the units' environment)"
    )


def unusable(library: cache.LibraryCheck, what: str, units_cuda: str | None) -> str | None:
    """Why a module file that is there cannot serve the units (``what`` names it): cut
    short, built for no arch the target runs, or against another CUDA runtime; None
    when it can."""
    if not library.complete:
        return f"{what} is corrupt or truncated: {library.error}"
    if not library.runs_on_target:
        return str(library.error)
    return runtime_mismatch(library, units_cuda)


def _prebuilt_report(
    name: str,
    raw: ModuleAnswer,
    resolution: Resolution,
    target: tuple[int, int],
    loads: Mapping[str, LoadAnswer],
    units_cuda: str | None = None,
) -> ModuleReport:
    """A module an installed wheel serves: its bytes are what pip installed, and it loads."""
    artifact = resolution.artifacts[0]
    path = Path(artifact.path)
    library = cache.inspect_library(path, target)
    if resolution.source == "provider":
        archs = ",".join(artifact.archs or ()) or "any arch"
        detail = (
            f"provider {artifact.provider} ({artifact.distribution} {artifact.version}, {archs})"
        )
    else:
        detail = "FlashInfer's own data/aot"
    problems: list[str] = []
    if len(resolution.artifacts) > 1:
        detail += f" and {len(resolution.artifacts) - 1} more provider(s) for other targets"
    if not library.exists:
        problems.append(f"{detail} names {path}, which is missing")
    elif (problem := unusable(library, f"{path.name} from {detail}", units_cuda)) is not None:
        problems.append(problem)
    vouched = False
    if library.exists:
        if artifact.record_sha256 is None:
            problems.append(f"{path} is not in the RECORD of the wheel FlashInfer names for it")
        elif artifact.record_sha256 != library.sha256:
            problems.append(
                f"{path} differs from what {artifact.distribution or 'its wheel'} installed "
                "(sha256 is not the one in its RECORD): reinstall that wheel"
            )
        else:
            vouched = True
    load = loads.get(str(path))
    if load is None:
        problems.append("load not checked")
    elif not load.ok:
        problems.append(f"does not load: {load.error}")
    return ModuleReport(
        name=name,
        compiled=library.exists,
        path=str(path),
        complete=library.complete,
        loads=load.ok if load is not None else None,
        load_error=load.error if load is not None else None,
        targets=tuple(dict.fromkeys(t.name for t in library.targets)),
        holds_target_arch=library.runs_on_target,
        fingerprint_ok=vouched,
        problems=tuple(problems),
        source=resolution.source,
        source_detail=detail,
    )


def _module_report(
    name: str,
    raw: ModuleAnswer | None,
    loads: Mapping[str, LoadAnswer],
    target: tuple[int, int],
    recorded: cache.Fingerprint | None,
    fingerprint_matches: bool,
    cuda_release: str | None = None,
    units_cuda: str | None = None,
) -> ModuleReport:
    if raw is None:
        return ModuleReport(name, False, None, problems=("not inspected: the gate rejects",))
    if raw.error or raw.path is None:
        error = raw.error or "no library path"
        return ModuleReport(name, False, None, problems=(f"FlashInfer: {error}",))
    resolution = raw.resolution
    if resolution is not None and resolution.source != "jit" and resolution.artifacts:
        return _prebuilt_report(name, raw, resolution, target, loads, units_cuda)
    path = Path(raw.path)
    library = cache.inspect_library(path, target)
    problems: list[str] = []
    if raw.aot:
        problems.append("FlashInfer says it is prebuilt but names no artifact for the target")
    if not library.exists:
        problems = ["not compiled"]
        if raw.headers is not None:
            problems += [
                headers.missing_header_text(m.header, m.included_from, cuda_release)
                for m in raw.headers.missing
            ]
        return ModuleReport(name, False, str(path), problems=tuple(problems))
    if (problem := unusable(library, path.name, units_cuda)) is not None:
        problems.append(problem)
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
    learned: Sequence[str] = (),
    proc: Path = Path("/proc"),
    started: float | None = None,
) -> DoctorReport:
    """Judge a probe's answer against the files on disk. Blocking file I/O.

    ``learned`` modules are judged like ``modules`` unless FlashInfer has no
    generator for them (they need arguments): those are listed, not failed.
    """
    extra = tuple(n for n in dict.fromkeys(learned) if n not in modules)
    not_rebuildable = {
        name: NOT_REBUILDABLE
        for name in extra
        if (answer := probe.modules.get(name)) is not None and not answer.generator
    }
    modules = (*modules, *(n for n in extra if n not in not_rebuildable))
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
    matches = fingerprint["state"] == "matches"
    reports = tuple(
        _module_report(
            name,
            probe.modules.get(name),
            probe.loads,
            serving.target,
            recorded,
            matches,
            probe.cuda_version or identity.nvcc.release,
            torch.cuda if torch else None,
        )
        for name in modules
    )
    # The fingerprint vouches for what warm built; a module an installed wheel
    # serves is vouched for by that wheel's RECORD instead.
    needs_fingerprint = not reports or any(not r.prebuilt for r in reports)
    if fingerprint["state"] == "missing" and gate.verdict == "accepts" and needs_fingerprint:
        problems.append("no fingerprint: nothing vouches for who built this cache")
    elif fingerprint["state"] == "mismatch" and needs_fingerprint:
        problems.append(
            "fingerprint mismatch, the venv changed since warm-up: "
            + "; ".join(fingerprint["differences"][:4])
        )
    for report in reports:
        problems += [f"{report.name}: {p}" for p in report.problems]
    found_locks: tuple[LockInfo, ...] = ()
    if jit_dir:
        found_locks = tuple(
            locks.inspect_lock(p, proc) for p in locks.find_lock_files(Path(jit_dir))
        )
    # FlashInfer keeps its lock files after a normal release (filelock shares one
    # inode between waiters), and 0.6's build_and_load takes them on every load: a
    # server that loaded a warm module and then died leaves one. An unheld lock is
    # evidence of a half-built module only when the modules are not vouched for.
    vouched = (matches or not needs_fingerprint) and all(r.ok for r in reports)
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
    others = _other_modules(Path(jit_dir), serving.target, modules) if jit_dir else {}
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
        learned=extra,
        not_rebuildable=not_rebuildable,
        others=others,
    )


def _other_modules(jit_dir: Path, target: tuple[int, int], judged: Sequence[str]) -> dict[str, str]:
    """Every other module in the cache (``cached_ops/<name>/<name>.so``): built by a
    server and not yet learned (learning waits for a ready unit), or configured once.
    Listed with what its file is, so nothing in the cache goes unseen."""
    found: dict[str, str] = {}
    try:
        entries = sorted(p for p in jit_dir.iterdir() if p.is_dir() and p.name != "tmp")
    except OSError:
        return found
    for directory in entries:
        so = directory / f"{directory.name}.so"
        if directory.name in judged or not so.exists():
            continue
        lib = cache.inspect_library(so, target)
        if lib.error or not lib.complete:
            found[directory.name] = f"{so}: {lib.error or 'incomplete'}"
        else:
            targets = ",".join(t.name for t in lib.targets) or "no CUDA targets"
            runs = "runs on the target" if lib.runs_on_target else "does NOT run on the target"
            found[directory.name] = f"{so}: {lib.size} bytes, {targets}, {runs}"
    return found


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
    learned: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> DoctorReport:
    """Inspect the cache. Changes nothing of it but what FlashInfer's own loader
    makes when it looks (its lock files, which root hands to the cache's owner);
    "unknown" when the venv cannot answer.

    Raises InputError only for an arch string that is not ``N.M``.
    """
    started = time.monotonic()
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    try:
        probe = await run_probe(
            serving,
            list(dict.fromkeys([*modules, *learned])),
            without_arch_list=True,
            check_headers=True,
            timeout_s=timeout_s,
        )
    except UnavailableError as exc:
        return unknown_report(serving, str(exc), started)
    finally:
        await asyncio.to_thread(cache.adopt_for_owner, serving.workspace)
    return await asyncio.to_thread(
        assess, serving, modules, probe, learned=learned, started=started
    )
