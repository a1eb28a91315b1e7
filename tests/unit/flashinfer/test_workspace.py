"""Workspace checks and quarantine: clear errors, nothing half-done."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.core.errors import CacheError
from supervisor.flashinfer import cache


def test_workspace_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheError, match="is not writable"):
        cache.check_workspace(blocker / "ws")


def test_full_workspace(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="is full"):
        cache.check_workspace(tmp_path, min_free_bytes=1 << 62)
    assert not [p for p in cache.cache_root(tmp_path).iterdir() if p.name.startswith(".k26")]


def test_quarantine_moves_and_prunes(tmp_path: Path) -> None:
    moved = []
    for index in range(cache.QUARANTINE_KEEP + 2):
        victim = tmp_path / "cached_ops" / "sampling"
        victim.mkdir(parents=True)
        (victim / "sampling.so").write_bytes(b"half")
        destination = cache.quarantine(tmp_path, victim, f"120f-sampling-{index}")
        assert destination is not None and not victim.exists()
        moved.append(destination)
    kept = list((cache.cache_root(tmp_path) / cache.QUARANTINE_NAME).iterdir())
    assert len(kept) == cache.QUARANTINE_KEEP
    assert moved[-1] in kept
    assert cache.quarantine(tmp_path, tmp_path / "absent", "x") is None


def test_unreadable_fingerprint_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / cache.FINGERPRINT_NAME
    path.write_text("{ half-written")
    assert cache.read_fingerprint(path) is None
