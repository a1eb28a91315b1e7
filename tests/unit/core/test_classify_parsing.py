"""The classifier's readers: tracebacks, C++ frames, glog lines and kernel records."""

from __future__ import annotations

from supervisor.core.classify import frames, kernel
from supervisor.core.classify.evidence import candidates
from supervisor.core.classify.stops import is_crash

RAY = "(SGLangEngine pid=7) "
CHAINED = [
    f"{RAY}Scheduler hit an exception: Traceback (most recent call last):",
    f'{RAY}  File "/v/torch/utils/cpp_extension.py", line 2104, in _run_ninja_build',
    f"{RAY}    subprocess.run(",
    f'{RAY}  File "/usr/lib/python3.12/subprocess.py", line 571, in run',
    f"{RAY}    raise CalledProcessError(retcode, process.args,",
    f"{RAY}subprocess.CalledProcessError: Command '['ninja', '-v']' returned non-zero exit "
    "status 1.",
    f"{RAY}The above exception was the direct cause of the following exception:",
    f"{RAY}Traceback (most recent call last):",
    f'{RAY}  File "/v/sglang/srt/model_executor/cuda_graph_runner.py", line 267, in __init__',
    f"{RAY}    self.capture()",
    f"{RAY}RuntimeError: Error building extension 'x'",
]


def parse(lines: list[str]) -> frames.Parsed:
    return frames.parse(lines, candidates(lines), is_crash)


def test_a_chained_traceback_behind_a_log_prefix() -> None:
    parsed = parse(CHAINED)
    first, last = parsed.errors
    assert (first.type, first.name) == ("subprocess.CalledProcessError", "CalledProcessError")
    assert [f.func for f in first.frames] == ["_run_ninja_build", "run"]
    assert first.frames[0].is_("torch/utils/cpp_extension.py", "run_ninja_build")
    assert last.type == "RuntimeError" and last.message == "Error building extension 'x'"
    assert [f.func for f in last.frames] == ["__init__"]
    assert last.cause is first and [e.index for e in last.chain()] == [10, 5]
    assert parsed.cut == ()


def test_an_exception_without_a_chain_line_is_not_chained() -> None:
    lines = ["ValueError: a", "INFO: later", "KeyError: 'b'"]
    first, second = parse(lines).errors
    assert second.cause is None and first.frames == () and second.message == "'b'"


def test_a_source_line_that_raises_is_no_exception_line() -> None:
    assert frames.exception_line('    raise RuntimeError("FlashInfer requires sm75+")') is None
    assert frames.exception_line("torch.AcceleratorError: CUDA error: x") == (
        "torch.AcceleratorError",
        "CUDA error: x",
    )


def test_a_cut_traceback_is_kept_when_the_output_ends_or_a_child_failure_follows() -> None:
    head = CHAINED[:3]
    assert [f.func for f in parse(head).cut[0]] == ["_run_ninja_build"]
    crash = [*head, "[T] Received sigquit from a child process. It usually means the child failed."]
    assert parse(crash).cut != ()
    assert parse([*head, *["INFO: later"] * 20]).cut == ()  # not cut: it went on


def test_a_c10_raise_with_its_frames() -> None:
    lines = [
        "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:632 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7fb4 in "
        "/v/torch/lib/libc10.so)",
        "frame #1: <unknown function> + 0xe5c6fc (0x7fb3 in /v/torch/lib/libtorch_cuda.so)",
    ]
    (raised,) = parse(lines).raises
    assert (raised.func, raised.file.rsplit("/", 1)[-1]) == ("checkTimeout", "ProcessGroupNCCL.cpp")
    assert [f.func for f in raised.frames] == [
        "c10::Error::Error(c10::SourceLocation, std::string)",
        "<unknown function>",
    ]
    assert raised.frames[1].where.endswith("libtorch_cuda.so")


def test_glog_lines_name_their_severity_and_source() -> None:
    assert frames.glog("[rank6]:[F429 14:03:49.385 ProcessGroupNCCL.cpp:1554] [PG 0] x") == (
        "F",
        "ProcessGroupNCCL.cpp",
    )
    assert frames.glog("[E ProcessGroupNCCL.cpp:475] [Rank 3] Watchdog caught") == (
        "E",
        "ProcessGroupNCCL.cpp",
    )
    assert frames.glog(
        "E0801 13:23:20.000000 32974 torch/distributed/elastic/multiprocessing/api.py:874] x"
    ) == ("E", "torch/distributed/elastic/multiprocessing/api.py")
    assert frames.glog("INFO 05-01 12:00:00 [core.py:12] ready") is None


def test_nvrm_records_are_joined_across_their_lines() -> None:
    lines = [
        "NVRM: API mismatch: the client has the version 535.54.03, but#012NVRM: this kernel "
        "module has the version 530.30.02.  Please#012NVRM: make sure that this kernel module "
        "and all NVIDIA driver#012NVRM: components have the same version.",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.54.03.",
        "usb 1-1: new high-speed USB device",
    ]
    messages = kernel.kernel_messages(lines)
    assert len(messages) == 6
    records = kernel.nvrm_records(messages)
    assert [len(lines) for _, lines in records] == [4, 1]
    assert records[0][0].startswith("API mismatch: the client has the version 535.54.03, but")
    driver = kernel.find_kernel_driver(lines)
    assert driver is not None and "(535.54.03)" in driver.what and "(530.30.02)" in driver.what
    assert kernel.find_kernel_driver(lines[1:]) is None
