"""The JIT watch: every file a unit's JIT caches gain while it is ready.

READY means nothing is left to compile under live traffic. From READY on, the
daemon watches each cache the unit writes (``core.jit_caches.locate`` on the
unit's own environment) with inotify (``adapters.inotify``, read by the event
loop, no timer). A new artifact is an event: ``on_artifact(unit, cache, kernel,
path)``, which the daemon turns into a log line, ``k26_jit_after_ready_total``
and an entry in ``/status``. The watch of a unit ends when it leaves READY: what
a start compiles is the warm-up's business, not an incident.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from supervisor.adapters.inotify import TreeWatch
from supervisor.core.jit_caches import CacheLocation, JitCache, artifact_kernel, ignored_artifact

log = logging.getLogger("k26.jitwatch")

OnArtifact = Callable[[str, JitCache, str, Path], None]


class UnitJitWatch:
    """The caches of one ready unit."""

    def __init__(self, unit: str, locations: Sequence[CacheLocation], on_artifact: OnArtifact):
        self.unit = unit
        self.locations = {Path(str(loc.path)): loc.cache for loc in locations}
        self.on_artifact = on_artifact
        self.seen: set[Path] = set()
        self._tree = TreeWatch(list(self.locations), self._on_file, on_error=self._on_error)

    def start(self) -> None:
        self._tree.start()

    async def start_async(self) -> None:
        await self._tree.start_async()

    def close(self) -> None:
        self._tree.close()

    @property
    def watched(self) -> list[Path]:
        return self._tree.watched

    def _on_error(self, message: str) -> None:
        log.warning("JIT watch of %s: %s", self.unit, message)

    def _on_file(self, root: Path, path: Path) -> None:
        relative = PurePosixPath(path.relative_to(root).as_posix())
        cache = self.locations[root]
        if ignored_artifact(relative, cache) or path in self.seen:
            return
        self.seen.add(path)
        self.on_artifact(self.unit, cache, artifact_kernel(cache, relative), path)


class JitWatches:
    """One ``UnitJitWatch`` per ready unit: ``watch`` at READY, ``unwatch`` when it leaves."""

    def __init__(self, on_artifact: OnArtifact) -> None:
        self.on_artifact = on_artifact
        self._units: dict[str, UnitJitWatch] = {}

    async def watch(self, unit: str, locations: Sequence[CacheLocation]) -> UnitJitWatch | None:
        self.unwatch(unit)
        watch = UnitJitWatch(unit, locations, self.on_artifact)
        self._units[unit] = watch  # an unwatch while the walk runs closes it
        try:
            await watch.start_async()
        except OSError as exc:  # no inotify (a container without it): say so, carry on
            log.warning("cannot watch %s's JIT caches: %s", unit, exc)
            self.unwatch(unit)
            return None
        if self._units.get(unit) is not watch:
            watch.close()  # left READY meanwhile
            return None
        return watch

    def unwatch(self, unit: str) -> None:
        watch = self._units.pop(unit, None)
        if watch is not None:
            watch.close()

    def close(self) -> None:
        for unit in list(self._units):
            self.unwatch(unit)
