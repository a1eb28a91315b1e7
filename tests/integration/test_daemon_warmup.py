"""The daemon with a real serving venv: no start onto a cache that cannot be warmed."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from k26dev import sandbox

from .builds import SMALL_MODULE
from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = [pytest.mark.integration, pytest.mark.flashinfer]


def test_unwritable_workspace_fails_clearly_and_never_starts_the_unit(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tiny_mount: Path,
    tmp_path: Path,
) -> None:
    python, env = serving_07
    env_file = tmp_path / "build.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_mount)], check=True)
    unit = standin_unit("--fail", "sampling-arch", "--flashinfer-cache", str(tiny_mount))
    extra = (
        f'\n[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{tiny_mount}"\nenv_file = "{env_file}"\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    # Replace the default [flashinfer] enabled = false section with the real one.
    config.write_text(config.read_text().replace("[flashinfer]\nenabled = false\n", extra))
    sup = supervise(config)
    # Nothing can serve until an operator fixes the workspace: the start fails at once.
    status = sup.cannot_start(timeout_s=120)
    assert status["warmup"]["state"] == "failed"
    assert "not writable" in (status["warmup"]["error"] or ""), status["warmup"]
    assert status["ready"] is False
    # Warm-up failed, so the unit was never started onto a cold cache.
    assert unit_status(status, unit.name)["state"] == "failed"
    assert "not writable" in status["supervisor"]["exit"]["reason"]
    assert unit.show("NRestarts") == "0"
    assert unit.show("ExecMainStartTimestampMonotonic") == "0"
    assert not unit.output.exists()


def test_a_serving_venv_that_answers_nonsense_never_leaves_the_unit_warming(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # An interpreter that answers every question with JSON of the wrong shape: the
    # warm-up's code meets types it never expected. The unit must not wait forever.
    python = tmp_path / "python"
    python.write_text(
        '#!/bin/sh\necho \'K26-RESULT {"identity": {"flashinfer": 5}, "flashinfer": 5}\'\n'
    )
    python.chmod(0o755)
    unit = standin_unit()
    extra = (
        f'\n[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{tmp_path / "ws"}"\nwarmup_attempts = 2\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    config.write_text(config.read_text().replace("[flashinfer]\nenabled = false\n", extra))
    sup = supervise(config)
    # A broken serving venv: no unit can start, so the start fails fast, saying why.
    status = sup.cannot_start(timeout_s=60)
    assert unit_status(status, unit.name)["state"] == "failed"
    assert "warm-up" in (unit_status(status, unit.name)["reason"] or ""), status
    assert status["warmup"]["state"] == "failed" and status["warmup"]["error"]
    assert unit.show("ExecMainStartTimestampMonotonic") == "0"  # never started


def test_pytorch_sampling_last_resort_when_warm_up_cannot_succeed(
    bus_env: sandbox.SandboxInfo,
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tiny_mount: Path,
    tmp_path: Path,
) -> None:
    python, _build_env = serving_07
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_mount)], check=True)
    # As the shipped units do: the backend comes from an optional EnvironmentFile.
    env_dir = Path(bus_env.runtime_dir) / "k26-supervisor" / "sampling"
    unit = standin_unit(
        "--fail",
        "sampling-arch",
        "--flashinfer-cache",
        str(tiny_mount),
        "--sampling-backend",
        "${SGLANG_SAMPLING_BACKEND}",
        extra=f"Environment=SGLANG_SAMPLING_BACKEND=flashinfer\nEnvironmentFile=-{env_dir}/%n.env\n",
    )
    extra = (
        f'\n[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{tiny_mount}"\npytorch_sampling_fallback = true\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    config.write_text(config.read_text().replace("[flashinfer]\nenabled = false\n", extra))
    sup = supervise(config)
    status = sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", timeout_s=120)
    u = unit_status(status, unit.name)
    assert u["sampling_backend"] == "pytorch" and status["ready"] is True
    assert (env_dir / f"{unit.name}.env").read_text().endswith("SGLANG_SAMPLING_BACKEND=pytorch\n")
    metrics = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=5).text
    assert f'k26_sampling_backend_pytorch{{unit="{unit.name}"}} 1.0' in metrics


@pytest.mark.precompile
def test_kill9_while_warming_resumes_and_never_starts_onto_a_cold_cache(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tmp_path: Path,
) -> None:
    """A real cold precompile, the supervisor SIGKILLed in the middle of it (any module
    would do: a small one)."""
    python, env = serving_07
    env_file = tmp_path / "build.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    # Crashes on the first sampled request unless the module is cached.
    unit = standin_unit(
        "--fail", "sampling-arch", "--flashinfer-cache", str(workspace),
        "--sampling-module", SMALL_MODULE,
    )  # fmt: skip
    extra = (
        f'\n[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{workspace}"\nenv_file = "{env_file}"\ntimeout_s = 900\n'
        f'modules = ["{SMALL_MODULE}"]\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    text = config.read_text().replace("[flashinfer]\nenabled = false\n", extra)
    config.write_text(text.replace("startup_deadline_s = 30", "startup_deadline_s = 60"))
    first = supervise(config)
    first.wait_status(
        lambda s: (
            unit_status(s, unit.name)["state"] == "warming"
            and (s.get("warmup") or {}).get("state") == "running"
        ),
        timeout_s=60,
    )
    first.proc.kill()
    first.proc.wait()
    second = supervise(config)
    status = second.wait_status(
        lambda s: unit_status(s, unit.name)["state"] == "ready", timeout_s=900
    )
    assert status["ready"] is True and status["warmup"]["state"] == "warm"
    # Never started onto the cold cache: the stand-in never hit FlashInfer's rejection.
    assert "FlashInfer requires" not in unit.output.read_text()
    assert list(workspace.rglob(f"cached_ops/{SMALL_MODULE}/{SMALL_MODULE}.so"))


def test_a_cache_root_only_the_serving_venv_s_sources_name_is_watched_where_pinned(
    bus_env: sandbox.SandboxInfo,
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tiny_mount: Path,
    tmp_path: Path,
) -> None:
    """Issue 37, part 4: a cache root that the serving venv's installed code reads and
    that no known cache follows (read from its sources by ``k26_caches.py roots``) is
    watched from READY on when the unit pins it, and a file it gains there is JIT
    after READY under the cache ``other``. The warm-up cannot succeed here (a
    read-only workspace), so the unit serves with the pytorch sampling last resort,
    as in the test above: the daemon knows the serving venv either way."""
    from supervisor.core import jit_caches
    from supervisor.flashinfer.venv import ServingEnv
    from supervisor.fleet import cache_layers

    python, _build_env = serving_07
    found = asyncio.run(cache_layers.cache_roots(ServingEnv(python, "12.0", tiny_mount)))
    unknown = jit_caches.unknown(found.variables)
    assert unknown, found.variables  # FlashInfer 0.7.4 reads several (autotune, ...)
    variable = unknown[0]
    root = tmp_path / "unknown-root"
    root.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_mount)], check=True)
    env_dir = Path(bus_env.runtime_dir) / "k26-supervisor" / "sampling"
    unit = standin_unit(
        "--fail", "sampling-arch", "--flashinfer-cache", str(tiny_mount),
        "--sampling-backend", "${SGLANG_SAMPLING_BACKEND}",
        extra=(
            f"Environment=SGLANG_SAMPLING_BACKEND=flashinfer {variable}={root}\n"
            f"EnvironmentFile=-{env_dir}/%n.env\n"
        ),
    )  # fmt: skip
    extra = (
        f'\n[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{tiny_mount}"\npytorch_sampling_fallback = true\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    config.write_text(config.read_text().replace("[flashinfer]\nenabled = false\n", extra))
    sup = supervise(config)
    sup.wait_status(
        lambda s: str(root) in unit_status(s, unit.name)["jit_after_ready"]["watched"],
        timeout_s=180,
    )
    (root / "tuned_kernel.json").write_text("{}\n")  # what the server's code writes there
    status = sup.wait_status(
        lambda s: unit_status(s, unit.name)["jit_after_ready"]["count"] >= 1, timeout_s=30
    )
    (seen,) = unit_status(status, unit.name)["jit_after_ready"]["latest"]
    assert seen["cache"] == "other" and seen["path"] == str(root / "tuned_kernel.json"), seen
