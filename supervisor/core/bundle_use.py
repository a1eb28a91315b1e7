"""Whether a pulled bundle was used: what the caches gained between the pull and READY.

A bundle is pulled so that a start builds nothing. Peers report pulled caches that a
server silently ignored because one key differed (ModelExpress #560, vllm #48190): the
start then compiles everything anyway, and only a slow start shows it. So after a
pull the warm-up lists each cache's compiled artifacts (the files the JIT watch would
report: ``jit_caches.ignored_artifact`` leaves out locks, logs, temporary files and,
in FlashInfer's cache, its generated sources and this supervisor's ``k26-*`` records),
and at each unit's READY lists them again, each with its size and mtime. A file that
appeared in between, or was written again in place, was built through the warm-up,
the start or the coverage: the bundle did not prevent it. In place matters: FlashInfer
runs ninja at every load, and a rebuild of a pulled module (an input newer than its
objects) rewrites the same ``cached_ops`` names.

The verdict is ``effective`` true when no cache gained an artifact by the first READY
after the pull, and false, naming each cache that rebuilt and how many files, as soon
as one did; it never turns back to true for that pull. A bundle whose caches the
units then compile in live traffic shows as JIT after READY (``adapters/jit_watch.py``),
not here. Pure: the listings are made by ``adapters/warmup.py``, off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

from supervisor.core.jit_caches import JitCache, artifact_kernel

MAX_KERNELS_SHOWN = 5  # kernel names kept per rebuilt cache, for /status and the log


@dataclass(frozen=True, slots=True)
class Rebuilt:
    cache: str
    files: int
    kernels: tuple[str, ...]  # a few of the kernels the new files were built for

    def to_json(self) -> dict[str, Any]:
        return {"cache": self.cache, "files": self.files, "kernels": list(self.kernels)}


@dataclass(frozen=True, slots=True)
class BundleUse:
    """The latest pulled bundle, and whether it prevented every build (None: no unit
    has been ready since the pull)."""

    digest: str
    registry: str
    pulled_at: str  # ISO 8601, UTC
    created_at: str | None = None  # the bundle's config: when the build host made it
    effective: bool | None = None
    rebuilt: tuple[Rebuilt, ...] = field(default=())
    checked_units: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "registry": self.registry,
            "pulled_at": self.pulled_at,
            "created_at": self.created_at,
            "effective": self.effective,
            "rebuilt": [r.to_json() for r in self.rebuilt],
            "checked_units": list(self.checked_units),
        }

    def summary(self) -> str:
        """What rebuilt, for the log: ``triton 12 files (kern_a, kern_b), ...``."""
        return ", ".join(
            f"{r.cache} {r.files} file(s)" + (f" ({', '.join(r.kernels)})" if r.kernels else "")
            for r in self.rebuilt
        )


def utc_time(stamp: str) -> datetime:
    """An ISO 8601 time, as a bundle's ``created_at``; no zone means UTC. ValueError
    when it is none."""
    when = datetime.fromisoformat(stamp)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Served:
    """The bundle the registry gave at the latest pull that got one, whether it
    installed anything or found it already here, and when: how old it was then tells
    a registry that keeps serving the same bundle (a build host that stopped pushing,
    a frozen tag). Its age at the pull, not now: a node whose caches stay warm does
    not ask again, and a bundle that was fresh when asked must not turn stale on a
    healthy node by the clock alone."""

    digest: str
    created_at: str | None  # the bundle's config, as the build host wrote it
    pulled_at: float  # Unix seconds

    def created_seconds(self) -> float | None:
        """``created_at`` in Unix seconds; None when it is no ISO 8601 time (an
        unsigned bundle's is whatever its pusher wrote). No zone means UTC."""
        if self.created_at is None:
            return None
        try:
            return utc_time(self.created_at).timestamp()
        except ValueError:
            return None

    def age_at_pull(self) -> float | None:
        """Seconds from ``created_at`` to the pull (0 for a clock behind the build
        host's); None without a readable ``created_at``."""
        created = self.created_seconds()
        return None if created is None else max(0.0, self.pulled_at - created)


Stamp = tuple[int, int]  # (size, mtime_ns): a file written again shows in either
# cache -> each artifact's path relative to the cache's root -> its stamp
Listing = dict[str, dict[str, Stamp]]


def judge(use: BundleUse, unit: str, before: Listing, after: Listing) -> BundleUse:
    """``use`` with the verdict of ``unit``'s READY: what each cache gained or wrote
    again since the pull (``before``) by now (``after``), merged with what earlier
    units found."""
    gained: dict[str, frozenset[str]] = {}
    for cache, stamps in after.items():
        had = before.get(cache, {})
        new = frozenset(f for f, stamp in stamps.items() if had.get(f) != stamp)
        if new:
            gained[cache] = new
    merged = {r.cache: r for r in use.rebuilt}
    for cache, files in sorted(gained.items()):
        kernels = sorted({_kernel(cache, f) for f in files})[:MAX_KERNELS_SHOWN]
        old = merged.get(cache)
        if old is None or old.files < len(files):
            merged[cache] = Rebuilt(cache, len(files), tuple(kernels))
    rebuilt = tuple(merged[c] for c in sorted(merged))
    units = use.checked_units + ((unit,) if unit not in use.checked_units else ())
    return replace(use, effective=not rebuilt, rebuilt=rebuilt, checked_units=units)


def _kernel(cache: str, relative: str) -> str:
    try:
        kind = JitCache(cache)
    except ValueError:
        return PurePosixPath(relative).name
    return artifact_kernel(kind, PurePosixPath(relative))
