"""The product's core claim: a real FlashInfer precompile for 12.0 on a machine with no GPU.

flashinfer-python 0.7.4's real ``sampling`` module is built with nvcc 13 for
``FLASHINFER_CUDA_ARCH_LIST=12.0`` (``sm_120f``), then doctor must call the
cache warm and valid and a second warm must compile nothing. Then the ways a
cache goes bad: a SIGKILLed builder's stale lock and partial output, a
truncated ``.so``, a fingerprint that no longer matches the venv. Each ends
in a clear verdict and a clean rebuild, never a trusted half-file.

The cold build of ``sampling`` is the session's (``sampling_build``, see
builds.py): this module asserts on it, and every other test here restores it at
its own path. The kill and full-disk tests need *a* build running, and build a
small module (``small_build``) instead of ``sampling`` again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.flashinfer import WarmResult, cache, doctor, unit_environment, warm
from supervisor.flashinfer.cache import FINGERPRINT_NAME, QUARANTINE_NAME
from supervisor.flashinfer.fatbin import cuda_targets
from supervisor.flashinfer.venv import SCRIPT

from . import provider_wheel
from .builds import ARCH, SessionBuild

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]


class Serving:
    """A session build, restored for this test, with doctor and warm around it."""

    def __init__(self, build: SessionBuild, *, restore: bool = True) -> None:
        self.build = build
        self.python = build.python
        self.env = build.env
        self.venv = build.python.parent.parent
        self.workspace = build.restore() if restore else build.workspace
        self.dir = build.dir
        self.so = build.so
        self.lock = build.lock

    def doctor(self) -> dict[str, Any]:
        report = asyncio.run(
            doctor(self.python, ARCH, self.workspace, (self.build.module,), env=self.env)
        )
        return report.as_dict()

    def warm(self, lines: list[str]) -> WarmResult:
        return asyncio.run(
            warm(
                self.python,
                ARCH,
                self.workspace,
                (self.build.module,),
                progress=lines.append,
                env=self.env,
            )
        )

    def warm_until(self, lines: list[str], stop: Callable[[str], bool]) -> None:
        """Run warm and cancel it (as a daemon shutting down would) once ``stop`` sees a line."""

        async def run() -> None:
            seen = asyncio.Event()

            def progress(line: str) -> None:
                lines.append(line)
                if stop(line):
                    seen.set()

            task = asyncio.create_task(
                warm(
                    self.python,
                    ARCH,
                    self.workspace,
                    (self.build.module,),
                    progress=progress,
                    env=self.env,
                )
            )
            waiter = asyncio.create_task(seen.wait())
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            assert waiter in done, f"warm ended before the expected line: {lines[-5:]}"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())


@pytest.fixture
def serving(sampling_build: SessionBuild) -> Serving:
    """The session's sampling build for 12.0, as built, at its own path."""
    return Serving(sampling_build)


@pytest.fixture
def small(small_build: SessionBuild) -> Serving:
    """A small module's build, for the tests where any real build would do."""
    return Serving(small_build)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cold_warm_builds_sampling_for_sm120(sampling_build: SessionBuild) -> None:
    """The session's cold build is this test's subject: every other test restores it."""
    result, lines = sampling_build.result, sampling_build.lines
    assert result.ok, f"{result.error}\n" + "\n".join(lines[-30:])
    assert result.built == ["sampling"]
    assert any("nvcc" in line and "compute_120f" in line for line in lines), "nvcc did not run"
    # Verified by the build's own interpreter: no third import of torch and FlashInfer.
    assert "k26: probed sampling in the build's own process" in lines, lines[-10:]
    print(f"\ncold warm-up of sampling for {ARCH}: {result.duration_s:.1f} s")
    serving = Serving(sampling_build)
    assert {t.name for t in cuda_targets(serving.so.read_bytes())} == {"sm_120f"}
    report = serving.doctor()
    assert report["status"] == "warm", report["problems"]
    module = report["modules"][0]
    assert module["loads"] is True and module["holds_target_arch"] is True
    assert module["source"] == "jit"  # no provider wheel in this venv: the workspace serves it
    assert not list((serving.dir / "cached_ops" / "tmp").glob("*.lock")), "build lock left"


def test_second_warm_compiles_nothing(serving: Serving) -> None:
    """Its speed is bench/flashinfer_warm.py's to measure; here only that nothing builds."""
    before = (sha(serving.so), serving.so.stat().st_mtime_ns)
    lines: list[str] = []
    result = serving.warm(lines)
    assert result.ok and result.built == []
    assert not any("nvcc" in line or "building" in line for line in lines), lines
    assert (sha(serving.so), serving.so.stat().st_mtime_ns) == before
    print(f"\nwarm-cache verification: {result.duration_s:.3f} s")


