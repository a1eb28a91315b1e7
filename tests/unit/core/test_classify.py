"""The exit classifier on real kernel and program output (tests/unit/samples/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.adapters.evidence import parse_kmsg_record
from supervisor.core.classify import (
    MAX_EVIDENCE_LINES,
    MAX_LINE_CHARS,
    ExitCause,
    ExitSnapshot,
    Verdict,
    classify,
    gpus_own_fault,
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
    records = map(parse_kmsg_record, sample("kmsg_memcg_oom.raw"))
    return [r.message for r in records if r is not None]


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
        "flashinfer-jit", "signal", "core-dump", "watchdog", "timeout", "start-limit",
        "cuda-error", "nccl", "gpu-xid", "gpu-driver", "port-in-use", "model-load", "stopped",
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


def test_oom_policy_stop_after_a_child_kill_is_oom_kill_not_a_stop(
    oom_kernel_lines: list[str],
) -> None:
    """The shipped units' shape on a cgroup v2 host: a worker (a child) is OOM-killed,
    systemd's OOMPolicy=stop SIGTERMs the main process (no stop job: stop_requested
    stays False) and reports Result=oom-kill. The main process's SIGTERM is not a stop."""
    verdict = classify(
        snap("oom-kill", 2, 15, unit=UNIT, pid=OOM_PID - 36, cgroup="/app.slice/oomsample.service"),
        oom_kernel_lines,
        [],
    )
    assert verdict.cause is ExitCause.OOM_KILL
    assert verdict.signal == 15
    assert verdict.summary.startswith("kernel OOM killer killed a process of the unit, ")
    assert any("Killed process" in line for line in verdict.evidence)


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


def test_a_clean_stop_ignores_old_errors_in_the_output() -> None:
    verdict = classify(stopping("success", 1, 0), [], sample("torch_cuda_oom_h200.txt"))
    assert verdict.cause is ExitCause.STOPPED
    assert verdict.exit_code == 0 and verdict.signal is None


def test_exit_0_unasked_after_a_crash_gets_the_crash_s_verdict() -> None:
    """SGLang and vLLM can exit 0 after a fatal engine error (sglang #29284): with no
    stop job, what the output shows decides, and the summary says it exited 0."""
    verdict = classify(snap("success", 1, 0), [], sample("torch_cuda_oom_h200.txt"))
    assert verdict.cause is ExitCause.GPU_OOM
    assert verdict.summary.endswith("(then it exited with status 0, unasked)")
    assert verdict.exit_code == 0 and not verdict.needs_person
    lines = [
        DEVICE_ASSERT,
        "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when "
        "calling `cublasGemmEx( handle, opa, opb, m, n, k, &falpha, a, CUDA_R_16BF)`",
    ]
    assert classify(snap("success", 1, 0), [], lines).cause is ExitCause.CUDA_ERROR


def test_exit_0_unasked_with_nothing_in_the_output_says_so_plainly() -> None:
    verdict = classify(snap("success", 1, 0), [], ["INFO: server started", "bye"])
    assert verdict.cause is ExitCause.CLEAN
    assert verdict.summary.startswith("exited with status 0 unasked: no stop job ran")
    child = ["Subprocess scheduler_0 (pid=77) crashed with exit code 0. Triggering SIGQUIT"]
    assert classify(snap("success", 1, 0), [], child).cause is ExitCause.EXIT_CODE


def test_exit_0_unasked_reads_the_kernel_log_too(oom_kernel_lines: list[str]) -> None:
    snapshot = snap("success", 1, 0, unit=UNIT, pid=OOM_PID, cgroup="/app.slice/oomsample.service")
    assert classify(snapshot, oom_kernel_lines, []).cause is ExitCause.OOM_KILL
    verdict = classify(snap("success", 1, 0), [XID_79], [])
    assert verdict.cause is ExitCause.GPU_XID and verdict.needs_person


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
        "needs_person": False,
    }
    assert isinstance(verdict, Verdict)


# --- stops (texts as in the sglang 0.4.x-0.5.23 wheels, tests/unit/samples/corpus) ---

T = "[2026-12-01 10:00:00]"
SIGTERM_LINE = (
    f"{T} SIGTERM received. signum=None frame=None. Draining requests and shutting down..."
)
DRAIN_LINES = [
    SIGTERM_LINE,
    f"{T} Gracefully exiting... Remaining number of requests 2. Remaining requests "
    "remaining_rids=['a1', 'b2'].",
    f"{T} Gracefully exiting... Remaining number of requests 0. Remaining requests "
    "remaining_rids=[].",
    f"{T} kill_process_tree called: parent_pid=4242, include_parent=True, pid=4242",
]
CRASH_LINES = [
    f"{T} Subprocess scheduler_0 (pid=4300) crashed with exit code -9. Triggering SIGQUIT "
    "for cleanup...",
    f"{T} SIGQUIT received. signum=3, frame=None. It usually means one child failed.",
    f"{T} Sleeping 5 seconds before crash diagnostics to let GPU activity settle.",
    f"{T} kill_process_tree called: parent_pid=4242, include_parent=True, pid=4242",
]
ILLEGAL_ACCESS = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"


