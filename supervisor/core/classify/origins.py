"""Rules keyed to where an error came from, read from its traceback or C++ frames.

An exception line that no line rule names (``subprocess.CalledProcessError``, a bare
``KeyError``, ``NotImplementedError: sharded is not supported``) is named by its
type and the code that raised it:

* a build helper (torch.utils.cpp_extension's ``_run_ninja_build`` and its checks for
  ninja and the CUDA toolkit, FlashInfer's
  ``jit/cpp_ext.py``, Triton's ``runtime/build.py``) → ``flashinfer-jit``;
* the GPU allocator (``torch.OutOfMemoryError``) → ``gpu-oom``;
* the CUDA runtime (``torch.AcceleratorError``) → ``cuda-error``, but an unknown or
  initialization error raised while CUDA initialises (torch's ``_lazy_init``) →
  ``gpu-driver``;
* a collective (``DistBackendError``, SGLang's and vLLM's pynccl) → ``nccl``;
* the Hugging Face hub (``huggingface_hub``'s errors, a 401/403 raised through
  ``hf_raise_for_status``) and a model's loader (``load_weights``, ``weight_loader``,
  TGI's and vLLM's ``get_model``) → ``model-load``;
* torch's ``_get_cuda_arch_flags`` failing on an empty arch list → ``flashinfer-arch``.

A chained exception inherits the cause of the one it was raised from or during when
it names none itself (``RuntimeError: Error building extension`` from a ninja
``CalledProcessError``, transformers' ``OSError`` from a 401). A traceback cut before
its exception line is named by its innermost frame. From C++: c10's ``Exception raised
from checkTimeout at ProcessGroupNCCL.cpp`` (and a ``WorkNCCL::checkTimeout`` frame) is a
collective's timeout, ``from malloc at CUDACachingAllocator.cpp`` the GPU allocator;
glog's fatal (``F``) lines of ProcessGroupNCCL, and its error (``E``) lines that say it
timed out or got stuck, are ``nccl``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .frames import CppRaise, PyError, PyFrame
from .model import ExitCause

Named = tuple[ExitCause, str]  # (cause, kind)
Origin = tuple[ExitCause, str, tuple[PyFrame, ...]]  # ... and the frames that show it

# torch's cpp_extension also refuses to build when ninja or the CUDA toolkit is missing
# (verify_ninja_availability, _join_cuda_home): the build tool's failure all the same.
_TORCH_BUILD_FUNCS = (
    "_run_ninja_build", "_write_ninja_file_and_compile_objects", "verify_ninja_availability",
    "_join_cuda_home",
)  # fmt: skip
_BUILD_FRAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch/utils/cpp_extension.py", _TORCH_BUILD_FUNCS),
    ("flashinfer/jit/cpp_ext.py", ("run_ninja",)),
    ("triton/runtime/build.py", ("_build", "compile_module_from_src")),
)
_BUILD_TYPES = frozenset({"CalledProcessError", "RuntimeError", "FileNotFoundError", "OSError"})
_HUB_TYPES = frozenset(
    {"GatedRepoError", "RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError",
     "LocalEntryNotFoundError", "HFValidationError", "OfflineModeIsEnabled"}
)  # fmt: skip
_HTTP_AUTH_RE = re.compile(r"\b40[13] Client Error\b|\b40[13] (?:Unauthorized|Forbidden)\b")
# Functions that load a model: an error they raise is the checkpoint's or the config's.
_LOADER_FUNCS = frozenset(
    {"load_weights", "weight_loader", "load_state_dict", "get_model", "get_model_architecture",
     "resolve_model_cls", "load_model_weights", "_load_weights", "_get_model_architecture",
     "get_architecture_class_name"}
)  # fmt: skip
# Not TypeError or AttributeError: in a loader those are most often the code's own bug.
_LOADER_TYPES = frozenset(
    {"KeyError", "ValueError", "NotImplementedError", "AssertionError", "OSError",
     "FileNotFoundError"}
)  # fmt: skip
_TORCH_CUDA_INIT = frozenset({"_lazy_init", "_cuda_init", "init", "device_count", "is_available"})
_INIT_FAILURE_RE = re.compile(r"\b(?:unknown error|initialization error)\b")
# A JIT package's own code (flashinfer/jit, deep_gemm/jit, ...) failing to build:
# not its cold-cache refusal (FLASHINFER_DISABLE_JIT), which builds nothing.
_BUILD_WORDS_RE = re.compile(
    r"(?i)\bcompil(?:e|ation) (?:failed|error)|\bbuild failed|\bninja\b|\bnvcc\b|\bnvrtc\b"
)
_NOT_BUILD_TYPES = frozenset({"MissingJITCacheError"})
_NCCL_FRAME_PATHS = ("pynccl.py", "pynccl_wrapper.py", "pynccl_allocator.py")


def _raised_in(error: PyError, suffix: str, *funcs: str) -> PyFrame | None:
    return next((f for f in error.frames if f.is_(suffix, *funcs)), None)


def error_cause(error: PyError) -> Origin | None:
    """The cause an exception's type and frames name, for one no line rule named, with
    the frames that show where it came from."""
    name = error.name
    for suffix, funcs in _BUILD_FRAMES:
        frame = _raised_in(error, suffix, *funcs) if name in _BUILD_TYPES else None
        if frame is not None:
            return ExitCause.FLASHINFER_JIT, "jit", (frame,)
    if name == "OutOfMemoryError" and error.type.startswith("torch."):
        return ExitCause.GPU_OOM, "cuda-oom", ()
    arch = _raised_in(error, "cpp_extension.py", "_get_cuda_arch_flags")
    if name == "IndexError" and arch is not None:
        caller = [f for f in error.frames if "flashinfer" in f.path][-1:]
        return ExitCause.FLASHINFER_ARCH, "arch", (*caller, arch)
    init = [f for f in error.frames[-3:] if f.is_("torch/cuda/__init__.py", *_TORCH_CUDA_INIT)]
    if init and _INIT_FAILURE_RE.search(error.message):
        return ExitCause.GPU_DRIVER, "driver", (init[-1],)
    jit = [f for f in error.frames[-3:] if "/jit/" in f.path]
    if jit and name not in _NOT_BUILD_TYPES and _BUILD_WORDS_RE.search(error.message):
        return ExitCause.FLASHINFER_JIT, "jit", (jit[-1],)
    if name == "AcceleratorError" and error.type.startswith("torch."):
        return ExitCause.CUDA_ERROR, "cuda", ()
    nccl = [f for f in error.frames[-2:] if f.path.endswith(_NCCL_FRAME_PATHS)]
    if name == "DistBackendError" or nccl:
        return ExitCause.NCCL, "nccl", tuple(nccl[-1:])
    hub = _raised_in(error, "huggingface_hub/utils/_http.py")
    if name in _HUB_TYPES or (
        _HTTP_AUTH_RE.search(error.message) and (name == "HfHubHTTPError" or hub is not None)
    ):
        return ExitCause.MODEL_LOAD, "model", (() if hub is None else (hub,))
    loader = [f for f in error.frames[-2:] if f.func in _LOADER_FUNCS]
    if name in _LOADER_TYPES and loader:
        return ExitCause.MODEL_LOAD, "model", (loader[-1],)
    return None


def refine(named: Named, error: PyError) -> Named:
    """A line rule's cause, corrected by where the error was raised: an unknown or
    initialization CUDA error while torch initialises CUDA is the driver stack's."""
    if (
        named[0] is ExitCause.CUDA_ERROR
        and _INIT_FAILURE_RE.search(error.message)
        and any(f.is_("torch/cuda/__init__.py", *_TORCH_CUDA_INIT) for f in error.frames[-3:])
    ):
        return ExitCause.GPU_DRIVER, "driver"
    return named


