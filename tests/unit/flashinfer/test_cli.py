"""The CLI's exit codes for doctor and warm."""

from __future__ import annotations

import contextlib
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


@pytest.mark.parametrize("command", ["export", "push"])
def test_bundle_export_and_push_carry_the_learned_modules_unless_told_not_to(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ready units built is carried by default, as doctor and warm count it; each
    command honours --no-learned (it accepted the flag and ignored it before)."""
    from supervisor.flashinfer import learned
    from supervisor.fleet import bundle, distribute

    learned.record(
        tmp_path, "12.0",
        [learned.Built("norm", "0.7.4", "120f", "cached_ops/norm/norm.so", 1, "ab", None)],
    )  # fmt: skip
    seen: list[tuple[tuple[str, ...], tuple[str, ...]]] = []

    async def export(*args: object, **kw: object) -> dict[str, object]:
        seen.append((tuple(args[4]), tuple(kw["learned"])))  # type: ignore[arg-type]
        return {"size_bytes": 1, "archive": "a", "files": 1, "modules": [], "duration_s": 0.0,
                "sha256": "s", "notes": []}  # fmt: skip

    async def push(*args: object, **kw: object) -> dict[str, object]:
        seen.append((tuple(kw["modules"]), tuple(kw["learned_modules"])))  # type: ignore[arg-type]
        raise SystemExit(0)  # what it prints is not this test's

    monkeypatch.setattr(bundle, "export_bundle", export)
    monkeypatch.setattr(distribute, "push", push)
    more = (
        ["--out", str(tmp_path / "b")]
        if command == "export"
        else ["--registry", "http://r:5000/k/b"]
    )
    base = ["flashinfer", "bundle", command, "--python", sys.executable, "--arch", "12.0",
            "--workspace", str(tmp_path), *more]  # fmt: skip
    for extra in ([], ["--no-learned"]):
        with contextlib.suppress(SystemExit):  # push's stand-in ends the command
            main([*base, *extra])
    assert seen == [(("sampling",), ("norm",)), (("sampling",), ())]
