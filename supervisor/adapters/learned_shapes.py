"""Learning from what compiled after READY (the record: core/learned_shapes.py).

Each file the JIT watch reports while a unit is ready belongs to a variant: Triton's
cache entry (its hash directory), else the file less its suffixes. At a variant's
first file the daemon reads the end of the unit's output (its ``StandardOutput=``
file, or the journal) for SGLang's last batch line, then, for up to ``SETTLE_S``, the
two batch lines printed after it (core/learned_shapes.py says why); the Triton
entry's ``<name>.source`` (or ``.ttir``) gives the kernel's signature. The record is
kept in the daemon's state directory, ``k26-learned-shapes.json`` (apart from
FlashInfer's ``k26-learned-modules.json`` in its workspace), written atomically off
the event loop, merged with what the file holds then (a ``bundle pull
--learned-into`` meanwhile is kept); the next start's coverage replays it.

A record that is not valid JSON of that schema is moved aside, named in the log,
and learning starts afresh: a corrupt file never stops a start, and its content is
kept beside it. One that cannot be read (permissions) is left alone: learning goes
on in memory, and the log says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from supervisor.atomic_write import give_to_directory_owner, write_atomic
from supervisor.core import learned_shapes as core
from supervisor.core.errors import InputError
from supervisor.core.jit_caches import JitCache

log = logging.getLogger("k26.learned")

# After a compile's first file: how long the batch lines printed after it are awaited
# (0.5.17 prints a prefill's line after its forward, see core/learned_shapes.py), and
# how often the output is read meanwhile.
SETTLE_S = 5.0
SETTLE_POLL_S = 0.25


def state_dir(configured: Path | None, bus: str) -> Path:
    """The daemon's state directory: the configured one, else systemd's
    ``$STATE_DIRECTORY`` (``StateDirectory=``), else the default for the bus."""
    if configured is not None:
        return configured
    given = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if given:
        return Path(given)
    if bus == "user":
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "k26-supervisor"
    return Path("/var/lib/k26-supervisor")


def read_records(path: Path) -> dict[str, list[core.LearnedShape]]:
    """The record at ``path`` (none: empty). ValueError names the file and the fault."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return core.parse_records(data, str(path))


def merge_learned_file(path: Path, document: Mapping[str, object]) -> int:
    """Fold a learned-shapes ``document`` (a pulled bundle's) into the file at
    ``path``; how many records were new. InputError when either is not a valid
    record: the file is then left exactly as it was."""
    try:
        incoming = core.parse_records(document, "the bundle's learned shapes")
        known = read_records(path)
    except ValueError as exc:
        raise InputError(f"{exc}; nothing merged") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it: {exc.strerror}; nothing merged") from None
    new = 0
    for unit, shapes in incoming.items():
        have = {s.key() for s in known.get(unit, [])}
        fresh = [s for s in shapes if s.key() not in have]
        new += len(fresh)
        known[unit] = core.merge(known.get(unit, []), fresh)
    text = json.dumps(core.document(known), indent=1, sort_keys=True) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, text, new_mode=0o600)
        give_to_directory_owner(path)  # a root merge: the daemon reads it as its own user
    except OSError as exc:
        raise InputError(f"{path}: cannot write it: {exc.strerror}; nothing merged") from None
    return new


