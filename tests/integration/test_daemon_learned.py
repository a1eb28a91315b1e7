"""Modules a ready unit built are learned, and the warm-up after a wiped cache covers them.

The stand-in's first forward JIT-builds a module the config never names
(``--jit-module``: a real build by the serving venv's FlashInfer 0.7.4 into the
unit's workspace, as a real model's kernels would be), while the daemon's
warm-up builds the configured one. After the unit is ready, both are in
``k26-learned-modules.json``. The cache is then wiped (``rm -rf
.cache/flashinfer``) and the unit SIGKILLed: the restart's warm-up builds
both before the start, so the server builds nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.core.jit_caches import CACHE_ENV
from supervisor.flashinfer import learned
from tests.waiting import wait_until

from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = [pytest.mark.integration, pytest.mark.flashinfer]

CONFIGURED = "api_log_stats"  # two small translation units: a cheap real build
SERVER_BUILT = "locality_domain"  # one translation unit, mostly host code


def test_what_a_ready_unit_built_is_learned_and_warmed_after_a_wipe(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tmp_path: Path,
) -> None:
    python, env = serving_07
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env_file = tmp_path / "build.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    unit_env = (
        f"EnvironmentFile={env_file}\nEnvironment=FLASHINFER_WORKSPACE_BASE={workspace} "
        "FLASHINFER_CUDA_ARCH_LIST=12.0 TORCH_CUDA_ARCH_LIST=12.0\n"
    )
    unit = standin_unit(
        "--flashinfer-cache", str(workspace), "--jit-python", str(python),
        "--jit-module", SERVER_BUILT, extra=unit_env,
    )  # fmt: skip
    section = (
        f'[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{workspace}"\nenv_file = "{env_file}"\nmodules = ["{CONFIGURED}"]\n'
        # In order, so the proof is clean: what the warm-up covers is built before the start.
        'overlap = "never"\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    text = config.read_text().replace("[flashinfer]\nenabled = false\n", section)
    config.write_text(text.replace("startup_deadline_s = 30", "startup_deadline_s = 900"))
    sup = supervise(config)
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", timeout_s=1200)

    def both_learned() -> dict[str, object] | None:
        known = learned.learned(workspace, "12.0")
        return known if {CONFIGURED, SERVER_BUILT} <= set(known) else None

    known = wait_until(both_learned, 60, "both modules in k26-learned-modules.json")
    assert known[SERVER_BUILT]["seen_after"] == unit.name  # type: ignore[index]
    assert unit.output.read_text().count(f"JIT-building FlashInfer's {SERVER_BUILT}") == 1
    doctor = subprocess.run(
        [sys.executable, "-m", "supervisor", "flashinfer", "doctor", "--python", str(python),
         "--arch", "12.0", "--workspace", str(workspace), "--env-file", str(env_file),
         "--module", CONFIGURED, "--unit", unit.name, "--bus", "user",
         "--state-dir", str(tmp_path / "daemon-state")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(f"\n$ k26-supervisor flashinfer doctor ... --module {CONFIGURED}\n{doctor.stdout}")
    assert f"learned from ready units: {SERVER_BUILT}" in doctor.stdout, doctor.stdout
    # --unit: every cache root the unit's environment pins, its learned shapes, and the
    # cache roots the serving venv's code can write that nothing here watches (read
    # from its sources: this venv's torch and FlashInfer 0.7 have several).
    for cache in CACHE_ENV:
        assert f"{unit.name} cache {cache}: " in doctor.stdout, cache
    assert f"{unit.name} learned shapes: " in doctor.stdout
    assert "problem: the serving venv's code can write a cache named by" in doctor.stdout
    assert doctor.returncode == 2, (doctor.returncode, doctor.stderr)

    # Wipe FlashInfer's cache (the learned record is beside it, not in it), then kill.
    shutil.rmtree(workspace / ".cache" / "flashinfer")
    log_before = sup.log.read_text()
    os.kill(unit.main_pid(), signal.SIGKILL)
    sup.wait_status(
        lambda s: (
            unit_status(s, unit.name)["restarts"] >= 1
            and unit_status(s, unit.name)["state"] == "ready"
        ),
        timeout_s=1200,
    )
    after = sup.log.read_text()[len(log_before) :]
    building = [line for line in after.splitlines() if "k26: building " in line]
    assert building and CONFIGURED in building[0] and SERVER_BUILT in building[0], building
    # The server found both warm: its only JIT build was the first one.
    assert unit.output.read_text().count(f"JIT-building FlashInfer's {SERVER_BUILT}") == 1
    record = json.loads((workspace / learned.LEARNED_NAME).read_text())
    assert set(record["archs"]["12.0"]["modules"]) == {CONFIGURED, SERVER_BUILT}
