"""The exit classifier on the families issue 26 lists: where an error came from decides.

Each family is tried in several wordings (other runtimes, other casings, a cut
paste), and next to each, lines that only look like it must decide nothing.
"""

from __future__ import annotations

import pytest

from supervisor.core.classify import ExitCause, ExitSnapshot, classify

T = "[2026-12-01 10:00:00]"


def exits(status: int = 1) -> ExitSnapshot:
    return ExitSnapshot("sglang-k26.service", "exit-code", 1, status, 4242, "/x.slice/u.service")


def killed() -> ExitSnapshot:
    return ExitSnapshot("sglang-k26.service", "signal", 2, 9, 4242, "/x.slice/u.service")


def cause(output: list[str], kernel: list[str] | None = None) -> ExitCause:
    return classify(exits(), kernel or [], output).cause


def frame(path: str, func: str, line: int = 10) -> str:
    return f'  File "/venv/lib/python3.12/site-packages/{path}", line {line}, in {func}'


# --- a JIT build that fails as a subprocess or an extension build ---------------------

NINJA_CHAIN = [
    "Traceback (most recent call last):",
    frame("torch/utils/cpp_extension.py", "_run_ninja_build", 2104),
    "    subprocess.run(",
    '  File "/usr/lib/python3.12/subprocess.py", line 571, in run',
    "    raise CalledProcessError(retcode, process.args,",
    "subprocess.CalledProcessError: Command '['ninja', '-v']' returned non-zero exit status 1.",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    frame("sglang/srt/model_executor/cuda_graph_runner.py", "capture"),
    frame("torch/utils/cpp_extension.py", "_run_ninja_build", 2120),
    "    raise RuntimeError(message) from e",
    "RuntimeError: Error building extension 'batch_decode_with_kv_cache'",
]


@pytest.mark.parametrize(
    "output",
    [
        NINJA_CHAIN,
        NINJA_CHAIN[:6],  # the chain cut after its first exception
        NINJA_CHAIN[:3],  # cut inside the build helper's frame
        # FlashInfer's own runner, with Ray's prefix
        [
            "(SGLangEngine pid=7) Scheduler hit an exception: Traceback (most recent call last):",
            "(SGLangEngine pid=7)   " + frame("flashinfer/jit/cpp_ext.py", "run_ninja").strip(),
            "(SGLangEngine pid=7)     subprocess.run(",
            "(SGLangEngine pid=7) subprocess.CalledProcessError: Command '['ninja', '-v', '-C', "
            "'/root/.cache/flashinfer/80/cached_ops']' returned non-zero exit status 1.",
        ],
        # the message alone, in another runtime's log prefix
        ["kserve-container (EngineCore_0 pid=58) RuntimeError: Error building extension 'x':"],
        ["RuntimeError: Error compiling objects for extension"],
        # Triton's launcher stub, built with the C compiler at first use
        [
            "subprocess.CalledProcessError: Command '['/usr/bin/gcc', '/tmp/tmpab/main.c', "
            "'-O3', '-shared', '-fPIC', '-o', '/tmp/tmpab/cuda_utils.so']' returned non-zero "
            "exit status 1."
        ],
        ["RuntimeError: Failed to find C compiler. Please specify via CC environment variable."],
        # a JIT package's own compiler wrapper (DeepGEMM-style)
        [
            "Traceback (most recent call last):",
            frame("deep_gemm/jit/compiler.py", "build"),
            "    raise RuntimeError(f'Failed to compile {path}')",
            "RuntimeError: NVCC compilation failed: exit status 2",
        ],
    ],
)
def test_a_jit_build_failure_is_flashinfer_jit(output: list[str]) -> None:
    assert cause(output) is ExitCause.FLASHINFER_JIT


def test_an_arch_rejection_inside_a_build_is_the_arch() -> None:
    output = [
        "nvcc fatal   : Unsupported gpu architecture 'compute_120a'",
        "ninja: build stopped: subcommand failed.",
        *NINJA_CHAIN,
    ]
    assert cause(output) is ExitCause.FLASHINFER_ARCH