def stopping(result: str = "signal", code: int = 2, status: int = 9) -> ExitSnapshot:
    return ExitSnapshot(
        "sglang-k26.service", result, code, status, 4242, "/system.slice/sglang-k26.service",
        stop_requested=True,
    )  # fmt: skip


def test_an_operator_stop_of_sglang_is_stopped_not_sigkill() -> None:
    """0.5.17 drains, then SIGKILLs its own tree: systemd sees signal/9."""
    verdict = classify(stopping(), [], ["noise", *DRAIN_LINES])
    assert verdict.cause is ExitCause.STOPPED
    assert "SIGTERM, then SGLang's own SIGKILL" in verdict.summary
    assert verdict.signal == 9
    assert SIGTERM_LINE.strip() in verdict.evidence
    assert any("kill_process_tree called" in ln for ln in verdict.evidence)


def test_sglang_stop_lines_make_it_stopped_without_a_stop_job() -> None:
    verdict = classify(sigkill(), [], DRAIN_LINES)
    assert verdict.cause is ExitCause.STOPPED
    assert verdict.summary.startswith("stopped: SIGTERM, then SGLang's own SIGKILL")
    assert "did not come from a stop job" in verdict.summary
    # 0.3.6-0.4.x: lowercase, and no kill_process_tree line.
    old = [SIGTERM_LINE, f"{T} Gracefully exiting... remaining number of requests 0"]
    assert classify(sigkill(), [], old).cause is ExitCause.STOPPED
    assert classify(snap("signal", 2, 15), [], old).cause is ExitCause.STOPPED


def test_a_sigterm_line_alone_does_not_make_a_stop() -> None:
    assert classify(sigkill(), [], [SIGTERM_LINE]).cause is ExitCause.SIGKILL


def test_sglang_crash_path_is_sigkill_not_stopped() -> None:
    """A child died: the same kill_process_tree line, but after the SIGQUIT lines."""
    for stop_requested in (False, True):
        snapshot = stopping() if stop_requested else sigkill()
        verdict = classify(snapshot, [], CRASH_LINES)
        assert verdict.cause is ExitCause.SIGKILL, stop_requested
    verdict = classify(sigkill(), [], CRASH_LINES)
    assert "after a child failed" in verdict.summary
    assert any("SIGQUIT received" in ln for ln in verdict.evidence)


def test_a_crash_before_the_stop_keeps_its_cause() -> None:
    """It was already dying (error, child-failure lines) when the stop job came."""
    verdict = classify(stopping(), [], [ILLEGAL_ACCESS, *CRASH_LINES])
    assert verdict.cause is ExitCause.CUDA_ERROR
    verdict = classify(stopping(), [], [ILLEGAL_ACCESS, *CRASH_LINES, *DRAIN_LINES])
    assert verdict.cause is ExitCause.CUDA_ERROR


def test_a_cuda_error_during_the_drain_keeps_its_cause() -> None:
    lines = [*DRAIN_LINES[:2], ILLEGAL_ACCESS, *CRASH_LINES]
    for snapshot in (stopping(), sigkill()):
        verdict = classify(snapshot, [], lines)
        assert verdict.cause is ExitCause.CUDA_ERROR
        assert verdict.summary.endswith("(while it was stopping)")


def test_a_child_failing_during_the_stop_without_error_text_is_generic() -> None:
    verdict = classify(stopping(), [], [*DRAIN_LINES[:2], *CRASH_LINES])
    assert verdict.cause is ExitCause.SIGKILL
    assert "a child failed while it was stopping" in verdict.summary


def test_an_error_before_the_stop_was_survived() -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    verdict = classify(stopping(), [], [oom, *DRAIN_LINES])
    assert verdict.cause is ExitCause.STOPPED
    assert "it had printed an error before the stop: torch.OutOfMemoryError" in verdict.summary
    assert oom in verdict.evidence
    # Without a stop job the same log is the OOM's: the drain lines are missing.
    assert classify(sigkill(), [], [oom]).cause is ExitCause.GPU_OOM


def test_without_sglang_stop_lines_the_ending_places_the_error() -> None:
    """No "SIGTERM received" line: died of the SIGTERM (or exited 0, or hung until
    TimeoutStopSec), it was alive when the stop came, so the error came before it; a
    SIGKILL that is not systemd's timeout is the program's own, after the error."""
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    for snapshot in (stopping("signal", 2, 15), stopping("timeout", 2, 9)):
        verdict = classify(snapshot, [], [oom])
        assert verdict.cause is ExitCause.STOPPED
        assert "it had printed an error before the stop" in verdict.summary
    assert classify(stopping("signal", 2, 9), [], [oom]).cause is ExitCause.GPU_OOM


def test_nccl_errors_while_stopping_are_the_teardown_echo() -> None:
    echo = "RuntimeError: NCCL error: remote process exited or there was a network error"
    assert classify(stopping(), [], [*DRAIN_LINES[:3], echo]).cause is ExitCause.STOPPED


def test_driver_shutting_down_is_not_a_cuda_error() -> None:
    line = "RuntimeError: CUDA error: driver shutting down"
    assert classify(stopping(), [], [*DRAIN_LINES, line]).cause is ExitCause.STOPPED
    assert classify(snap(), [], [line]).cause is ExitCause.EXIT_CODE


