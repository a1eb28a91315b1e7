"""The CLI's exit codes for doctor and warm."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from supervisor.cli import main


def test_doctor_cannot_determine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["flashinfer", "doctor", "--python", str(tmp_path / "py"), "--arch", "12.0",
                 "--workspace", str(tmp_path), "--json"])  # fmt: skip
    assert code == 3
    assert json.loads(capsys.readouterr().out)["status"] == "unknown"


def test_doctor_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["flashinfer", "doctor", "--python", sys.executable, "--arch", "12.0",
                 "--workspace", str(tmp_path)])  # fmt: skip
    assert code == 3
    assert "status: unknown (cannot determine)" in capsys.readouterr().out


def test_bad_arch_is_usage_level(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["flashinfer", "warm", "--python", sys.executable, "--arch", "120",
                 "--workspace", str(tmp_path)])  # fmt: skip
    assert code == 65
    assert "--arch" in capsys.readouterr().err


def test_warm_failure_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["flashinfer", "warm", "--python", str(tmp_path / "py"), "--arch", "12.0",
                 "--workspace", str(tmp_path)])  # fmt: skip
    assert code == 69
    assert "cannot run" in capsys.readouterr().err
