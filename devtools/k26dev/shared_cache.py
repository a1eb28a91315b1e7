"""The shared cache outside the clone, for what the tests, the demo and the benches need.

Serving venvs with real FlashInfer releases, Debian's Prometheus and Alertmanager
binaries, the Debian package's wheelhouse and the staleness tests' toolkits are big and
slow to fetch, and no clone should fetch them twice. They live in one directory
outside any clone, each entry keyed by the exact versions it holds:
``$K26_SERVING_CACHE``, else ``$XDG_CACHE_HOME/k26-supervisor``, else
``~/.cache/k26-supervisor`` (``scripts/cache-dir.sh`` is the same rule for the
shell scripts, which make the entries).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

from k26dev.errors import SandboxError

REPO = Path(__file__).resolve().parents[2]  # devtools/k26dev/shared_cache.py
SCRIPTS = REPO / "scripts"


def root() -> Path:
    """The cache directory (not created here)."""
    explicit = os.environ.get("K26_SERVING_CACHE")
    if explicit:
        return Path(explicit).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "k26-supervisor"


def _script_path(*argv: str) -> Path:
    done = subprocess.run(
        ["bash", str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SandboxError(f"scripts/{' '.join(argv)}: {done.stderr.strip()}")
    return Path(done.stdout.strip())


def tools_dir() -> Path:
    """Where ``scripts/tools.sh`` unpacks Debian's prometheus and alertmanager packages;
    its ``bin/`` holds prometheus, promtool, alertmanager and amtool."""
    return _script_path("tools.sh", "path")


def serving_venv(name: str, *, make: bool = True) -> Path:
    """The serving venv ``name`` (``0.7``, ``0.2``, ``0.7.0-cu128``): made or checked by
    ``scripts/serving-venv.sh`` first unless ``make`` is false. Raises SandboxError with
    the script's output when it fails."""
    script = str(SCRIPTS / "serving-venv.sh")
    if make:
        done = subprocess.run(["bash", script, name], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxError(
                f"scripts/serving-venv.sh {name} failed:\n{done.stdout}\n{done.stderr}"
            )
    return _script_path("serving-venv.sh", "path", name)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One maker of ``path`` at a time, across processes (test workers, a CI run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# The build backends the package's build needs offline: the product's own, and Cython
# for the dependencies kept as source (pystemd).
BUILD_REQUIREMENTS = ("setuptools>=77", "wheel", "cython")


def wheelhouse() -> Path:
    """What the Debian package's build needs offline: every dependency as a wheel, but
    as its source archive where the wheel would be one built here (``*-linux_*.whl``:
    pystemd, which PyPI has no wheel of, made by this venv's interpreter, would
    carry that interpreter's library path; the package compiles it with Debian's
    python3.11 and build flags), and the build backends. Never the product itself
    (debian/rules builds it from the checkout). Keyed by pyproject.toml; made with
    the project venv's pip (network) the first time only."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    wheels = root() / f"wheelhouse-{digest[:10]}"
    marker = wheels / ".k26-wheelhouse-2"  # 2: local wheels kept as source
    with _locked(wheels):
        if marker.exists() and marker.read_text() == digest:
            return wheels
        staging = wheels.with_name(wheels.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        pip = [str(REPO / ".venv" / "bin" / "pip"), "--disable-pip-version-check", "-q"]
        # The dependencies as pyproject.toml names them: the product itself is never
        # built here (an in-tree build would leave build/ and an egg-info in the clone,
        # whose metadata then shadows the editable install's).
        _pip([*pip, "wheel", "--wheel-dir", str(staging), *dependencies()])
        for local in staging.glob("*-linux_*.whl"):
            name, version = local.name.split("-")[:2]
            _pip([*pip, "download", "--no-deps", "--no-binary", name, "--dest", str(staging),
                  f"{name}=={version}"])  # fmt: skip
            local.unlink()
        _pip([*pip, "download", "--dest", str(staging), *BUILD_REQUIREMENTS])
        (staging / marker.name).write_text(digest)
        shutil.rmtree(wheels, ignore_errors=True)
        staging.rename(wheels)
    return wheels


def dependencies() -> list[str]:
    """The product's runtime requirements, as pyproject.toml states them."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def _pip(argv: list[str]) -> None:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SandboxError(f"{' '.join(argv[3:5])} failed: {done.stderr.strip()}")


def main() -> int:
    """``python -m k26dev.shared_cache wheelhouse``: print the wheelhouse, made if needed
    (``scripts/deb.sh`` passes it to the package build)."""
    import sys

    if sys.argv[1:] != ["wheelhouse"]:
        print("usage: python -m k26dev.shared_cache wheelhouse", file=sys.stderr)
        return 64
    try:
        print(wheelhouse())
    except SandboxError as exc:
        print(f"k26dev.shared_cache: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