@pytest.mark.parametrize(
    ("snapshot", "how"),
    [
        (stopping("signal", 2, 15), "stopped: SIGTERM"),
        (stopping("success", 1, 0), "stopped on request: exited cleanly"),
        (stopping("exit-code", 1, 143), "stopped: SIGTERM"),
        (stopping("signal", 2, 9), "stopped: SIGKILL while its stop job ran"),
        (stopping("timeout", 2, 9), "stopped: it ignored SIGTERM for TimeoutStopSec"),
    ],
)
def test_stop_job_endings(snapshot: ExitSnapshot, how: str) -> None:
    """A stop job and no SGLang lines (a plain server): these endings are the stop."""
    verdict = classify(snapshot, [], ["INFO:     Shutting down"])
    assert verdict.cause is ExitCause.STOPPED
    assert verdict.summary.startswith(how), verdict.summary


def test_an_error_exit_during_a_stop_job_is_not_a_stop() -> None:
    port = "OSError: [Errno 98] Address already in use"
    assert classify(stopping("exit-code", 1, 1), [], [port]).cause is ExitCause.PORT_IN_USE
    assert classify(stopping("exit-code", 1, 1), [], []).cause is ExitCause.EXIT_CODE
    assert classify(stopping("core-dump", 3, 6), [], []).cause is ExitCause.CORE_DUMP


def test_without_a_stop_job_sigterm_and_sigkill_stay_generic() -> None:
    assert classify(snap("signal", 2, 15), [], []).cause is ExitCause.SIGNAL
    assert classify(sigkill(), [], ["INFO:     Shutting down"]).cause is ExitCause.SIGKILL
    assert classify(snap("timeout", 2, 9), [], DRAIN_LINES).cause is ExitCause.TIMEOUT


# --- NVIDIA Xid -----------------------------------------------------------------------

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4300, name=python3, GPU has fallen off the bus."


# What real SGLang 0.5.17 printed on the H200 for a ~900-token prompt under
# --context-length 1024 (field facts), and what the driver logged for its scheduler.
DEVICE_ASSERT = (
    "/pytorch/aten/src/ATen/native/cuda/IndexKernelUtils.cu:16: vectorized_gather_kernel: "
    "block: [3,0,0], thread: [64,0,0] Assertion `ind >=0 && ind < ind_dim_size && "
    '"vectorized gather kernel index out of bounds"` failed.'
)
CUBLAS_FAILED = (
    "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( "
    "handle, opa, opb, m, n, k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, "
    "c, CUDA_R_16BF, ldc, compute_type, CUBLAS_GEMM_DEFAULT_TENSOR_OP)`"
)
XID_43 = "NVRM: Xid (PCI:0000:00:06): 43, pid=4300, name=python, channel 0x00000009"


def test_a_device_assert_with_xid_43_is_the_program_s_cuda_error() -> None:
    """The incident: a program fault that the driver logged as Xid 43 is a program death
    (cuda-error, restarted), with the Xid kept as evidence; no person is called."""
    output = [DEVICE_ASSERT, CUBLAS_FAILED, *CRASH_LINES]
    verdict = classify(sigkill(), ["noise", XID_43], output)
    assert verdict.cause is ExitCause.CUDA_ERROR and not verdict.needs_person
    assert verdict.summary.startswith("CUDA failure: ")
    assert "the driver logged it as NVIDIA Xid 43 on GPU 0000:00:06 (GPU stopped processing)" in (
        verdict.summary
    )
    assert XID_43 in verdict.evidence and CUBLAS_FAILED[:80] in " ".join(verdict.evidence)


def test_the_real_device_assert_keeps_its_xid_in_the_evidence() -> None:
    """The H200 run (2026-12-03): the device-side assert printed once per faulting
    thread, 32 lines that differ only in their coordinates. They count as one line, so
    the evidence keeps the Xid the summary cites and the CUBLAS error it names."""
    real = SAMPLES / "real-sglang-0.5.17"
    output = (real / "eagle3-device-assert-xid43.log").read_text().splitlines()
    kernel = (real / "eagle3-device-assert-xid43.kmsg").read_text().splitlines()
    verdict = classify(sigkill(), kernel, output)
    assert verdict.cause is ExitCause.CUDA_ERROR and not verdict.needs_person
    assert "NVIDIA Xid 43 on GPU 0000:00:06" in verdict.summary
    assert kernel[0] in verdict.evidence
    asserts = [ln for ln in verdict.evidence if "vectorized_gather_kernel" in ln]
    assert len(asserts) == 1, asserts
    assert any("CUBLAS_STATUS_EXECUTION_FAILED" in ln for ln in verdict.evidence)


def test_a_child_s_exception_no_rule_names_is_quoted_in_the_self_kill_summary() -> None:
    """K2 with an EAGLE-3 draft on the H200 (2026-12-03): the scheduler's traceback ended
    in an AssertionError that no rule maps to a cause. The verdict stays the generic
    sigkill, but says which exception it was and keeps the line."""
    real = SAMPLES / "real-sglang-0.5.17" / "k2-eagle3-graphs-aux-hidden-states-assert.log"
    verdict = classify(sigkill(), [], real.read_text().splitlines())
    assert verdict.cause is ExitCause.SIGKILL
    raised = "AssertionError: captured 1 of 3 aux hidden states"
    assert f"after a child failed with {raised};" in verdict.summary
    assert raised in verdict.evidence


