"""warm: make the JIT cache warm and valid, or fail leaving nothing half-done.

Order of work, each step only when the one before it passed:

1. fast path: the venv's identity (no flashinfer/torch import) equals a
   fingerprint's, and every module file still has the recorded size, sha256,
   a complete ELF and code for the arch, and no lock file is left: done, built
   nothing (well under 2 s).
2. take ``k26-warm.lock`` (one warm-up per workspace), prove the workspace
   writable with room to build.
3. full probe (FlashInfer's gate, paths, loads). Rejecting gate: fail.
4. drop the fingerprint, remove stale locks (provably unheld), quarantine
   every module dir that is not valid, build with a time limit in the
   venv's own process group, streaming its output.
5. verify with a second full probe, write the fingerprint, re-assess: ok only
   when doctor would say "warm". On any failure the module dirs the build
   touched are quarantined, so no untrusted ``.so`` is left in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.core.errors import CacheError, SupervisorError, UnavailableError
from supervisor.flashinfer import cache, headers, locks
from supervisor.flashinfer.doctor import assess, run_probe
from supervisor.flashinfer.models import DoctorReport, LockInfo, WarmResult
from supervisor.flashinfer.protocol import Build, Identity, Probe, parse
from supervisor.flashinfer.venv import ServingEnv, identity, run_script

IDENTITY_TIMEOUT_S = 60.0


def fast_check(
    serving: ServingEnv, modules: Sequence[str], who: Identity, learned: Sequence[str] = ()
) -> cache.Fingerprint | None:
    """The fingerprint that vouches for a warm cache right now, or None. Blocking I/O.

    A learned module the fingerprint knows FlashInfer cannot rebuild is not required.
    """
    current = who.recorded()
    for found in cache.find_fingerprints(serving.workspace):
        if found.arch != serving.arch or dict(found.identity) != current:
            continue
        if locks.find_lock_files(found.path.parent / "cached_ops"):
            return None
        wanted = [*modules, *(n for n in learned if n not in found.not_rebuildable)]
        for name in dict.fromkeys(wanted):
            entry = found.modules.get(name)
            if entry is None:
                break
            library = cache.inspect_library(_recorded_path(found, name, entry), serving.target)
            if not (
                library.complete
                and library.runs_on_target
                and library.sha256 == entry.get("sha256")
                and library.size == entry.get("size")
            ):
                break
        else:
            return found
    return None


def _recorded_path(found: cache.Fingerprint, name: str, entry: Mapping[str, Any]) -> Path:
    """Where the module the fingerprint vouches for is now.

    A JIT module lives beside its fingerprint (``<tag dir>/cached_ops/<name>/<name>.so``),
    so a cache copied or restored elsewhere is checked where it is, not at the
    absolute path recorded when it was built; a wheel's module stays where pip put it.
    """
    if entry.get("source", "jit") == "jit":
        return found.path.parent / "cached_ops" / name / f"{name}.so"
    return Path(str(entry.get("path")))


@contextlib.contextmanager
def warm_lock(workspace: Path) -> Iterator[None]:
    """One warm-up per workspace at a time (the daemon and an operator's CLI)."""
    path = cache.cache_root(workspace) / cache.WARM_LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise UnavailableError(
                    f"another warm-up is running for {workspace} (holds {path})"
                ) from exc
            raise
        yield
    finally:
        os.close(fd)


def _prepare(report: DoctorReport, serving: ServingEnv) -> tuple[list[str], list[str]]:
    """Drop the fingerprint, remove stale locks, quarantine invalid module dirs."""
    quarantined: list[str] = []
    for lock in report.locks:  # refuse before changing anything: a live build is not ours
        if lock.state == "held":
            raise UnavailableError(f"a live build holds {lock.path} ({lock.detail})")
    if report.fingerprint.get("path"):
        cache.remove_fingerprint(Path(report.fingerprint["path"]))
    removed, held = _remove_unheld(lock.path for lock in report.locks)
    if held:  # taken since the report was made
        raise UnavailableError(f"a live build holds {held[0].path} ({held[0].detail})")
    for module in report.modules:
        if module.path is None or module.prebuilt:  # an installed wheel's files: never ours
            continue
        build_dir = Path(module.path).parent
        if build_dir.exists():
            moved = cache.quarantine(
                serving.workspace, build_dir, f"{report.arch_tag}-{module.name}"
            )
            if moved is not None:
                quarantined.append(str(moved))
    return quarantined, removed


def _cleanup_failed(report: DoctorReport, serving: ServingEnv) -> list[str]:
    """After a failed or killed build: no lock, no partial .so left in place."""
    quarantined: list[str] = []
    for module in report.modules:
        if module.path is None or module.prebuilt:
            continue
        moved = cache.quarantine(
            serving.workspace, Path(module.path).parent, f"{report.arch_tag}-{module.name}-failed"
        )
        if moved is not None:
            quarantined.append(str(moved))
    if report.cache_dir:
        _remove_unheld(locks.find_lock_files(Path(report.cache_dir)))
    return quarantined


def _remove_unheld(paths: Iterable[Path]) -> tuple[list[str], list[LockInfo]]:
    """Remove each lock file that provably no process holds (FlashInfer keeps its lock
    files after every build and load). The paths removed, and the locks found held."""
    removed: list[str] = []
    held: list[LockInfo] = []
    for path in paths:
        outcome = locks.remove_if_stale(path)
        if outcome.state == "held":
            held.append(outcome)
        elif outcome.detail == "removed":
            removed.append(str(path))
    return removed, held


def _write_fingerprint(
    report: DoctorReport, probe: Probe, not_rebuildable: Mapping[str, str] | None = None
) -> None:
    modules: dict[str, dict[str, Any]] = {}
    for module in report.modules:
        library = cache.inspect_library(Path(str(module.path)), (0, 0))
        modules[module.name] = {
            "path": module.path,
            "size": library.size,
            "sha256": library.sha256,
            "targets": list(module.targets),
            "source": module.source,
        }
    workspace_dir = Path(str(probe.workspace_dir))
    cache.write_fingerprint(
        cache.Fingerprint(
            arch=report.arch,
            arch_tag=str(report.arch_tag),
            identity=probe.identity.recorded(),
            modules=modules,
            built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            path=workspace_dir / cache.FINGERPRINT_NAME,
            not_rebuildable=dict(not_rebuildable or {}),
        )
    )


def _toolkit_mismatch(report: DoctorReport) -> str | None:
    """Why a build here would make modules the units cannot run (flashinfer #5145)."""
    nvcc, torch_cuda = report.versions.get("cuda"), report.versions.get("torch_cuda")
    if not nvcc or not torch_cuda:
        return None
    built, runs = nvcc.split(".")[0], torch_cuda.split(".")[0]
    if built == runs:
        return None
    return (
        f"the build would use CUDA {nvcc} (nvcc {report.versions.get('nvcc')}), whose modules "
        f"link libcudart.so.{built}, but the units' torch is built for CUDA {torch_cuda}: "
        f"a driver for CUDA {runs} refuses them (flashinfer #5145). Set CUDA_HOME in the "
        f"units' environment to a CUDA {runs} toolkit; nothing was built"
    )


def _unverified(report: DoctorReport) -> bool:
    """Everything but the fingerprint checks out (loads, arch, complete, no locks)."""
    return (
        report.gate.verdict == "accepts"
        and not report.locks
        and all(
            m.compiled and m.complete and m.loads is True and m.holds_target_arch
            for m in report.modules
        )
    )


def _free_bytes(path: Path) -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _build_error(
    tail: str, returncode: int, free_bytes: int | None = None, cuda_release: str | None = None
) -> str:
    """Say why a build failed; a full disk first, since the tools word it many ways
    (GNU as reports BFD assertion failures, not ENOSPC, when its output is cut)."""
    full = free_bytes is not None and free_bytes < 1024 * 1024
    if full or "No space left on device" in tail or "ENOSPC" in tail:
        left = f", {free_bytes // 1024} KiB free" if free_bytes is not None else ""
        return f"the workspace filled up during the build (No space left on device{left})"
    missing = headers.missing_in_build_output(tail)
    if missing:
        return "; ".join(
            headers.missing_header_text(h, where, cuda_release) for h, where in missing
        )
    lines = [line for line in tail.splitlines() if line.strip()]
    return f"the build failed (exit {returncode}): " + " | ".join(lines[-6:])


async def warm(
    python: Path,
    arch: str,
    workspace: Path,
    modules: Sequence[str] = ("sampling",),
    timeout_s: float = 1800,
    progress: Callable[[str], None] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    min_free_bytes: int = cache.MIN_FREE_BYTES,
    learned: Sequence[str] = (),
    alive: Callable[[], None] | None = None,
) -> WarmResult:
    """Warm the cache and verify it. Never raises for a failed warm-up: see ``.error``.

    ``progress``: each line the warm-up says; ``alive``: now and then while a build
    uses the CPU, even when it prints nothing (a long nvcc step).

    Raises InputError only for an arch string that is not ``N.M``; a
    cancellation ends the build's whole process group before it propagates.
    """
    started = time.monotonic()
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    say = progress or (lambda _line: None)
    try:
        return await _warm(
            serving, modules, learned, timeout_s, say, started, min_free_bytes, alive
        )
    finally:
        # Run by root on the units' cache: what root made there becomes theirs.
        await asyncio.to_thread(cache.adopt_for_owner, serving.workspace)


async def _warm(
    serving: ServingEnv,
    modules: Sequence[str],
    learned: Sequence[str],
    timeout_s: float,
    say: Callable[[str], None],
    started: float,
    min_free_bytes: int,
    alive: Callable[[], None] | None,
) -> WarmResult:
    def elapsed() -> float:
        return time.monotonic() - started

    try:
        who = await identity(serving, timeout_s=IDENTITY_TIMEOUT_S)
        if await asyncio.to_thread(fast_check, serving, modules, who, learned) is not None:
            say(f"k26: cache already warm and valid ({elapsed():.2f} s); nothing to build")
            return WarmResult(True, [], elapsed())
        await asyncio.to_thread(cache.check_workspace, serving.workspace, min_free_bytes)
        with warm_lock(serving.workspace):
            return await _warm_locked(serving, modules, learned, timeout_s, say, started, alive)
    except OSError as exc:  # moving or removing cache files failed midway
        error = CacheError(f"cache I/O failed in {serving.workspace}: {exc}")
        say(f"k26: warm-up failed: {error}")
        return WarmResult.failed(error, elapsed())
    except SupervisorError as exc:
        say(f"k26: warm-up failed: {exc}")
        return WarmResult.failed(exc, elapsed())


async def _warm_locked(
    serving: ServingEnv,
    configured: Sequence[str],
    learned: Sequence[str],
    timeout_s: float,
    say: Callable[[str], None],
    started: float,
    alive: Callable[[], None] | None,
) -> WarmResult:
    def elapsed() -> float:
        return time.monotonic() - started

    asked = list(dict.fromkeys([*configured, *learned]))
    probe = await run_probe(serving, asked, check_headers=True)
    report = await asyncio.to_thread(assess, serving, configured, probe, learned=learned)
    not_rebuildable = report.not_rebuildable
    for name in not_rebuildable:
        say(f"k26: learned module {name}: not rebuildable ({not_rebuildable[name]})")
    modules = [m.name for m in report.modules]  # configured + the rebuildable learned
    if report.gate.verdict == "rejects":
        raise CacheError(
            f"FlashInfer's gate rejects {serving.arch}: {report.gate.error}; "
            "run `k26-supervisor flashinfer patch`"
        )
    if report.gate.verdict != "accepts":
        raise CacheError(
            f"FlashInfer's gate could not be run for {serving.arch}: {report.gate.error} "
            f"(fix the serving venv {serving.python})"
        )
    if report.status == "warm":
        for module in report.modules:
            if module.prebuilt:
                say(f"k26: {module.name}: served by {module.source_detail}; nothing to build")
        # Verified just now. Record it when no fingerprint did (every module served by
        # a wheel) or when learned modules were found unrebuildable, so that the next
        # warm-up takes the fast path.
        if report.fingerprint.get("state") != "matches" or not_rebuildable:
            await asyncio.to_thread(_write_fingerprint, report, probe, not_rebuildable)
        # Lock files a finished build or load left (FlashInfer keeps them): provably
        # unheld ones go, so the next warm-up takes the fast path.
        stale = [lock.path for lock in report.locks if lock.state == "stale"]
        removed, _ = await asyncio.to_thread(_remove_unheld, stale)
        for path in removed:
            say(f"k26: removed stale lock {path}")
        say("k26: cache already warm and valid; nothing to build")
        return WarmResult(True, [], elapsed(), removed_locks=removed, report=report)
    if report.fingerprint.get("state") != "mismatch" and _unverified(report):
        # Built and sound but never fingerprinted (say, by a unit's own JIT):
        # still rebuilt, since nothing records which toolchain made it.
        say("k26: modules present but unvouched-for; rebuilding them")
    for problem in report.problems:
        say(f"k26: {problem}")
    unbuildable = [p for p in report.problems if ": the build needs " in p]
    if unbuildable:
        # nvcc's dependency scan already failed: a build would only fail later.
        raise CacheError("; ".join(unbuildable))
    broken = [m for m in report.modules if m.prebuilt and not m.ok]
    if broken:
        # FlashInfer would load these as they are; a build cannot fix a wheel's files.
        raise CacheError(
            "; ".join(f"{m.name} ({m.source_detail}): {'; '.join(m.problems)}" for m in broken)
        )
    for module in report.modules:
        if module.prebuilt:
            say(f"k26: {module.name}: served by {module.source_detail}; nothing to build")
    to_build = [m.name for m in report.modules if not m.prebuilt]
    if to_build and (mismatch := _toolkit_mismatch(report)) is not None:
        raise CacheError(mismatch)
    quarantined, removed = await asyncio.to_thread(_prepare, report, serving)
    for path in removed:
        say(f"k26: removed stale lock {path}")
    for path in quarantined:
        say(f"k26: quarantined {path}")
    built: list[str] = []
    verified: Probe | None = None
    if to_build:
        built, verified = await _build(
            serving, report, to_build, modules, timeout_s, say, started, alive
        )
    say("k26: verifying the build" if to_build else "k26: verifying the prebuilt modules")
    probe = verified or await run_probe(serving, modules)
    report = await asyncio.to_thread(assess, serving, modules, probe)
    # The build's own locks, released: provably unheld.
    await asyncio.to_thread(_remove_unheld, [lock.path for lock in report.locks])
    report = await asyncio.to_thread(assess, serving, modules, probe)
    if not _unverified(report):
        await asyncio.to_thread(_cleanup_failed, report, serving)
        raise CacheError("the build finished but does not verify: " + "; ".join(report.problems))
    await asyncio.to_thread(_write_fingerprint, report, probe, not_rebuildable)
    report = await asyncio.to_thread(assess, serving, modules, probe)
    if report.status != "warm":
        raise CacheError("verification failed after the build: " + "; ".join(report.problems))
    say(f"k26: warm and valid ({elapsed():.1f} s)")
    return WarmResult(
        True, built, elapsed(), quarantined=quarantined, removed_locks=removed, report=report
    )


async def _build(
    serving: ServingEnv,
    report: DoctorReport,
    to_build: Sequence[str],
    verify: Sequence[str],
    timeout_s: float,
    say: Callable[[str], None],
    started: float,
    alive: Callable[[], None] | None = None,
) -> tuple[list[str], Probe | None]:
    """Build ``to_build`` in the venv's own process group; CacheError on any failure.
    Also returns the probe of ``verify`` the build's process made after it (None if
    it made none), so that verifying needs no second interpreter."""
    args = ["build"]
    for name in to_build:
        args += ["--module", name]
    for name in verify:
        args += ["--verify", name]
    remaining = max(1.0, timeout_s - (time.monotonic() - started))
    say(f"k26: building {', '.join(to_build)} for {serving.arch} (limit {remaining:.0f} s)")
    try:
        run = await run_script(serving, args, timeout_s=remaining, on_line=say, on_busy=alive)
    except TimeoutError:
        await asyncio.to_thread(_cleanup_failed, report, serving)
        raise CacheError(
            f"the build did not finish within {timeout_s:.0f} s; partial output quarantined"
        ) from None
    except asyncio.CancelledError:
        await asyncio.shield(asyncio.to_thread(_cleanup_failed, report, serving))
        raise
    try:
        reply = parse(Build, "build", run.result) if run.result is not None else None
    except UnavailableError:
        await asyncio.to_thread(_cleanup_failed, report, serving)
        raise
    built = list(reply.built) if reply else []
    if run.returncode != 0 or reply is None or not reply.ok:
        await asyncio.to_thread(_cleanup_failed, report, serving)
        error = (reply.error if reply else None) or ""
        free = await asyncio.to_thread(_free_bytes, cache.cache_root(serving.workspace))
        release = report.versions.get("cuda")
        text = f"{error}\n{run.tail_text(400)}"
        raise CacheError(_build_error(text, run.returncode, free, release))
    return built, reply.probe
