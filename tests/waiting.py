"""The one way tests wait: for a condition, with a deadline, never for a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.05


def wait_until(
    condition: Callable[[], T], timeout_s: float, what: str, *, poll_s: float = POLL_S
) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    Fails at ``timeout_s`` with an AssertionError naming ``what`` (and the last
    value seen). Exceptions from ``condition`` propagate: a condition that cannot
    be checked is a failure, not a reason to keep waiting.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {value!r})")
        time.sleep(poll_s)


def wait_for_text(path: Path, needle: str, timeout_s: float) -> str:
    """Wait until ``path`` holds ``needle``; return the file's text then."""

    def found() -> str:
        text = path.read_text(errors="replace") if path.exists() else ""
        return text if needle in text else ""

    return wait_until(found, timeout_s, f"{path.name} to print {needle!r}")
