"""The exit classifier on real kernel and program output (tests/unit/samples/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.adapters.evidence import kmsg_messages
from supervisor.core.classify import (
    MAX_EVIDENCE_LINES,
    MAX_LINE_CHARS,
    ExitCause,
    ExitSnapshot,
    Verdict,
    classify,
)

SAMPLES = Path(__file__).parents[1] / "samples"

# The real OOM in kmsg_memcg_oom.raw: pid 10136 in this memory cgroup.
OOM_PID = 10136
OOM_CGROUP_KERNEL = "/k26oomsample-10093/app.slice/oomsample.service"
UNIT = "oomsample.service"


def sample(name: str) -> list[str]:
    return (SAMPLES / name).read_text().splitlines()


@pytest.fixture(scope="module")
def oom_kernel_lines() -> list[str]:
    return kmsg_messages(sample("kmsg_memcg_oom.raw"))


def snap(
    result: str = "exit-code",
    code: int = 1,
    status: int = 1,
    *,
    unit: str = "sglang-k26.service",
    pid: int = 4242,
    cgroup: str = "/app.slice/sglang-k26.service",
) -> ExitSnapshot:
    return ExitSnapshot(unit, result, code, status, pid, cgroup, None)


def sigkill(**kwargs: object) -> ExitSnapshot:
    return snap("signal", 2, 9, **kwargs)  # type: ignore[arg-type]


def test_causes_keep_their_public_spellings() -> None:
    assert [c.value for c in ExitCause] == [
        "clean", "exit-code", "sigkill", "oom-kill", "gpu-oom", "flashinfer-arch",
        "signal", "core-dump", "watchdog", "timeout", "start-limit",
    ]  # fmt: skip


# --- kernel OOM kills ---------------------------------------------------------------


def test_memcg_oom_of_the_main_pid_on_a_hybrid_host(oom_kernel_lines: list[str]) -> None:
    """systemd says Result=signal/9 (it cannot read memory.events there); the kernel
    log, whose cgroup paths start at the real root, says why."""
    verdict = classify(
        sigkill(unit=UNIT, pid=OOM_PID, cgroup="/app.slice/oomsample.service"),
        oom_kernel_lines,
        [],
    )
    assert verdict.cause is ExitCause.OOM_KILL
    assert verdict.signal == 9 and verdict.exit_code is None
    assert verdict.evidence[0] == "systemd: Result=signal ExecMainCode=2 ExecMainStatus=9"
    assert any(
        ln.startswith("oom-kill:constraint=CONSTRAINT_MEMCG")
        and f"task_memcg={OOM_CGROUP_KERNEL}" in ln
        for ln in verdict.evidence
    )
    assert any(f"Killed process {OOM_PID} (python3)" in ln for ln in verdict.evidence)
    assert "main process" in verdict.summary and OOM_CGROUP_KERNEL in verdict.summary
    # Only the deciding lines, not the 80-record dump around them.
    assert len(verdict.evidence) == 3


def test_memcg_oom_matched_by_unit_name_without_a_control_group(
    oom_kernel_lines: list[str],
) -> None:
    verdict = classify(sigkill(unit=UNIT, pid=1, cgroup=""), oom_kernel_lines, [])
    assert verdict.cause is ExitCause.OOM_KILL


def test_memcg_oom_matched_by_main_pid_alone(oom_kernel_lines: list[str]) -> None:
    killed_only = [ln for ln in oom_kernel_lines if "Killed process" in ln]
    verdict = classify(sigkill(unit="other.service", pid=OOM_PID), killed_only, [])
    assert verdict.cause is ExitCause.OOM_KILL
    assert verdict.evidence[1:] == tuple(killed_only)


def test_someone_elses_oom_is_not_ours(oom_kernel_lines: list[str]) -> None:
    verdict = classify(sigkill(), oom_kernel_lines, [])
    assert verdict.cause is ExitCause.SIGKILL
    assert verdict.evidence == ("systemd: Result=signal ExecMainCode=2 ExecMainStatus=9",)


def test_a_cgroup_suffix_must_match_whole_path_components(oom_kernel_lines: list[str]) -> None:
    verdict = classify(sigkill(unit="x", pid=1, cgroup="/sample.service"), oom_kernel_lines, [])
    assert verdict.cause is ExitCause.SIGKILL


def test_oom_kill_of_a_child_explains_the_main_exit(oom_kernel_lines: list[str]) -> None:
    """An SGLang scheduler (a child) is OOM-killed; the main process exits 1."""
    verdict = classify(
        snap(unit=UNIT, pid=OOM_PID - 36, cgroup="/app.slice/oomsample.service"),
        oom_kernel_lines,
        ["Received sigquit from a child process. It usually means the child failed."],
    )
    assert verdict.cause is ExitCause.OOM_KILL
    assert verdict.exit_code == 1
    assert "a process of the unit" in verdict.summary and "status 1" in verdict.summary


def test_systemd_result_oom_kill_needs_no_kernel_line() -> None:
    verdict = classify(snap("oom-kill", 2, 9), [], [])
    assert verdict.cause is ExitCause.OOM_KILL
    assert "Result=oom-kill" in verdict.summary


def test_kernel_oom_beats_gpu_text(oom_kernel_lines: list[str]) -> None:
    verdict = classify(
        sigkill(unit=UNIT, pid=OOM_PID, cgroup="/app.slice/oomsample.service"),
        oom_kernel_lines,
        sample("torch_cuda_oom_h200.txt"),
    )
    assert verdict.cause is ExitCause.OOM_KILL


def test_oom_kill_record_with_a_comma_list_of_nodes() -> None:
    line = (
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,2,"
        "oom_memcg=/system.slice/sglang-k26.service,task_memcg=/system.slice/sglang-k26.service,"
        "task=python3,pid=777,uid=0"
    )
    verdict = classify(
        sigkill(pid=777, cgroup="/system.slice/sglang-k26.service"), ["noise", line], []
    )
    assert verdict.cause is ExitCause.OOM_KILL
    assert "python3 (pid 777)" in verdict.summary


# --- output evidence ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "deciding"),
    [
        ("flashinfer_0.2.5_no_arch_indexerror.txt", "IndexError: list index out of range"),
        ("flashinfer_0.5.2_sm75_rejection.txt", "FlashInfer requires GPUs with sm75 or higher"),
        ("flashinfer_0.7.4_sm75_rejection.txt", "Detected TARGET_CUDA_ARCHS=[]"),
        ("torch_no_kernel_image_h200.txt", "no kernel image is available"),
        ("cupy_no_kernel_image_h200.txt", "CUDA_ERROR_NO_BINARY_FOR_GPU"),
        ("torch_unknown_cuda_arch.txt", "Unknown CUDA arch (15.0) or GPU not supported"),
    ],
)
def test_architecture_rejections(name: str, deciding: str) -> None:
    verdict = classify(snap(), [], sample(name))
    assert verdict.cause is ExitCause.FLASHINFER_ARCH, verdict
    assert any(deciding in ln for ln in verdict.evidence)
    assert verdict.exit_code == 1 and verdict.signal is None


def test_the_0_2_indexerror_evidence_shows_where_it_came_from() -> None:
    verdict = classify(snap(), [], sample("flashinfer_0.2.5_no_arch_indexerror.txt"))
    assert any("flashinfer/jit/core.py" in ln for ln in verdict.evidence)
    assert any("_get_cuda_arch_flags" in ln for ln in verdict.evidence)


def test_a_plain_indexerror_is_not_an_arch_rejection() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "/srv/app/main.py", line 3, in <module>',
        "    items[5]",
        "IndexError: list index out of range",
    ]
    assert classify(snap(), [], lines).cause is ExitCause.EXIT_CODE


def test_a_cold_jit_cache_is_not_an_arch_rejection() -> None:
    verdict = classify(snap(), [], sample("flashinfer_0.7.4_missing_jit_cache.txt"))
    assert verdict.cause is ExitCause.EXIT_CODE


def test_torch_older_than_sm120_support() -> None:
    line = "ValueError: Unknown CUDA arch (12.0) or GPU not supported"
    assert classify(snap(), [], [line]).cause is ExitCause.FLASHINFER_ARCH


def test_gpu_oom_from_a_real_torch_traceback() -> None:
    verdict = classify(snap(), [], sample("torch_cuda_oom_h200.txt"))
    assert verdict.cause is ExitCause.GPU_OOM
    assert any(
        ln.startswith("torch.OutOfMemoryError: CUDA out of memory.") for ln in verdict.evidence
    )
    assert verdict.summary.startswith("GPU out of memory: torch.OutOfMemoryError")


@pytest.mark.parametrize(
    "line",
    [
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        "RuntimeError: CUDA error: out of memory",
        "torch.AcceleratorError: CUDA error: out of memory",
        "cudaErrorMemoryAllocation",
        "NCCL WARN Cuda failure 2 'out of memory'",
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
        "Current value: mem_fraction_static=0.6",
    ],
)
def test_gpu_oom_texts(line: str) -> None:
    assert classify(snap(), [], ["[2025-09-18 10:12:03 TP0] " + line]).cause is ExitCause.GPU_OOM


def test_sglang_self_sigkill_after_a_scheduler_oom_is_gpu_oom() -> None:
    """SGLang's main process SIGKILLs itself once a child failed: Result=signal/9."""
    output = [
        *sample("torch_cuda_oom_h200.txt"),
        "[2025-09-18 10:12:03] Received sigquit from a child process. It usually means the "
        "child failed.",
    ]
    verdict = classify(sigkill(), [], output)
    assert verdict.cause is ExitCause.GPU_OOM
    assert verdict.signal == 9