class LearnedStore:
    """The learned shapes of every unit, in memory and in one file."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / core.LEARNED_SHAPES_NAME
        self._records: dict[str, list[core.LearnedShape]] = {}
        self.writable = True  # False while a bad file could not be moved aside
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        try:
            self._records = await asyncio.to_thread(read_records, self.path)
        except OSError as exc:  # unreadable, not corrupt: left as it is
            log.error("learned shapes: cannot read %s: %s; learning goes on in memory only "
                      "(fix its owner or mode, then restart)", self.path, exc)  # fmt: skip
            self._records, self.writable = {}, False
        except ValueError as exc:
            aside = self.path.with_name(f"{self.path.name}.bad-{int(time.time())}")
            try:
                await asyncio.to_thread(os.replace, self.path, aside)
            except OSError as move:
                log.error("learned shapes: %s; cannot move it aside (%s): learning goes on "
                          "in memory only until it is removed", exc, move)  # fmt: skip
                self._records, self.writable = {}, False
                return
            log.error("learned shapes: %s; moved it to %s and start afresh", exc, aside)
            self._records = {}

    def for_unit(self, unit: str) -> list[core.LearnedShape]:
        return list(self._records.get(unit, ()))

    async def add(self, unit: str, shapes: Sequence[core.LearnedShape]) -> list[core.LearnedShape]:
        """Fold ``shapes`` into ``unit``'s record and write the file; the unit's record."""
        async with self._lock:
            return await self._put(unit, core.merge(self._records.get(unit, []), shapes))

    async def merge_units(self, units: Mapping[str, Sequence[core.LearnedShape]]) -> int:
        """Fold another node's records in (a pulled bundle's); how many were new."""
        new = 0
        async with self._lock:
            for unit, shapes in units.items():
                known = {s.key() for s in self._records.get(unit, [])}
                fresh = [s for s in shapes if s.key() not in known]
                if fresh:
                    new += len(fresh)
                    await self._put(unit, core.merge(self._records.get(unit, []), fresh))
        return new

    async def set_batches(
        self, unit: str, key: tuple[str, str], batches: tuple[core.BatchLine, ...]
    ) -> list[core.LearnedShape] | None:
        """The candidate batches of a variant recorded this run (see Learner)."""
        async with self._lock:
            records = self._records.get(unit, [])
            at = next((i for i, s in enumerate(records) if s.key() == key), None)
            if at is None:
                return None
            joined = core.union(records[at].batches, batches)
            if joined == records[at].batches:
                return None
            updated = [*records]
            updated[at] = replace(records[at], batches=joined)
            return await self._put(unit, updated)

    async def sign(
        self, unit: str, key: tuple[str, str], signature: str
    ) -> list[core.LearnedShape] | None:
        """Give a recorded variant its signature; None when there was nothing to add."""
        async with self._lock:
            records = self._records.get(unit, [])
            at = next((i for i, s in enumerate(records) if s.key() == key), None)
            if at is None or records[at].signature is not None:
                return None
            signed = [*records]
            signed[at] = replace(records[at], signature=signature)
            return await self._put(unit, signed)

    async def _put(self, unit: str, merged: list[core.LearnedShape]) -> list[core.LearnedShape]:
        """Under the lock: the unit's new record, written, then kept."""
        records = {**self._records, unit: merged}
        if self.writable:
            try:
                records = await asyncio.to_thread(self._write, records)
            except OSError as exc:  # kept in memory: this run still replays it
                log.error("learned shapes: cannot write %s: %s", self.path, exc)
        self._records = records
        return list(records[unit])

    def _write(
        self, records: dict[str, list[core.LearnedShape]]
    ) -> dict[str, list[core.LearnedShape]]:
        """Write ``records`` with whatever the file gained from elsewhere since (a
        ``bundle pull --learned-into``): those records are kept. The records written."""
        try:
            on_disk = read_records(self.path)
        except ValueError:
            on_disk = {}  # corrupt since the start: ours replace it
        joined = dict(records)
        for unit, shapes in on_disk.items():
            known = {s.key() for s in joined.get(unit, [])}
            extra = [s for s in shapes if s.key() not in known]
            if extra:
                joined[unit] = core.merge(extra, joined.get(unit, []))
        text = json.dumps(core.document(joined), indent=1, sort_keys=True) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self.path, text, new_mode=0o600)
        return joined


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def variant_of(cache: JitCache, root: Path, path: Path) -> tuple[str, str]:
    """(variant, kernel) of a new file: Triton's entry is its hash directory, and the
    kernel its file name's stem (a group file's without ``__grp__``); elsewhere the
    file, less its suffixes, under the cache root."""
    relative = PurePosixPath(path.relative_to(root).as_posix())
    stem = relative.name.split(".")[0]
    if cache is JitCache.TRITON and len(relative.parts) >= 2:
        return relative.parts[0], stem.removeprefix("__grp__")
    return _file_variant(relative), stem


def _file_variant(relative: PurePosixPath) -> str:
    """Outside Triton a directory may be a shard of many kernels (inductor's <2
    chars>/): the file, less its suffixes, under its root is the variant."""
    return (relative.parent / relative.name.split(".")[0]).as_posix().removeprefix("./")


_KERNEL = re.compile(r"[A-Za-z_][\w$.]*")  # a kernel's name, as Triton and variant_of give it


def census(roots: Mapping[str, Sequence[Path]]) -> dict[str, frozenset[str]]:
    """Every entry in each of the unit's caches (``roots``: cache name -> its roots),
    named as ``variant_of`` names a new file's: Triton's hash directories (one a
    variant, there from its compile's first file on), elsewhere each file less its
    suffixes under its root. A root that is missing or cannot be read adds nothing;
    links are not followed. Blocking: call it off the event loop."""
    out: dict[str, frozenset[str]] = {}
    for cache, paths in roots.items():
        names: set[str] = set()
        for root in paths:
            if cache == str(JitCache.TRITON):
                try:
                    with os.scandir(root) as entries:
                        names.update(
                            f"{root}/{e.name}" for e in entries if e.is_dir(follow_symlinks=False)
                        )
                except OSError:
                    continue
                continue
            for here, _dirs, files in os.walk(root):
                base = PurePosixPath(Path(here).relative_to(root).as_posix())
                names.update(f"{root}/{_file_variant(base / name)}" for name in files)
        out[cache] = frozenset(names)
    return out


def made(roots: Mapping[str, Sequence[Path]], entries: Sequence[tuple[str, str, str]]) -> bool:
    """Whether every (cache, variant, kernel) entry is in the unit's caches (``roots``:
    cache name -> its roots), complete: a Triton entry once its ``<kernel>.json``
    metadata is in (Triton 3.6 writes it after the binaries, then the group file),
    elsewhere the variant's file with any suffix. A record may come from another node
    (a bundle): an entry of a cache the unit has no root for, or whose variant or
    kernel names anything but a path inside the root, is not there."""
    for cache, variant, kernel in entries:
        relative = PurePosixPath(variant)
        if (
            relative.is_absolute()
            or not relative.parts
            or any(part in ("..", ".") for part in relative.parts)
            or not _KERNEL.fullmatch(kernel)
        ):
            return False
        if not any(_entry_in(root / relative, cache, kernel) for root in roots.get(cache, ())):
            return False
    return True