@pytest.mark.parametrize(
    "output",
    [
        ["Loading extension module fused_dense_cuda..."],
        ["Emitting ninja build file /root/.cache/torch_extensions/py312_cu124/x/build.ninja..."],
        ["WARNING 05-01 [jit_monitor.py:12] Triton kernel JIT compilation during inference"],
        ["subprocess.CalledProcessError: Command '['git', 'rev-parse', 'HEAD']' returned 128."],
        # FlashInfer with JIT turned off and a cold cache builds nothing
        [
            frame("flashinfer/jit/core.py", "build_and_load"),
            "flashinfer.jit.core.MissingJITCacheError: JIT compilation is disabled via "
            "FLASHINFER_DISABLE_JIT environment variable",
        ],
    ],
)
def test_what_only_looks_like_a_build_failure_is_not(output: list[str]) -> None:
    assert cause(output) is ExitCause.EXIT_CODE


# --- a collective that times out, seen only through its frames or its work --------------


@pytest.mark.parametrize(
    "output",
    [
        # hard-wrapped: the sentence split mid-word, the work description on its own
        [
            "[Rank 1] Watchdog caught collective opera",
            "tion timeout: WorkNCCL(SeqNum=4, OpType=BROADCAST, NumelIn=112, NumelOut=112, "
            "Timeout(ms)=1800000) ran for 1800010 milliseconds before ti",
        ],
        ["WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran…"],
        # c10's raise site and frames, the message gone
        [
            "Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/"
            "ProcessGroupNCCL.cpp:632 (most recent call first):",
            "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in "
            "/venv/lib/libc10.so)",
        ],
        [
            "Exception raised from ncclCommWatchdog at ../torch/csrc/distributed/c10d/"
            "ProcessGroupNCCL.cpp:1901 (most recent call first):",
            "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in "
            "/venv/lib/libc10.so)",
            "frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono"
            "::duration<long, std::ratio<1l, 1000l> > >) + 0x1d2 (0x7f in /venv/lib/libtorch_cuda.so)",
        ],
        # glog's fatal line, and an error line that says it got stuck or timed out
        [
            "[rank6]:[F429 14:03:49.385461578 ProcessGroupNCCL.cpp:1554] [PG ID 0 PG GUID "
            "0(default_pg) Rank 6] Terminating the process after attempting to dump debug info"
        ],
        [
            "[rank0]:[E1203 08:00:01.1 ProcessGroupNCCL.cpp:1743] [PG ID 0 Rank 0] "
            "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress"
        ],
        [
            "[rank2]:[E1203 08:00:01.1 ProcessGroupNCCL.cpp:616] [Rank 2] Timeout at NCCL work: "
            "12, last enqueued NCCL work: 12, last completed NCCL work: 11."
        ],
        # a collective's own error type, and the pynccl wrappers
        [
            "torch.distributed.DistBackendError: [2] is setting up NCCL communicator and "
            "retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but "
            "store->get('0') got error: Connection reset by peer"
        ],
        [
            frame("sglang/srt/distributed/device_communicators/pynccl.py", "all_reduce"),
            "    self.nccl.ncclAllReduce(",
            frame("sglang/srt/distributed/device_communicators/pynccl_wrapper.py", "NCCL_CHECK"),
            "    raise RuntimeError(f'NCCL failed: {error_str}')",
            "RuntimeError: NCCL failed: remote process exited or there was a network error",
        ],
    ],
)
def test_an_nccl_failure_is_read_from_its_frames_and_work(output: list[str]) -> None:
    assert cause(output) is ExitCause.NCCL


@pytest.mark.parametrize(
    "output",
    [
        [
            "[rank0]:[W1203 08:00:01.1 ProcessGroupNCCL.cpp:1479] Warning: WARNING: "
            "destroy_process_group() was not called before program exit"
        ],
        [
            "[rank0]:[E1203 08:00:01.1 ProcessGroupNCCL.cpp:1012] [PG 0 Rank 0] Process group "
            "watchdog thread terminated with exception: something else"
        ],
        # c10d's store: a client that cannot connect is no collective
        [
            "[W socket.cpp:697] [c10d] The client socket has failed to connect to "
            "10.0.0.2:29500 (errno: 110 - Connection timed out).",
            "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients.",
        ],
        [
            "frame #3: c10d::ProcessGroupNCCL::WorkNCCL::finishedGPUExecutionInternal() const + "
            "0x56 (0x7f in /venv/lib/libtorch_cuda.so)"
        ],
    ],
)
def test_what_only_names_nccl_decides_nothing(output: list[str]) -> None:
    assert cause(output) is ExitCause.EXIT_CODE


