"""What the staleness tests need around a real FlashInfer: toolkits, venvs, the CLI.

- ``cuda_13_2_home()``: a second, real CUDA toolkit (nvcc 13.2.78 and its
  crt, nvvm, runtime and cccl wheels from PyPI) laid out like
  ``/usr/local/cuda-13.0``, which this machine's 13.0 was made from;
- ``cuda_12_9_runtime()``: the real CUDA 12.9 runtime library
  (``nvidia-cuda-runtime-cu12==12.9.79``). PyPI has no nvcc 12.9: the
  ``nvidia-cuda-nvcc-cu12==12.9.86`` wheel ships ``ptxas`` but no ``nvcc``
  or ``cicc``, and ``nvidia-cuda-nvcc`` starts at 13.0.48;
- ``LayeredVenv``: a venv of our own over a read-only serving venv (a
  ``.pth`` adds its site-packages) with FlashInfer in its own site-packages,
  so a test can reinstall FlashInfer without touching the shared venv;
- ``k26()``: the operator's commands, ``flashinfer doctor|warm --json``.

Installs go to the shared cache outside the clone (``shared_cache.root()``) once,
behind a file lock, each in a directory keyed by its exact requirements.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k26dev import shared_cache

ROOT = Path(__file__).resolve().parents[2]
CACHE = shared_cache.root()
ARCH = "12.0"

CUDA_13_2 = (
    "nvidia-cuda-nvcc==13.2.78",
    "nvidia-cuda-crt==13.2.78",
    "nvidia-nvvm==13.2.78",
    "nvidia-cuda-runtime==13.2.86",
    "nvidia-cuda-cccl==13.2.86",
)
CUDA_12_9_RUNTIME = ("nvidia-cuda-runtime-cu12==12.9.79",)


@contextlib.contextmanager
def _install_lock(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _pip(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def _install_target(name: str, requirements: tuple[str, ...]) -> Path:
    """``pip install --target CACHE/NAME-KEY`` once; the marker says it finished."""
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:10]
    dest = CACHE / f"{name}-{key}"
    marker = dest / ".k26-complete"
    with _install_lock(name):
        if marker.exists():
            return dest
        staging = CACHE / f"{name}-{key}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        _pip("install", "--quiet", "--no-deps", "--target", str(staging), *requirements)
        _finish_layout(name, staging)
        (staging / ".k26-complete").write_text("\n".join(requirements) + "\n")
        staging.rename(dest)
    return dest


def _finish_layout(name: str, staging: Path) -> None:
    if name != "cuda-13.2":
        return
    # What /usr/local/cuda-13.0 has beyond the wheels: lib64, the unversioned
    # libcudart.so that -lcudart needs, and the targets/ dir nvcc.profile names.
    home = staging / "nvidia" / "cu13"
    (home / "lib64").symlink_to("lib")
    (home / "lib" / "libcudart.so").symlink_to("libcudart.so.13")
    target = home / "targets" / "x86_64-linux"
    target.mkdir(parents=True)
    (target / "include").symlink_to("../../include")
    (target / "lib").symlink_to("../../lib")


def cuda_13_2_home() -> Path:
    """A real CUDA 13.2 toolkit home (nvcc, cicc, ptxas, headers, libcudart)."""
    home = _install_target("cuda-13.2", CUDA_13_2) / "nvidia" / "cu13"
    version = subprocess.run(
        [str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert "release 13.2" in version, version
    return home


def cuda_12_9_runtime() -> Path:
    """The directory holding the real CUDA 12.9 ``libcudart.so.12``."""
    lib = _install_target("cuda-12.9-runtime", CUDA_12_9_RUNTIME) / "nvidia/cuda_runtime/lib"
    assert (lib / "libcudart.so.12").is_file(), list(lib.iterdir())
    return lib


def needed(library: Path) -> list[str]:
    """The shared libraries an ELF file asks the loader for (DT_NEEDED)."""
    out = subprocess.run(
        ["readelf", "-d", str(library)], capture_output=True, text=True, check=True
    ).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_env_file(path: Path, env: Mapping[str, str]) -> Path:
    path.write_text("".join(f"{key}={value}\n" for key, value in env.items()))
    return path


@dataclass(frozen=True)
class Outcome:
    """One ``k26-supervisor flashinfer ...`` run: exit status, JSON, progress."""

    command: str
    rc: int
    report: dict[str, Any]
    stderr: str
    seconds: float


def k26(
    verb: str,
    python: Path,
    workspace: Path,
    env_file: Path,
    module: str,
    *,
    timeout_s: float = 900,
) -> Outcome:
    """Run the operator's command (``doctor`` or ``warm``) with ``--json``."""
    args = [
        "flashinfer",
        verb,
        "--python",
        str(python),
        "--arch",
        ARCH,
        "--workspace",
        str(workspace),
        "--module",
        module,
        "--env-file",
        str(env_file),
        "--json",
    ]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    seconds = time.monotonic() - started
    try:
        report = json.loads(done.stdout) if done.stdout.strip() else {}
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{verb} printed no JSON: {done.stdout!r}\n{done.stderr}") from exc
    command = "k26-supervisor " + " ".join(args)
    return Outcome(command, done.returncode, report, done.stderr, seconds)


