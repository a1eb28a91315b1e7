"""The daemon against real systemd (sandbox), real stand-in units, a real notify socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor import sandbox

from .conftest import StandinUnit, free_port

pytestmark = pytest.mark.integration


class NotifySocket:
    """A real sd_notify receiver, as systemd would hold for a Type=notify unit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._recv, daemon=True).start()

    def _recv(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            with self._cond:
                self.messages.append((time.monotonic(), data.decode()))
                self._cond.notify_all()

    def wait_for(self, needle: str, timeout_s: float) -> float:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(needle in m for _, m in self.messages), timeout=timeout_s
            )
            assert ok, f"no {needle!r} in {[m for _, m in self.messages][-10:]}"
            return next(t for t, m in self.messages if needle in m)

    def close(self) -> None:
        self.sock.close()


class Supervisor:
    def __init__(self, info: sandbox.SandboxInfo, config: Path, tmp: Path) -> None:
        n = len(list(tmp.glob("notify*.sock")))
        self.notify = NotifySocket(tmp / f"notify{n}.sock")
        self.port = int(config.read_text().split("127.0.0.1:")[1].split('"')[0])
        env = dict(os.environ, **info.env, NOTIFY_SOCKET=str(self.notify.path))
        self.log = tmp / "supervisor.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
            env=env,
            stdout=open(self.log, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

    def status(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.port}/status", timeout=5).json()  # type: ignore[no-any-return]

    def wait_status(
        self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 60
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited: {self.log.read_text()[-3000:]}")
            try:
                last = self.status()
                if pred(last):
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(
            f"condition not met in {timeout_s}s; last /status: {last}\n{self.log.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.notify.close()


def write_config(
    tmp: Path, units: list[tuple[StandinUnit, str, str | None]], extra: str = ""
) -> Path:
    port = free_port()
    body = (
        textwrap.dedent(
            f"""\
        [supervisor]
        bus = "user"
        listen = "127.0.0.1:{port}"
        job_timeout_s = 30

        [flashinfer]
        enabled = false

        [probe]
        timeout_s = 3
        startup_deadline_s = 30
        interval_s = 1
        failures_to_fail = 2

        [restart]
        backoff_initial_s = 0.2
        backoff_max_s = 1
        max_failures = 4
        failure_window_s = 60

        [fallback]
        oom_exits = 2
        window_s = 120
        retry_preferred_after_s = 0
        """
        )
        + extra
    )
    for unit, role, fallback in units:
        body += f'\n[[units]]\nname = "{unit.name}"\nrole = "{role}"\nurl = "{unit.url}"\n'
        if fallback:
            body += f'fallback = "{fallback}"\n'
    path = tmp / "config.toml"
    path.write_text(body)
    return path


@pytest.fixture
def supervise(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> Iterator[Callable[[Path], Supervisor]]:
    made: list[Supervisor] = []

    def start(config: Path) -> Supervisor:
        made.append(Supervisor(bus_env, config, tmp_path))
        return made[-1]

    yield start
    for s in made:
        s.stop()


def _unit(status: dict[str, Any], name: str) -> dict[str, Any]:
    return status["units"][name]  # type: ignore[no-any-return]


def test_cold_start_is_ready_only_after_a_sampled_probe(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--load-seconds", "1.5")
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    ready_at = sup.notify.wait_for("READY=1", 60)
    status = sup.status()
    u = _unit(status, unit.name)
    assert status["ready"] is True and u["state"] == "ready" and u["ready"] is True
    probe = u["last_probe"]
    assert probe["ok"] is True and probe["completion_tokens"] >= 1
    # READY=1 came after the sampled probe's success, and after the model loaded.
    log = unit.output.read_text()
    assert "standin: loaded" in log
    assert any("EXTEND_TIMEOUT_USEC=" in m for t, m in sup.notify.messages if t <= ready_at)
    metrics = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=5).text
    assert f'k26_unit_ready{{unit="{unit.name}"}} 1.0' in metrics


def test_sampling_crash_is_never_ready_though_greedy_health_passes(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--fail", "sampling-arch")
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    status = sup.wait_status(lambda s: _unit(s, unit.name)["last_exit"] is not None)
    assert _unit(status, unit.name)["last_exit"]["cause"] == "flashinfer-arch"
    assert status["ready"] is False
    assert not any("READY=1" in m for _, m in sup.notify.messages)
    # An arch rejection cannot be fixed by restarting: the unit ends failed.
    status = sup.wait_status(lambda s: _unit(s, unit.name)["state"] == "failed")
    assert status["ready"] is False


def test_sigkill_leads_to_restart_and_ready_again(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    sup.notify.wait_for("READY=1", 60)
    pid = unit.main_pid()
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    status = sup.wait_status(
        lambda s: (
            (_unit(s, unit.name)["last_exit"] or {}).get("cause") == "sigkill"
            and _unit(s, unit.name)["state"] == "ready"
            and _unit(s, unit.name)["restarts"] >= 1
        )
    )
    assert unit.main_pid() not in (0, pid)
    assert status["ready"] is True


def test_operator_stop_is_respected(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    sup.notify.wait_for("READY=1", 60)
    unit.systemctl("stop", unit.name)
    sup.wait_status(lambda s: _unit(s, unit.name)["state"] == "stopped")
    # Give the supervisor every chance to fight it: a probe interval passes.
    sup.notify.wait_for("stopped by an operator", 10)
    assert unit.show("ActiveState") == "inactive"


def test_sampled_hang_fails_the_probe_by_its_deadline(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--fail", "sampled-hang")
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    status = sup.wait_status(lambda s: (_unit(s, unit.name)["last_probe"] or {}).get("ok") is False)
    assert status["ready"] is False
    metrics = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=5).text
    line = f'k26_probe_failures_total{{reason="timeout",unit="{unit.name}"}}'
    count = [ln for ln in metrics.splitlines() if ln.startswith(line)]
    assert count and float(count[0].split()[-1]) >= 1, count


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
    assert _unit(second.status(), unit.name)["restarts"] == 0


def test_eagle3_ooms_switch_to_the_autoregressive_fallback(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    ar = standin_unit(name="k26t-ar.service")
    eagle = standin_unit(
        "--fail",
        "cuda-oom",
        "--load-seconds",
        "0.3",
        name="k26t-eagle3.service",
        extra="Conflicts=k26t-ar.service\n",
    )
    sup = supervise(
        write_config(tmp_path, [(eagle, "eagle3", ar.name), (ar, "autoregressive", None)])
    )
    status = sup.wait_status(
        lambda s: (
            _unit(s, eagle.name)["state"] == "standby" and _unit(s, ar.name)["state"] == "ready"
        ),
        timeout_s=90,
    )
    assert _unit(status, eagle.name)["last_exit"]["cause"] == "gpu-oom"
    assert _unit(status, eagle.name)["fallback_engaged"] is True
    assert eagle.show("ActiveState") in ("inactive", "failed")
    sup.notify.wait_for("READY=1", 10)


def test_a_unit_with_systemd_restart_is_refused_not_raced(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit(extra="Restart=on-failure\n")
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    sup.notify.wait_for("Restart=on-failure would race", 30)
    status = sup.wait_status(lambda s: _unit(s, unit.name)["state"] == "failed")
    assert status["ready"] is False
    # Refused means hands off: the supervisor never started it.
    assert unit.show("ActiveState") == "inactive"
    assert "Restart=no" in sup.log.read_text()


def test_operator_sigusr1_retries_the_preferred_unit(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    ar = standin_unit(name="k26t-ar2.service")
    eagle = standin_unit(
        "--fail",
        "cuda-oom",
        "--load-seconds",
        "0.3",
        name="k26t-eagle3b.service",
        extra="Conflicts=k26t-ar2.service\n",
    )
    sup = supervise(
        write_config(tmp_path, [(eagle, "eagle3", ar.name), (ar, "autoregressive", None)])
    )

    def fell_back(s: dict[str, Any]) -> bool:
        return _unit(s, eagle.name)["state"] == "standby" and _unit(s, ar.name)["state"] == "ready"

    sup.wait_status(fell_back, timeout_s=90)
    runs_before = eagle.output.read_text().count("standin: listening")
    sup.proc.send_signal(signal.SIGUSR1)
    # The preferred unit is tried again (it still OOMs here) ...
    sup.wait_status(lambda s: _unit(s, eagle.name)["state"] != "standby", timeout_s=30)
    eagle.wait_output("CUDA out of memory", timeout_s=30)
    deadline = time.monotonic() + 60
    while eagle.output.read_text().count("standin: listening") <= runs_before:
        assert time.monotonic() < deadline, "the preferred unit was not started again"
        time.sleep(0.05)
    # ... and the supervisor falls back again.
    sup.wait_status(fell_back, timeout_s=90)