def test_a_cuda_fault_the_watchdog_caught_stays_a_cuda_error() -> None:
    output = [
        "  what():  [PG ID 2 Rank 1] Process group watchdog thread terminated with exception: "
        "CUDA error: an illegal memory access was encountered",
        "Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/"
        "CUDAException.cpp:43 (most recent call first):",
        "Exception raised from ncclCommWatchdog at /pytorch/torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:1905 (most recent call first):",
    ]
    assert cause(output) is ExitCause.CUDA_ERROR
    assert cause(output[1:]) is ExitCause.EXIT_CODE  # the message cut: nothing left to say


# --- GPU memory in other runtimes' words -----------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 7216.00 MiB on device 0: "
        "cudaMalloc failed: out of memory",
        "alloc_tensor_range: failed to allocate CUDA0 buffer of size 7566000128",
        "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
        "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 1073741824",
        "RuntimeError: Not enough memory to handle 4096 prefill tokens. You need to decrease "
        "`--max-batch-prefill-tokens`",
        "RuntimeError: Not enough memory to handle 16384 total tokens",
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB.",
        "torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of "
        "memory)",
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying "
        "to allocate 17179869184 bytes.",
        "tvm.error.InternalError: Check failed: (e == cudaSuccess) is false: CUDA: out of memory",
        "onnxruntime.capi.onnxruntime_pybind11_state.RuntimeException: CUDA failure 2: out of "
        "memory ; GPU=0",
    ],
)
def test_gpu_memory_in_other_runtimes_words(line: str) -> None:
    assert cause([f"{T} {line}"]) is ExitCause.GPU_OOM


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not "
        "enough memory: you tried to allocate 68719476736 bytes.",
        "RuntimeError: [enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 1179648000 bytes. Error code 12 (Cannot "
        "allocate memory)",
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 58.0 GiB for an array "
        "with shape (7, 1000, 1000, 1000) and data type float64",
        "MemoryError",
        "java.lang.OutOfMemoryError: Java heap space",
        "Error: model requires more system memory (30.0 GiB) than is available (14.2 GiB)",
    ],
)
def test_host_memory_is_not_gpu_memory(line: str) -> None:
    assert cause([line]) is ExitCause.EXIT_CODE


# --- the driver stack, however it says so ----------------------------------------------

API_MISMATCH = [
    "NVRM: API mismatch: the client has the version 535.54.03, but",
    "NVRM: this kernel module has the version 530.30.02.  Please",
    "NVRM: make sure that this kernel module and all NVIDIA driver",
    "NVRM: components have the same version.",
]


@pytest.mark.parametrize(
    "line",
    [
        "nvidia-container-cli: initialization error: nvml error: driver/library version mismatch",
        "docker: Error response from daemon: failed to create task for container: ... "
        "stderr: nvidia-container-cli: initialization error: nvml error: driver not loaded: unknown.",
        "nvidia-container-cli: requirement error: unsatisfied condition: cuda>=12.4, please "
        "update your driver to a newer version, or use an earlier cuda container: unknown",
        'docker: Error response from daemon: could not select device driver "" with '
        "capabilities: [[gpu]].",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
        "that the latest NVIDIA driver is installed and running.",
        "RuntimeError: CUDA unknown error - this may be due to an incorrectly set up "
        "environment, e.g. changing env variable CUDA_VISIBLE_DEVICES after program start. "
        "Setting the available devices to be zero.",
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda "
        "functions before calling NumCudaDevices() that might have already set an error? "
        "Error 999: unknown error",
        "cudaGetDeviceCount returned 999",
        "RuntimeError: No CUDA GPUs are available",
        "RuntimeError: CUDA error: the provided PTX was compiled with an unsupported toolchain.",
        "triton.runtime.errors.PTXASError: Triton Error [CUDA]: the provided PTX was compiled "
        "with an unsupported toolchain.",
        "pynvml.NVMLError_DriverNotLoaded: Driver Not Loaded",
    ],
)
def test_the_driver_stack_in_other_words(line: str) -> None:
    assert cause([f"{T} {line}"]) is ExitCause.GPU_DRIVER


