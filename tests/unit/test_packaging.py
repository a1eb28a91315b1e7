"""What a build ships: the production wheel holds the daemon and its CLI, nothing else.

The wheel is built as a server (or the Debian package's debian/rules) builds it,
``python -m build --wheel`` from this checkout; the development tools (``k26dev``:
sandbox, booted host, stand-in SGLang with its ``sglang`` shim, demo) come only
with the editable ``.[dev]`` install (build_backend/k26_backend.py).
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "src"  # a copy: the build's own build/ and egg-info stay out of the clone
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            # .cache: the GPU kit's downloads and staging (git-ignored, not the package's)
            ".git",
            ".venv",
            ".cache",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
        ),
    )
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("k26_supervisor-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_the_daemon_package_only(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"supervisor"}, tops
    assert not [n for n in names if "k26dev" in n or "sglang_shim" in n or "standin" in n]
    shipped = {n for n in names if n.endswith(".py")}
    in_tree = {
        str(p.relative_to(REPO))
        for p in (REPO / "supervisor").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert shipped == in_tree  # every module of the daemon, and only those
    assert "supervisor/py.typed" in names
    assert "supervisor/fleet/venv_scripts/k26_caches.py" in names  # run in the serving venv


def test_the_wheel_has_one_command(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    commands = [ln.split("=")[0].strip() for ln in text.splitlines() if "=" in ln]
    assert commands == ["k26-supervisor"], text
    assert "k26-supervisor = supervisor.cli:main" in text


def test_the_dev_install_adds_k26dev_and_its_command() -> None:
    """This venv is the editable ``.[dev]`` install (scripts/dev.sh setup)."""
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("k26-dev") == "k26dev.cli:main"
    assert scripts.get("k26-supervisor") == "supervisor.cli:main"
    help_text = subprocess.run(
        [sys.executable, "-m", "k26dev", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("sandbox", "standin", "demo"):
        assert command in help_text
    product = subprocess.run(
        [sys.executable, "-m", "supervisor", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("sandbox", "standin", "demo"):
        assert f" {command} " not in product and f"{{{command}" not in product, product


def test_the_daemon_never_imports_the_dev_tools() -> None:
    imports = re.compile(r"^\s*(from|import)\s+k26dev\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "supervisor").rglob("*.py")
        if imports.search(p.read_text())
    ]
    assert offenders == []
