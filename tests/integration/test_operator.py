"""An operator's ``systemctl stop`` wins, however the process ends, and keeps winning.

Real SGLang SIGKILLs itself after draining on SIGTERM, so systemd reports an
ordinary stop as ``Result=signal``, status 9; a plain Python server dies of the
SIGTERM itself; a server stuck in its drain is SIGKILLed by ``TimeoutStopSec=``.
In every case the stop job was the operator's, and the unit stays down: across a
supervisor restart too, until the operator starts it or sends SIGUSR1.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import wait_until

from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = pytest.mark.integration


def _probes_pass(sup: Supervisor, unit: str, count: int) -> None:
    """Wait until ``count`` more sampled probes of ``unit`` were made: proof that the
    supervisor kept deciding (probe interval 1 s, backoff 0.2 s) meanwhile."""
    seen: list[str] = []

    def probed() -> bool:
        at = (unit_status(sup.status(), unit)["last_probe"] or {}).get("at")
        if at and (not seen or seen[-1] != at):
            seen.append(at)
        return len(seen) > count

    wait_until(probed, 30, f"{count} probes of {unit}")


def _stopped_by_operator(status: dict[str, Any], unit: str) -> bool:
    u = unit_status(status, unit)
    return u["state"] == "stopped" and u["held_by_operator"] is True


def _pair(
    standin_unit: Callable[..., StandinUnit], flags: tuple[str, ...] = (), **kw: Any
) -> tuple[StandinUnit, StandinUnit]:
    return standin_unit(*flags, **kw), standin_unit()


def _config(tmp_path: Path, unit: StandinUnit, companion: StandinUnit) -> Path:
    return write_config(
        tmp_path, [(unit, "autoregressive", None), (companion, "autoregressive", None)]
    )


@pytest.mark.parametrize(
    ("flags", "timing", "result", "cause"),
    [
        # SGLang's own stop: drain, then its own SIGKILL (with SGLang's 5 s poll).
        ((), True, "signal", "stopped"),
        # A plain server that dies of SIGTERM's default action.
        (("--stop-mode", "sigterm"), False, "success", "stopped"),
    ],
    ids=["sglang-self-sigkill", "plain-sigterm-death"],
)
def test_an_operator_stop_is_respected_whatever_the_exit(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
    flags: tuple[str, ...],
    timing: bool,
    result: str,
    cause: str,
) -> None:
    unit, companion = _pair(standin_unit, flags, sglang_timing=timing)
    sup = supervise(_config(tmp_path, unit, companion))
    sup.notify.wait_for("READY=1", 60)
    unit.systemctl("stop", unit.name)
    assert unit.show("Result") == result
    status = sup.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    assert unit_status(status, unit.name)["last_exit"]["cause"] == cause
    assert "operator" in unit_status(status, unit.name)["reason"]
    _probes_pass(sup, companion.name, 3)
    assert unit.show("ActiveState") in ("inactive", "failed")
    assert unit_status(sup.status(), unit.name)["restarts"] == 0
    assert unit_status(sup.status(), unit.name)["state"] == "stopped"


def test_a_stop_that_runs_into_timeoutstopsec_is_still_the_operators(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # A sampled request hangs, so the drain never ends: systemd SIGKILLs after 2 s.
    unit, companion = _pair(standin_unit, ("--fail", "sampled-hang"), extra="TimeoutStopSec=2\n")
    config = _config(tmp_path, unit, companion)
    config.write_text(config.read_text().replace("failures_to_fail = 2", "failures_to_fail = 50"))
    sup = supervise(config)
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] in ("ready", "probing"))
    unit.wait_output("sampled-hang: a sampled request will never be answered", 30)
    unit.systemctl("stop", unit.name)
    assert unit.show("Result") == "timeout"
    assert "Remaining number of requests 1" in unit.output.read_text()
    sup.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    _probes_pass(sup, companion.name, 3)
    assert unit_status(sup.status(), unit.name)["state"] == "stopped"


def test_the_stop_outlives_a_supervisor_restart_until_sigusr1(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit, companion = _pair(standin_unit)
    config = _config(tmp_path, unit, companion)
    first = supervise(config)
    first.notify.wait_for("READY=1", 60)
    unit.systemctl("stop", unit.name)
    first.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    first.stop()  # SIGTERM: the units stay as they are
    second = supervise(config)
    second.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    _probes_pass(second, companion.name, 3)
    assert unit.show("ActiveState") in ("inactive", "failed")
    # The operator hands it back.
    second.proc.send_signal(signal.SIGUSR1)
    status = second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready")
    assert unit_status(status, unit.name)["held_by_operator"] is False


def test_an_operator_start_after_the_stop_is_supervised_again(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit, companion = _pair(standin_unit)
    sup = supervise(_config(tmp_path, unit, companion))
    sup.notify.wait_for("READY=1", 60)
    unit.systemctl("stop", unit.name)
    sup.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    unit.systemctl("start", unit.name)
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready")
    # And now a crash is the supervisor's business again.
    pid = unit.main_pid()
    assert pid > 1
    unit.systemctl("kill", "--signal=SIGKILL", unit.name)
    status = sup.wait_status(
        lambda s: (
            unit_status(s, unit.name)["restarts"] >= 1
            and unit_status(s, unit.name)["state"] == "ready"
        )
    )
    assert unit_status(status, unit.name)["last_exit"]["cause"] == "sigkill"


def test_a_hold_is_void_once_the_unit_was_started_while_the_supervisor_was_away(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit, companion = _pair(standin_unit)
    config = _config(tmp_path, unit, companion)
    first = supervise(config)
    first.notify.wait_for("READY=1", 60)
    unit.systemctl("stop", unit.name)
    first.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    first.stop()
    # While no supervisor runs, the operator starts it, then it crashes.
    unit.systemctl("start", unit.name)
    wait_until(lambda: _healthy(unit.url), 30, "the unit to answer /health")
    unit.systemctl("kill", "--signal=SIGKILL", unit.name)
    wait_until(lambda: unit.show("ActiveState") == "failed", 30, "the unit to fail")
    second = supervise(config)
    status = second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready")
    assert unit_status(status, unit.name)["held_by_operator"] is False


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stop_between_runs_is_held_though_no_process_exits(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    """Found by the chaos soak: the unit crashed and waits out its backoff when an
    operator runs `systemctl stop`. Nothing runs, so no exit tells; systemd's job is
    all there is. The supervisor must not start it when the backoff ends."""
    unit, companion = _pair(standin_unit)
    config = _config(tmp_path, unit, companion)
    config.write_text(
        config.read_text()
        .replace("backoff_initial_s = 0.2", "backoff_initial_s = 4")
        .replace("backoff_max_s = 1", "backoff_max_s = 4")
    )
    sup = supervise(config)
    sup.notify.wait_for("READY=1", 60)
    unit.systemctl("kill", "--signal=SIGKILL", unit.name)
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "backoff")
    unit.systemctl("stop", unit.name)  # the unit is already down: a job, no exit
    status = sup.wait_status(lambda s: _stopped_by_operator(s, unit.name))
    assert "between runs" in unit_status(status, unit.name)["reason"]
    assert unit_status(status, unit.name)["last_exit"]["cause"] == "sigkill"
    # Past the 4 s backoff, many probes of the companion later: still down, still held.
    _probes_pass(sup, companion.name, 6)
    assert unit.show("ActiveState") in ("inactive", "failed")
    assert _stopped_by_operator(sup.status(), unit.name)
    # SIGUSR1 hands it back.
    sup.proc.send_signal(signal.SIGUSR1)
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready")
