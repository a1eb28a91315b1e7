"""The warm-up alongside the load, with a real cold nvcc build (issue 17).

FlashInfer 0.7.4 accepts 12.0 unpatched, so the daemon starts the unit at once
and builds the configured module while the stand-in loads; the stand-in crashes
on a sampled request unless that module is in the workspace
(``--sampling-module``), so a probe sent before the warm-up ended would show.
Then a real build racing a real build of the same module into one workspace: the
product's warm-up, and FlashInfer's own JIT in a second process as a server
would run it. The subject is the overlap and the race, not which module: each
test builds a small one (about 25 s, still several times the stand-in's load),
never ``sampling`` again (the precompile tests own that build).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.adapters.warmup import Warmup
from supervisor.core.config import FlashInferSection
from supervisor.core.status import StatusBoard
from supervisor.flashinfer import doctor, unit_environment
from supervisor.flashinfer.cache import FINGERPRINT_NAME
from supervisor.flashinfer.fatbin import cuda_targets
from supervisor.fleet import accepted
from tests.waiting import wait_until

from .builds import SMALL_MODULE
from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = [pytest.mark.integration, pytest.mark.flashinfer, pytest.mark.precompile]

ARCH = "12.0"
LOAD_S = 5  # well under a cold build of the module (25-60 s): the unit is loaded first
MODULE = SMALL_MODULE


def overlap_config(tmp_path: Path, unit: StandinUnit, python: Path, env: dict[str, str]) -> Path:
    env_file = tmp_path / "build.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    workspace = tmp_path / "workspace"
    extra = (
        f'\n[flashinfer]\nenabled = true\npython = "{python}"\narch = "{ARCH}"\n'
        f'workspace = "{workspace}"\nenv_file = "{env_file}"\ntimeout_s = 900\n'
        f'modules = ["{MODULE}"]\n'
    )
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    text = config.read_text().replace("[flashinfer]\nenabled = false\n", extra)
    config.write_text(text.replace("startup_deadline_s = 30", "startup_deadline_s = 120"))
    return config


def logged_at(sup: Supervisor, pattern: str) -> float:
    """The monotonic stamp of the daemon's first log line matching ``pattern``."""
    found = re.search(pattern + r".*monotonic=([0-9.]+)", sup.log.read_text())
    assert found, f"no {pattern!r} in the log:\n{sup.log.read_text()[-3000:]}"
    return float(found.group(1))


def started_at(unit: StandinUnit) -> float:
    micros = int(unit.show("ExecMainStartTimestampMonotonic") or 0)
    return micros / 1e6


def loaded_and_waiting(unit: StandinUnit) -> Callable[[dict[str, object]], bool]:
    def check(status: dict[str, object]) -> bool:
        u = unit_status(status, unit.name)  # type: ignore[arg-type]
        return bool(u["state"] == "warming" and u["active_state"] == "active")

    return check


def test_the_unit_starts_at_once_and_is_ready_only_after_warm_up_and_probe(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tmp_path: Path,
) -> None:
    python, env = serving_07
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    unit = standin_unit(
        "--load-seconds",
        str(LOAD_S),
        "--fail",
        "sampling-arch",
        "--flashinfer-cache",
        str(workspace),
        "--sampling-module",
        MODULE,
    )
    sup = supervise(overlap_config(tmp_path, unit, python, env))
    # Started while the cold build runs: the unit is up before the warm-up is done.
    status = sup.wait_status(
        lambda s: (
            unit_status(s, unit.name)["state"] in ("starting", "loading")
            and (s.get("warmup") or {}).get("state") == "running"
        ),
        timeout_s=120,
    )
    plan = unit_status(status, unit.name)["warmup"]
    assert plan["mode"] == "overlapped", plan
    assert "FlashInfer 0.7.4's gate accepts 12.0" in plan["why"]
    assert status["warmup"]["mode"] == "overlapped"
    wait_until(lambda: started_at(unit) > 0, 60, "the unit's start")
    # Loaded before the build ended: held out of ready, no probe, no READY=1.
    status = sup.wait_status(loaded_and_waiting(unit), timeout_s=LOAD_S + 120)
    assert status["ready"] is False and status["warmup"]["state"] == "running"
    assert not any("READY=1" in m for _, m in sup.notify.messages)
    status = sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", 900)
    ready_at = sup.notify.wait_for("READY=1", timeout_s=30)
    warm_done = logged_at(sup, rf"state: unit={re.escape(unit.name)} probing")
    probed = logged_at(sup, rf"state: unit={re.escape(unit.name)} ready")
    assert started_at(unit) < warm_done < probed <= ready_at
    assert status["warmup"]["state"] == "warm" and status["ready"] is True
    assert status["warmup"]["duration_s"] > LOAD_S  # a real cold build, longer than the load
    # The first sampled request came after the warm-up: the stand-in never crashed.
    assert "FlashInfer requires" not in unit.output.read_text()
    assert unit.show("NRestarts") == "0" and unit_status(status, unit.name)["restarts"] == 0


