"""docs/benchmarks.md shows bench/chaos.py's expected outcomes exactly as the code has
them (``chaos.py --table``): the table a reader trusts is the one the soak checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_outcomes_are_the_code_s() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--table"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    table = done.stdout
    assert table.count("\n") == 2 + 15, table  # the header, and the 15 kinds
    assert table in (ROOT / "docs" / "benchmarks.md").read_text(), (
        "docs/benchmarks.md's chaos table differs from `bench/chaos.py --table`: paste it"
    )
