"""The product's core claim: a real FlashInfer precompile for 12.0 on a machine with no GPU.

flashinfer-python 0.7.4's real ``sampling`` module is built with nvcc 13 for
``FLASHINFER_CUDA_ARCH_LIST=12.0`` (``sm_120f``), then doctor must call the
cache warm and valid and a second warm must compile nothing. Then the ways a
cache goes bad: a SIGKILLed builder's stale lock and partial output, a
truncated ``.so``, a fingerprint that no longer matches the venv. Each ends
in a clear verdict and a clean rebuild, never a trusted half-file.

About 70 s per build on 2 cores when the machine is otherwise idle; this
module builds twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.flashinfer import WarmResult, doctor, read_env_file, unit_environment, warm
from supervisor.flashinfer.cache import FINGERPRINT_NAME, QUARANTINE_NAME
from supervisor.flashinfer.fatbin import cuda_targets
from supervisor.flashinfer.venv import SCRIPT

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]

ROOT = Path(__file__).resolve().parents[2]
ARCH = "12.0"


class Serving:
    def __init__(self, workspace: Path) -> None:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "serving-venv.sh"), "0.7"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.fail(f"scripts/serving-venv.sh 0.7 failed:\n{done.stdout}\n{done.stderr}")
        venv = ROOT / ".cache" / "serving-0.7"
        self.python = venv / "bin" / "python"
        self.env = read_env_file(venv / "k26-build.env")
        self.workspace = workspace
        self.dir = workspace / ".cache" / "flashinfer" / "0.7.4" / "120f"
        self.so = self.dir / "cached_ops" / "sampling" / "sampling.so"
        self.lock = self.dir / "cached_ops" / "tmp" / "sampling.lock"

    def doctor(self) -> dict[str, Any]:
        report = asyncio.run(doctor(self.python, ARCH, self.workspace, env=self.env))
        return report.as_dict()

    def warm(self, lines: list[str]) -> WarmResult:
        return asyncio.run(
            warm(self.python, ARCH, self.workspace, progress=lines.append, env=self.env)
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
                warm(self.python, ARCH, self.workspace, progress=progress, env=self.env)
            )
            waiter = asyncio.create_task(seen.wait())
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            assert waiter in done, f"warm ended before the expected line: {lines[-5:]}"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Serving:
    return Serving(tmp_path_factory.mktemp("flashinfer-workspace"))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cold_warm_builds_sampling_for_sm120(serving: Serving) -> None:
    lines: list[str] = []
    result = serving.warm(lines)
    assert result.ok, f"{result.error}\n" + "\n".join(lines[-30:])
    assert result.built == ["sampling"]
    assert any("nvcc" in line and "compute_120f" in line for line in lines), "nvcc did not run"
    print(f"\ncold warm-up of sampling for {ARCH}: {result.duration_s:.1f} s")
    assert {t.name for t in cuda_targets(serving.so.read_bytes())} == {"sm_120f"}
    report = serving.doctor()
    assert report["status"] == "warm", report["problems"]
    module = report["modules"][0]
    assert module["loads"] is True and module["holds_target_arch"] is True
    assert not list((serving.dir / "cached_ops" / "tmp").glob("*.lock")), "build lock left"


def test_second_warm_compiles_nothing_within_2s(serving: Serving) -> None:
    before = (sha(serving.so), serving.so.stat().st_mtime_ns)
    lines: list[str] = []
    result = serving.warm(lines)
    assert result.ok and result.built == []
    assert result.duration_s < 2.0, result.duration_s
    assert not any("nvcc" in line or "building" in line for line in lines), lines
    assert (sha(serving.so), serving.so.stat().st_mtime_ns) == before
    print(f"\nwarm-cache verification: {result.duration_s:.3f} s")


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


def test_sigkilled_builder_then_clean_rebuild(serving: Serving) -> None:
    env = {**os.environ, **serving.env, **unit_environment(ARCH, serving.workspace)}
    builder = subprocess.Popen(
        [str(serving.python), str(SCRIPT), "build", "--module", "sampling"],
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
    assert result.built == ["sampling"]
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


def test_workspace_filling_up_mid_build(serving: Serving, tmp_path: Path) -> None:
    """A real ENOSPC from nvcc: a clear error, and no .so, lock or fingerprint left."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    # Room for FlashInfer's log, build.ninja and two objects, not for sampling.so's third.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    try:
        lines: list[str] = []
        result = asyncio.run(
            warm(
                serving.python,
                ARCH,
                small,
                progress=lines.append,
                env=serving.env,
                min_free_bytes=0,  # let it start, so the disk fills during the build
            )
        )
        assert not result.ok and result.exit_code == 74
        assert result.error is not None and "filled up during the build" in result.error
        assert not list(small.rglob("*.so")), "no half-written module may stay in place"
        assert [p.name for p in small.rglob("*.lock")] == ["k26-warm.lock"]  # ours, unheld
        assert not list(small.rglob(FINGERPRINT_NAME))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
