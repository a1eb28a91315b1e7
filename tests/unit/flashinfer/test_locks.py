"""Build locks: live holders are never touched, a SIGKILLed holder's file is removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.flashinfer import locks

# Takes the flock exactly as filelock's UnixFileLock does, then says so.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    path = tmp_path / "cached_ops" / "tmp" / "sampling.lock"
    path.parent.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "locked"
    yield proc, path
    proc.kill()
    proc.wait()


def test_live_holder_is_seen_and_kept(holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, path = holder
    info = locks.inspect_lock(path)
    assert info.state == "held"
    assert proc.pid in info.holders
    assert locks.remove_if_stale(path).state == "held"
    assert path.exists()


def test_sigkilled_holder_leaves_a_stale_lock_that_is_removed(
    holder: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, path = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert path.exists(), "flock files outlive their holder"
    assert locks.inspect_lock(path).state == "stale"
    outcome = locks.remove_if_stale(path)
    assert (outcome.state, outcome.detail) == ("stale", "removed")
    assert not path.exists()


def test_open_by_another_process_is_kept(tmp_path: Path) -> None:
    """A process that has the file open may be about to lock it: not provably stale."""
    path = tmp_path / "x.lock"
    path.write_text("")
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1]); print('open', flush=True); "
         "sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "open"
        assert locks.inspect_lock(path).state == "stale"
        assert locks.remove_if_stale(path).state == "held"
        assert path.exists()
    finally:
        reader.kill()
        reader.wait()


def test_find_lock_files(tmp_path: Path) -> None:
    jit = tmp_path / "cached_ops"
    (jit / "tmp").mkdir(parents=True)
    (jit / "tmp" / "sampling.lock").write_text("")
    (jit / "sampling").mkdir()
    (jit / "sampling" / "sampling.so").write_text("")
    assert locks.find_lock_files(jit) == [jit / "tmp" / "sampling.lock"]
    assert locks.find_lock_files(tmp_path / "absent") == []
