"""The GPU scripts (bench/gpu/) call each command in the CLI that has it.

They run only on a lent GPU host, so nothing else here would see a command that
moved from ``k26-supervisor`` to ``k26-dev``: it broke them once, unseen.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "bench" / "gpu" / "check_cli_calls.py"


def check(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECKER), *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_every_cli_call_of_the_gpu_scripts_names_a_command_of_its_cli() -> None:
    done = check()
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "checked" in said and " 0 CLI calls" not in said


def test_a_command_sent_to_the_wrong_cli_is_named(tmp_path: Path) -> None:
    script = tmp_path / "moved.py"
    script.write_text(
        "import subprocess, sys\n"
        'subprocess.run([sys.executable, "-m", "supervisor", "sandbox", "up"])\n'
    )
    done = check(script)
    assert done.returncode == 1
    assert "moved.py:2" in done.stdout + done.stderr
    assert "'sandbox' is a k26-dev command" in done.stdout + done.stderr