def test_the_last_error_printed_wins() -> None:
    oom = sample("torch_cuda_oom_h200.txt")
    arch = sample("flashinfer_0.7.4_sm75_rejection.txt")
    assert classify(snap(), [], oom + arch).cause is ExitCause.FLASHINFER_ARCH
    assert classify(snap(), [], arch + oom).cause is ExitCause.GPU_OOM


def test_output_overrides_a_core_dump() -> None:
    lines = [
        "terminate called after throwing an instance of 'c10::Error'",
        "  what():  CUDA error: out of memory",
    ]
    verdict = classify(snap("core-dump", 3, 6), [], lines)
    assert verdict.cause is ExitCause.GPU_OOM and verdict.signal == 6


# --- systemd results ----------------------------------------------------------------


def test_clean_exit_ignores_old_errors_in_the_output() -> None:
    verdict = classify(snap("success", 1, 0), [], sample("torch_cuda_oom_h200.txt"))
    assert verdict.cause is ExitCause.CLEAN
    assert verdict.exit_code == 0 and verdict.signal is None


@pytest.mark.parametrize(
    ("snapshot", "cause", "exit_code", "signal"),
    [
        (snap("exit-code", 1, 3), ExitCause.EXIT_CODE, 3, None),
        (snap("signal", 2, 15), ExitCause.SIGNAL, None, 15),
        (snap("signal", 2, 9), ExitCause.SIGKILL, None, 9),
        (snap("core-dump", 3, 11), ExitCause.CORE_DUMP, None, 11),
        (snap("watchdog", 2, 6), ExitCause.WATCHDOG, None, 6),
        (snap("timeout", 2, 15), ExitCause.TIMEOUT, None, 15),
        (snap("start-limit-hit", 1, 1), ExitCause.START_LIMIT, 1, None),
        (snap("protocol", 1, 0), ExitCause.EXIT_CODE, 0, None),
        (snap("resources", 0, 0), ExitCause.EXIT_CODE, None, None),
    ],
)
def test_systemd_results(
    snapshot: ExitSnapshot, cause: ExitCause, exit_code: int | None, signal: int | None
) -> None:
    verdict = classify(snapshot, [], [])
    assert (verdict.cause, verdict.exit_code, verdict.signal) == (cause, exit_code, signal)
    assert verdict.summary


