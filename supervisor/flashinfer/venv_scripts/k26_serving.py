"""Runs INSIDE the serving venv, with its interpreter: what the supervisor asks FlashInfer.

The supervisor never imports flashinfer or torch itself. It runs this file
as ``<serving python> k26_serving.py COMMAND ...`` with the units' environment
(FLASHINFER_WORKSPACE_BASE, FLASHINFER_CUDA_ARCH_LIST, ...). Commands:

    identity            fast: versions and hashes, no flashinfer/torch import
    probe               identity + FlashInfer's own gate, arch tag, cache dir,
                        module paths and build arch flags; --load loads .so files
    build               builds modules through FlashInfer's JIT, streaming progress
    torch-arches        the compute capabilities this torch's cpp_extension knows

Progress lines start with ``K26-PROGRESS``; the last line of stdout is
``K26-RESULT <json>``. Kept compatible with Python 3.8 and self-contained
(it is run as a file, so it imports nothing from the supervisor).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT = "K26-RESULT "
PROGRESS = "K26-PROGRESS "
ARCH_VARIABLES = ("FLASHINFER_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST")
# Files whose code decides the gate and the arch flags; hashed into the identity
# so that a patch, a revert or a hand edit invalidates the cache fingerprint.
GATE_FILES = ("jit/core.py", "jit/env.py", "jit/cpp_ext.py", "compilation_context.py")
BUILD_ENV = (
    "FLASHINFER_CUDA_ARCH_LIST",
    "TORCH_CUDA_ARCH_LIST",
    "FLASHINFER_EXTRA_CFLAGS",
    "FLASHINFER_EXTRA_CUDAFLAGS",
    "FLASHINFER_EXTRA_LDFLAGS",
    "FLASHINFER_NVCC",
    "CC",
    "CXX",
    # Where the module's libraries (libcudart, libcuda) are found when it loads:
    # part of what doctor verified, so part of what the fingerprint vouches for.
    "LD_LIBRARY_PATH",
)
# Variables that change the build only when set (FlashInfer 0.7: FLASHINFER_JIT_VERBOSE=1
# builds -O0 -g --device-debug, so a unit with it rebuilds at its first load). Recorded
# only when set, so fingerprints from before this list stay valid.
OPTIONAL_BUILD_ENV = ("FLASHINFER_JIT_VERBOSE", "FLASHINFER_JIT_DEBUG")


def emit(result: dict[str, Any]) -> None:
    sys.stdout.write(RESULT + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def progress(text: str) -> None:
    sys.stdout.write(PROGRESS + text + "\n")
    sys.stdout.flush()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def where(exc: BaseException) -> str | None:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def distribution(names: list[str]) -> dict[str, Any] | None:
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        record = dist.read_text("RECORD") or ""
        return {"name": name, "version": dist.version, "record_sha256": sha256_text(record)}
    return None


def aot_wheels() -> list[dict[str, Any]]:
    """Installed wheels that can serve modules instead of the JIT workspace.

    flashinfer-jit-cache (the shim and its per-arch providers) and
    flashinfer-cubin: installing, upgrading or removing one changes what
    FlashInfer loads, so it is part of who "built" the cache.
    """
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("flashinfer-jit-cache") or name == "flashinfer-cubin":
            record = dist.read_text("RECORD") or ""
            found[name] = {"name": name, "version": dist.version,
                           "record_sha256": sha256_text(record)}  # fmt: skip
    return [found[name] for name in sorted(found)]


def flashinfer_dir() -> Path | None:
    # find_spec on a top-level package does not execute it, so this works even
    # when importing flashinfer raises (as the gate does in some releases).
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def torch_cuda_version() -> str | None:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_file.read_text()
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]?([^'\"\n]+?)['\"]?\s*$", text, re.M)
    if match is None or match.group(1) == "None":
        return None
    return match.group(1)


def cuda_home() -> str | None:
    """The CUDA home as FlashInfer (and torch's cpp_extension) resolve it."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    if os.path.exists("/usr/local/cuda"):
        return "/usr/local/cuda"
    return None


def nvcc_identity() -> dict[str, Any]:
    home = cuda_home()
    nvcc = os.environ.get("FLASHINFER_NVCC") or (
        os.path.join(home, "bin", "nvcc") if home else None
    )
    info: dict[str, Any] = {
        "cuda_home": home,
        "path": nvcc,
        "release": None,
        "version_sha256": None,
    }
    if nvcc is None:
        info["error"] = "no CUDA home: set CUDA_HOME or put nvcc on PATH"
        return info
    try:
        real = os.path.realpath(nvcc)
        stat = os.stat(real)
        info["realpath"] = real
        info["size"] = stat.st_size
        info["mtime_ns"] = stat.st_mtime_ns
        text = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        info["error"] = error_text(exc)
        return info
    match = re.search(r"release (\d+\.\d+)", text)
    info["release"] = match.group(1) if match else None
    info["version_sha256"] = sha256_text(text)
    return info


def identity() -> dict[str, Any]:
    package = flashinfer_dir()
    gate_files: dict[str, str | None] = {}
    if package is not None:
        for relative in GATE_FILES:
            if (package / relative).exists():
                gate_files[relative] = sha256_file(package / relative)
    torch = distribution(["torch"])
    if torch is not None:
        torch["cuda"] = torch_cuda_version()
    out: dict[str, Any] = {
        "python": os.path.realpath(sys.executable),
        "python_version": platform.python_version(),
        "prefix": sys.prefix,
        "flashinfer": distribution(["flashinfer-python", "flashinfer"]),
        "flashinfer_dir": str(package) if package else None,
        "gate_files": gate_files,
        "torch": torch,
        "nvcc": nvcc_identity(),
        "env": {name: os.environ.get(name) for name in BUILD_ENV},
    }
    for name in OPTIONAL_BUILD_ENV:
        if os.environ.get(name):
            out["env"][name] = os.environ[name]
    wheels = aot_wheels()
    if wheels:  # absent when none: fingerprints from before this key stay valid
        out["aot_wheels"] = wheels
    return out


def find_generator(module: str) -> Callable[[], Any]:
    candidates = [
        (f"flashinfer.jit.{module}", f"gen_{module}_module"),
        ("flashinfer.jit", f"gen_{module}_module"),
        (f"flashinfer.{module}", f"gen_{module}_module"),
    ]
    for module_name, attribute in candidates:
        try:
            found = importlib.import_module(module_name)
        except ImportError:
            continue
        generator = getattr(found, attribute, None)
        if callable(generator):
            return generator  # type: ignore[no-any-return]
    # Deeper in the JIT package (0.7: flashinfer.jit.mamba.seq_chunk_cumsum, ...):
    # look for the definition in the sources first, import only the file that has it.
    try:
        jit = importlib.import_module("flashinfer.jit")
    except BaseException:
        jit = None
    wanted = f"def gen_{module}_module("
    for root in getattr(jit, "__path__", []):
        for path in sorted(Path(root).rglob("*.py")):
            try:
                if wanted not in path.read_text(errors="replace"):
                    continue
            except OSError:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            try:
                found = importlib.import_module(".".join(("flashinfer.jit", *parts)))
            except BaseException:
                continue
            generator = getattr(found, f"gen_{module}_module", None)
            if callable(generator):
                return generator  # type: ignore[no-any-return]
    raise LookupError(f"this FlashInfer has no generator for module {module!r}")


def arch_flags(core: Any) -> list[str]:
    """The -gencode flags FlashInfer's build would pass to nvcc."""
    context = getattr(core, "current_compilation_context", None)
    if context is not None:
        return [f for f in context.get_nvcc_flags_list() if f.startswith("-gencode")]
    # 0.2.x: the flags come from torch's cpp_extension, through jit.env.
    env = importlib.import_module("flashinfer.jit.env")
    return [f for f in env._get_cuda_arch_flags() if "arch" in f]


def run_gate() -> dict[str, Any]:
    try:
        core = importlib.import_module("flashinfer.jit.core")
    except OSError as exc:  # an unwritable or full workspace, not an arch verdict
        return {"verdict": "unknown", "error": error_text(exc), "where": where(exc)}
    except ImportError as exc:  # a package the venv lacks: broken venv, not an arch verdict
        text = f"the serving venv cannot import FlashInfer's JIT: {error_text(exc)}"
        return {"verdict": "unknown", "error": text, "where": where(exc)}
    except BaseException as exc:  # the gate may raise at import time
        return {"verdict": "rejects", "error": error_text(exc), "where": where(exc)}
    check = getattr(core, "check_cuda_arch", None)
    if check is None:
        return {"verdict": "unknown", "error": "this FlashInfer has no check_cuda_arch()"}
    try:
        check()
    except BaseException as exc:
        return {"verdict": "rejects", "error": error_text(exc), "where": where(exc)}
    try:
        flags = arch_flags(core)
    except BaseException as exc:
        return {"verdict": "rejects", "error": error_text(exc), "where": where(exc)}
    context = getattr(core, "current_compilation_context", None)
    targets = sorted(f"{a}.{b}" for a, b in context.TARGET_CUDA_ARCHS) if context else None
    return {"verdict": "accepts", "error": None, "arch_flags": flags, "target_archs": targets}


def gate_without_arch_list() -> dict[str, Any]:
    """FlashInfer's check as a unit without the arch variables would run it."""
    saved = {name: os.environ.pop(name) for name in ARCH_VARIABLES if name in os.environ}
    try:
        for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            del sys.modules[name]
        return run_gate()
    finally:
        os.environ.update(saved)


def record_sha256(distribution_name: str, path: Path) -> str | None:
    """The sha256 (hex) pip recorded for ``path`` when it installed the distribution."""
    try:
        dist = importlib.metadata.distribution(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    target = os.path.realpath(path)
    for entry in dist.files or ():
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        if os.path.realpath(str(entry.locate())) == target:
            padded = entry.hash.value + "=" * (-len(entry.hash.value) % 4)
            return base64.urlsafe_b64decode(padded).hex()
    return None


def aot_providers() -> list[dict[str, Any]]:
    """The jit-cache provider wheels this FlashInfer accepted (0.7+), as it sees them."""
    try:
        env = importlib.import_module("flashinfer.jit.env")
    except BaseException:
        return []
    return [
        {
            "id": provider.provider_id,
            "distribution": provider.distribution,
            "version": provider.version,
            "dir": str(provider.jit_cache_dir),
            "archs": sorted(provider.cuda_architectures),
            "modules": len(provider.modules),
        }
        for provider in getattr(env, "FLASHINFER_AOT_PROVIDERS", ())
    ]


def cubin_source() -> dict[str, Any]:
    """Where this FlashInfer reads its downloaded cubins from (flashinfer-cubin or the cache)."""
    try:
        env = importlib.import_module("flashinfer.jit.env")
    except BaseException as exc:
        return {"dir": None, "package": None, "error": error_text(exc)}
    package = distribution(["flashinfer-cubin"])
    directory = getattr(env, "FLASHINFER_CUBIN_DIR", None)
    return {
        "dir": str(directory) if directory is not None else None,
        "package": package["version"] if package else None,
        "error": None,
    }


def resolution(spec: Any) -> dict[str, Any]:
    """Where FlashInfer will load the module from, asked of its own code.

    0.7+: ``spec.aot_artifacts`` (the provider wheels' choice per target arch,
    or the package's own data/aot); 0.2-0.6: ``spec.is_aot`` (data/aot only).
    """
    providers = {p["id"]: p for p in aot_providers()}
    artifacts = getattr(spec, "aot_artifacts", None)
    if artifacts is None:
        if getattr(spec, "is_aot", False):
            path = Path(spec.aot_path)
            sha = record_sha256("flashinfer-python", path) or record_sha256("flashinfer", path)
            own: dict[str, Any] = {
                "provider": "flashinfer-python",
                "path": str(path),
                "archs": None,
                "distribution": None,
                "version": None,
                "record_sha256": sha,
            }
            return {"source": "package", "artifacts": [own]}
        return {"source": "jit", "artifacts": []}
    found: list[dict[str, Any]] = []
    for artifact in artifacts:
        provider = providers.get(artifact.provider_id)
        dist_name = provider["distribution"] if provider else "flashinfer-python"
        archs = sorted(artifact.cuda_architectures) if artifact.cuda_architectures else None
        found.append({
            "provider": artifact.provider_id,
            "path": str(artifact.path),
            "archs": archs,
            "distribution": provider["distribution"] if provider else None,
            "version": provider["version"] if provider else None,
            "record_sha256": record_sha256(dist_name, Path(artifact.path)),
        })  # fmt: skip
    if not found:
        return {"source": "jit", "artifacts": []}
    source = "package" if all(a["provider"] == "flashinfer-python" for a in found) else "provider"
    return {"source": source, "artifacts": found}


_MISSING_HEADER = re.compile(
    r"^(?P<where>\S+?):(?P<line>\d+):\d+: fatal error: (?P<header>[^:]+): No such file or directory"
)


def _ninja_variables(text: str) -> dict[str, str]:
    values = {}
    for line in text.replace("$\n", "").splitlines():
        match = re.match(r"^(\w+) = ?(.*)$", line)
        if match:
            values[match.group(1)] = match.group(2)
    return values


def _expand(value: str, variables: dict[str, str]) -> str:
    for _ in range(8):
        expanded = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), ""), value)
        if expanded == value:
            break
        value = expanded
    return value


