"""``write_atomic``: the one way files are replaced (caches, patches, state, drop-ins).

Old or new bytes, never a mix; the mode asked for, else the old file's, else the
creation mode less the umask; no temporary file left behind, whatever happens.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.atomic_write import write_atomic


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_data_and_0644_less_the_umask(tmp_path: Path, umask_027: None) -> None:
    path = tmp_path / "f"
    write_atomic(path, "text\n")
    assert path.read_text() == "text\n"
    assert mode(path) == 0o640
    assert os.listdir(tmp_path) == ["f"]


def test_new_mode_0666_is_what_open_would_make(tmp_path: Path, umask_027: None) -> None:
    write_atomic(tmp_path / "f", b"bytes", new_mode=0o666)
    (tmp_path / "g").write_bytes(b"bytes")
    assert mode(tmp_path / "f") == mode(tmp_path / "g") == 0o640


def test_a_replaced_file_keeps_its_mode_unless_one_is_given(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("old")
    path.chmod(0o600)
    write_atomic(path, "new", new_mode=0o666)
    assert (path.read_text(), mode(path)) == ("new", 0o600)
    write_atomic(path, "newer", mode=0o2755)
    assert (path.read_text(), mode(path)) == ("newer", 0o2755)


@pytest.mark.parametrize("durable", [True, False])
def test_the_old_file_is_replaced_not_rewritten(tmp_path: Path, durable: bool) -> None:
    """A reader holding the old file still reads the old bytes: a rename, not a rewrite."""
    path = tmp_path / "f"
    path.write_text("old")
    with path.open() as reader:
        write_atomic(path, "new", durable=durable)
        assert reader.read() == "old"
    assert path.read_text() == "new"


def test_a_failed_replace_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "d"
    target.mkdir()
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        write_atomic(target, "cannot replace a non-empty directory")
    assert (target / "inside").read_text() == "kept"
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_a_missing_directory_is_an_oserror_and_nothing_is_made(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "none" / "f", "x")
    assert os.listdir(tmp_path) == []
