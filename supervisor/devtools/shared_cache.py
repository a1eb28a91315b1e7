"""The shared cache outside the clone, for what the tests, the demo and the benches need.

Serving venvs with real FlashInfer releases, Debian's Prometheus and Alertmanager
binaries, the installer's wheelhouse and the staleness tests' toolkits are big and
slow to fetch, and no clone should fetch them twice. They live in one directory
outside any clone, each entry keyed by the exact versions it holds:
``$K26_SERVING_CACHE``, else ``$XDG_CACHE_HOME/k26-supervisor``, else
``~/.cache/k26-supervisor`` (``scripts/cache-dir.sh`` is the same rule for the
shell scripts, which make the entries).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from supervisor.core.errors import SandboxError

REPO = Path(__file__).resolve().parents[2]
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