def test_an_unknown_cuda_error_while_cuda_initialises_is_the_driver() -> None:
    output = [
        "Traceback (most recent call last):",
        frame("torch/cuda/__init__.py", "_lazy_init", 314),
        "    torch._C._cuda_init()",
        "RuntimeError: CUDA error: unknown error",
    ]
    assert cause(output) is ExitCause.GPU_DRIVER
    elsewhere = [output[0], frame("app/run.py", "step"), "    x.cuda()", output[-1]]
    assert cause(elsewhere) is ExitCause.CUDA_ERROR


def test_the_kernels_api_mismatch_is_the_driver() -> None:
    assert cause([], API_MISMATCH) is ExitCause.GPU_DRIVER
    # rsyslog's escaped newlines
    assert cause([], ["#012".join(API_MISMATCH)]) is ExitCause.GPU_DRIVER
    verdict = classify(exits(), API_MISMATCH, ["ERROR: Encountered errors"])
    assert "535.54.03" in verdict.summary and "530.30.02" in verdict.summary
    assert verdict.summary.endswith("restarting will not help")
    # a cause that needs no GPU keeps its say; a clean stop ignores it, an exit 0 that
    # nobody asked for does not
    assert cause(["OSError: [Errno 98] Address already in use"], API_MISMATCH) is (
        ExitCause.PORT_IN_USE
    )
    stopped = ExitSnapshot("u.service", "success", 1, 0, 1, "", stop_requested=True)
    assert classify(stopped, API_MISMATCH, []).cause is ExitCause.STOPPED
    unasked = ExitSnapshot("u.service", "success", 1, 0, 1, "")
    assert classify(unasked, API_MISMATCH, []).cause is ExitCause.GPU_DRIVER


@pytest.mark.parametrize(
    "line",
    [
        "nvidia-container-cli: mount error: file creation failed: /var/lib/docker/overlay2/x/"
        "merged/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1: file exists: unknown",
        "Checking for a driver/library version mismatch before start-up",
        "/venv/lib/python3.12/site-packages/torch/cuda/__init__.py:129: UserWarning: CUDA "
        "initialization: CUDA unknown error - this may be due to an incorrectly set up "
        "environment",
        "E tensorflow/compiler/xla/stream_executor/cuda/cuda_driver.cc:268] failed call to "
        "cuInit: CUDA_ERROR_NO_DEVICE_FOUND",
    ],
)
def test_what_only_names_the_driver_decides_nothing(line: str) -> None:
    assert cause([line]) is ExitCause.EXIT_CODE


# --- GPU faults without an Xid number --------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "number", "gpu"),
    [
        (
            [
                "NVRM: The NVIDIA GPU 0000:82:00.0",
                "NVRM: (PCI ID: 10de:1db4) installed in this system has",
                "NVRM: fallen off the bus and is not responding to commands.",
            ],
            79,
            "0000:82:00.0",
        ),
        (
            [
                "NVRM: _kgspRpcRecvPoll: Timeout waiting for RPC from GSP0! Expected function 76 "
                "(GSP_RM_CONTROL) (0x20802a02 0x8)."
            ],
            119,
            "?",
        ),
        (
            [
                "NVRM: GPU0000:3b:00.0: Timeout after 6s of waiting for RPC response from GPU1 "
                "GSP! Expected function 10 (FREE) (0xa55a00b0 0x0)."
            ],
            119,
            "0000:3b:00.0",
        ),
        (
            [
                "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused "
                "by previous Xid 149"
            ],
            149,
            "0000:dc:00",
        ),
    ],
)
def test_gpu_faults_the_driver_reports_without_an_xid(
    kernel: list[str], number: int, gpu: str
) -> None:
    verdict = classify(killed(), kernel, ["RuntimeError: CUDA error: unknown error"])
    assert verdict.cause is ExitCause.GPU_XID
    assert verdict.summary.startswith(f"NVIDIA Xid {number} on GPU {gpu} ")


def test_an_xid_45_that_names_no_earlier_xid_is_still_the_cleanup() -> None:
    kernel = ["NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001"]
    assert classify(killed(), kernel, []).cause is ExitCause.SIGKILL


