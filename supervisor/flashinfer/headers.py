"""A header the build needs and the toolkit lacks: name it, and say what provides it.

FlashInfer's modules include CUDA library headers that a minimal toolkit (or a
pip-installed one) may not have: ``norm`` includes ``cublasLt.h`` through its
TensorRT-LLM utilities, ``sampling`` includes ``curand.h``. The compiler's own
line (``fatal error: cublasLt.h: No such file or directory``) says what is
missing but not where to get it; this module does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FATAL = re.compile(
    r"(?P<where>[^\s:]+):(?P<line>\d+):\d+: fatal error: (?P<header>[^:\s]+): No such file or directory"
)


@dataclass(frozen=True)
class Library:
    name: str
    apt: str  # NVIDIA's CUDA repository; {v} is the CUDA release as 13-0
    pip: str  # {cu} is "" for CUDA 13 (nvidia/cu13/include), "-cu12" for 12


_CUBLAS = Library("cuBLAS", "libcublas-dev-{v}", "nvidia-cublas{cu}")
_CURAND = Library("cuRAND", "libcurand-dev-{v}", "nvidia-curand{cu}")
_CUSPARSE = Library("cuSPARSE", "libcusparse-dev-{v}", "nvidia-cusparse{cu}")
_CUSOLVER = Library("cuSOLVER", "libcusolver-dev-{v}", "nvidia-cusolver{cu}")
_CUFFT = Library("cuFFT", "libcufft-dev-{v}", "nvidia-cufft{cu}")
_NVRTC = Library("NVRTC", "cuda-nvrtc-dev-{v}", "nvidia-cuda-nvrtc{cu}")
_RUNTIME = Library("the CUDA runtime", "cuda-cudart-dev-{v}", "nvidia-cuda-runtime{cu}")
_NCCL = Library("NCCL", "libnccl-dev", "nvidia-nccl{cu}")
_CUDNN = Library("cuDNN", "libcudnn9-dev-cuda-{major}", "nvidia-cudnn{cu}")

LIBRARIES: dict[str, Library] = {
    "cublasLt.h": _CUBLAS,
    "cublas_v2.h": _CUBLAS,
    "cublas_api.h": _CUBLAS,
    "cublas.h": _CUBLAS,
    "curand.h": _CURAND,
    "curand_kernel.h": _CURAND,
    "curand_philox4x32_x.h": _CURAND,
    "cusparse.h": _CUSPARSE,
    "cusolverDn.h": _CUSOLVER,
    "cufft.h": _CUFFT,
    "nvrtc.h": _NVRTC,
    "cuda_runtime.h": _RUNTIME,
    "cuda_runtime_api.h": _RUNTIME,
    "cuda_fp16.h": _RUNTIME,
    "cuda_bf16.h": _RUNTIME,
    "cuda_fp8.h": _RUNTIME,
    "nccl.h": _NCCL,
    "cudnn.h": _CUDNN,
}


def provides(header: str, cuda_release: str | None = None) -> str:
    """What to install so that ``header`` is found, as one clause."""
    library = LIBRARIES.get(header)
    if library is None:
        return (
            f"find the package that ships {header} and put its include directory on "
            "CPATH in the units' environment"
        )
    major, _, minor = (cuda_release or "").partition(".")
    version = f"{major}-{minor}" if major and minor else "<major>-<minor>"
    cu = "" if major == "13" else f"-cu{major}" if major else "-cu<major>"
    apt = library.apt.format(v=version, major=major or "<major>")
    pip = library.pip.format(cu=cu)
    return (
        f"it comes with {library.name}'s development headers: the toolkit package {apt} "
        f"(NVIDIA's CUDA repository), or pip {pip} in the serving venv with its include "
        "directory on CPATH in the units' environment"
    )


def missing_header_text(
    header: str, included_from: str | None, cuda_release: str | None = None
) -> str:
    where = f" (included from {included_from})" if included_from else ""
    return (
        f"the build needs {header}{where}, which no include path has: "
        f"{provides(header, cuda_release)}"
    )


def missing_in_build_output(text: str) -> list[tuple[str, str]]:
    """(header, included_from) for each missing header a compiler reported, in order."""
    seen: dict[str, str] = {}
    for match in _FATAL.finditer(text):
        seen.setdefault(match.group("header"), f"{match.group('where')}:{match.group('line')}")
    return list(seen.items())