@pytest.mark.parametrize("number", [13, 31, 43])
def test_a_program_fault_xid_with_no_output_stays_gpu_xid_but_is_restartable(number: int) -> None:
    kernel = [f"NVRM: Xid (PCI:0000:9a:00): {number}, pid=4300, name=python3, Ch 00000010"]
    verdict = classify(sigkill(), kernel, [])
    assert verdict.cause is ExitCause.GPU_XID and not verdict.needs_person
    assert "an application fault in NVIDIA's catalog" in verdict.summary
    assert "restarted under backoff" in verdict.summary


def test_a_contained_ecc_error_is_restarted_and_asks_for_a_reset_when_convenient() -> None:
    kernel = ["NVRM: Xid (PCI:0000:9a:00): 94, pid=4300, name=python3, Contained: CE User "
              "Channel (0x9). RST: No, D-RST: No"]  # fmt: skip
    verdict = classify(sigkill(), kernel, [])
    assert verdict.cause is ExitCause.GPU_XID and not verdict.needs_person
    assert "reset the GPU when convenient" in verdict.summary
    uncorrectable = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    assert classify(sigkill(), kernel, [uncorrectable]).cause is ExitCause.CUDA_ERROR


@pytest.mark.parametrize("number", [48, 74, 79, 95, 119, 120])
def test_a_hardware_xid_needs_a_person_whatever_the_program_printed(number: int) -> None:
    kernel = [f"NVRM: Xid (PCI:0000:3b:00): {number}, pid=4300, name=python3, Ch 00000010"]
    verdict = classify(sigkill(), ["noise", *kernel], [ILLEGAL_ACCESS, *CRASH_LINES])
    assert verdict.cause is ExitCause.GPU_XID and verdict.needs_person
    assert verdict.summary.endswith("needs a person (reset or drain the node)")
    assert kernel[0] in verdict.evidence and ILLEGAL_ACCESS in verdict.evidence


def test_an_xid_explains_the_cuda_error_the_program_printed() -> None:
    verdict = classify(sigkill(), ["noise", XID_79], [ILLEGAL_ACCESS, *CRASH_LINES])
    assert verdict.cause is ExitCause.GPU_XID and verdict.needs_person
    assert verdict.summary == (
        "NVIDIA Xid 79 on GPU 0000:3b:00 (GPU has fallen off the bus): "
        "needs a person (reset or drain the node)"
    )
    assert XID_79 in verdict.evidence and ILLEGAL_ACCESS in verdict.evidence


def test_xid_names_the_first_deciding_xid_and_the_program_fault_ones() -> None:
    kernel = [
        "NVRM: Xid (PCI:0000:9a:00): 45, pid=4300, name=python3, Ch 00000008",
        "NVRM: Xid (PCI:0000:9a:00): 31, pid=4300, name=python3, Ch 00000010, intr 0. MMU Fault",
        "NVRM: Xid (PCI:0000:9a:00): 43, pid=4300, name=python3, Ch 00000010",
    ]
    verdict = classify(sigkill(), kernel, [])
    assert verdict.cause is ExitCause.GPU_XID and not verdict.needs_person
    assert verdict.summary.startswith(
        "NVIDIA Xid 31 on GPU 0000:9a:00 (GPU memory page fault, then Xid 45, 43): an "
        "application fault"
    )


def test_a_hardware_xid_beside_a_program_fault_decides() -> None:
    kernel = [
        "NVRM: Xid (PCI:0000:9a:00): 31, pid=4300, name=python3, Ch 00000010, intr 0. MMU Fault",
        "NVRM: Xid (PCI:0000:9a:00): 62, pid='<unknown>', name=<unknown>, 2023b230 20238a3a",
    ]
    verdict = classify(sigkill(), kernel, [ILLEGAL_ACCESS])
    assert verdict.cause is ExitCause.GPU_XID and verdict.needs_person
    assert verdict.summary.startswith("NVIDIA Xid 62 on GPU 0000:9a:00")


def test_xid_45_alone_is_the_cleanup_after_a_kill() -> None:
    kernel = ["NVRM: Xid (PCI:0000:9a:00): 45, pid=4300, name=python3, Ch 00000008"]
    assert classify(sigkill(), kernel, []).cause is ExitCause.SIGKILL
    assert classify(stopping(), kernel, DRAIN_LINES).cause is ExitCause.STOPPED


def test_fallen_off_the_bus_without_an_xid_line() -> None:
    verdict = classify(snap(), ["NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."], [])
    assert verdict.cause is ExitCause.GPU_XID
    assert "Xid 79 on GPU 0000:3b:00.0" in verdict.summary


def test_kernel_oom_beats_xid_and_a_clean_stop_ignores_it(oom_kernel_lines: list[str]) -> None:
    snapshot = sigkill(unit=UNIT, pid=OOM_PID, cgroup="/app.slice/oomsample.service")
    assert classify(snapshot, [*oom_kernel_lines, XID_79], []).cause is ExitCause.OOM_KILL
    assert classify(stopping("success", 1, 0), [XID_79], []).cause is ExitCause.STOPPED


