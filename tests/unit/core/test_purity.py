"""The core imports no I/O: checked in a fresh interpreter, by what it loads.

pydantic (the config models' one dependency) loads ``threading`` and ``socket``
for its own reasons; those are the baseline. A core module may load nothing
from the list that an interpreter with only pydantic imported has not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_CORE_DIR = Path(__file__).resolve().parents[3] / "supervisor" / "core"
# Every module of the core, a package's own modules too (supervisor.core.classify.kernel).
CORE = sorted(
    ".".join(("supervisor", "core", *p.relative_to(_CORE_DIR).with_suffix("").parts)).removesuffix(
        ".__init__"
    )
    for p in _CORE_DIR.rglob("*.py")
    if p != _CORE_DIR / "__init__.py"
)
# Modules that do I/O (or exist to), and the adapters' own dependencies.
FORBIDDEN = (
    "asyncio",
    "subprocess",
    "socket",
    "selectors",
    "select",
    "ssl",
    "fcntl",
    "threading",
    "concurrent",
    "http",
    "urllib.request",
    "httpx",
    "httpcore",
    "h11",
    "pystemd",
    "prometheus_client",
    "supervisor.adapters",
    "supervisor.flashinfer",
    "k26dev",
    "supervisor.commands",
    "supervisor.daemon",
)


def _forbidden_after(module: str, then: str = "") -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"m = importlib.import_module({module!r})\n"
        f"{then}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True
    )
    loaded = json.loads(done.stdout)
    return {name for name in loaded for f in FORBIDDEN if name == f or name.startswith(f + ".")}


@pytest.fixture(scope="module")
def baseline() -> set[str]:
    # pydantic loads its parts lazily: build one model, as core.config does.
    return _forbidden_after("pydantic", "m.create_model('X', a=(int, 1))(a=2)")


@pytest.mark.parametrize("module", CORE)
def test_a_core_module_imports_no_io(module: str, baseline: set[str]) -> None:
    bad = sorted(_forbidden_after(module) - baseline)
    assert not bad, f"{module} pulls in {bad}"


def test_the_check_catches_an_io_import(baseline: set[str]) -> None:
    assert "asyncio" in _forbidden_after("supervisor.adapters.probe") - baseline


def test_the_list_covers_every_core_module() -> None:
    assert "supervisor.core.machine" in CORE and "supervisor.core.classify" in CORE
    assert "supervisor.core.classify.kernel" in CORE
    assert len(CORE) >= 10
