"""Numbers a test measured on the way, printed at the end of every run.

The closing notes ask for some of them (the booted host's boot time, security
score and journal catch-up); a test records each as it asserts on it, and
``pytest_terminal_summary`` prints them, so every CI log carries them.
"""

from __future__ import annotations

MEASURED: dict[str, list[str]] = {}


def record(what: str, value: str) -> None:
    MEASURED.setdefault(what, []).append(value)
