"""What the benchmarks share: a free port, systemctl in a sandbox, a stand-in unit, ranks.

Imported by the scripts next to it (``python bench/NAME.py`` puts ``bench/`` on
``sys.path``), as ``from common import ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

from k26dev import sandbox
from k26dev.ports import free_port as free_port  # the one way: never twice

ROOT = Path(__file__).resolve().parents[1]


def nearest_rank(values: list[float], q: float) -> float:
    """The nearest-rank percentile: a value that was measured, never interpolated."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Systemctl:
    """``systemctl --user`` against one sandbox's manager."""

    def __init__(self, info: sandbox.SandboxInfo) -> None:
        self.env = dict(os.environ, **info.env)

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["systemctl", "--user", *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            timeout=30,
        )

    def show(self, unit: str, *props: str) -> dict[str, str]:
        args = [f"-p{p}" for p in props]
        out = self("show", *args, unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self, unit: str) -> int:
        return int(self.show(unit, "MainPID").get("MainPID") or 0)


def write_standin_unit(
    info: sandbox.SandboxInfo,
    unit: str,
    port: int,
    output: Path,
    *,
    description: str,
    unit_lines: str = "",
) -> None:
    """A stand-in SGLang as a plain service: no Restart=, the supervisor (or the bench) decides."""
    cmd = f"{sys.executable} -m k26dev.standin --port {port}"
    service = textwrap.dedent(
        f"""\
        [Service]
        Type=simple
        ExecStart={cmd}
        StandardOutput=append:{output}
        StandardError=inherit
        Restart=no
        KillMode=mixed
        TimeoutStopSec=10
        """
    )
    text = f"[Unit]\nDescription={description}\n{unit_lines}\n{service}"
    (info.unit_dir / unit).write_text(text)


@contextlib.asynccontextmanager
async def standin_server(args: list[str], prefix: str) -> AsyncIterator[tuple[str, Path]]:
    """The stand-in SGLang (``python -m k26dev.standin``, loaded at once, compiles
    instant) with ``args``, its Triton and inductor caches in a fresh temporary
    directory: its URL once it is loaded, and that directory. Killed on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": f"{tmp}/triton",
               "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "k26dev.standin", "--port", "0", "--load-seconds", "0",
            "--triton-compile-seconds", "0", *args,
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.stdout is not None
        url, drain = "", None
        try:
            async with asyncio.timeout(60):
                while True:
                    line = (await proc.stdout.readline()).decode()
                    if not line:
                        raise SystemExit(f"the stand-in exited: {args}")
                    if found := re.search(r"listening on (http://\S+)", line):
                        url = found.group(1)
                    if line.startswith("standin: loaded"):
                        break
            # Keep reading its output: a full pipe would block the stand-in's log writes
            # (and with it the requests being timed), and asyncio (3.11) answers wait()
            # only once the pipe is closed, which a reader paused on a full buffer never
            # sees: the bench would hang on the way out.
            drain = asyncio.create_task(_drain(proc.stdout))
            yield url, Path(tmp)
        finally:
            proc.kill()
            await (drain or _drain(proc.stdout))
            await proc.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(1 << 16):
        pass