def _provider_venv(serving: Serving, where: Path, archs: list[str]) -> Path:
    """A venv over the serving venv with a provider wheel serving the built sampling.so."""
    venv = serving.venv
    cfg = dict(
        line.split(" = ", 1)
        for line in (venv / "pyvenv.cfg").read_text().splitlines()
        if " = " in line
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    python = provider_wheel.layered_venv(Path(cfg["executable"]), site, where / "venv")
    wheels = provider_wheel.provider_wheels(
        where / "wheels", {"sampling": serving.so}, version="0.7.4+cu130", archs=archs
    )
    provider_wheel.pip_install(python, wheels)
    return python


def _flashinfer_loads_from(python: Path, workspace: Path, env: dict[str, str]) -> str:
    """Ask FlashInfer itself, in that venv, which file it would load for sampling."""
    code = "from flashinfer.jit.sampling import gen_sampling_module as g; print(g().get_library_path())"
    done = subprocess.run(
        [str(python), "-c", code],
        env={**os.environ, **env, **unit_environment(ARCH, workspace)},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def test_a_provider_wheel_serves_sampling_and_warm_builds_nothing(
    serving: Serving, tmp_path: Path
) -> None:
    """FlashInfer 0.7's loader picks the provider; doctor says so and warm builds nothing."""
    python = _provider_venv(serving, tmp_path, ["sm120f"])
    workspace = tmp_path / "ws"  # no JIT cache at all
    provider_so = _flashinfer_loads_from(python, workspace, serving.env)
    assert "k26test_jit_cache_provider/jit_cache/sampling/sampling.so" in provider_so
    report = asyncio.run(doctor(python, ARCH, workspace, env=serving.env))
    module = report.modules[0]
    assert report.status == "warm", report.problems
    assert module.source == "provider" and module.path == provider_so
    assert "flashinfer-jit-cache-k26test-sm120f 0.7.4+cu130, sm120f" in str(module.source_detail)
    assert module.loads is True and module.holds_target_arch and module.fingerprint_ok
    lines: list[str] = []
    result = asyncio.run(warm(python, ARCH, workspace, progress=lines.append, env=serving.env))
    assert result.ok and result.built == [], f"{result.error}\n" + "\n".join(lines[-20:])
    assert not any("nvcc" in line or "building" in line for line in lines), lines
    assert any("served by provider k26test" in line for line in lines), lines
    assert not (workspace / ".cache/flashinfer/0.7.4/120f/cached_ops/sampling").exists()
    fingerprint = json.loads(
        (workspace / ".cache/flashinfer/0.7.4/120f" / FINGERPRINT_NAME).read_text()
    )
    assert fingerprint["modules"]["sampling"]["source"] == "provider"
    wheels = {w["name"] for w in fingerprint["identity"]["aot_wheels"]}
    assert wheels == {"flashinfer-jit-cache", "flashinfer-jit-cache-k26test-sm120f"}

    # A provider file that is not what pip installed: flagged, never "repaired" by a build,
    # and never moved (it is the wheel's file, not the workspace's).
    provider = Path(provider_so)
    provider.write_bytes(provider.read_bytes() + b"\0")
    report = asyncio.run(doctor(python, ARCH, workspace, env=serving.env))
    assert report.status == "needs-warmup"
    assert any("sha256 is not the one in its RECORD" in p for p in report.problems), report.problems
    result = asyncio.run(warm(python, ARCH, workspace, env=serving.env))
    assert not result.ok and "reinstall that wheel" in str(result.error)
    assert provider.exists()

    # The provider uninstalled: FlashInfer goes back to JIT, and the fingerprint that
    # recorded the wheel no longer vouches for anything.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "uninstall", "--quiet", "-y",
         "flashinfer-jit-cache-k26test-sm120f"],
        check=True, timeout=120,
    )  # fmt: skip
    report = asyncio.run(doctor(python, ARCH, workspace, env=serving.env))
    assert report.modules[0].source == "jit" and report.status == "needs-warmup"
    assert report.fingerprint["state"] == "mismatch", report.fingerprint
    assert any("aot_wheels" in d for d in report.fingerprint["differences"])


def test_a_provider_for_another_arch_is_not_used(serving: Serving, tmp_path: Path) -> None:
    """FlashInfer only takes a provider whose archs run on the target: sm90a does not on 12.0."""
    python = _provider_venv(serving, tmp_path, ["sm90a"])
    workspace = tmp_path / "ws"
    loads_from = _flashinfer_loads_from(python, workspace, serving.env)
    assert loads_from.startswith(str(workspace)), loads_from
    report = asyncio.run(doctor(python, ARCH, workspace, env=serving.env))
    assert report.modules[0].source == "jit"
    assert "sampling: not compiled" in report.problems


