"""The error texts that name a cause on their own: the line-rule table.

Real texts; tests/unit/samples/README.md and tests/unit/samples/corpus/README.md say
where each was seen. A rule names a cause and a kind (the kind picks the advice,
rules.py). A line is tried against the rules in table order and the first match
names it, so where one line names two causes the earlier wins: NCCL's ``Cuda failure
'out of memory'`` is ``gpu-oom``, torch's ``CUDA error: system not yet initialized``
is ``gpu-driver``. Every rule is anchored on an error's shape, never a bare word.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .model import ExitCause


@dataclass(frozen=True)
class Rule:
    cause: ExitCause
    kind: str
    needle: str  # a plain substring every match contains: a cheap first test
    pattern: re.Pattern[str]
    unless: re.Pattern[str] | None = None  # a line that also matches this is not one


def _rules(cause: ExitCause, kind: str, *rules: tuple[str, str]) -> tuple[Rule, ...]:
    return tuple(Rule(cause, kind, needle, re.compile(pattern)) for needle, pattern in rules)


# An architecture named with a rejection next to it, on an error line: ptxas's "Value
# 'sm_120' is not defined for option 'gpu-name'", CuTe DSL's "expects arch to be one of
# ['sm_100a', 'sm_100f'], but got sm_121a", "FP8 requires compute capability >= 8.9".
_ARCH_REJECT = (
    r"(?:not (?:defined|supported|compatible)|[Uu]nsupported|\bexpects?\b|\brequires?\b"
    r"|\bonly support(?:s|ed)?\b|\bnot a recognized\b|\btoo old\b|\bbut got\b)"
)
ERROR_SHAPE = re.compile(
    r"(?:\bfatal\b|\berror\b|\bERROR\b|\bError\b|Assertion|[A-Z]\w*(?:Error|Exception): )"
)

ARCH_NEEDLES = frozenset({"sm_", "compute_", "apability", "SM", "Ampere", "Hopper", "Blackwell"})


def _arch_rule(needle: str, token: str) -> Rule:
    pattern = f"{token}.{{0,80}}{_ARCH_REJECT}|{_ARCH_REJECT}.{{0,80}}{token}"
    return Rule(ExitCause.FLASHINFER_ARCH, "arch", needle, re.compile(pattern))


# Checked in this order on each line; the first rule that matches names the line.
LINE_RULES: tuple[Rule, ...] = (
    *_rules(
        ExitCause.GPU_OOM,
        "cuda-oom",
        # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError / RuntimeError (old torch);
        # SGLang's "Capture cuda graph failed: CUDA out of memory. Tried to allocate ...";
        # ROCm's "HIP out of memory".
        ("out of memory", r"(?:CUDA|HIP) out of memory\. Tried to allocate"),
        ("out of memory", r"(?:Error|Exception|failed): CUDA out of memory\b"),
        ("OutOfMemoryError", r"OutOfMemoryError: (?:CUDA|HIP)"),
        # torch.AcceleratorError / RuntimeError, c10::Error; FlashInfer's "CUDA Error:"
        ("out of memory", r"CUDA [Ee]rror: out of memory"),
        ("MemoryAllocation", r"cudaErrorMemoryAllocation"),
        ("OUT_OF_MEMORY", r"CUDA_ERROR_OUT_OF_MEMORY"),
        ("_STATUS_ALLOC_FAILED", r"(?:CUBLAS|CUDNN)_STATUS_ALLOC_FAILED"),
        ("out of memory", r"Cuda failure (?:\d+ )?'out of memory'"),  # NCCL
        # The CUDA-check macros of C++ inference engines, cudart's text for error 2:
        # FasterTransformer "[FT][ERROR] CUDA runtime error: out of memory <file>:<line>",
        # LMDeploy TurboMind "[TM][ERROR] CUDA runtime error: out of memory <file>:<line>",
        # TensorRT-LLM "[TensorRT-LLM][ERROR] CUDA runtime error in cudaMalloc(...): out of
        # memory", old torch "cuda runtime error (2) : out of memory at .../THC/..." and
        # "THCudaCheck FAIL file=... line=58 error=2 : out of memory".
        (
            "out of memory",
            r"\b(?:CUDA|cuda) runtime error(?: \(2\))?(?: in .*?)? ?: out of memory\b",
        ),
        ("out of memory", r"\bTHCudaCheck FAIL .*\berror=2 : out of memory\b"),
        ("out of memory", r"Triton Error \[CUDA\]: out of memory"),
        # The GPU allocator in other runtimes' words: ggml/llama.cpp/Ollama
        # "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 7216.00 MiB on device 0:
        # cudaMalloc failed: out of memory", "unable to allocate CUDA0 buffer"; XLA; TF.
        ("out of memory", r"\bcudaMalloc\w*(?: retry)? failed: out of memory"),
        ("to allocate CUDA", r"\b(?:failed|unable) to allocate CUDA\d* buffer"),
        ("Out of memory while trying", r"RESOURCE_EXHAUSTED: Out of memory while trying to"),
        ("OOM when allocating", r"OOM when allocating tensor .*device:GPU:\d"),
        ("GPU memory", r"Requested amount of GPU memory \(\d+ bytes\) could not be allocated"),
        ("CUDA: out of memory", r"\bCUDA: out of memory\b"),  # TVM / MLC's CUDA_CALL
        ("CUDA failure", r"\bCUDA failure \d+: out of memory\b"),  # onnxruntime
    ),
    *_rules(
        ExitCause.GPU_OOM,
        "kv-pool",
        # SGLang 0.3-0.5.x KV pool; 0.5.17+ KV budget; 0.4.x profiled a negative pool
        # (init_memory_pool then raises "Not enough memory").
        ("Not enough memory", r"Not enough memory\. Please try to increase --mem-fraction-static"),
        ("leave no GPU memory", r"Loaded weights leave no GPU memory for the KV cache"),
        (
            "profiled value",
            r"is larger than the profiled value (?:-\d+|0)\. Use the profiled value instead",
        ),
        # vLLM
        ("No available memory", r"No available memory for the cache blocks"),
        (
            "stored in KV cache",
            r"larger than the maximum number of tokens that can be stored in KV cache",
        ),
        (
            "available KV cache memory",
            r"KV cache is needed, which is larger than the available KV cache memory",
        ),
    ),
    *_rules(
        ExitCause.GPU_OOM,
        "batch-tokens",
        # TGI's warm-up at --max-batch-prefill-tokens / --max-batch-total-tokens
        ("Not enough memory to handle", r"Not enough memory to handle \d+ (?:\w+ )?tokens"),
    ),
    *_rules(
        ExitCause.GPU_OOM,
        "free-memory",
        (
            "Free memory on device",
            r"Free memory on device .* on startup is less than desired GPU memory",
        ),
        ("memory capacity is unbalanced", r"Error: The memory capacity is unbalanced"),  # SGLang
    ),
    *_rules(
        ExitCause.FLASHINFER_ARCH,
        "arch",
        ("FlashInfer requires", r"FlashInfer requires sm75\+"),  # 0.2.x
        ("FlashInfer requires", r"FlashInfer requires GPUs with sm75"),  # 0.5.x, 0.7.x
        ("requires CUDA >=", r"SM 12[.\dx+]* requires CUDA >="),  # FlashInfer arch normalisation
        ("No supported CUDA architectures", r"No supported CUDA architectures found for major"),
        ("Unknown CUDA arch", r"Unknown CUDA arch \([^)]*\) or GPU not supported"),  # torch
        ("no kernel image", r"no kernel image is available for execution on the device"),
        ("no kernel image", r"CUDA error: no kernel image"),
        ("cudaErrorNoKernelImage", r"cudaErrorNoKernelImageForDevice"),
        ("CUDA_ERROR_NO_BINARY", r"CUDA_ERROR_NO_BINARY_FOR_GPU"),
        ("Unsupported gpu architecture", r"Unsupported gpu architecture 'compute_\d+\w*'"),  # nvcc
        (
            "gpu-name",
            r"Value '(?:sm|compute)_\d+\w*' is not defined for option 'gpu-name'",
        ),  # ptxas
        ("Unsupported compute capability", r"Unsupported compute capability: \d+\.\d+"),  # pdmux
        ("SGLang only supports sm75", r"SGLang only supports sm75 and above"),
        ("only supports Ampere", r"FlashAttention only supports Ampere GPUs or newer"),
        # DeepGEMM "Assertion error (.../attention.hpp:219): Unsupported architecture",
        # FlashInfer/TRT-LLM runners ".../fmhaRunner.cuh:30: Unsupported architecture";
        # NOT "Unsupported architectures: ChatGLMForConditionalGeneration" (a model class).
        (
            "Unsupported architecture",
            r"\.(?:hpp|cuh?|h|cpp|cc):\d+\)?:? ?Unsupported architecture\b(?!s)",
        ),
        ("requires SM", r"(?:Error|Exception): .*\brequires SM ?\d{2,3}\b"),  # "requires SM90+."
        (
            "compute capability of at least",
            r"only supported on GPUs with compute capability of at least",
        ),
        ("Minimum capability", r"is not supported for the current GPU\. Minimum capability: \d+"),
    ),
    _arch_rule("sm_", r"\bsm_\d{2,3}[a-z]?\b"),
    _arch_rule("compute_", r"\bcompute_\d{2,3}[a-z]?\b"),
    _arch_rule("apability", r"\b(?:[Cc]ompute|CUDA|GPU) [Cc]apability\b"),
    _arch_rule("SM", r"\bSM ?\d{2,3}[a-z]?\b"),
    _arch_rule("Ampere", r"\bAmpere\b"),
    _arch_rule("Hopper", r"\bHopper\b"),
    _arch_rule("Blackwell", r"\bBlackwell\b"),
    *_rules(
        ExitCause.FLASHINFER_JIT,
        "jit",
        # FlashInfer 0.6 runs ninja on every module load, warm cache or not: a unit
        # without ninja on its PATH dies in the first forward (seen on the H200).
        (
            "Errno 2] No such file or directory: 'ninja'",
            r"\[Errno 2\] No such file or directory: 'ninja'",
        ),
        ("Error: Ninja build failed", r"RuntimeError: Ninja build failed"),  # flashinfer cpp_ext
        (
            "Errno 2] No such file or directory: '",
            r"\[Errno 2\] No such file or directory: '[^']*nvcc'",
        ),
        ("fatal error: ", r"fatal error: [\w./+-]+\.(?:h|hpp|cuh): No such file or directory"),
        # torch.utils.cpp_extension's JIT build (FlashInfer 0.2-0.4, every load() user)
        ("Error building extension", r"Error building extension '"),
        ("Error compiling objects", r"Error compiling objects for extension"),
        # A build tool run as a subprocess: ninja, nvcc, the C compiler (Triton's launcher)
        (
            "CalledProcessError: Command '",
            r"CalledProcessError: Command '\[?'?(?:[^' ]*/)?(?:ninja|nvcc|cmake|make|gcc|g\+\+"
            r"|c\+\+|cc|clang|clang\+\+|ptxas)(?:-[\d.]+)?['\s,]",
        ),
        ("Failed to find C compiler", r"Failed to find C compiler"),  # Triton
        # The build tool or the CUDA toolkit missing from the unit's environment, as the
        # JIT loaders say it: torch.utils.cpp_extension.verify_ninja_availability ("Ninja
        # is required to load C++ extensions", "... (pip install ninja to get it)" since
        # torch 1.x), its _join_cuda_home, DeepSpeed's op_builder, FlashInfer's
        # jit/cpp_ext.py get_cuda_path. An exception line only: a library that falls back
        # logs the exception's repr ("RuntimeError('Ninja is required ...')") and lives on.
        ("Error: Ninja is required", r"Error: Ninja is required to load C\+\+ extensions"),
        (
            "CUDA_HOME environment variable is not set",
            r"(?:Error|Exception): CUDA_HOME environment variable is not set",
        ),
        (
            "Error: Unable to JIT load the ",
            r"Error: Unable to JIT load the \w+ op due to ninja not being installed",
        ),
        ("Error: Could not find nvcc", r"Error: Could not find nvcc and default cuda_home="),
    ),
    *_rules(
        ExitCause.PORT_IN_USE,
        "port",
        ("Errno 98", r"\[Errno 98\]"),  # OSError EADDRINUSE; uvicorn's bind error
        ("Errno 10048", r"\[Errno 10048\]"),  # Windows WSAEADDRINUSE
        ("WinError 10048", r"\[WinError 10048\]"),
        ("Errno 48", r"\[Errno 48\] Address already in use"),  # macOS
        ("errno: 98", r"errno: 98\b"),  # torch TCPStore
        ("EADDRINUSE", r"EADDRINUSE\b"),
        ("AddrInUse", r"\bkind: AddrInUse\b"),  # Rust's io::ErrorKind
        # zmq's "ZMQError: Address already in use", Go's "listen tcp :8080: bind: address
        # already in use", nginx's "bind() to 0.0.0.0:80 failed (98: Address already in use)"
        (
            "ddress already in use",
            r"(?:[Ee]rror|\bbind|\blisten|\bfailed)\b.{0,160}\b[Aa]ddress already in use",
        ),
        ("ddress already in use", r"[Aa]ddress already in use \((?:os error|errno) \d+\)"),
        ("usage of each socket", r"Only one usage of each socket address"),  # Windows
        ("port is already allocated", r"port is already allocated"),  # docker
        ("is not available in", r"port at \d+ is not available in \d+ seconds"),  # SGLang
    ),
    Rule(
        ExitCause.PORT_IN_USE,
        "port",
        "bind",
        # llama.cpp's "couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"
        re.compile(
            r"\b(?:[Cc]ouldn't|[Cc]ould not|[Cc]an't|[Cc]annot|[Uu]nable to|[Ff]ailed to) bind\b"
            r".{0,80}?\b(?:socket|port|address|addr|tcp|TCP|HTTP|http|server)\b"
        ),
        re.compile(r"(?i)permission denied|EACCES|Errno 13\b|cannot assign requested|Errno 99\b"),
    ),
    *_rules(
        ExitCause.MODEL_LOAD,
        "model",
        (
            "does not appear to have a file named",
            r"(?:OSError|EnvironmentError): .*\bdoes not appear to have a file named\b",
        ),
        (
            "is not a valid model",
            r"(?:OSError|EnvironmentError): .*\bis not a local folder and is not a valid model",
        ),
        ("gated repo", r"You are trying to access a gated repo\b"),
        ("gated repo", r"Cannot access gated repo for url\b"),
        ("gated repo", r"enable access to public gated repositories"),
        ("GatedRepoError", r"GatedRepoError\b"),
        ("NotFoundError", r"(?:Repository|Revision|Entry)NotFoundError\b"),
        ("HFValidationError", r"HFValidationError\b"),
        ("Repository Not Found", r"Repository Not Found for url\b"),
        # The Hub refusing the token (or a private/missing repo): 401/403, any wording
        (
            "Client Error",
            r"\b40[13] Client Error\b.{0,80}https?://(?:[\w-]+\.)*(?:huggingface\.co|hf\.co"
            r"|hf-mirror\.com)/",
        ),
        ("HfHubHTTPError", r"HfHubHTTPError: .*\b40[13]\b"),
        ("Invalid credentials", r"Invalid credentials in Authorization header"),
        ("Access to model", r"Access to model \S+ is restricted"),
        ("huggingface", r"couldn't connect to 'https://huggingface\.co' to load"),
        (
            "Can't load",
            r"(?:OSError|ValueError|EnvironmentError): Can't load (?:tokenizer|the configuration|config|the model|weights)\b",
        ),
        ("path_or_model_id", r"Incorrect path_or_model_id\b"),
        ("Unrecognized model in", r"Unrecognized model in\b"),
        ("has model type", r"The checkpoint you are trying to load has model type\b"),
        ("SafetensorError", r"SafetensorError\b"),  # safetensors_rust.SafetensorError
        ("in loading state_dict", r"Error\(s\) in loading state_dict for\b"),
        ("are not supported for now", r"Model architectures \[[^\]]*\] are not supported for now"),
        (
            "Unsupported architectures",
            r"Unsupported architectures: [A-Z]\w*(?:For|Model)",
        ),  # old SGLang
        ("has no vLLM implementation", r"has no vLLM implementation\b"),
        ("Cannot find any model weights", r"Cannot find any model weights with\b"),  # SGLang, vLLM
        ("No model weights found", r"No model weights found in\b"),
        ("No supported config format", r"No supported config format found in\b"),  # vLLM
        ("No tokenizer file found", r"No tokenizer file found in directory\b"),  # vLLM
        # A weights file that is not there
        (
            "rrno 2] No such file or directory: '",
            r"(?:FileNotFoundError|OSError|IOError): \[Errno 2\] No such file or directory: "
            r"'[^']+\.(?:safetensors|gguf|ggml|pt|pth|bin|ckpt)'",
        ),
        # llama.cpp / Ollama: "llama_model_load: error loading model: unknown model
        # architecture: 'mllama'" (the reason after the colon; an allocation that failed is
        # memory, not the model: "unable to allocate CUDA0 buffer" is gpu-oom above, the
        # host's "unable to allocate CPU buffer" names no cause). Its next line,
        # "llama_load_model_from_file: failed to load model", and Ollama's "panic: unable
        # to load model: <blob>" only say that loading failed, whatever the reason: the
        # line before them says why, so they are no rule.
        ("unknown model architecture", r"unknown model architecture: '"),
        (
            "odel",
            r"^(?:.*\s)?Error: (?:pull model manifest: file does not exist|model ['\"]?\S+? not found)",
        ),
    ),
    Rule(
        ExitCause.MODEL_LOAD,
        "model",
        "error loading model",
        re.compile(r"\berror loading model\b"),
        re.compile(r"(?i)alloc|out of memory|\bmmap failed"),
    ),
    *_rules(
        ExitCause.GPU_DRIVER,
        "driver",
        # cudaErrorInsufficientDriver (35): cudart's own text, in torch's "CUDA error: ...",
        # THCudaCheck's "error=35 : ...", onnxruntime's "CUDA failure 35: ...".
        (
            "CUDA driver version is insufficient",
            r"CUDA driver version is insufficient for CUDA runtime version",
        ),
        ("cudaErrorInsufficientDriver", r"cudaErrorInsufficientDriver\b"),
        # 802 (an NVSwitch host whose nvidia-fabricmanager is not running, or not of the
        # driver's version): torch's "Error 802: ...", "CUDA error: ..." and "CUDA driver
        # error: ...", old torch's "(802) : ...", NCCL's "Cuda failure 802 '...'"; 804; 803.
        (
            "system not yet initialized",
            r"(?:\b802\b\W{1,4}|[Ee]rror: |')system not yet initialized\b",
        ),
        ("non supported HW", r"forward compatibility was attempted on non supported HW"),
        (
            "unsupported display driver",
            r"system has unsupported display driver / cuda driver combination",
        ),
        # A PTX newer than the driver: the driver is older than the toolkit that built it.
        ("unsupported toolchain", r"the provided PTX was compiled with an unsupported toolchain"),
        (
            "cudaError",
            r"cudaError(?:SystemNotReady|SystemDriverMismatch|CompatNotSupportedOnDevice"
            r"|NoDevice|UnsupportedPtxVersion)\b",
        ),
        (
            "CUDA_ERROR_",
            r"CUDA_ERROR_(?:SYSTEM_NOT_READY|SYSTEM_DRIVER_MISMATCH"
            r"|COMPAT_NOT_SUPPORTED_ON_DEVICE|NO_DEVICE|UNSUPPORTED_PTX_VERSION)\b",
        ),
        # torch's _cuda_init (RuntimeError, or AssertionError in old torch), and torch's
        # cudaGetDeviceCount failure, whatever its code (999: "unknown error").
        ("Found no NVIDIA driver", r"Found no NVIDIA driver on your system"),
        ("NVIDIA driver on your system is too old", r"The NVIDIA driver on your system is too old"),
        ("no CUDA-capable device", r"no CUDA-capable device is detected"),  # cudaErrorNoDevice
        ("No CUDA GPUs are available", r"(?:Error|^): No CUDA GPUs are available"),  # torch
        ("cudaGetDeviceCount", r"Unexpected error from cudaGetDeviceCount\(\)"),
        ("cudaGetDeviceCount", r"\bcudaGetDeviceCount returned \d+"),  # deviceQuery
        ("cuInit", r"[Ee]rror\b.*\bcuInit\b.*\b(?:CUDA_ERROR_UNKNOWN|unknown error)"),
        ("CUDA unknown error", r"CUDA unknown error - this may be due to an incorrectly set up"),
        ("CUDA driver initialization failed", r"CUDA driver initialization failed"),
        # NVML after a driver upgrade without a reboot: nvidia-smi's "Failed to initialize
        # NVML: Driver/library version mismatch", pynvml's NVMLError_LibRmVersionMismatch,
        # the container toolkit's "nvml error: driver/library version mismatch".
        (
            "river/library version mismatch",
            r"(?:NVML|nvml|[Ee]rror)\w*: [Dd]river/library version mismatch",
        ),
        ("NVMLError_LibRmVersionMismatch", r"NVMLError_LibRmVersionMismatch\b"),
        ("LIB_RM_VERSION_MISMATCH", r"NVML_ERROR_LIB_RM_VERSION_MISMATCH\b"),
        ("NVML/RM version mismatch", r"RM has detected an NVML/RM version mismatch"),
        (
            "NVIDIA driver",
            r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver",
        ),
        ("Driver Not Loaded", r"NVML: Driver Not Loaded"),
        ("NVMLError_", r"NVMLError_(?:DriverNotLoaded|LibraryNotFound)\b"),
        ("NVML Shared Library Not Found", r"NVML Shared Library Not Found"),
        ("DRIVER_NOT_LOADED", r"NVML_ERROR_DRIVER_NOT_LOADED\b"),
        # The container toolkit cannot reach the driver, or the driver is too old for the
        # image ("requirement error: unsatisfied condition: cuda>=12.4"); a "mount error"
        # (a file the image itself ships) is not the driver's.
        ("initialization error", r"nvidia-container-cli: initialization error\b"),
        ("requirement error", r"nvidia-container-cli: requirement error\b"),
        # docker without the NVIDIA runtime: no GPU stack to hand the container
        (
            "rror response from daemon: could not select device driver",
            r"[Ee]rror response from daemon: could not select device driver .* capabilities: "
            r"\[\[gpu\]\]",
        ),
    ),
    *_rules(
        ExitCause.CUDA_ERROR,
        "cuda",
        # RuntimeError / torch.AcceleratorError / c10::Error what() / "thread terminated
        # with exception: CUDA error: ..." / vLLM's "Worker failed with error 'CUDA error:"
        # ("driver shutting down" is interpreter teardown, not a fault); ggml's own line.
        (
            "CUDA error: ",
            r"(?:Error|Exception|exception|what\(\)): +CUDA error: (?!driver shutting down)",
        ),
        ("CUDA error: ", r"\berror ['\"]CUDA error: (?!driver shutting down)"),
        ("CUDA error: ", r"(?:^|[\]|>]\s*)CUDA error: (?!driver shutting down)\w"),
        ("CUDA Error: ", r"CUDA Error: \w"),  # FlashInfer's own check
        # TensorRT-LLM's "CUDA runtime error in <call>: <text>", FasterTransformer's and
        # TurboMind's "[FT][ERROR] CUDA runtime error: <text> <file>:<line>"
        ("CUDA runtime error", r"CUDA runtime error(?: in .*?)?: \w"),
        ("Triton Error [CUDA]: ", r"Triton Error \[CUDA\]: \w"),
        ("an illegal memory access", r"an illegal memory access was encountered"),
        ("an illegal instruction", r"an illegal instruction was encountered"),
        ("device-side assert triggered", r"device-side assert triggered"),
        # The per-thread lines a device assert prints before its summary line:
        # "Indexing.cu:1236: indexSelectSmallIndex: block: [3,0,0], thread: [39,0,0]
        # Assertion `srcIndex < srcSelectDimSize` failed."
        ("Assertion `", r"\bblock: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion `.*` failed"),
        ("unspecified launch failure", r"unspecified launch failure"),
        ("CUBLAS_STATUS_", r"CUBLAS_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR)\b"),
        ("CUDNN_STATUS_", r"CUDNN_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR|MAPPING_ERROR)\b"),
        (
            "cudaError",
            r"cudaError(?:IllegalAddress|LaunchFailure|Assert|MisalignedAddress"
            r"|IllegalInstruction|HardwareStackError|ECCUncorrectable)\b",
        ),
        (
            "CUDA_ERROR_",
            r"CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|ASSERT|MISALIGNED_ADDRESS"
            r"|ILLEGAL_INSTRUCTION|HARDWARE_STACK_ERROR|ECC_UNCORRECTABLE|UNKNOWN)\b",
        ),
    ),
    *_rules(
        ExitCause.NCCL,
        "nccl",
        # "RuntimeError: NCCL error: ...", "init_device: NCCL error: ...", torch's
        # "DistBackendError: NCCL error in: .../ProcessGroupNCCL.cpp:1970, ..."
        ("NCCL error", r"(?:[:('\"] *|^\s*)NCCL error\b"),
        ("NCCL Error", r"(?:[:('\"] *|^\s*)NCCL Error\b"),  # old torch "NCCL Error 1: ..."
        (
            "nccl",
            r"nccl(?:InternalError|SystemError|RemoteError|UnhandledCudaError|InvalidUsage"
            r"|InvalidArgument)\b",
        ),
        # The watchdog's timeout, also when a hard-wrapped paste split the sentence; the
        # work it names is a collective: "WorkNCCL(SeqNum=4, OpType=BROADCAST, ...)".
        ("Watchdog caught", r"Watchdog caught collective"),
        ("NCCL(SeqNum=", r"WorkNCCL\(SeqNum=\d+, OpType=\w+"),
        ("NCCL communicator", r"NCCL communicator was aborted"),
        # A CUDA call in NCCL's transport setup (NVLS, P2P, SHM, NET) that failed and was
        # returned (CUCHECK, CUDACHECK): "transport/nvls.cc:254 NCCL WARN Cuda failure 401
        # 'the operation cannot be performed in the present state'". The texts that name
        # another cause are matched above, first: 'out of memory' (gpu-oom), 802
        # (gpu-driver), an illegal address or a launch failure (cuda-error). Not the launch
        # path's failures (enqueue.cc: "Cuda failure 'invalid resource handle'" after an
        # OOM), which echo what broke the CUDA context, nor CUDACHECKIGNORE's survived
        # ones, printed as INFO.
        (
            "NCCL WARN Cuda failure",
            r"\btransport/[\w/]+\.cc:\d+ NCCL WARN Cuda failure (?:\d+ )?'",
        ),
        # Newer NCCL (seen in 2.29, transport/nvls.cc): NVLink SHARP (NVLS) multicast
        # refused, usually the Fabric Manager or the NVSwitches (its 'out of memory' is
        # the switches' multicast slots, NVIDIA/nccl#2077).
        ("Failed to bind NVLink SHARP", r"Failed to bind NVLink SHARP \(NVLS\) Multicast memory"),
    ),
)