# --- the new output causes, and their guards ----------------------------------------


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5570')",
         ExitCause.PORT_IN_USE),
        ("ValueError: nccl_port at 31000 is not available in 30 seconds. nccl_port is used by "
         "a process already.", ExitCause.PORT_IN_USE),
        ("OSError: Incorrect path_or_model_id: '/models/missing'. Please provide either the "
         "path to a local folder or the repo_id of a model on the Hub.", ExitCause.MODEL_LOAD),
        ("RuntimeError: Cannot find any model weights with `/models/k26`", ExitCause.MODEL_LOAD),
        ("ValueError: No supported config format found in /models/k26", ExitCause.MODEL_LOAD),
        ("OSError: Can't load the configuration of '/models/k26'. If you were trying to load it "
         "from 'https://huggingface.co/models', ...", ExitCause.MODEL_LOAD),
        ("what():  NCCL Error 1: unhandled cuda error", ExitCause.NCCL),
        ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
         "ProcessGroupNCCL.cpp:1970, unhandled system error", ExitCause.NCCL),
        ("RuntimeError: CUDA error: misaligned address", ExitCause.CUDA_ERROR),
        ("RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`",
         ExitCause.CUDA_ERROR),
        ("RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED", ExitCause.CUDA_ERROR),
        ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
         ExitCause.GPU_OOM),
        ("RuntimeError: SGLang only supports sm75 and above.", ExitCause.FLASHINFER_ARCH),
        ("nvcc fatal   : Unsupported gpu architecture 'compute_120a'", ExitCause.FLASHINFER_ARCH),
    ],
)  # fmt: skip
def test_new_output_causes(line: str, cause: ExitCause) -> None:
    assert classify(sigkill(), [], [f"{T} {line}"]).cause is cause


@pytest.mark.parametrize(
    "line",
    [
        "NCCL_DEBUG=INFO NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=0",
        "host:123:456 [0] NCCL INFO Channel 00/02 :    0   1",
        "(run with NCCL_DEBUG=INFO for details)",
        "[rank0]:[W701 02:36:19.144600040 ProcessGroupNCCL.cpp:1575] Warning: WARNING: "
        "destroy_process_group() was not called before program exit",
        "Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=9.69 GB, "
        "mem usage=15.10 GB.",
        "Memory pool end. avail mem=2.44 GB",
        "Capture cuda graph begin. This can take up to several minutes. avail mem=3.1 GB",
        "max_total_tokens=131072 is larger than the profiled value 56524. Use the profiled "
        "value instead.",
        "RuntimeError: alloc_req_slots runs out of memory. Please set a smaller number for "
        "`--max-running-requests`.",
        "RuntimeError: Prefill out of memory. Try to lower your batch size.",
        "Available memory 20GB is less than required memory 30GB for warmup, reducing max_m "
        "to 1024 to avoid out of memory",
        "INFO: retrying with a smaller batch to avoid CUDA out of memory",
        "OSError: [Errno 12] Cannot allocate memory",
        "The memory capacity is unbalanced. Some GPUs may be occupied by other processes. ",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.",
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "[rank10]:[W507 09:29:36.399571193 CUDAGuardImpl.h:119] Warning: CUDA warning: "
        "unspecified launch failure (function destroyEvent)",
        "The port 30000 is in use, but we could not find the process that uses it.",
        "port 30000 is in use. Waiting for 15 seconds for port to be available.",
        "FlashInfer is not available on Non-NV platforms. Fallback to other kernel libraries.",
        "WARNING: Unsupported architecture for the fused MoE config, using the default one",
        "KeyError: 'temperature'",
        "Received sigquit from a child process. It usually means the child failed.",
    ],
)
def test_harmless_lines_name_no_cause(line: str) -> None:
    assert classify(sigkill(), [], [f"{T} {line}"]).cause is ExitCause.SIGKILL
    assert classify(snap(), [], [f"{T} {line}"]).cause is ExitCause.EXIT_CODE


def test_nccl_is_the_echo_of_another_cause() -> None:
    """A rank's OOM, then its peers' NCCL failures: the OOM is the cause."""
    lines = [
        "[TP0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.",
        "[TP1] RuntimeError: NCCL error: remote process exited or there was a network error",
        "[TP2] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)",
    ]
    assert classify(sigkill(), [], lines).cause is ExitCause.GPU_OOM
    assert classify(sigkill(), [], lines[1:]).cause is ExitCause.NCCL
    # NCCL wrapping a CUDA OOM, in either order.
    wrapped = [
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
        "ncclUnhandledCudaError: Call to CUDA function failed.",
        "Last error:",
        "Cuda failure 2 'out of memory'",
    ]
    assert classify(sigkill(), [], wrapped).cause is ExitCause.GPU_OOM
    assert classify(sigkill(), [], wrapped[3:] + wrapped[:3]).cause is ExitCause.GPU_OOM
    assert classify(sigkill(), [], wrapped[:3]).cause is ExitCause.NCCL


