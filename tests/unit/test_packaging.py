"""What a build ships: the production wheel holds the daemon and its CLI, nothing else.

The wheel is built as a server (or the Debian package's debian/rules) builds it,
``python -m build --wheel`` from this checkout; the development tools (``k26dev``:
sandbox, booted host, stand-in SGLang with its ``sglang`` shim, demo) are a
distribution of their own, ``k26-dev`` in ``devtools/``, which scripts/dev.sh
installs editable beside the product. Both are plain setuptools: no ``setup.py``,
no build backend of our own.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
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


def test_both_distributions_are_plain_setuptools() -> None:
    """No setup.py, no in-tree build backend: what a build holds is the pyproject.toml's."""
    for project in (REPO, REPO / "devtools"):
        with open(project / "pyproject.toml", "rb") as f:
            build = tomllib.load(f)["build-system"]
        assert build["build-backend"] == "setuptools.build_meta", project
        assert "backend-path" not in build, project
        assert not (project / "setup.py").exists() and not (project / "setup.cfg").exists()
    assert not (REPO / "build_backend").exists()


def test_the_dev_tools_are_a_distribution_of_their_own() -> None:
    with open(REPO / "devtools" / "pyproject.toml", "rb") as f:
        dev = tomllib.load(f)
    assert dev["project"]["scripts"] == {"k26-dev": "k26dev.cli:main"}
    assert "k26-supervisor" in dev["project"]["dependencies"]  # k26dev imports supervisor
    assert dev["tool"]["setuptools"]["packages"]["find"]["include"] == ["k26dev", "k26dev.*"]
    assert (REPO / "devtools" / "k26dev" / "__init__.py").is_file()
    assert not (REPO / "k26dev").exists()  # one copy, in devtools/


def test_the_dev_install_adds_k26dev_and_its_command() -> None:
    """This venv holds both editable installs (scripts/dev.sh setup): the product with
    its one command, and k26-dev with its own."""
    product = importlib.metadata.distribution("k26-supervisor")
    assert [(ep.name, ep.value) for ep in product.entry_points] == [
        ("k26-supervisor", "supervisor.cli:main")
    ]
    dev = importlib.metadata.distribution("k26-dev")
    assert [(ep.name, ep.value) for ep in dev.entry_points] == [("k26-dev", "k26dev.cli:main")]
    assert "k26-supervisor" in (dev.requires or [])
    help_text = subprocess.run(
        [sys.executable, "-m", "k26dev", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("sandbox", "standin", "demo"):
        assert command in help_text
    product_help = subprocess.run(
        [sys.executable, "-m", "supervisor", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("sandbox", "standin", "demo"):
        assert f" {command} " not in product_help and f"{{{command}" not in product_help


def test_the_daemon_never_imports_the_dev_tools() -> None:
    imports = re.compile(r"^\s*(from|import)\s+k26dev\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "supervisor").rglob("*.py")
        if imports.search(p.read_text())
    ]
    assert offenders == []