# --- arch rejections from other compilers ----------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "ptxas fatal   : Value 'sm_120' is not defined for option 'gpu-name'",
        "RuntimeError: Internal Triton PTX codegen error: ptxas fatal   : Value 'sm_121a' is not "
        "defined for option 'gpu-name'",
        "cutlass.cute.nvgpu.common.OpError: OpError: expects arch to be one of ['sm_100a', "
        "'sm_100f'], but got sm_121a",
        "ptxas /tmp/k.ptx, line 42; error   : Instruction 'wgmma.fence' requires .target sm_90a",
        "ValueError: FP8 is only supported on GPUs with compute capability >= 8.9, got 8.6",
        "RuntimeError: FlashAttention-3 requires Hopper GPUs",
        "AssertionError: This kernel requires SM90 or newer",
    ],
)
def test_arch_rejections_from_other_compilers(line: str) -> None:
    assert cause([f"{T} {line}"]) is ExitCause.FLASHINFER_ARCH


@pytest.mark.parametrize(
    "output",
    [
        ["UserWarning: TORCH_CUDA_ARCH_LIST is not set, all archs for visible cards are "
         "included for compilation (sm_90)."],
        # torch's incompatible-device warning: its text starts on the next line
        [
            "UserWarning: ",
            "NVIDIA RTX A5000 with CUDA capability sm_86 is not compatible with the current "
            "PyTorch installation.",
            "The current PyTorch install supports CUDA capabilities sm_37 sm_50 sm_60 sm_70.",
        ],
        ["INFO: using sm_90 kernels; Hopper requires no fallback"],
        ["[1/4] /usr/local/cuda/bin/nvcc -gencode=arch=compute_90a,code=sm_90a -c x.cu"],
    ],
)  # fmt: skip
def test_what_only_names_an_arch_decides_nothing(output: list[str]) -> None:
    assert cause(output) is ExitCause.EXIT_CODE


# --- bind failures in any wording ------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "Error: listen tcp 127.0.0.1:11434: bind: Only one usage of each socket address "
        "(protocol/network address/port) is normally permitted.",
        "main: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080",
        "Error: listen tcp :8080: bind: address already in use",
        "OSError: [WinError 10048] Only one usage of each socket address",
        "ERROR:    [Errno 10048] error while attempting to bind on address ('0.0.0.0', 8000)",
        "OSError: [Errno 48] Address already in use",
        "thread 'main' panicked at src/main.rs:12:5: Os { code: 98, kind: AddrInUse, message: "
        '"Address already in use" }',
        "nginx: [emerg] bind() to 0.0.0.0:80 failed (98: Address already in use)",
        "docker: Error response from daemon: driver failed programming external connectivity: "
        "Bind for 0.0.0.0:8000 failed: port is already allocated.",
    ],
)
def test_bind_failures_in_other_wordings(line: str) -> None:
    assert cause([line]) is ExitCause.PORT_IN_USE


@pytest.mark.parametrize(
    "line",
    [
        "main: couldn't bind HTTP server socket, hostname: 0.0.0.0, port: 80: Permission denied",
        "OSError: [Errno 99] error while attempting to bind on address ('10.9.9.9', 80): cannot "
        "assign requested address",
        "[W socket.cpp:697] [c10d] The client socket has failed to connect to 10.0.0.2:29500 "
        "(errno: 110 - Connection timed out).",
        "INFO:stirling:Attempting to bind MUDServer daemon...",
        "The port 30000 is in use, but we could not find the process that uses it.",
    ],
)
def test_what_only_names_a_port_decides_nothing(line: str) -> None:
    assert cause([line]) is ExitCause.EXIT_CODE


# --- device asserts, per thread --------------------------------------------------------


def test_per_thread_device_assert_lines_are_a_cuda_error() -> None:
    lines = [
        "../aten/src/ATen/native/cuda/Indexing.cu:1236: indexSelectSmallIndex: block: [3,0,0], "
        f"thread: [{t},0,0] Assertion `srcIndex < srcSelectDimSize` failed."
        for t in range(32, 40)
    ]
    assert cause(lines) is ExitCause.CUDA_ERROR
    assert cause(lines[-1:]) is ExitCause.CUDA_ERROR
    other = "/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:92: operator(): block: [0,0,0], "
    other += 'thread: [0,0,0] Assertion `-sizes[i] <= index && "index out of bounds"` failed.'
    assert cause([other]) is ExitCause.CUDA_ERROR
    assert cause(["python: main.c:12: main: Assertion `x > 0' failed."]) is ExitCause.EXIT_CODE