def flashinfer_says(
    python: Path, workspace: Path, env: Mapping[str, str], module: str
) -> dict[str, Any]:
    """FlashInfer's own view of a module: its spec's ``is_compiled`` and path."""
    code = (
        "import json, importlib\n"
        f"spec = importlib.import_module('flashinfer.jit.{module}').gen_{module}_module()\n"
        "print(json.dumps({'compiled': spec.is_compiled, 'path': str(spec.get_library_path())}))\n"
    )
    done = subprocess.run(
        [str(python), "-c", code],
        env=unit_env(workspace, env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def unit_env(workspace: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The environment a unit runs FlashInfer with (see ``unit_environment``), and
    where ``env`` pins no tvm-ffi cache, the workspace's, as the product's children get
    (``ServingEnv.environment``): never the user's ~/.cache/tvm-ffi."""
    from supervisor.flashinfer import unit_environment
    from supervisor.flashinfer.venv import tvm_ffi_cache

    pinned = {"TVM_FFI_CACHE_DIR": str(tvm_ffi_cache(workspace))}
    return {**os.environ, **pinned, **env, **unit_environment(ARCH, workspace)}


class LayeredVenv:
    """A venv of ours: base interpreter of ``over``, its packages, our own FlashInfer."""

    def __init__(self, directory: Path, over: Path) -> None:
        config = dict(
            line.split(" = ", 1) for line in (over / "pyvenv.cfg").read_text().splitlines()
        )
        base = Path(config["executable"])
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(directory)], check=True)
        self.prefix = directory
        self.python = directory / "bin" / "python"
        self.site = directory / "lib" / f"python{config['version'].rsplit('.', 1)[0]}"
        self.site = self.site / "site-packages"
        underlying = over / "lib" / self.site.parent.name / "site-packages"
        # After our own site-packages on sys.path: our FlashInfer wins, the rest
        # (torch, tvm_ffi, filelock, pip) comes from the serving venv, unchanged.
        (self.site / "k26-layer.pth").write_text(f"{underlying}\n")

    def install(self, wheel: Path) -> None:
        """What an operator's reinstall does: pip replaces our FlashInfer."""
        pip = [str(self.python), "-m", "pip", "install", "--quiet", "--no-deps"]
        done = subprocess.run(
            [*pip, "--no-index", "--force-reinstall", str(wheel)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"

    def keep_wheel_times(self, wheel: Path) -> None:
        """Give every installed file the time its wheel entry carries (pip uses now;
        an installer that keeps file times, as #4489's did, leaves these)."""
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                path = self.site / info.filename
                if info.is_dir() or not path.is_file():
                    continue
                stamp = time.mktime((*info.date_time, 0, 0, -1))
                os.utime(path, (stamp, stamp))


def download_wheel(requirement: str, directory: Path) -> Path:
    """``pip download --no-deps`` (pip's own cache makes a second one cheap)."""
    directory.mkdir(parents=True, exist_ok=True)
    _pip("download", "--quiet", "--no-deps", "--dest", str(directory), requirement)
    (found,) = directory.glob("*.whl")
    return found


def rebuilt_wheel(original: Path, out: Path, changes: Mapping[str, tuple[bytes, bool]]) -> Path:
    """Another build of the same version: ``changes`` maps a member to (text to
    append, whether its entry gets the rebuild's time or keeps the old one).
    RECORD gets the new hashes, as a wheel builder writes it. The rebuild's time is
    taken 2 s ahead: a zip entry keeps whole even seconds (DOS time, rounded down), so
    "now" could read as older than an object a build made a moment ago (it did once, in
    CI: ninja then saw nothing newer and rebuilt nothing)."""
    now = time.localtime(time.time() + 2)[:6]
    record_name = next(
        n for n in zipfile.ZipFile(original).namelist() if n.endswith(".dist-info/RECORD")
    )
    members: dict[str, tuple[zipfile.ZipInfo, bytes]] = {}
    with zipfile.ZipFile(original) as source:
        for info in source.infolist():
            data = source.read(info)
            if info.filename in changes:
                extra, fresh = changes[info.filename]
                data += extra
                if fresh:
                    info = zipfile.ZipInfo(info.filename, date_time=now)
                    info.compress_type = zipfile.ZIP_DEFLATED
            members[info.filename] = (info, data)
    missing = set(changes) - set(members)
    assert not missing, f"not in {original.name}: {missing}"
    lines = []
    for line in members[record_name][1].decode().splitlines():
        name = line.split(",", 1)[0]
        if name in changes:
            data = members[name][1]
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            line = f"{name},sha256={digest.decode()},{len(data)}"
        lines.append(line)
    info = members[record_name][0]
    members[record_name] = (info, ("\n".join(lines) + "\n").encode())
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as target:
        for info, data in members.values():
            target.writestr(info, data)
    return out
