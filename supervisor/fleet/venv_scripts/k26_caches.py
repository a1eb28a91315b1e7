"""Runs INSIDE the serving venv, with its interpreter: who would write each JIT cache.

``k26_serving.py identity`` says who builds FlashInfer's cache. The other caches a
unit fills (Triton, torch inductor, TVM-FFI, DeepGEMM) are written by other
compilers; this script says which, without importing torch, triton or tvm_ffi
(nothing here needs a GPU or loads a CUDA library):

- each distribution that writes or keys a cache: name, version, a hash of its
  RECORD (torch also the CUDA it was built for, from ``torch/version.py``);
- the ``ptxas`` Triton runs (``TRITON_PTXAS_PATH``, else the one its NVIDIA backend
  ships): its release and a hash of its ``--version`` text;
- the ``nvcc`` TVM-FFI and DeepGEMM run (``CUDA_HOME``/``CUDA_PATH``, else ``nvcc``
  on ``PATH``, else ``/usr/local/cuda``), the same way;
- the GPU models the NVIDIA driver lists (``/proc/driver/nvidia/gpus/*/information``):
  torch inductor keys its caches on the device's name.

``k26_caches.py roots`` says which cache roots the installed code can write: every
environment variable that names a cache directory (``*CACHE*`` or ``*EXTENSIONS*``,
ending ``_DIR``, ``_PATH``, ``_HOME`` or ``_ROOT``) read by the sources of SGLang,
FlashInfer and torch and of every distribution they require, installed here (their
``Requires-Dist``, followed). Read from the ``.py`` files as text, nothing imported.

The last line of stdout is ``K26-RESULT <json>``. Python 3.8+. It imports nothing
from the supervisor: what it shares with ``k26_serving.py`` (a distribution's RECORD
hash, torch's CUDA, the result line) it takes from that script, which the package
ships with it (``supervisor/flashinfer/venv_scripts/``), found by its path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

# k26_serving.py, FlashInfer's venv script: ../../flashinfer/venv_scripts from here.
sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "flashinfer",
        "venv_scripts",
    ),
)
from k26_serving import (  # type: ignore[import-not-found]
    distribution,
    emit,
    sha256_text,
    torch_cuda_version,
)

# Each distribution that writes or keys one of the caches, by its names on PyPI.
DISTRIBUTIONS = {
    "torch": ["torch"],
    "triton": ["triton", "pytorch-triton"],
    "tvm_ffi": ["apache-tvm-ffi", "tvm-ffi"],
    "deep_gemm": ["deep-gemm", "deep_gemm"],
    "sgl_kernel": ["sgl-kernel", "sgl_kernel"],
}
# Where Triton's NVIDIA backend keeps the ptxas it runs (3.x), and where 2.x kept it.
PTXAS_IN_TRITON = ("backends/nvidia/bin/ptxas", "third_party/cuda/bin/ptxas")


def package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # a top-level package: not executed
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(next(iter(spec.submodule_search_locations)))


def tool(path: str | None) -> dict[str, Any] | None:
    """A CUDA tool's release and the hash of its ``--version`` text."""
    if not path:
        return None
    info: dict[str, Any] = {"path": path, "release": None, "version_sha256": None}
    try:
        text = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
        return info
    match = re.search(r"release (\d+\.\d+)", text)
    info["release"] = match.group(1) if match else None
    info["version_sha256"] = sha256_text(text)
    return info


def triton_ptxas() -> str | None:
    explicit = os.environ.get("TRITON_PTXAS_PATH")
    if explicit:
        return explicit
    top = package_dir("triton")
    if top is None:
        return None
    for relative in PTXAS_IN_TRITON:
        candidate = os.path.join(top, relative)
        if os.path.isfile(candidate):
            return candidate
    return shutil.which("ptxas")


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def gpu_models() -> list[str]:
    models = set()
    for path in glob.glob("/proc/driver/nvidia/gpus/*/information"):
        try:
            with open(path) as handle:
                for line in handle:
                    key, _, value = line.partition(":")
                    if key.strip() == "Model":
                        models.add(value.strip())
        except OSError:
            continue
    return sorted(models)


def identity() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python_version": platform.python_version(),
        "prefix": sys.prefix,
        "distributions": {key: distribution(names) for key, names in DISTRIBUTIONS.items()},
        "torch_cuda": torch_cuda_version(),
        "ptxas": tool(triton_ptxas()) if package_dir("triton") else None,
        "nvcc": tool(nvcc()),
        "gpu_models": gpu_models(),
        "env": {name: os.environ.get(name) for name in ("CC", "CXX", "TRITON_PTXAS_PATH")},
    }
    return out


# os.getenv("X", ...), os.environ.get("X"), os.environ["X"], environ.setdefault("X")
_READ = re.compile(
    r"""(?:getenv|environ\.get|environ\.setdefault|environ)\s*[\(\[]\s*["']([A-Z][A-Z0-9_]+)["']"""
)
# SGLang's environ.py declares its variables as attributes: NAME = EnvStr(...)
_DECLARED = re.compile(r"^\s+([A-Z][A-Z0-9_]+)\s*=\s*Env[A-Za-z]*\(", re.M)
_ROOT_NAME = re.compile(r"(CACHE|EXTENSIONS)[A-Z0-9_]*_(DIR|PATH|HOME|ROOT)$")
ROOTS_FROM = ("sglang", "flashinfer-python", "flashinfer", "torch")


def _requirement_name(line: str) -> str:
    return re.split(r"[ ;<>=!~\[(]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _distributions() -> dict[str, Any]:
    from importlib import metadata

    by_name: dict[str, Any] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            by_name.setdefault(name, dist)
    return by_name


def roots() -> dict[str, Any]:
    """Each cache variable the code reads: the files (relative to site-packages)."""
    by_name = _distributions()
    todo = [n for n in ROOTS_FROM if n in by_name]
    seen: set[str] = set()
    files: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        dist = by_name[name]
        for requirement in dist.requires or []:
            if "extra ==" in requirement:
                continue  # an optional extra: installed or not, not required
            other = _requirement_name(requirement)
            if other in by_name and other not in seen:
                todo.append(other)
        for entry in dist.files or []:
            if str(entry).endswith(".py"):
                files.add(str(dist.locate_file(entry)))
    variables: dict[str, list[str]] = {}
    for path in sorted(files):
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        names = set(_READ.findall(text))
        if path.endswith(os.sep + "environ.py"):
            names |= set(_DECLARED.findall(text))
        for name in names:
            if _ROOT_NAME.search(name):
                shown = path.split("site-packages" + os.sep, 1)[-1]
                variables.setdefault(name, []).append(shown)
    return {"scanned": sorted(seen), "files": len(files), "variables": variables}


def main() -> int:
    if sys.argv[1:] == ["identity"]:
        emit(identity())
    elif sys.argv[1:] == ["roots"]:
        emit(roots())
    else:
        sys.stderr.write("usage: k26_caches.py identity|roots\n")
        return 64
    return 0


if __name__ == "__main__":
    sys.exit(main())
