"""A run that writes into the user's own JIT caches fails (tests/conftest.py).

Tests must leave a developer's ``~/.triton``, ``~/.cache/flashinfer``,
``~/.cache/tvm-ffi`` and ``/tmp/torchinductor_<user>`` as they found them. A test
that runs the stand-in or a serving venv with a cache unpinned writes there,
passes, and leaves the mess behind; the guard turns that into a failure, under
xdist too (the workers write, the controller looks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body: str, *xdist: str) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    source = (
        "import os\nfrom pathlib import Path\n\n"
        f"HOME = Path({str(home)!r})\n\n\n"
        "def test_it():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    (tmp_path / "test_writes.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         *xdist, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home),
             "TMPDIR": str(tmp_path / "tmp")},
    )  # fmt: skip


WRITES = (
    ".triton/cache/abc/k.json",
    ".cache/flashinfer/0.7.0/flashinfer_jit.log",
    ".cache/tvm-ffi/addon.so",
    ".cache/sglang/autotune.json",
    ".cache/deep_gemm/kernel.cubin",
)


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_a_write_into_any_user_cache_fails_the_run(tmp_path: Path, xdist: tuple[str, ...]) -> None:
    (tmp_path / "tmp").mkdir()
    body = f"""\
        import getpass
        for path in {WRITES!r}:
            target = HOME / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("x")
        (Path(os.environ["TMPDIR"]) / f"torchinductor_{{getpass.getuser()}}").mkdir()
    """
    done = _run(tmp_path, body, *xdist)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the run wrote into the user's own JIT caches" in done.stdout, done.stdout
    for path in WRITES:
        assert str(tmp_path / "home" / path) in done.stdout, path
    assert str(tmp_path / "tmp" / "torchinductor_") in done.stdout


def test_what_was_there_before_and_pinned_caches_are_fine(tmp_path: Path) -> None:
    old = tmp_path / "home" / ".triton" / "cache" / "old"
    old.mkdir(parents=True)
    body = """\
        pinned = HOME / "pinned" / "triton"
        pinned.mkdir(parents=True)
        (pinned / "k.json").write_text("x")
        assert (HOME / ".triton" / "cache" / "old").is_dir()
    """
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "user's own JIT caches" not in done.stdout