def test_a_module_whose_header_is_missing_fails_before_any_build(
    serving_07: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """norm includes cublasLt.h, which this toolkit lacks: named with what provides it."""
    python, env = serving_07
    workspace = tmp_path / "ws"
    report = asyncio.run(doctor(python, ARCH, workspace, ("norm",), env=env))
    needs = [p for p in report.problems if "the build needs cublasLt.h" in p]
    assert needs and "libcublas-dev-13-0" in needs[0] and "nvidia-cublas" in needs[0], (
        report.problems
    )
    assert "trtllm/common/cudaUtils.h" in needs[0]
    lines: list[str] = []
    started = time.monotonic()
    result = asyncio.run(warm(python, ARCH, workspace, ("norm",), progress=lines.append, env=env))
    assert not result.ok and "the build needs cublasLt.h" in str(result.error)
    assert not any("building norm" in line for line in lines), lines
    assert not list(workspace.rglob("*.so")) and not list(workspace.rglob("*.o"))
    print(f"\nnorm refused before building, in {time.monotonic() - started:.1f} s")


def test_truncated_so_is_never_trusted(serving: Serving) -> None:
    data = serving.so.read_bytes()
    serving.so.write_bytes(data[: len(data) // 2])  # what a kill mid-link leaves
    truncated = sha(serving.so)
    report = serving.doctor()
    assert report["status"] == "needs-warmup"
    module = report["modules"][0]
    assert module["compiled"] is True, "FlashInfer itself would trust this file"
    assert module["complete"] is False
    assert any("truncated" in p for p in report["problems"])
    # Warm quarantines it before building; stop it there, as a shutdown would.
    lines: list[str] = []
    serving.warm_until(lines, lambda line: line.startswith("k26: building"))
    assert not serving.so.exists()
    quarantined = list((serving.workspace / ".cache/flashinfer" / QUARANTINE_NAME).rglob("*.so"))
    assert truncated in {sha(p) for p in quarantined}
    assert not (serving.dir / FINGERPRINT_NAME).exists()


def test_sigkilled_builder_then_clean_rebuild(small_build: SessionBuild) -> None:
    """A real builder SIGKILLed while nvcc compiles (any module would do: a small one)."""
    serving = Serving(small_build, restore=False)
    shutil.rmtree(cache.cache_root(serving.workspace), ignore_errors=True)  # cold
    module = small_build.module
    env = {**os.environ, **serving.env, **unit_environment(ARCH, serving.workspace)}
    builder = subprocess.Popen(
        [str(serving.python), str(SCRIPT), "build", "--module", module],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert builder.stdout is not None
    for line in builder.stdout:
        if line.startswith("[1/"):  # nvcc is compiling: the lock is held, outputs half-made
            break
    else:
        pytest.fail("the builder ended before nvcc started")
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()
    builder.stdout.close()
    assert serving.lock.exists(), "a SIGKILLed builder leaves its lock file"
    report = serving.doctor()
    assert report["status"] == "needs-warmup"
    assert any("stale lock left by a dead builder" in p for p in report["problems"])

    lines: list[str] = []
    result = serving.warm(lines)
    assert result.ok, f"{result.error}\n" + "\n".join(lines[-30:])
    assert result.built == [module]
    assert str(serving.lock) in result.removed_locks
    assert result.quarantined, "the partial build dir must be moved aside"
    assert serving.doctor()["status"] == "warm"


def test_fingerprint_mismatch_after_version_change(serving: Serving) -> None:
    """A venv changed under a warm cache (here: the torch it was built with)."""
    path = serving.dir / FINGERPRINT_NAME
    recorded = json.loads(path.read_text())
    recorded["identity"]["torch"]["version"] = "2.12.0+cpu"
    path.write_text(json.dumps(recorded))
    old = sha(serving.so)
    report = serving.doctor()
    assert report["status"] == "needs-warmup"
    fingerprint = report["fingerprint"]
    assert fingerprint["state"] == "mismatch"
    assert "torch.version: '2.12.0+cpu' -> '2.13.0+cpu'" in fingerprint["differences"]
    lines: list[str] = []
    serving.warm_until(lines, lambda line: line.startswith("k26: building"))
    assert any("fingerprint mismatch" in line for line in lines)
    assert not serving.so.exists() and not path.exists()
    quarantined = list((serving.workspace / ".cache/flashinfer" / QUARANTINE_NAME).rglob("*.so"))
    assert old in {sha(p) for p in quarantined}


def test_workspace_filling_up_mid_build(small_build: SessionBuild, tmp_path: Path) -> None:
    """A real ENOSPC from the build (any module would do: a small one)."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs needs root")
    # Room for every file the build writes but the module itself, and half of that:
    # tmpfs counts whole pages, so each file is rounded up to one.
    files = small_build.kept_files()
    so_name = f"cached_ops/{small_build.module}/{small_build.module}.so"
    page = 4096
    pages = sum(-(-size // page) for name, size in files.items() if name != so_name)
    size = (pages + files[so_name] // page // 2) * page
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)], check=True)
    try:
        lines: list[str] = []
        result = asyncio.run(
            warm(
                small_build.python,
                ARCH,
                small,
                (small_build.module,),
                progress=lines.append,
                env=small_build.env,
                min_free_bytes=0,  # let it start, so the disk fills during the build
            )
        )
        assert not result.ok and result.exit_code == 74, (result.error, lines[-10:])
        assert result.error is not None and "filled up during the build" in result.error
        assert any("No space left on device" in line for line in lines), lines[-20:]
        assert any(line.startswith("[1/") for line in lines), "the build never started"
        assert not list(small.rglob("*.so")), "no half-written module may stay in place"
        assert [p.name for p in small.rglob("*.lock")] == ["k26-warm.lock"]  # ours, unheld
        assert not list(small.rglob(FINGERPRINT_NAME))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