def test_watchdog_and_timeout_are_not_explained_away_by_output() -> None:
    text = sample("torch_cuda_oom_h200.txt")
    assert classify(snap("watchdog", 2, 6), [], text).cause is ExitCause.WATCHDOG
    assert classify(snap("timeout", 2, 15), [], text).cause is ExitCause.TIMEOUT


def test_signal_summaries_name_the_signal() -> None:
    assert "SIGTERM" in classify(snap("signal", 2, 15), [], []).summary
    assert "SIGSEGV" in classify(snap("core-dump", 3, 11), [], []).summary


# --- the verdict --------------------------------------------------------------------


def test_evidence_is_capped_and_trimmed() -> None:
    lines = [f"RuntimeError: CUDA error: out of memory (rank {i}) " + "x" * 900 for i in range(60)]
    verdict = classify(snap(), [], lines)
    assert len(verdict.evidence) == MAX_EVIDENCE_LINES
    assert all(len(ln) <= MAX_LINE_CHARS for ln in verdict.evidence)
    assert "(rank 59)" in verdict.evidence[-1]  # the last lines are kept


def test_to_json() -> None:
    verdict = classify(sigkill(), [], [])
    assert verdict.to_json() == {
        "cause": "sigkill",
        "summary": verdict.summary,
        "evidence": ["systemd: Result=signal ExecMainCode=2 ExecMainStatus=9"],
        "exit_code": None,
        "signal": 9,
    }
    assert isinstance(verdict, Verdict)