def test_cut_frames_decide_only_as_the_innermost_frame_of_a_cut_traceback() -> None:
    frames = [
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.12/site-packages/flashinfer/jit/core.py", line 413, in '
        "gen_jit_spec",
        "    check_cuda_arch()",
        '  File "/venv/lib/python3.12/site-packages/flashinfer/jit/core.py", line 108, in '
        "check_cuda_arch",
        "    raise RuntimeError(",
    ]
    assert classify(snap(), [], frames).cause is ExitCause.FLASHINFER_ARCH
    # The exception line is there and says something else: it decides.
    ended = [*frames, "ModuleNotFoundError: No module named 'torch.utils.cpp_extension'"]
    assert classify(snap(), [], ended).cause is ExitCause.EXIT_CODE
    # Not the innermost frame.
    deeper = [*frames[:4], '  File "/venv/lib/python3.12/site-packages/x.py", line 1, in y']
    assert classify(snap(), [], deeper).cause is ExitCause.EXIT_CODE
    # A frame outside a traceback's end: many lines follow, none an exception.
    assert classify(snap(), [], [*frames, *["INFO: later"] * 20]).cause is ExitCause.EXIT_CODE


def test_a_keyerror_is_model_load_only_inside_load_weights() -> None:
    lines = [
        '  File "/sgl/python/sglang/srt/models/llama.py", line 500, in load_weights',
        "    param = params_dict[name]",
        "KeyError: 'lm_head.weight'",
    ]
    assert classify(sigkill(), [], lines).cause is ExitCause.MODEL_LOAD
    other = ['  File "/sgl/python/sglang/srt/sampling.py", line 5, in verify', *lines[1:]]
    assert classify(sigkill(), [], other).cause is ExitCause.SIGKILL


@pytest.mark.parametrize(
    ("line", "advice"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
         "; lower --mem-fraction-static or free the GPU"),
        ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
         "raise --mem-fraction-static"),
        ("OSError: [Errno 98] Address already in use",
         "; another process holds it — restarting will not help"),
        ("OSError: You are trying to access a gated repo.", "restarting will not help"),
        ("RuntimeError: FlashInfer requires GPUs with sm75 or higher", "restarting will not help"),
        (ILLEGAL_ACCESS, "restart"),
        ("RuntimeError: NCCL error: internal error", "interconnect"),
    ],
)  # fmt: skip
def test_summaries_say_what_to_do(line: str, advice: str) -> None:
    verdict = classify(snap(), [], [line])
    assert verdict.summary.split(": ", 1)[1].startswith(line[:40])
    assert advice in verdict.summary


def test_every_rule_survives_the_prefilter() -> None:
    """A line is only tried against the rules when it holds a prefilter word: each
    rule's needle must hold one, and each needle must be in its own pattern."""
    from supervisor.core.classify import evidence, rules

    for rule in rules.LINE_RULES:
        assert rule.needle in rule.pattern.pattern.replace("\\", ""), rule
    for needle in (*(r.needle for r in rules.LINE_RULES), *evidence.OTHER_NEEDLES):
        assert any(word in needle for word in evidence.PREFILTER_WORDS), needle


def test_a_long_tail_of_healthy_lines_still_finds_the_error_at_its_end() -> None:
    """The tail is up to 2000 lines (its speed: bench/classify_speed.py)."""
    healthy = [
        f"[2025-01-01 10:00:{i % 60:02d} TP0] Decode batch. #running-req: 12, #token: 5000, "
        "token usage: 0.05, gen throughput (token/s): 1200.00, #queue-req: 0"
        for i in range(1990)
    ]
    lines = [*healthy, *sample("torch_cuda_oom_h200.txt")]
    verdict = classify(sigkill(), [], lines)
    assert verdict.cause is ExitCause.GPU_OOM


# --- the host's GPU driver stack ---------------------------------------------------

NUM_DEVICES = (
    "Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
    "calling NumCudaDevices() that might have already set an error?"
)
ERROR_802 = f"RuntimeError: {NUM_DEVICES} Error 802: system not yet initialized"