# Innermost frames that decide a traceback whose exception line was cut off:
# (path suffix, functions, cause, kind).
_CUT_FRAMES: tuple[tuple[str, tuple[str, ...], ExitCause, str], ...] = (
    ("flashinfer/jit/core.py", ("check_cuda_arch",), ExitCause.FLASHINFER_ARCH, "arch"),
    ("torch/utils/cpp_extension.py", ("_get_cuda_arch_flags",), ExitCause.FLASHINFER_ARCH, "arch"),
    (
        "vllm/v1/core/kv_cache_utils.py",
        ("check_enough_kv_cache_memory",),
        ExitCause.GPU_OOM,
        "kv-pool",
    ),
    (
        "torch/utils/cpp_extension.py",
        ("_run_ninja_build", "verify_ninja_availability", "_join_cuda_home"),
        ExitCause.FLASHINFER_JIT,
        "jit",
    ),
    ("flashinfer/jit/cpp_ext.py", ("run_ninja",), ExitCause.FLASHINFER_JIT, "jit"),
)


def cut_cause(frames: Sequence[PyFrame]) -> Named | None:
    """The cause the innermost frame of a cut traceback names."""
    innermost = frames[-1]
    for suffix, funcs, cause, kind in _CUT_FRAMES:
        if innermost.is_(suffix, *funcs):
            return cause, kind
    return None


def cpp_cause(raised: CppRaise) -> Named | None:
    """The cause c10's ``Exception raised from FUNC at FILE`` (and its frames) name."""
    file = raised.file.rsplit("/", 1)[-1]
    if file == "ProcessGroupNCCL.cpp" and raised.func == "checkTimeout":
        return ExitCause.NCCL, "nccl"
    if any("WorkNCCL::checkTimeout" in f.func for f in raised.frames[:4]):
        return ExitCause.NCCL, "nccl"
    if file == "CUDACachingAllocator.cpp" and raised.func == "malloc":
        return ExitCause.GPU_OOM, "cuda-oom"
    return None


_NCCL_SOURCES = frozenset({"ProcessGroupNCCL.cpp", "ProcessGroupNCCL.hpp", "NCCLUtils.cpp"})
_NCCL_STUCK_RE = re.compile(
    r"\bstuck\b|\btimed out\b|before timing out|\bWatchdog caught\b|\bwatchdog hang\b"
    r"|\bTimeout at NCCL work\b|\bcollective timeout\b|\bno heartbeat\b"
)


def glog_cause(severity: str, file: str, line: str) -> Named | None:
    """A glog line of ProcessGroupNCCL: fatal, or an error that says it timed out."""
    if file.rsplit("/", 1)[-1] not in _NCCL_SOURCES:
        return None
    if severity == "F" or (severity == "E" and _NCCL_STUCK_RE.search(line)):
        return ExitCause.NCCL, "nccl"
    return None
