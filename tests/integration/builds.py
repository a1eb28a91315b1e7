"""The session's real FlashInfer builds, shared by the tests whose subject is not the build.

A cold nvcc build of FlashInfer 0.7.4's ``sampling`` for 12.0 costs 120-300 s on
2 cores. The ``sampling_build`` fixture (conftest) makes it once per session (per
xdist worker of the ``nvcc`` group: every test that uses it is in that group), and
the test of the cold precompile asserts on that very build. Every other test that
needs the cache warm calls ``restore()``: the arch dir as built, mtimes and all,
put back at the path it was built at. FlashInfer's ninja state names absolute
paths, so a copy anywhere else would make its loader rebuild.

``small_build`` does the same for ``locality_domain`` (one translation unit,
about 25 s): the module the kill, full-disk and race tests build, where any real
build would do.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from supervisor.flashinfer import WarmResult, cache, warm

ARCH = "12.0"
ARCH_DIR = ("0.7.4", "120f")  # FlashInfer 0.7.4 with CUDA 13: 12.0 builds as sm_120f
SMALL_MODULE = "locality_domain"


@dataclass
class SessionBuild:
    python: Path
    env: dict[str, str]  # the serving venv's build environment, its bin first on PATH
    workspace: Path
    module: str
    result: WarmResult
    lines: list[str] = field(default_factory=list)
    kept: Path | None = None  # the arch dir as built

    @property
    def dir(self) -> Path:
        return cache.cache_root(self.workspace).joinpath(*ARCH_DIR)

    @property
    def so(self) -> Path:
        return self.dir / "cached_ops" / self.module / f"{self.module}.so"

    @property
    def lock(self) -> Path:
        return self.dir / "cached_ops" / "tmp" / f"{self.module}.lock"

    def restore(self) -> Path:
        """The workspace as the build left it; its path."""
        if self.kept is None:
            pytest.fail(f"the session's build of {self.module} failed: {self.result.error}")
        shutil.rmtree(cache.cache_root(self.workspace), ignore_errors=True)
        shutil.copytree(self.kept, self.dir, symlinks=True)  # copy2: mtimes kept
        return self.workspace

    def kept_files(self) -> dict[str, int]:
        """Each file of the build as kept (relative path -> size)."""
        assert self.kept is not None
        return {
            str(p.relative_to(self.kept)): p.stat().st_size
            for p in self.kept.rglob("*")
            if p.is_file()
        }


def build_once(python: Path, env: dict[str, str], base: Path, module: str) -> SessionBuild:
    """A cold build of ``module`` for 12.0 in ``base/ws``, kept aside in ``base/as-built``."""
    env = {**env, "PATH": f"{python.parent}:{os.environ['PATH']}"}
    made = SessionBuild(python, env, base / "ws", module, WarmResult(False, [], 0.0))
    made.result = asyncio.run(
        warm(python, ARCH, made.workspace, (module,), progress=made.lines.append, env=env)
    )
    if made.result.ok and made.so.is_file():
        made.kept = base / "as-built"
        shutil.copytree(made.dir, made.kept, symlinks=True)
    return made
