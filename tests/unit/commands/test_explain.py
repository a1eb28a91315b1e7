"""``k26-supervisor explain --output FILE``: the daemon's classifier on pasted logs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "unit" / "samples" / "corpus"


def k26(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "explain", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def _case(name: str, tmp_path: Path) -> tuple[dict[str, object], list[str]]:
    case = json.loads((CORPUS / name).read_text())
    out = tmp_path / "output.txt"
    out.write_text("\n".join(case["output"]) + "\n")  # type: ignore[arg-type]
    args = ["--output", str(out)]
    if case["kernel"]:
        kern = tmp_path / "kernel.txt"
        kern.write_text("\n".join(case["kernel"]) + "\n")  # type: ignore[arg-type]
        args += ["--kernel", str(kern)]
    systemd = case["systemd"]
    assert isinstance(systemd, dict)
    if systemd["exec_main_code"] == 1:
        args += ["--exit-status", str(systemd["exec_main_status"])]
    else:
        args += ["--signal", str(systemd["exec_main_status"])]
    args += ["--result", str(systemd["result"])]
    for line in case["kernel"]:  # type: ignore[attr-defined]
        killed = re.search(r"\bKilled process (\d+) ", line)
        if killed:  # the kernel-OOM cases kill the unit's main process
            args += ["--pid", killed.group(1)]
            break
    return case, args


@pytest.mark.parametrize(
    "name",
    sorted(p.name for p in CORPUS.glob("*.json")),
)
def test_explain_gives_every_real_case_its_cause(name: str, tmp_path: Path) -> None:
    case, args = _case(name, tmp_path)
    done = k26(*args, "--json")
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["cause"] == case["cause"], (name, verdict["summary"])
    assert verdict["evidence"][0].startswith("systemd: Result=")


def test_the_text_form_says_cause_summary_and_evidence(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text(
        "[2026-12-01 10:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 60.00 GiB.\n"
        "[2026-12-01 10:00:00] Received sigquit from a child process. It usually means the "
        "child failed.\n"
    )
    done = k26("--output", str(out))
    assert done.returncode == 0, done.stderr
    first, summary, header, *evidence = done.stdout.splitlines()
    assert first == f"{out}: gpu-oom"
    assert "mem-fraction-static" in summary and header == "evidence:"
    assert any("CUDA out of memory" in line for line in evidence)


def test_a_stop_asked_for_is_stopped(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("INFO: shutting down\n")
    verdict = json.loads(k26("--output", str(out), "--stopped", "--json").stdout)
    assert verdict["cause"] == "stopped"
    verdict = json.loads(k26("--output", str(out), "--json").stdout)
    assert verdict["cause"] == "sigkill"  # the default end: SGLang's own SIGKILL


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        ([], 64, "give a UNIT, or --output FILE"),
        (["x.service", "--output", "/dev/null"], 64, "not both"),
        (["x.service", "--signal", "9"], 64, "go with --output"),
        (["--output", "/nonexistent/file"], 65, "cannot read --output /nonexistent/file"),
        (["--output", "/dev/null", "--signal", "9", "--exit-status", "1"], 64, "not allowed"),
        (["bad/name.service"], 65, "invalid unit name"),
    ],
)
def test_bad_input_is_one_line_and_a_sysexits_code(args: list[str], code: int, says: str) -> None:
    done = k26(*args)
    assert done.returncode == code, done.stderr
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