def _entry_in(where: Path, cache: str, kernel: str) -> bool:
    try:
        if cache == str(JitCache.TRITON):
            return any((where / n).is_file() for n in (f"{kernel}.json", f"__grp__{kernel}.json"))
        if where.exists():
            return True
        prefix = where.name + "."
        return any(p.name.startswith(prefix) for p in where.parent.iterdir())
    except (OSError, ValueError):  # ValueError: a NUL in a record's string
        return False


def _signature_near(path: Path, kernel: str) -> str | None:
    for suffix in (".source", ".ttir"):
        try:
            text = (path.parent / f"{kernel}{suffix}").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found = core.triton_signature(text)
        if found is not None:
            return found
    return None


OutputOf = Callable[[str], Awaitable[list[str]]]
OnLearned = Callable[[str, list[core.LearnedShape]], None]


class Learner:
    """Turns the JIT watch's files into learned shapes (one per variant)."""

    def __init__(self, store: LearnedStore, output_of: OutputOf, on_learned: OnLearned) -> None:
        self.store = store
        self.output_of = output_of  # the unit's recent output lines
        self.on_learned = on_learned  # (unit, its whole record) after each change
        # This run's variants: set once the first sighting is recorded.
        self._pending: dict[tuple[str, str, str], asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def saw(self, unit: str, cache: JitCache, root: Path, path: Path) -> None:
        """A file the watch reported (on the event loop; the work runs as a task)."""
        try:
            variant, kernel = variant_of(cache, root, path)
        except ValueError:
            return
        task = asyncio.create_task(self._saw(unit, cache, variant, kernel, path, time.time()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _saw(
        self, unit: str, cache: JitCache, variant: str, kernel: str, path: Path, now: float
    ) -> None:
        key = (unit, str(cache), variant)
        try:
            recorded = self._pending.get(key)
            if recorded is None:
                recorded = self._pending[key] = asyncio.Event()
                try:
                    # Read at once: the compile holds the scheduler, so the last batch
                    # line is the batch before it; those printed next are in _settle.
                    before = await self.output_of(unit)
                    shape = core.LearnedShape(
                        cache=str(cache),
                        kernel=kernel,
                        variant=variant,
                        first_seen=_iso(now),
                        last_seen=_iso(now),
                        batches=tuple(core.candidates(before, [])),
                    )
                    self.on_learned(unit, await self.store.add(unit, [shape]))
                except BaseException:
                    del self._pending[key]  # a later file of it tries again
                    raise
                finally:
                    recorded.set()  # never leaves the variant's other files waiting
                batches = await self._settle(unit, before)
                if batches:
                    record = await self.store.set_batches(unit, shape.key(), batches)
                    if record is not None:
                        self.on_learned(unit, record)
                log.warning(
                    "learned shape: unit=%s cache=%s kernel=%s variant=%s batches=%s",
                    unit, cache, kernel, variant,
                    " | ".join(b.line for b in batches) or "unknown (no batch line near it)",
                )  # fmt: skip
            else:
                await recorded.wait()
                if key not in self._pending:
                    return  # the first sighting failed (logged); a later file retries
            if cache is JitCache.TRITON and path.suffix in (".source", ".ttir"):
                signature = await asyncio.to_thread(_signature_near, path, kernel)
                if signature is not None:
                    record = await self.store.sign(unit, (str(cache), variant), signature)
                    if record is not None:
                        self.on_learned(unit, record)
        except Exception:  # learning must never take the daemon down
            log.exception("learned shapes: recording %s %s failed", cache, variant)

    async def _settle(self, unit: str, before: list[str]) -> tuple[core.BatchLine, ...]:
        """The candidate batches, once the lines printed after the compile are in (two
        batch lines, or ``SETTLE_S``: an idle server prints no more)."""
        found = core.candidates(before, [])
        deadline = time.monotonic() + SETTLE_S
        wanted = len(found) + 2
        while True:
            found = core.candidates(before, await self.output_of(unit))
            if len(found) >= wanted or time.monotonic() >= deadline:
                return tuple(found)
            await asyncio.sleep(SETTLE_POLL_S)

    def forget_run(self, unit: str) -> None:
        """The unit left READY: its next run's files are new sightings."""
        for key in [k for k in self._pending if k[0] == unit]:
            del self._pending[key]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def status_json(
    path: Path, records: Sequence[core.LearnedShape], kept: int = 20
) -> dict[str, object]:
    """The unit's learned shapes as /status shows them: the newest ``kept``."""
    return {
        "path": str(path),
        "count": len(records),
        "replayable": sum(1 for r in records if core.replay_items(r)),
        "latest": [r.to_json() for r in records[-kept:]],
    }
