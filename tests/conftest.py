"""Shared test plumbing.

SIGTERM becomes KeyboardInterrupt so an interrupted run still tears its
systemd sandboxes down (pytest runs fixture finalizers on KeyboardInterrupt).
"""

from __future__ import annotations

import signal
from types import FrameType


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure() -> None:
    signal.signal(signal.SIGTERM, _sigterm)
