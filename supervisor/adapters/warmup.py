"""The daemon's side of FlashInfer warm-up: one at a time, recorded, patch when allowed.

Every start the supervisor makes goes through ``Warmup.ensure`` (before the
start, or alongside the load when ``core/warmup_plan.py`` says so). On a warm
cache that is a verification of well under two seconds; on a cold one it is a
real precompile in the serving venv. A gate that rejects the arch is patched
only where the config allows it. ``check_gate`` asks the gate without building.

With ``flashinfer.registry`` set, a cold cache is pulled before anything is built
(``_pull``, ``flashinfer/distribute.py``): this node's bundle, found by its own
identity, checked and installed, then the warm-up below finds it warm and builds
nothing. No bundle for this node: it builds, as without a registry. A bundle that
does not fit, or a registry that is down: a warning in the log and in the warm-up's
``error`` on /status, the cache as it was, then the local build.

Each outcome carries the gate's verdict (``GateFacts``), the fact the core
plans the next start on. A module another process is building (a server's own
JIT, or a build a SIGKILLed supervisor left running) is waited for under
FlashInfer's own lock, then verified: never a failure, never a cache two
builders wrote at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from supervisor import flashinfer
from supervisor.adapters import unit_env
from supervisor.core import jit_caches
from supervisor.core.bundle_use import BundleUse, Listing, Served, judge
from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.config import FlashInferSection
from supervisor.core.errors import InputError, SupervisorError
from supervisor.core.events import GateFacts
from supervisor.core.jit_caches import JitCache
from supervisor.core.status import StatusBoard, WarmupInfo, iso8601, utc_now
from supervisor.flashinfer import cache, learned
from supervisor.flashinfer.venv import ServingEnv
from supervisor.fleet import cache_layers, distribute, registry
from supervisor.fleet.archive import Limits

log = logging.getLogger("k26.warmup")

# How often to look whether another process still holds a build lock: flock
# release sends no notification, and a build takes minutes.
LIVE_BUILD_POLL_S = 0.5


@dataclass(frozen=True)
class WarmOutcome:
    ok: bool
    error: str | None = None
    arch_rejected: bool = False
    built: tuple[str, ...] = ()
    gate: GateFacts | None = None


def list_artifacts(roots: Mapping[str, Path]) -> Listing:
    """Each cache's compiled artifacts, as paths relative to its root (what the JIT
    watch would report: ``jit_caches.ignored_artifact`` leaves out locks, logs,
    temporary files and FlashInfer's generated sources), each with its size and
    mtime. A root that does not exist lists nothing, a file gone meanwhile is left
    out. Blocking: run it in a worker thread."""
    out: Listing = {}
    for kind, root in roots.items():
        try:
            known: JitCache | None = JitCache(kind)
        except ValueError:  # a root no known cache follows
            known = None
        found: dict[str, tuple[int, int]] = {}
        for directory, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(directory, name)
                relative = PurePosixPath(os.path.relpath(path, root))
                if jit_caches.ignored_artifact(relative, known):
                    continue
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                found[str(relative)] = (info.st_size, info.st_mtime_ns)
        out[kind] = found
    return out


# FlashInfer build locks under a workspace that a live process holds.
held_build_locks = distribute.held_build_locks


async def unit_cache_locations(
    snapshot: Callable[[str], Awaitable[UnitSnapshot]], units: Sequence[str]
) -> dict[str, Path]:
    """Where the units keep the caches a registry pull fills (Triton, inductor, TVM-FFI,
    DeepGEMM), read from each unit's own environment over the bus as the JIT watch
    reads it: only caches a unit pins. Where two units pin one cache at two paths,
    the first unit's (config order) is filled and the other is said in the log. A
    unit the bus cannot describe is skipped with a warning."""
    found: dict[str, Path] = {}
    carried = set(cache_layers.names())
    for unit in units:
        try:
            snap = await snapshot(unit)
        except SupervisorError as exc:
            log.warning("registry pull: cannot read %s's environment: %s", unit, exc)
            continue
        if snap.load_state != "loaded":
            continue
        resolved = await unit_env.resolve(snap)
        for where in jit_caches.locate(resolved.env, home=resolved.home, user=resolved.user):
            name = str(where.cache)
            if not where.pinned or name not in carried:
                continue
            path = Path(str(where.path))
            if found.setdefault(name, path) != path:
                log.info(
                    "registry pull: %s keeps its %s cache at %s; only %s is filled",
                    unit, name, path, found[name],
                )  # fmt: skip
    return found


class Warmup:
    def __init__(
        self,
        cfg: FlashInferSection,
        board: StatusBoard,
        on_progress: Callable[[], None] = lambda: None,
        *,
        accepted_record: Path,
        cache_locations: Callable[[], Awaitable[Mapping[str, Path]]] | None = None,
        learned_shapes: Callable[[Mapping[str, Any]], Awaitable[int]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.board = board
        self._lock = asyncio.Lock()
        # Each line of build output is progress, and so is each quarter minute in which
        # the build used the CPU (one nvcc step on a loaded host can print nothing for
        # minutes): it keeps systemd's start timeout extended (EXTEND_TIMEOUT_USEC)
        # while a cold build runs, and only then. A build that hangs extends nothing.
        self.on_progress = on_progress
        # Where the units' other JIT caches live (triton, inductor, tvm-ffi, deepgemm),
        # for a pull: from the units' own environment when the daemon can say
        # (core/jit_caches.py); else those flashinfer.env_file pins.
        self.cache_locations = cache_locations
        # A pulled bundle's learned shapes: merged into the daemon's own record (how
        # many were new), so the coverage replays what the build host learned.
        self.learned_shapes = learned_shapes
        # What this node accepted from each signed tag (fleet/accepted.py): in the
        # daemon's state directory, which the units cannot write, unlike the workspace.
        self.accepted_record = accepted_record
        # The latest pull: the caches' artifacts right after it, to tell at READY
        # whether the bundle was used (core/bundle_use.py).
        self._pulled: tuple[dict[str, Path], Listing] | None = None
        if cfg.registry is not None:
            board.declare_bundle_pulls()
        self._unknown_roots: asyncio.Future[list[str]] | None = None

    async def ensure(self, *, recheck: bool, patch_allowed: bool) -> WarmOutcome:
        """Warm and verify the cache; ``recheck`` after an arch exit also re-runs the gate."""
        if not self.cfg.enabled:
            return WarmOutcome(True)
        async with self._lock:  # two units restarting share one build
            return await self._ensure(recheck, patch_allowed)

    async def check_gate(self) -> GateFacts:
        """FlashInfer's verdict on the arch, from doctor (no build, a few seconds).

        A workspace that cannot take a build makes the verdict unknown: the
        warm-up would fail, and it should fail before the unit starts, as always.
        """
        cfg = self.cfg
        try:
            await asyncio.to_thread(cache.check_workspace, cfg.workspace)
            env = await self._env()
            report = await flashinfer.doctor(
                cfg.python, cfg.arch, cfg.workspace, cfg.modules, env=env
            )
        except SupervisorError as exc:
            return GateFacts("unknown", cfg.arch, error=str(exc))
        verdict = report.gate.verdict
        return GateFacts(
            verdict if verdict in ("accepts", "rejects") else "unknown",
            cfg.arch,
            report.versions.get("flashinfer"),
            error=report.gate.error,
        )

    async def learned(self) -> tuple[str, ...]:
        """Modules ready units built for this arch (``k26-learned-modules.json``)."""
        try:
            known = await asyncio.to_thread(learned.learned, self.cfg.workspace, self.cfg.arch)
        except SupervisorError as exc:  # a corrupt record: said, left alone, not fatal
            log.error("learned modules not used: %s", exc)
            return ()
        return tuple(known)

    async def learn(self, unit: str) -> list[str]:
        """After ``unit`` was ready: record the modules its FlashInfer built for the arch.

        Only the arch tags a fingerprint records for this arch count (the cache this
        supervisor warmed), so a unit on another arch's cache teaches nothing here.
        """
        cfg = self.cfg
        if not cfg.enabled:
            return []

        def work() -> list[str]:
            tags = {
                f.arch_tag for f in cache.find_fingerprints(cfg.workspace) if f.arch == cfg.arch
            }
            if not tags:
                return []
            return learned.learn_from_cache(cfg.workspace, cfg.arch, tags, unit=unit)

        try:
            new = await asyncio.to_thread(work)
        except (SupervisorError, OSError) as exc:
            log.error("could not record the modules %s used: %s", unit, exc)
            return []
        if new:
            log.info("learned FlashInfer modules from %s: %s", unit, ", ".join(new))
        return new

    def _say(self, line: str) -> None:
        log.info("%s", line)
        self.on_progress()

    async def unknown_roots(self) -> list[str]:
        """The cache variables the serving venv's installed code reads that no watched
        cache follows (``k26_caches.py roots``, from its sources; ``jit_caches.unknown``),
        asked once per daemon run; the JIT watch follows those a unit pins. Empty
        with the warm-up off (no serving interpreter is configured) or when the venv
        cannot answer (said once in the log)."""
        if not self.cfg.enabled:
            return []
        if self._unknown_roots is None:
            self._unknown_roots = asyncio.ensure_future(self._ask_roots())
        return list(await asyncio.shield(self._unknown_roots))

    def unknown_roots_now(self) -> list[str]:
        """``unknown_roots`` if the scan is done, else none: for whoever may not wait."""
        done = self._unknown_roots
        if done is None or not done.done() or done.cancelled() or done.exception() is not None:
            return []
        return list(done.result())

    async def _ask_roots(self) -> list[str]:
        cfg = self.cfg
        try:
            serving = ServingEnv(cfg.python, cfg.arch, cfg.workspace, await self._env())
            found = await cache_layers.cache_roots(serving)
        except (SupervisorError, OSError) as exc:
            log.warning("cache roots: %s; the JIT watch follows the known caches only", exc)
            return []
        unknown = jit_caches.unknown(found.variables)
        if unknown:
            log.info(
                "cache roots the serving venv's code reads beyond the known caches: %s "
                "(watched where a unit pins them)", " ".join(unknown),
            )  # fmt: skip
        return unknown

    async def _env(self) -> dict[str, str]:
        if not self.cfg.env_file:
            return {}
        return dict(await asyncio.to_thread(flashinfer.read_env_file, self.cfg.env_file))

    async def _warm(self, env: dict[str, str]) -> flashinfer.WarmResult:
        """``flashinfer.warm``, after waiting out any build another process runs here."""
        cfg = self.cfg
        known = await self.learned()
        while True:
            result = await flashinfer.warm(
                cfg.python,
                cfg.arch,
                cfg.workspace,
                cfg.modules,
                cfg.timeout_s,
                self._say,
                env=env,
                learned=known,
                alive=self.on_progress,  # a build that prints nothing for minutes, yet works
            )
            if result.ok:
                return result
            held = await asyncio.to_thread(held_build_locks, cfg.workspace)
            if not held:
                return result
            # FlashInfer serialises builders on this lock; wait our turn, then verify.
            self._say(f"k26: another process is building here ({held[0]}); waiting for it")
            while held:
                await asyncio.sleep(LIVE_BUILD_POLL_S)
                held = await asyncio.to_thread(held_build_locks, cfg.workspace)

    async def _locations(self, env: Mapping[str, str]) -> dict[str, Path]:
        """Those ``flashinfer.env_file`` pins, then the units' own (they win)."""
        found = cache_layers.pinned_locations(env)
        if self.cache_locations is not None:
            found.update(await self.cache_locations())
        return found

    async def _pull(self, env: dict[str, str]) -> str | None:
        """Before any build: this node's bundle from the registry, into what is cold.

        Returns the warning to show on /status (the registry down, a bundle refused),
        or None. Never raises for the registry: the local build follows either way."""
        cfg = self.cfg
        if cfg.registry is None:
            return None
        try:
            caches = await self._locations(env)
            result = await distribute.pull(
                cfg.python,
                cfg.arch,
                cfg.workspace,
                cfg.registry,
                env=env,
                caches=caches,
                flashinfer="if-cold",
                modules=cfg.modules,
                learned=await self.learned(),
                timeout_s=cfg.registry_timeout_s,
                access=registry.Access(cfg.registry_auth, cfg.registry_ca),
                say=self._say,
                keys=cfg.registry_keys,
                accepted_record=self.accepted_record,
                limits=Limits(
                    cfg.bundle_max_entries, cfg.bundle_max_entry_bytes, cfg.bundle_max_total_bytes
                ),
            )
        except registry.NotInRegistry as exc:
            self.board.record_bundle_pull("absent")
            self._say(f"k26: {exc}; building here")
            return None
        except InputError as exc:
            self.board.record_bundle_pull("refused")
            why = f"registry bundle refused, the cache left as it was: {exc}"
        except SupervisorError as exc:
            self.board.record_bundle_pull("failed")
            why = f"registry pull failed: {exc}"
        except Exception as exc:  # a bug here must not cost the node its local build
            self.board.record_bundle_pull("failed")
            log.exception("registry pull failed unexpectedly")
            why = f"registry pull failed: {type(exc).__name__}: {exc}"
        else:
            if result["digest"] is None:  # every cache warm: the registry was not asked
                return None
            self.board.record_bundle_pull("installed" if result["installed"] else "current")
            # The registry was asked and gave a bundle: its age, installed or not.
            self.board.set_bundle_served(
                Served(result["digest"], result["created_at"], time.time())
            )
            installed = ", ".join(f"{e['cache']} ({e['files']} files)" for e in result["installed"])
            coverage = result["coverage"]
            covered = (
                f"; its coverage passed on {coverage['unit']} at {coverage['at']}"
                if coverage
                else "; it carries no coverage marker"
            )
            self._say(
                f"k26: pulled {result['digest']} from {cfg.registry} in "
                f"{result['duration_s']:.2f} s: {installed or 'nothing was cold'}"
                + (covered if installed else "")
            )
            for note in result["notes"]:
                log.info("registry pull: %s", note)
            if installed:
                # FlashInfer's cache, as the JIT watch sees it: not the workspace,
                # where this daemon's own k26-learned-modules.json is no build.
                roots = {str(JitCache.FLASHINFER): cache.cache_root(cfg.workspace), **caches}
                self._pulled = (roots, await asyncio.to_thread(list_artifacts, roots))
                # Only here: a pull that installed nothing has no verdict of its own,
                # and must not reset the one of the pull that installed the caches.
                self.board.set_bundle(
                    BundleUse(
                        result["digest"],
                        cfg.registry,
                        iso8601(utc_now()) or "",
                        created_at=result["created_at"],
                    )
                )
            carried = result.get("learned_shapes")
            if carried and self.learned_shapes is not None:
                new = await self.learned_shapes(carried)
                self._say(f"k26: the bundle's learned shapes: {new} new, replayed from now on")
            return None
        log.warning("%s; warming here instead", why)
        self.on_progress()
        return why

    async def check_bundle(self, unit: str) -> BundleUse | None:
        """At ``unit``'s READY: whether the latest pulled bundle prevented every build
        since the pull (core/bundle_use.py), on /status and in the metrics; a warning
        naming each cache that rebuilt. None when nothing was pulled."""
        use = self.board.bundle
        if self._pulled is None or use is None:
            return None
        roots, before = self._pulled
        try:
            after = await asyncio.to_thread(list_artifacts, roots)
        except OSError as exc:
            log.warning(
                "bundle %s: cannot list the caches at %s's READY: %s", use.digest, unit, exc
            )
            return None
        judged = judge(use, unit, before, after)
        self.board.set_bundle(judged)
        if judged.effective is False and judged.rebuilt != use.rebuilt:
            log.warning(
                "bundle %s did not prevent builds through %s's READY: %s rebuilt; the "
                "bundle lacks what this node compiles (a key or a path that differs from "
                "the build host's, or caches the build host never filled)",
                judged.digest, unit, judged.summary(),
            )  # fmt: skip
        elif judged.effective and use.effective is None:
            log.info("bundle %s: nothing rebuilt through %s's READY", judged.digest, unit)
        return judged

    async def _ensure(self, recheck: bool, patch_allowed: bool) -> WarmOutcome:
        cfg = self.cfg
        started = time.monotonic()
        self.board.set_warmup(WarmupInfo(cfg.arch, "running", at=utc_now()))
        patched = False
        version: str | None = None
        pull_warning: str | None = None
        try:
            env = await self._env()
            pull_warning = await self._pull(env)
            result = await self._warm(env)
            report = result.report
            gate = report.gate.verdict if report is not None else "unknown"
            if recheck or (not result.ok and gate == "rejects"):
                report = await flashinfer.doctor(
                    cfg.python, cfg.arch, cfg.workspace, cfg.modules, env=env
                )
                gate = report.gate.verdict
            version = report.versions.get("flashinfer") if report is not None else None
            if gate == "rejects" and patch_allowed:
                result_patch = await flashinfer.patch(cfg.python, cfg.arch, cfg.workspace, env=env)
                log.warning("FlashInfer gate patched: %s", result_patch.message)
                patched = result_patch.changed
                result = await self._warm(env)
                gate = "accepts" if result.ok else gate
        except Exception as exc:  # a SupervisorError says why; anything else is a bug here
            if not isinstance(exc, SupervisorError):
                log.exception("FlashInfer warm-up failed unexpectedly")
            why = str(exc) if isinstance(exc, SupervisorError) else f"{type(exc).__name__}: {exc}"
            if pull_warning:
                why = f"{why} (and {pull_warning})"
            duration = time.monotonic() - started
            self.board.record_warmup(cfg.arch, "failed", duration, ok=False, error=why)
            self.board.set_warmup(
                WarmupInfo(cfg.arch, "failed", at=utc_now(), error=why, duration_s=duration)
            )
            return WarmOutcome(False, why, arch_rejected=False)
        duration = time.monotonic() - started
        ok = result.ok and gate != "rejects"
        error = result.error if not ok else None
        if gate == "rejects" and not error:
            error = f"FlashInfer's gate rejects arch {cfg.arch}; allow_patch is off"
        shown = error  # on /status: the registry's warning too, beside a local warm-up
        if pull_warning:
            shown = f"{error} (and {pull_warning})" if error else f"{pull_warning}; warmed here"
        label = "failed" if not ok else ("built" if result.built else "warm")
        self.board.record_warmup(cfg.arch, label, duration, ok=ok, error=shown)
        self.board.set_warmup(
            WarmupInfo(
                cfg.arch, "warm" if ok else "failed", at=utc_now(), error=shown, duration_s=duration
            )
        )
        # A warm, verified cache means the gate accepts the venv as it is now.
        verdict = "accepts" if ok else (gate if gate in ("accepts", "rejects") else "unknown")
        facts = GateFacts(verdict, cfg.arch, version, patched=patched, error=error)
        return WarmOutcome(
            ok, error, arch_rejected=gate == "rejects", built=tuple(result.built), gate=facts
        )
