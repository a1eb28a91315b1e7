"""No product function is reachable only from tests.

Vulture reads ``supervisor/`` alone (with tests/unit/vulture_whitelist.py, the
reviewed names it cannot see used): a function, method, property or class that only a
test calls is reported, and fails here. Decorated registrations are used by their
decorator (pydantic's validators, the coverage shapes' ``@_builtin``). Unused
*variables and attributes* are not asserted: most are data (pydantic fields, frozen
records' fields) read by serialisation, which vulture cannot follow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("function", "method", "property", "class", "import")


def test_no_product_code_is_called_only_by_tests() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vulture", "supervisor", "tests/unit/vulture_whitelist.py",
         "--min-confidence", "60",
         "--ignore-decorators", "@field_validator,@model_validator,@_builtin"],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode in (0, 3), done.stderr  # 3: vulture found something
    found = [
        line for line in done.stdout.splitlines() if any(f"unused {k} " in line for k in KINDS)
    ]
    assert found == [], "\n".join(found)
    # Not vacuous: vulture ran over the product and saw its data fields.
    assert "supervisor/" in done.stdout