def test_supervisor_sigkilled_mid_overlap_resumes_without_restarting_the_unit(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    serving_07: tuple[Path, dict[str, str]],
    tmp_path: Path,
) -> None:
    python, env = serving_07
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    unit = standin_unit(
        "--load-seconds",
        str(LOAD_S),
        "--fail",
        "sampling-arch",
        "--flashinfer-cache",
        str(workspace),
        "--sampling-module",
        MODULE,
    )
    config = overlap_config(tmp_path, unit, python, env)
    first = supervise(config)
    first.wait_status(loaded_and_waiting(unit), timeout_s=LOAD_S + 180)
    pid = unit.main_pid()
    first.proc.kill()  # the build it ran goes on as an orphan, holding FlashInfer's lock
    first.proc.wait()
    assert not any("READY=1" in m for _, m in first.notify.messages)
    second = supervise(config)
    status = second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "warming", 60)
    assert status["ready"] is False, status  # found loaded, but not ready before the warm-up
    status = second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", 900)
    ready_at = second.notify.wait_for("READY=1", timeout_s=30)
    assert logged_at(second, rf"state: unit={re.escape(unit.name)} probing") <= ready_at
    assert status["warmup"]["state"] == "warm"
    assert unit.main_pid() == pid, "the unit that was up must not be restarted"
    assert "FlashInfer requires" not in unit.output.read_text()


# --- a real build racing a real build --------------------------------------------------

# What a server does on its first use of a module: FlashInfer's own JIT, under its lock.
SERVER_JIT = f"""
from flashinfer.jit.{MODULE} import gen_{MODULE}_module
m = gen_{MODULE}_module().build_and_load()
print("K26-SERVER-LOADED", flush=True)
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_server_jit_racing_the_warm_up_leaves_one_complete_trusted_module(
    serving_07: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = serving_07
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    cache_dir = workspace / ".cache" / "flashinfer" / "0.7.4" / "120f"
    so = cache_dir / "cached_ops" / MODULE / f"{MODULE}.so"
    env_file = tmp_path / "build.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    cfg = FlashInferSection(
        python=python,
        arch=ARCH,
        workspace=workspace,
        env_file=env_file,
        timeout_s=900,
        modules=(MODULE,),
    )
    server_env = {**os.environ, **env, **unit_environment(ARCH, workspace)}
    lines: list[str] = []
    compiling = asyncio.Event()

    async def race() -> tuple[object, subprocess.CompletedProcess[str]]:
        board = StatusBoard(version="t", config_path="c")
        warmup = Warmup(cfg, board, accepted_record=accepted.record_path(tmp_path / "state"))
        warmup._say = lambda line: (lines.append(line), line.startswith("[1/") and compiling.set())  # type: ignore[method-assign]
        task = asyncio.create_task(warmup.ensure(recheck=False, patch_allowed=False))
        waiter = asyncio.create_task(compiling.wait())
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        assert waiter in done, f"the warm-up ended before nvcc ran: {lines[-10:]}"
        # nvcc is compiling under FlashInfer's lock: the "server" asks for the module now.
        server = asyncio.create_task(
            asyncio.to_thread(
                subprocess.run,
                [str(python), "-c", SERVER_JIT],
                env=server_env,
                capture_output=True,
                text=True,
                timeout=900,
            )
        )
        outcome = await task
        return outcome, await server

    started = time.monotonic()
    outcome, server = asyncio.run(race())
    print(f"\nraced build: {time.monotonic() - started:.1f} s")
    assert outcome.ok, f"{outcome.error}\n" + "\n".join(lines[-30:])  # type: ignore[attr-defined]
    assert outcome.built == (MODULE,)  # type: ignore[attr-defined]
    assert server.returncode == 0 and "K26-SERVER-LOADED" in server.stdout, server.stderr[-3000:]
    # One complete module for the arch, that loads, and a fingerprint that vouches for it.
    assert {t.name for t in cuda_targets(so.read_bytes())} == {"sm_120f"}
    report = asyncio.run(doctor(python, ARCH, workspace, (MODULE,), env=env)).as_dict()
    assert report["status"] == "warm", report["problems"]
    module = report["modules"][0]
    assert module["complete"] and module["loads"] is True and module["fingerprint_ok"]
    fingerprint = json.loads((cache_dir / FINGERPRINT_NAME).read_text())
    entry = fingerprint["modules"][MODULE]
    assert (entry["sha256"], entry["size"]) == (sha(so), so.stat().st_size)
    assert entry["path"] == str(so)