def preflight(spec: Any) -> dict[str, Any]:
    """Would the build find every header? nvcc's dependency scan, FlashInfer's own flags.

    The flags come from FlashInfer's ninja generator, as a build would write
    them, but nothing is written: ``nvcc -M`` preprocesses each source and
    stops at the first header no include path has.
    """
    try:
        cpp_ext = importlib.import_module("flashinfer.jit.cpp_ext")
        generate = cpp_ext.generate_ninja_build_for_op
        wanted = inspect.signature(generate).parameters
        kwargs = {name: getattr(spec, name) for name in wanted if hasattr(spec, name)}
        variables = _ninja_variables(generate(**kwargs))
        flags = shlex.split(_expand(variables["cuda_cflags"], variables))
        nvcc = _expand(variables["nvcc"], variables)
    except BaseException as exc:
        return {"checked": False, "missing": [], "error": error_text(exc)}
    missing: list[dict[str, Any]] = []
    for source in spec.sources:
        if Path(source).suffix != ".cu":
            continue
        try:
            run = subprocess.run(
                [nvcc, "-M", *flags, str(source), "-o", os.devnull],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            return {"checked": False, "missing": missing, "error": error_text(exc)}
        for line in (run.stdout + run.stderr).splitlines():
            match = _MISSING_HEADER.match(line.strip())
            if match and all(m["header"] != match.group("header") for m in missing):
                missing.append({
                    "header": match.group("header"),
                    "included_from": f"{match.group('where')}:{match.group('line')}",
                    "source": str(source),
                })  # fmt: skip
    return {"checked": True, "missing": missing, "error": None}


def module_status(names: list[str], check_headers: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in names:
        try:
            spec = find_generator(name)()
            if hasattr(spec, "get_library_path"):
                path = spec.get_library_path()
            else:
                path = spec.jit_library_path
            lock = getattr(spec, "lock_path", None)
            result[name] = {
                "path": str(path),
                "build_dir": str(getattr(spec, "build_dir", Path(path).parent)),
                "compiled": bool(getattr(spec, "is_compiled", Path(path).exists())),
                "aot": bool(getattr(spec, "is_aot", False)),
                "lock_path": str(lock) if lock is not None else None,
                "resolution": resolution(spec),
                "error": None,
            }
            entry = result[name]
            if check_headers and not entry["compiled"] and entry["resolution"]["source"] == "jit":
                entry["headers"] = preflight(spec)
        except BaseException as exc:
            entry = {"error": error_text(exc), "where": where(exc)}
            if isinstance(exc, LookupError) and "no generator" in str(exc):
                entry["generator"] = False  # needs arguments: not rebuildable from a name
            result[name] = entry
    return result


def elf_complete(path: str) -> str | None:
    """None when the file's ELF headers all lie inside it, else why not.

    dlopen of a truncated file can crash the loader; check before loading.
    """
    try:
        with open(path, "rb") as handle:
            header = handle.read(64)
            size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        return error_text(exc)
    if len(header) < 64 or header[:4] != b"\x7fELF":
        return "not an ELF file"
    shoff = int.from_bytes(header[0x28:0x30], "little")
    shentsize = int.from_bytes(header[0x3A:0x3C], "little")
    shnum = int.from_bytes(header[0x3C:0x3E], "little")
    if shoff + shentsize * shnum > size:
        return f"section headers end past the file ({size} bytes): truncated"
    return None


def load_library(path: str) -> dict[str, Any]:
    """Load the module as FlashInfer itself would: tvm_ffi (0.4+) or torch ops."""
    problem = elf_complete(path)
    if problem is not None:
        return {"ok": False, "error": problem}
    started = time.monotonic()
    try:
        if "tvm_ffi" in sys.modules:
            sys.modules["tvm_ffi"].load_module(path)
            loader = "tvm_ffi.load_module"
        else:
            importlib.import_module("torch").ops.load_library(path)
            loader = "torch.ops.load_library"
    except BaseException as exc:
        return {"ok": False, "error": error_text(exc)}
    return {"ok": True, "loader": loader, "seconds": round(time.monotonic() - started, 4)}


def command_probe(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"identity": identity()}
    gate = run_gate()
    out["gate"] = gate
    try:
        env = importlib.import_module("flashinfer.jit.env")
        out["workspace_dir"] = str(env.FLASHINFER_WORKSPACE_DIR)
        out["jit_dir"] = str(env.FLASHINFER_JIT_DIR)
        out["arch_tag"] = Path(env.FLASHINFER_WORKSPACE_DIR).name
    except BaseException as exc:
        out["workspace_dir"] = out["jit_dir"] = out["arch_tag"] = None
        out["dir_error"] = error_text(exc)
    try:
        out["flashinfer_version"] = importlib.import_module("flashinfer").__version__
    except BaseException:
        fi = out["identity"]["flashinfer"]
        out["flashinfer_version"] = fi["version"] if fi else None
    try:
        cpp_ext = importlib.import_module("flashinfer.jit.cpp_ext")
        out["cuda_version"] = str(cpp_ext.get_cuda_version())
    except BaseException as exc:
        out["cuda_version"] = None
        out["cuda_version_error"] = error_text(exc)
    accepts = gate["verdict"] == "accepts"
    out["modules"] = module_status(args.module, args.check_headers) if accepts else {}
    out["providers"] = aot_providers()
    out["cubin"] = cubin_source()
    loads = list(args.load)
    if args.load_compiled:
        loads += [m["path"] for m in out["modules"].values() if m.get("compiled")]
    out["loads"] = {path: load_library(path) for path in loads}
    if args.without_arch_list:
        out["gate_without_arch_list"] = gate_without_arch_list()
    return out


def command_build(args: argparse.Namespace) -> dict[str, Any]:
    gate = run_gate()
    if gate["verdict"] != "accepts":
        return {"ok": False, "gate": gate, "built": [], "error": gate["error"]}
    built: list[str] = []
    for name in args.module:
        progress(f"building {name}")
        started = time.monotonic()
        try:
            spec = find_generator(name)()
            try:
                spec.build(verbose=True, need_lock=True)
            except TypeError:
                spec.build()
        except BaseException as exc:
            return {"ok": False, "built": built, "failed": name, "error": error_text(exc)}
        progress(f"built {name} in {time.monotonic() - started:.1f} s")
        built.append(name)
    result: dict[str, Any] = {"ok": True, "built": built, "error": None}
    if args.verify:
        # The verifying probe in this process: torch and FlashInfer are imported
        # already, and a second interpreter would only import them again. What it
        # reads is on disk, as a fresh process would read it.
        try:
            result["probe"] = command_probe(
                argparse.Namespace(
                    module=list(args.verify),
                    load=[],
                    load_compiled=True,
                    without_arch_list=False,
                    check_headers=False,
                )
            )
            progress(f"probed {', '.join(args.verify)} in the build's own process")
        except BaseException as exc:  # the caller probes in a process of its own
            progress(f"verifying probe failed here ({error_text(exc)}); the caller probes")
    return result


def command_torch_arches(args: argparse.Namespace) -> dict[str, Any]:
    """Which capabilities torch's own arch-flag function accepts (newest last)."""
    cpp_extension = importlib.import_module("torch.utils.cpp_extension")
    known: list[str] = []
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        for candidate in args.candidate:
            os.environ["TORCH_CUDA_ARCH_LIST"] = candidate
            try:
                cpp_extension._get_cuda_arch_flags()
            except ValueError:
                continue
            known.append(candidate)
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    return {"known": known}


def main() -> int:
    parser = argparse.ArgumentParser(prog="k26_serving")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("identity")
    probe = sub.add_parser("probe")
    probe.add_argument("--module", action="append", default=[])
    probe.add_argument("--load", action="append", default=[])
    probe.add_argument("--load-compiled", action="store_true")
    probe.add_argument("--without-arch-list", action="store_true")
    probe.add_argument("--check-headers", action="store_true")
    build = sub.add_parser("build")
    build.add_argument("--module", action="append", default=[])
    build.add_argument("--verify", action="append", default=[])
    arches = sub.add_parser("torch-arches")
    arches.add_argument("--candidate", action="append", default=[])
    args = parser.parse_args()
    if args.command == "identity":
        emit(identity())
    elif args.command == "probe":
        emit(command_probe(args))
    elif args.command == "build":
        result = command_build(args)
        emit(result)
        return 0 if result["ok"] else 1
    else:
        emit(command_torch_arches(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
