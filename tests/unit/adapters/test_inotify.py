"""inotify through ctypes, for real: files written, moved in, and made in directories
that did not exist when the watch began, each seen once; no timers, only the loop."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

from supervisor.adapters.inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_ISDIR,
    IN_Q_OVERFLOW,
    RawEvent,
    TreeWatch,
    parse_events,
)

DEADLINE_S = 10.0


class Seen:
    def __init__(self) -> None:
        self.files: list[tuple[Path, Path]] = []
        self.errors: list[str] = []
        self._changed = asyncio.Event()

    def on_file(self, root: Path, path: Path) -> None:
        self.files.append((root, path))
        self._changed.set()

    def on_error(self, message: str) -> None:
        self.errors.append(message)
        self._changed.set()

    async def until(self, count: int) -> list[Path]:
        async def wait() -> None:
            while len(self.files) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), DEADLINE_S)
        return [p for _, p in self.files]


def test_parse_events_reads_packed_records() -> None:
    def record(wd: int, mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name))
        return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

    data = record(1, IN_CLOSE_WRITE, b"a.so") + record(2, IN_CREATE | IN_ISDIR, b"sub")
    assert parse_events(data) == [
        RawEvent(1, IN_CLOSE_WRITE, "a.so"),
        RawEvent(2, IN_CREATE | IN_ISDIR, "sub"),
    ]


async def test_files_written_and_moved_in_are_seen(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    seen = Seen()
    watch = TreeWatch([root], seen.on_file, on_error=seen.on_error)
    watch.start()
    try:
        (root / "kernel.cubin").write_bytes(b"\0" * 100)
        staged = tmp_path / "staging.json"
        staged.write_text("{}")
        os.replace(staged, root / "kernel.json")  # write elsewhere, rename into place
        assert await seen.until(2) == [root / "kernel.cubin", root / "kernel.json"]
        assert all(r == root for r, _ in seen.files)
    finally:
        watch.close()


async def test_a_burst_in_a_new_directory_tree_is_never_missed(tmp_path: Path) -> None:
    """Triton makes a hash dir and writes into it at once: what lands before the new
    directory's watch takes hold is found by scanning it."""
    root = tmp_path / "triton"
    root.mkdir()
    seen = Seen()
    watch = TreeWatch([root], seen.on_file, on_error=seen.on_error)
    watch.start()
    try:
        deep = root / "ABCDEF" / "inner"
        deep.mkdir(parents=True)
        for name in ("k.cubin", "k.json", "k.ptx"):
            (deep / name).write_text(name)
        paths = await seen.until(3)
        assert sorted(p.name for p in paths) == ["k.cubin", "k.json", "k.ptx"]
        assert deep in watch.watched
        (deep / "later.cubin").write_text("x")  # and the new directory stays watched
        assert (await seen.until(4))[-1] == deep / "later.cubin"
    finally:
        watch.close()


async def test_a_cache_made_on_first_use_is_watched_from_its_parent(tmp_path: Path) -> None:
    root = tmp_path / "home" / ".cache" / "tvm-ffi"  # not there yet
    (tmp_path / "home").mkdir()
    seen = Seen()
    watch = TreeWatch([root], seen.on_file, on_error=seen.on_error)
    watch.start()
    try:
        (tmp_path / "home" / "unrelated.txt").write_text("not ours")
        root.mkdir(parents=True)
        (root / "op.so").write_bytes(b"\x7fELF")
        assert await seen.until(1) == [root / "op.so"]
        assert seen.files[0][0] == root
    finally:
        watch.close()
    assert not [p for _, p in seen.files if p.name == "unrelated.txt"]


def test_an_overflowed_queue_is_reported() -> None:
    seen = Seen()
    watch = TreeWatch([Path("/nonexistent")], seen.on_file, on_error=seen.on_error)
    watch.handle(RawEvent(-1, IN_Q_OVERFLOW, ""))
    assert seen.errors and "overflowed" in seen.errors[0]


async def test_closing_the_watch_stops_the_reports(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    seen = Seen()
    watch = TreeWatch([root], seen.on_file, on_error=seen.on_error)
    watch.start()
    (root / "a").write_text("a")
    await seen.until(1)
    watch.close()
    assert watch.watched == []
    for n in range(3):
        (root / f"after-{n}").write_text("x")
    await asyncio.sleep(0)  # one loop turn: nothing is read any more
    assert [p.name for _, p in seen.files] == ["a"]