# --- the Hugging Face hub and the model's loader ---------------------------------------


@pytest.mark.parametrize(
    "output",
    [
        ["requests.exceptions.HTTPError: 401 Client Error: Unauthorized for url: "
         "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json"],
        ["huggingface_hub.errors.HfHubHTTPError: 401 Client Error: Unauthorized for url: "
         "https://huggingface.co/api/models/x/y (Request ID: Root=1-abc)"],
        ["huggingface_hub.utils._errors.RepositoryNotFoundError: 401 Client Error. "
         "(Request ID: Root=1-abc)"],
        ["403 Forbidden: Please enable access to public gated repositories in your fine-grained "
         "token settings to view this repository."],
        ["OSError: There was a specific connection error when trying to load x/y:",
         "401 Client Error: Unauthorized for url: https://hf-mirror.com/x/y/resolve/main/config.json"],
        [
            "Traceback (most recent call last):",
            frame("huggingface_hub/utils/_http.py", "hf_raise_for_status", 409),
            "    response.raise_for_status()",
            "requests.exceptions.HTTPError: 401 Client Error: Unauthorized for url: "
            "https://example.org/x",
            "The above exception was the direct cause of the following exception:",
            "Traceback (most recent call last):",
            frame("transformers/utils/hub.py", "cached_file", 342),
            "OSError: couldn't load it",
        ],
        [
            frame("text_generation_server/models/__init__.py", "get_model", 240),
            '    raise NotImplementedError("sharded is not supported for this model")',
            "NotImplementedError: sharded is not supported for this model",
        ],
        ["Error: 500 Internal Server Error: llama-server process has terminated: exit status 1: "
         "error loading model: unknown model architecture: 'mllama'"],
        # llama.cpp's reason line; the wrapper line after it ("llama_load_model_from_file:
        # failed to load model") names no cause: test_classify_held_out_families.py
        ["llama_model_load: error loading model: unknown model architecture: 'mllama'",
         "llama_load_model_from_file: failed to load model"],
        ["FileNotFoundError: [Errno 2] No such file or directory: 'ckpt/epoch_9.pt'"],
    ],
)  # fmt: skip
def test_model_loading_failures(output: list[str]) -> None:
    assert cause(output) is ExitCause.MODEL_LOAD


@pytest.mark.parametrize(
    "output",
    [
        ["requests.exceptions.HTTPError: 401 Client Error: Unauthorized for url: "
         "https://api.example.com/v1/chat"],
        ["FileNotFoundError: [Errno 2] No such file or directory: 'data/train.jsonl'"],
        [frame("app/serve.py", "handle"), "NotImplementedError: streaming"],
    ],
)  # fmt: skip
def test_what_only_looks_like_a_model_load_decides_nothing(output: list[str]) -> None:
    assert cause(output) is ExitCause.EXIT_CODE


# --- the traceback's structure ---------------------------------------------------------


def test_a_chained_exception_inherits_the_cause_it_was_raised_from() -> None:
    verdict = classify(exits(), [], NINJA_CHAIN)
    assert verdict.evidence[-1] == NINJA_CHAIN[-1]  # the last exception printed
    assert any("_run_ninja_build" in line for line in verdict.evidence)  # where it came from


def test_frames_far_above_an_exception_are_not_its_frames() -> None:
    output = [
        frame("torch/utils/cpp_extension.py", "_run_ninja_build"),
        *["INFO: serving"] * 30,
        "RuntimeError: something unrelated",
    ]
    assert cause(output) is ExitCause.EXIT_CODE


def test_a_warning_body_decides_nothing_but_the_error_after_it_does() -> None:
    output = [
        "UserWarning: ",
        "NVIDIA RTX A5000 with CUDA capability sm_86 is not compatible with the current "
        "PyTorch installation.",
        "RuntimeError: CUDA error: no kernel image is available for execution on the device",
    ]
    assert cause(output) is ExitCause.FLASHINFER_ARCH
