"""``k26-supervisor explain --output FILE``: the daemon's classifier on pasted logs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.core.test_corpus import KNOWN_MISSES

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "unit" / "samples" / "corpus"
# The held-out third is scored once, by tests/unit/core/test_corpus.py: not here.
HELD_IDS = frozenset(json.loads((CORPUS / "HELDOUT.json").read_text())["held_out"])


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


def _fit_case(name: str) -> Any:
    reason = KNOWN_MISSES.get(name.removesuffix(".json"))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize(
    "name",
    [
        _fit_case(p.name)
        for p in sorted(CORPUS.glob("*.json"))
        if p.name != "HELDOUT.json" and p.stem not in HELD_IDS
    ],
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


# --- how it ended, read from the pasted text --------------------------------------------


def _explain_text(tmp_path: Path, text: str, *args: str) -> dict[str, Any]:
    out = tmp_path / "out.txt"
    out.write_text(text)
    done = k26("--output", str(out), "--json", *args)
    assert done.returncode == 0, done.stderr
    verdict: dict[str, Any] = json.loads(done.stdout)
    return verdict


def test_systemds_own_oom_kill_line_is_an_oom_kill(tmp_path: Path) -> None:
    verdict = _explain_text(
        tmp_path,
        "INFO: loading weights\n"
        "sglang-k26.service: A process of this unit has been killed by the OOM killer.\n"
        "sglang-k26.service: Main process exited, code=killed, status=9/KILL\n"
        "sglang-k26.service: Failed with result 'oom-kill'.\n",
    )
    assert verdict["cause"] == "oom-kill" and verdict["signal"] == 9
    assert verdict["ending"] == (
        "read from the text: systemd's line 'Failed with result 'oom-kill''"
    )


def test_systemds_exit_line_gives_the_status(tmp_path: Path) -> None:
    verdict = _explain_text(
        tmp_path,
        "OSError: [Errno 98] Address already in use\n"
        "x.service: Main process exited, code=exited, status=1/FAILURE\n",
    )
    assert verdict["cause"] == "port-in-use" and verdict["exit_code"] == 1


def test_a_shells_core_dumped_is_a_core_dump(tmp_path: Path) -> None:
    verdict = _explain_text(
        tmp_path, "Loading extension module fused_dense_cuda...\nBus error (core dumped)\n"
    )
    assert verdict["cause"] == "core-dump" and verdict["signal"] == 7
    assert "SIGBUS" in verdict["summary"]
    text = "[1/2] x\n./serve.sh: line 4: 4242 Segmentation fault      (core dumped) python -m x\n"
    assert _explain_text(tmp_path, text)["signal"] == 11


def test_a_final_killed_is_a_sigkill(tmp_path: Path) -> None:
    verdict = _explain_text(tmp_path, "Loading checkpoint shards: 50%\nKilled\n")
    assert verdict["cause"] == "sigkill" and verdict["signal"] == 9
    assert "the shell's final 'Killed'" in verdict["ending"]
    # Only the last line: a "Killed" earlier is not how it ended.
    verdict = _explain_text(tmp_path, "Killed\nINFO: restarted\n", "--exit-status", "3")
    assert verdict["cause"] == "exit-code" and "ending" not in verdict


def test_the_kernels_killed_process_names_the_probable_pid(tmp_path: Path) -> None:
    kernel = tmp_path / "dmesg.txt"
    kernel.write_text(
        "Out of memory: Killed process 31337 (python3) total-vm:80000000kB, "
        "anon-rss:60000000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:120000kB "
        "oom_score_adj:0\n"
    )
    verdict = _explain_text(
        tmp_path, "Loading checkpoint shards: 50%\nKilled\n", "--kernel", str(kernel)
    )
    assert verdict["cause"] == "oom-kill"
    assert verdict["main_pid"] == 31337 and verdict["main_pid_probable"] is True
    assert "probable: main PID 31337" in verdict["summary"]
    # Pasted into the output itself, the same; with --pid, nothing is guessed.
    pasted = _explain_text(tmp_path, kernel.read_text() + "Killed\n")
    assert pasted["cause"] == "oom-kill" and "probable" in pasted["summary"]
    given = _explain_text(tmp_path, "Killed\n", "--kernel", str(kernel), "--pid", "7")
    assert given["cause"] == "sigkill" and "main_pid_probable" not in given


def test_the_text_form_says_how_it_ended(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("Aborted (core dumped)\n")
    done = k26("--output", str(out))
    assert done.returncode == 0, done.stderr
    assert f"{out}: core-dump" in done.stdout
    assert "(how it ended: read from the text: the shell's 'Aborted (core dumped)')" in done.stdout
