"""What the benchmarks share: a free port, systemctl in a sandbox, a stand-in unit, ranks.

Imported by the scripts next to it (``python bench/NAME.py`` puts ``bench/`` on
``sys.path``), as ``from common import ...``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from k26dev import sandbox
from k26dev.ports import free_port as free_port  # the one way: never twice


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
