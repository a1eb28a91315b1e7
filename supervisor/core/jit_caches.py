"""Where a unit's JIT caches live, from the unit's own environment (pure).

SGLang compiles kernels through five caches: FlashInfer's workspace, Triton's,
torch inductor's, TVM-FFI's (sgl-kernel's JIT) and DeepGEMM's; its own cache
(``SGLANG_CACHE_DIR``) holds FlashInfer autotune results. Each library reads an
environment variable and falls back to a default under ``HOME`` or ``/tmp``
(read from the sources SGLang 0.5.17 pins: SGLang overwrites DeepGEMM's
``DG_JIT_CACHE_DIR`` with ``SGLANG_DG_CACHE_DIR``; inductor's default honours
``TMPDIR``). Four more roots exist where their code runs: the flash-attention CuTe
DSL kernels of SGLang and FlashInfer (``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, else
``<tmp>/<user>/flash_attention_cute_dsl_cache``), CUTLASS's CuTe DSL
(``CUTE_DSL_CACHE_DIR``, else ``$TMPDIR/<user>/cutlass_python_cache``), TileLang
(``TILELANG_CACHE_DIR``, else ``~/.tilelang/cache``) and the CUDA driver's PTX JIT
(``CUDA_CACHE_PATH``, else ``~/.nv/ComputeCache``). Which variables the installed
packages really read is the serving venv's to say
(``fleet/venv_scripts/k26_caches.py roots``: their sources, scanned); ``unknown``
names what they read that this table does not know.
``locate`` applies exactly those rules to the environment systemd gives the unit
(``Environment=``, ``EnvironmentFile=``, the ``User=``'s home), so the watch and
the doctor look where the server writes, never where this process would.

``assess`` says, per cache, whether it outlives a restart: one under ``/tmp`` or
``/var/tmp`` of a unit with ``PrivateTmp=yes`` is wiped at every restart (the
inductor default, ``/tmp/torchinductor_<user>``, is the usual victim); one under
the unit's ``CacheDirectory=`` is kept, and is where the shipped units pin them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import PurePosixPath


class JitCache(StrEnum):
    FLASHINFER = "flashinfer"
    TRITON = "triton"
    INDUCTOR = "inductor"
    TVM_FFI = "tvm-ffi"
    DEEPGEMM = "deepgemm"
    SGLANG = "sglang"
    CUTE_DSL = "cute-dsl"  # flash-attention's CuTe DSL kernels (SGLang, FlashInfer)
    CUTLASS_DSL = "cutlass-dsl"  # CUTLASS's CuTe DSL itself
    TILELANG = "tilelang"
    CUDA = "cuda"  # the driver's PTX JIT cache
    # A root the serving venv's installed code reads that none of the above follows
    # (``unknown``, from its sources), watched where a unit pins it (``pinned_unknown``).
    OTHER = "other"


# The variable each library reads first. FlashInfer appends .cache/flashinfer to its
# base; the others use the path as given.
CACHE_ENV: Mapping[JitCache, str] = {
    JitCache.FLASHINFER: "FLASHINFER_WORKSPACE_BASE",
    JitCache.TRITON: "TRITON_CACHE_DIR",
    JitCache.INDUCTOR: "TORCHINDUCTOR_CACHE_DIR",
    JitCache.TVM_FFI: "TVM_FFI_CACHE_DIR",
    JitCache.DEEPGEMM: "SGLANG_DG_CACHE_DIR",  # SGLang sets DG_JIT_CACHE_DIR from it
    JitCache.SGLANG: "SGLANG_CACHE_DIR",
    JitCache.CUTE_DSL: "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
    JitCache.CUTLASS_DSL: "CUTE_DSL_CACHE_DIR",
    JitCache.TILELANG: "TILELANG_CACHE_DIR",
    JitCache.CUDA: "CUDA_CACHE_PATH",
}
# Variables the packages read that name one of the caches above by another route:
# DeepGEMM's own (SGLang overwrites it from SGLANG_DG_CACHE_DIR), and roots the
# table derives a cache from (TMPDIR, TRITON_HOME, XDG_CACHE_HOME: a default's base).
ALSO_KNOWN = frozenset({"DG_JIT_CACHE_DIR", "TRITON_HOME", "XDG_CACHE_HOME"})


def unknown(variables: Iterable[str]) -> list[str]:
    """Of the cache variables a serving venv's sources read, those no cache here is
    located by: a cache root the JIT watch would not see."""
    known = set(CACHE_ENV.values()) | ALSO_KNOWN
    return sorted(v for v in set(variables) if v not in known)


def pinned_unknown(env: Mapping[str, str], variables: Iterable[str]) -> list[CacheLocation]:
    """Where a unit's environment pins a cache root that no cache here follows
    (``unknown(variables)``): each as an ``OTHER`` location named by its variable,
    for the JIT watch. Relative values are taken from ``/``, as ``locate`` does."""
    out: list[CacheLocation] = []
    for variable in unknown(variables):
        value = env.get(variable, "")
        if value:
            path = PurePosixPath(value)
            path = path if path.is_absolute() else PurePosixPath("/") / path
            out.append(CacheLocation(JitCache.OTHER, path, True, variable))
    return out


@dataclass(frozen=True, slots=True)
class CacheLocation:
    cache: JitCache
    path: PurePosixPath
    pinned: bool  # set by the unit's environment, not a library default
    source: str  # the variable, or the default rule that gave the path


@dataclass(frozen=True, slots=True)
class CacheAssessment:
    location: CacheLocation
    kept: bool  # survives a restart of the unit
    problem: str | None  # why not, and what to do


def locate(env: Mapping[str, str], *, home: str, user: str) -> list[CacheLocation]:
    """Each JIT cache's directory for a unit whose environment is ``env`` and whose
    user is ``user`` with home ``home`` (``env["HOME"]`` wins, as it does for the
    libraries). Relative values are taken from ``/`` (systemd's working directory)."""
    home = env.get("HOME") or home
    user = env.get("USER") or user

    def absolute(value: str) -> PurePosixPath:
        path = PurePosixPath(value)
        return path if path.is_absolute() else PurePosixPath("/") / path

    tmp = PurePosixPath(env.get("TMPDIR") or "/tmp")  # tempfile.gettempdir() honours it
    triton_home = PurePosixPath(env.get("TRITON_HOME") or home)
    defaults: Mapping[JitCache, tuple[PurePosixPath, str]] = {
        JitCache.FLASHINFER: (PurePosixPath(home), "HOME (FlashInfer's default base)"),
        JitCache.TRITON: (triton_home / ".triton" / "cache", "~/.triton/cache"),
        JitCache.INDUCTOR: (
            tmp / f"torchinductor_{user}",
            "$TMPDIR or /tmp, torchinductor_<user> (torch's default)",
        ),
        JitCache.TVM_FFI: (PurePosixPath(home) / ".cache" / "tvm-ffi", "~/.cache/tvm-ffi"),
        JitCache.DEEPGEMM: (PurePosixPath(home) / ".cache" / "deep_gemm", "~/.cache/deep_gemm"),
        JitCache.SGLANG: (PurePosixPath(home) / ".cache" / "sglang", "~/.cache/sglang"),
        JitCache.CUTE_DSL: (
            tmp / user / "flash_attention_cute_dsl_cache",
            "$TMPDIR or /tmp, <user>/flash_attention_cute_dsl_cache",
        ),
        JitCache.CUTLASS_DSL: (
            tmp / user / "cutlass_python_cache",
            "$TMPDIR or /tmp, <user>/cutlass_python_cache",
        ),
        JitCache.TILELANG: (PurePosixPath(home) / ".tilelang" / "cache", "~/.tilelang/cache"),
        JitCache.CUDA: (PurePosixPath(home) / ".nv" / "ComputeCache", "~/.nv/ComputeCache"),
    }
    out: list[CacheLocation] = []
    for cache in CACHE_ENV:
        variable = CACHE_ENV[cache]
        value = env.get(variable, "")
        if value:
            path, pinned, source = absolute(value), True, variable
        else:
            path, source = defaults[cache]
            pinned = False
        if cache is JitCache.FLASHINFER:
            path = path / ".cache" / "flashinfer"
        out.append(CacheLocation(cache, path, pinned, source))
    return out


def _under(path: PurePosixPath, tops: Sequence[PurePosixPath]) -> PurePosixPath | None:
    for top in tops:
        if path == top or top in path.parents:
            return top
    return None


def assess(
    locations: Sequence[CacheLocation],
    *,
    private_tmp: bool,
    cache_directories: Sequence[str] = (),
) -> list[CacheAssessment]:
    """Whether each cache outlives a restart of the unit (see the module docstring)."""
    temporary = [PurePosixPath("/tmp"), PurePosixPath("/var/tmp")]
    kept_dirs = [PurePosixPath("/var/cache") / d for d in cache_directories]
    out: list[CacheAssessment] = []
    for location in locations:
        # The variable that sets it: a known cache's own, or the one an OTHER root came by.
        variable = CACHE_ENV.get(location.cache, location.source)
        tmp = _under(location.path, temporary)
        if tmp is not None and private_tmp:
            problem = (
                f"{location.cache} cache {location.path} is under {tmp}, which PrivateTmp=yes "
                f"wipes at every restart: set {variable} to a directory under "
                "the unit's CacheDirectory="
            )
            out.append(CacheAssessment(location, False, problem))
        elif tmp is not None:
            problem = (
                f"{location.cache} cache {location.path} is under {tmp}, which a reboot (or "
                f"tmpfiles cleaning) empties: set {variable} under the "
                "unit's CacheDirectory="
            )
            out.append(CacheAssessment(location, False, problem))
        elif kept_dirs and _under(location.path, kept_dirs) is None and not location.pinned:
            problem = (
                f"{location.cache} cache {location.path} follows a library default "
                f"({location.source}), not the unit's CacheDirectory=: pin "
                f"{variable} so every cache lives in one place the unit keeps"
            )
            out.append(CacheAssessment(location, True, problem))
        else:
            out.append(CacheAssessment(location, True, None))
    return out


def artifact_kernel(cache: JitCache, relative: PurePosixPath) -> str:
    """A short name for what a new file in ``cache`` was built for: FlashInfer's module
    (``cached_ops/<module>/``), otherwise the file's own stem (Triton names its files
    after the kernel; inductor, TVM-FFI and DeepGEMM after a hash or the op)."""
    parts = relative.parts
    if cache is JitCache.FLASHINFER and "cached_ops" in parts:
        index = parts.index("cached_ops")
        if index + 1 < len(parts) - 1:
            return parts[index + 1]
    name = relative.name
    for suffix in (".cubin", ".json", ".ptx", ".ttir", ".ttgir", ".llir", ".source", ".so"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return relative.stem or name


# The sources FlashInfer renders from its templates into ``<ver>/<arch>/generated/``.
GENERATED_SOURCES = (".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp", ".inc", ".inl")


def ignored_artifact(relative: PurePosixPath, cache: JitCache | None = None) -> bool:
    """Files a cache writes that are no compiled kernel: locks, logs, what is only on
    its way to its final name (Triton's ``tmp.pid_*`` dirs, FlashInfer's ``tmp/``), and
    in FlashInfer's cache (``cache``) two more: its generated sources (its JIT spec
    renders them, ``write_if_different``, when a process first loads a templated
    module, built or not; a build shows in the module's ``cached_ops`` objects), and
    this supervisor's own ``k26-*`` records there (the fingerprint a warm-up or an
    import writes, the quarantine)."""
    if relative.name.endswith((".lock", ".tmp", ".log")):
        return True
    if cache is JitCache.FLASHINFER:
        if any(part.startswith("k26-") for part in relative.parts):
            return True
        if "generated" in relative.parts[:-1] and relative.name.endswith(GENERATED_SOURCES):
            return True
    return any(
        part == "tmp" or part.startswith(("tmp.", ".tmp", "tmp_")) for part in relative.parts
    )
