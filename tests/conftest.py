"""Shared test plumbing.

SIGTERM becomes KeyboardInterrupt so an interrupted run still tears its
systemd sandboxes down (pytest runs fixture finalizers on KeyboardInterrupt).
The tool binaries scripts/tools.sh unpacked (promtool, prometheus,
alertmanager) go first on PATH, so tests find them without any install.
What tests recorded in ``tests.measured`` is printed at the end of the run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType

import pytest

from tests.measured import MEASURED

TOOLS_BIN = Path(__file__).resolve().parents[1] / ".cache" / "tools" / "bin"


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure() -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    if TOOLS_BIN.is_dir():
        os.environ["PATH"] = f"{TOOLS_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not MEASURED:
        return
    terminalreporter.section("measured on the way")
    for what, values in MEASURED.items():
        terminalreporter.write_line(f"{what}: {', '.join(values)}")
