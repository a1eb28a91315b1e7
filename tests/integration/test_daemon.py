"""The daemon's life against real systemd (sandbox), stand-in units and a real notify socket.

Start-up to READY=1, a kill -9 of the supervisor, the EAGLE-3 fallback and its
retry, a unit systemd would restart on its own. Faults (kills, OOMs, crashes,
hangs) are in test_fault_matrix.py, an operator's stop in test_operator.py:
each scenario runs once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import wait_until

from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = pytest.mark.integration


def test_cold_start_is_ready_only_after_a_sampled_probe(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--load-seconds", "1.5")
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    ready_at = sup.notify.wait_for("READY=1", 60)
    status = sup.status()
    u = unit_status(status, unit.name)
    assert status["ready"] is True and u["state"] == "ready" and u["ready"] is True
    probe = u["last_probe"]
    assert probe["ok"] is True and probe["completion_tokens"] >= 1
    # READY=1 came after the sampled probe's success, and after the model loaded.
    log = unit.output.read_text()
    assert "standin: loaded" in log
    assert any("EXTEND_TIMEOUT_USEC=" in m for t, m in sup.notify.messages if t <= ready_at)
    metrics = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=5).text
    assert f'k26_unit_ready{{unit="{unit.name}"}} 1.0' in metrics


def test_supervisor_kill9_leaves_a_healthy_unit_alone(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    first = supervise(config)
    first.notify.wait_for("READY=1", 60)
    pid = unit.main_pid()
    first.proc.kill()
    first.proc.wait()
    first.notify.close()
    second = supervise(config)
    second.notify.wait_for("READY=1", 60)
    assert unit.main_pid() == pid
    assert unit_status(second.status(), unit.name)["restarts"] == 0


def _eagle3_that_ooms(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
    tag: str,
) -> tuple[StandinUnit, StandinUnit, Supervisor]:
    """An EAGLE-3 unit that CUDA-OOMs after loading, its autoregressive fallback, a supervisor."""
    ar = standin_unit(name=f"k26t-ar-{tag}.service")
    eagle = standin_unit(
        "--fail",
        "cuda-oom",
        "--load-seconds",
        "0.3",
        name=f"k26t-eagle3-{tag}.service",
        extra=f"Conflicts={ar.name}\n",
    )
    sup = supervise(
        write_config(tmp_path, [(eagle, "eagle3", ar.name), (ar, "autoregressive", None)])
    )
    return eagle, ar, sup


def _fell_back(eagle: StandinUnit, ar: StandinUnit) -> Callable[[dict[str, Any]], bool]:
    def pred(s: dict[str, Any]) -> bool:
        return (
            unit_status(s, eagle.name)["state"] == "standby"
            and unit_status(s, ar.name)["state"] == "ready"
        )

    return pred


def test_eagle3_ooms_switch_to_the_autoregressive_fallback(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    eagle, ar, sup = _eagle3_that_ooms(standin_unit, supervise, tmp_path, "a")
    status = sup.wait_status(_fell_back(eagle, ar), timeout_s=90)
    assert unit_status(status, eagle.name)["last_exit"]["cause"] == "gpu-oom"
    assert unit_status(status, eagle.name)["fallback_engaged"] is True
    assert eagle.show("ActiveState") in ("inactive", "failed")
    sup.notify.wait_for("READY=1", 10)


def test_a_unit_with_systemd_restart_is_refused_not_raced(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit(extra="Restart=on-failure\n")
    config = write_config(tmp_path, [(unit, "autoregressive", None)])
    sup = supervise(config)
    sup.notify.wait_for("Restart=on-failure would race", 30)
    # Its only unit refused: start-up cannot succeed, so the daemon fails its start at
    # once (exit 79), saying why, instead of waiting out systemd's TimeoutStartSec.
    started = time.monotonic()
    status = sup.cannot_start(timeout_s=30)
    print(f"\nstart-up that cannot succeed: exit 79 after {time.monotonic() - started:.2f} s")
    assert status["ready"] is False
    assert unit_status(status, unit.name)["state"] == "failed"
    assert "Restart=on-failure would race" in status["supervisor"]["exit"]["reason"]
    assert not any("READY=1" in m for _, m in sup.notify.messages)
    assert any("STATUS=failed: start-up cannot succeed" in m for _, m in sup.notify.messages), (
        sup.notify.messages
    )
    # Refused means hands off: the supervisor never started it.
    assert unit.show("ActiveState") == "inactive"
    assert "Restart=no" in sup.log.read_text()
    # After the fact, `status` reads what the daemon saved and names the reason.
    shown = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--config", str(config)],
        env=sup.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 69, shown.stderr
    assert "NOT RUNNING" in shown.stdout and "with status 79" in shown.stdout, shown.stdout
    assert "Restart=on-failure would race" in shown.stdout


def test_operator_sigusr1_retries_the_preferred_unit(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    eagle, ar, sup = _eagle3_that_ooms(standin_unit, supervise, tmp_path, "b")
    fell_back = _fell_back(eagle, ar)
    sup.wait_status(fell_back, timeout_s=90)
    runs_before = eagle.output.read_text().count("standin: loading model")
    sup.proc.send_signal(signal.SIGUSR1)
    # The preferred unit is tried again (it still OOMs here) ...
    sup.wait_status(lambda s: unit_status(s, eagle.name)["state"] != "standby", timeout_s=30)
    eagle.wait_output("CUDA out of memory", timeout_s=30)
    wait_until(
        lambda: eagle.output.read_text().count("standin: loading model") > runs_before,
        60,
        "the preferred unit to be started again",
    )
    # ... and the supervisor falls back again.
    sup.wait_status(fell_back, timeout_s=90)