@pytest.mark.parametrize(
    "line",
    [
        # cudaErrorInsufficientDriver (35)
        "RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version",
        "THCudaCheck FAIL file=..\\torch\\csrc\\cuda\\Module.cpp line=33 error=35 : CUDA driver "
        "version is insufficient for CUDA runtime version",
        "CUDA error at bandwidthTest.cu:255 code=35(cudaErrorInsufficientDriver) "
        '"cudaSetDevice(currentDevice)"',
        # 802: nvidia-fabricmanager not running (or not of the driver's version)
        ERROR_802,
        f"ERROR 02-20 16:43:12 engine.py:389] {NUM_DEVICES} Error 802: system not yet initialized",
        "[rank7]: Cuda failure 802 'system not yet initialized'",
        "host:392:494 [2] NCCL WARN Cuda failure 802 'system not yet initialized'",
        "ERROR 12-08 20:46:56 [multiproc_executor.py:597] RuntimeError: CUDA driver error: "
        "system not yet initialized",
        "RuntimeError: CUDA error: system not yet initialized",
        "RuntimeError: cuda runtime error (802) : system not yet initialized at "
        "/opt/conda/conda-bld/pytorch/work/aten/src/THC/THCGeneral.cpp:50",
        "cupy.cuda.runtime.CUDARuntimeError: cudaErrorSystemNotReady: system not yet initialized",
        "cuInit failed: CUDA_ERROR_SYSTEM_NOT_READY",
        # 803, 804
        f"RuntimeError: {NUM_DEVICES} Error 803: system has unsupported display driver / cuda "
        "driver combination",
        f"RuntimeError: {NUM_DEVICES} Error 804: forward compatibility was attempted on non "
        "supported HW",
        # torch's _cuda_init
        "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an "
        "NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx",
        "AssertionError: Found no NVIDIA driver on your system.",
        "RuntimeError: The NVIDIA driver on your system is too old (found version 11040). Please "
        "update your GPU driver",
        # cudaErrorNoDevice (100)
        "RuntimeError: CUDA error: no CUDA-capable device is detected",
        "cuInit failed: CUDA_ERROR_NO_DEVICE",
        "CUDA error: code=100(cudaErrorNoDevice)",
        # NVML after a driver upgrade without a reboot
        "Failed to initialize NVML: Driver/library version mismatch",
        "pynvml.nvml.NVMLError_LibRmVersionMismatch: RM has detected an NVML/RM version mismatch.",
        "tensorpack.utils.nvml.NvmlException: NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    ],
)
def test_the_host_driver_stack(line: str) -> None:
    verdict = classify(sigkill(), [], [f"{T} {line}"])
    assert verdict.cause is ExitCause.GPU_DRIVER, verdict.summary
    assert verdict.summary.startswith("GPU driver stack unusable: ")
    assert classify(snap(), [], [line]).cause is ExitCause.GPU_DRIVER


def test_the_driver_summary_says_what_to_do_and_that_no_restart_heals_it() -> None:
    verdict = classify(snap(), [], [ERROR_802])
    assert verdict.summary.startswith(f"GPU driver stack unusable: {ERROR_802[:40]}")
    for advice in ("upgrade the driver", "nvidia-fabricmanager", "reboot", "SIGUSR1"):
        assert advice in verdict.summary, advice
    assert verdict.summary.endswith("restarting will not help")
    assert ERROR_802 in verdict.evidence


def test_a_driver_line_beats_cuda_error_and_nccl_on_the_same_line_and_after_them() -> None:
    # On one line: torch's "CUDA error: ..." shape, NCCL's words.
    same_line = [
        "RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version",
        "[rank0]: torch.distributed.DistBackendError: NCCL error in: NCCLUtils.cpp:77, "
        "unhandled cuda error; Cuda failure 802 'system not yet initialized'",
    ]
    for line in same_line:
        assert classify(sigkill(), [], [line]).cause is ExitCause.GPU_DRIVER, line
    # NCCL wrapping it: NCCL's lines are its echo, in either order.
    wrapped = [
        "[rank7]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/"
        "distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error (run with NCCL_DEBUG=INFO for "
        "details), NCCL version 2.25.1",
        "[rank7]: ncclUnhandledCudaError: Call to CUDA function failed.",
        "[rank7]: Last error:",
        "[rank7]: Cuda failure 802 'system not yet initialized'",
    ]
    assert classify(snap(), [], wrapped).cause is ExitCause.GPU_DRIVER
    assert classify(snap(), [], wrapped[3:] + wrapped[:3]).cause is ExitCause.GPU_DRIVER
    assert classify(snap(), [], wrapped[:3]).cause is ExitCause.NCCL
    # A CUDA error printed before the driver failure was survived: the driver one ended it.
    later = [ILLEGAL_ACCESS, ERROR_802]
    assert classify(sigkill(), [], later).cause is ExitCause.GPU_DRIVER
    assert classify(sigkill(), [], later[::-1]).cause is ExitCause.CUDA_ERROR


@pytest.mark.parametrize(
    "line",
    [
        # torch.cuda.is_available() only warns; the program may go on (on the CPU).
        "/venv/lib/python3.10/site-packages/torch/cuda/__init__.py:174: UserWarning: CUDA "
        f"initialization: {NUM_DEVICES} Error 802: system not yet initialized (Triggered "
        "internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)",
        "/venv/lib/python3.10/site-packages/torch/cuda/__init__.py:107: UserWarning: CUDA "
        "initialization: Found no NVIDIA driver on your system. Please check that you have an "
        "NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx",
        "07/20/2023 10:28:52 - WARNING - transformers_modules.chatglm2-6b.quantization - Failed "
        "to load cpm_kernels:CUDA Runtime Error: CUDA driver version is insufficient for CUDA "
        "runtime version",
        "(EngineCore_DP0 pid=68) WARNING 02-06 16:34:06 [cuda.py:80] Failed to initialize NVML: "
        "Driver/library version mismatch",
        # Bare words, not an error shape.
        "Fabric manager: system not yet initialized, retrying in 10 s",
        "Checking for a Driver/library version mismatch before start-up",
        "INFO: the NVIDIA driver is too old for CUDA 13 builds; using the CUDA 12 build",
    ],
)
def test_a_driver_warning_or_a_bare_word_decides_nothing(line: str) -> None:
    assert classify(sigkill(), [], [f"{T} {line}"]).cause is ExitCause.SIGKILL
    assert classify(snap(), [], [line]).cause is ExitCause.EXIT_CODE


def test_the_warning_then_the_error_decides_on_the_error() -> None:
    warning = (
        "UserWarning: CUDA initialization: Unexpected error from cudaGetDeviceCount(). "
        "Error 804: forward compatibility was attempted on non supported HW"
    )
    error = f"RuntimeError: {NUM_DEVICES} Error 804: forward compatibility was attempted on non supported HW"
    verdict = classify(snap(), [], [warning, error])
    assert verdict.cause is ExitCause.GPU_DRIVER
    assert verdict.evidence[1:] == (error,)


def test_a_driver_failure_is_not_a_stop_and_an_xid_still_beats_it() -> None:
    assert classify(stopping("exit-code", 1, 1), [], [ERROR_802]).cause is ExitCause.GPU_DRIVER
    assert classify(snap(), [XID_79], [ERROR_802]).cause is ExitCause.GPU_XID
    assert classify(stopping("success", 1, 0), [], [ERROR_802]).cause is ExitCause.STOPPED
    unasked = classify(snap("success", 1, 0), [], [ERROR_802])
    assert unasked.cause is ExitCause.GPU_DRIVER and unasked.needs_person


# --- FlashInfer's JIT inside the server -------------------------------------------


def test_ninja_missing_from_the_units_path_is_flashinfer_jit_not_sigkill() -> None:
    """The H200 run: a warm cache, and FlashInfer 0.6 still runs ninja on every load;
    not on the unit's PATH, so the scheduler raised and SGLang killed its tree."""
    lines = (SAMPLES / "real-sglang-0.5.17" / "ninja-missing-on-the-units-path.log").read_text()
    verdict = classify(sigkill(), [], lines.splitlines())
    assert verdict.cause is ExitCause.FLASHINFER_JIT
    assert any("No such file or directory: 'ninja'" in e for e in verdict.evidence)
    assert verdict.summary.startswith("FlashInfer's JIT build failed in the server:")
    assert "serving venv's bin" in verdict.summary


@pytest.mark.parametrize(
    "line",
    [
        "FileNotFoundError: [Errno 2] No such file or directory: '/usr/local/cuda/bin/nvcc'",
        "RuntimeError: Ninja build failed. Ninja output:",
        "/opt/sglang/venv/lib/python3.12/site-packages/flashinfer/data/include/flashinfer/"
        "norm.cuh:20:10: fatal error: cublasLt.h: No such file or directory",
    ],
)
def test_flashinfer_build_failures_in_the_server(line: str) -> None:
    lines = ["[2026-12-01 16:34:43 TP0] Scheduler hit an exception: Traceback", line]
    assert classify(sigkill(), [], lines).cause is ExitCause.FLASHINFER_JIT


def test_a_file_not_found_that_is_no_build_tool_decides_nothing() -> None:
    lines = ["FileNotFoundError: [Errno 2] No such file or directory: '/models/k26/tokenizer.json'"]
    assert classify(snap(), [], lines).cause is not ExitCause.FLASHINFER_JIT


@pytest.mark.parametrize(
    ("number", "acted_on"),
    [(13, False), (31, False), (43, False), (45, False), (63, False), (92, False), (94, False),
     (48, True), (74, True), (79, True), (95, True), (119, True), (120, True)],
)  # fmt: skip
def test_only_the_gpus_own_xids_are_acted_on_as_they_are_read(number: int, acted_on: bool) -> None:
    """The same line a death would be classified by: what calls a person there calls
    one the moment it is read; a program's fault waits for the death's own evidence."""
    line = f"NVRM: Xid (PCI:0000:3b:00): {number}, pid=4300, name=python3, Ch 00000010"
    found = gpus_own_fault([line])
    assert (found is not None) is acted_on
    assert acted_on is classify(sigkill(), [line], []).needs_person
    if found is not None:
        assert found.startswith(f"NVIDIA Xid {number} on GPU 0000:3b:00 (")


def test_sglang_s_own_advice_after_a_graph_runner_failure_is_quoted() -> None:
    """Tiny EAGLE-3 with prefill CUDA graphs on the H100 (2026-12-05): ready by its own
    account, then the first sampled request failed in the draft's prefill graph, and
    SGLang printed what to do ("Possible suggestions:", numbered). No rule names the
    cause; the verdict quotes the exception and SGLang's advice, and keeps both."""
    from supervisor.core.classify.verdict import sglang_advice

    real = SAMPLES / "real-sglang-0.5.17" / "eagle3-prefill-graph-first-request-crash.log"
    verdict = classify(sigkill(), [], real.read_text().splitlines())
    assert verdict.cause is ExitCause.SIGKILL
    raised = (
        "RuntimeError: The size of tensor a (384) must match the size of tensor b (128) "
        "at non-singleton dimension 1"
    )
    assert f"after a child failed with {raised}; SGLang's own advice: 1. change to " in (
        verdict.summary
    )
    assert "2. disable the prefill CUDA graph by --cuda-graph-backend-prefill=disabled" in (
        verdict.summary
    )
    assert "no rule here names" not in verdict.summary
    assert raised in verdict.evidence
    assert any("--cuda-graph-backend-prefill=tc_piecewise" in ln for ln in verdict.evidence)
    # The block ends at its first line that is no numbered item; a head with none is none.
    assert sglang_advice(["Possible solutions:", "1. a", "2. b", "Open an issue"]) == (
        "1. a",
        "2. b",
    )
    assert sglang_advice(["Possible solutions:", "see the docs"]) == ()
    assert sglang_advice(["1. not advice"]) == ()
