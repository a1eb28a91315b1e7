"""The real daemon as a process, for integration tests: config, notify socket, /status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from k26dev import sandbox
from supervisor.daemon import EXIT_CANNOT_START
from tests.waiting import wait_until

from .conftest import StandinUnit, free_port


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
        self.env = env
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
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            nonlocal last
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited: {self.log.read_text()[-3000:]}")
            try:
                last = self.status()
            except httpx.HTTPError:
                return None
            return last if pred(last) else None

        try:
            return wait_until(check, timeout_s, "the /status condition")
        except AssertionError as exc:
            if "supervisor exited" in str(exc):
                raise
            raise AssertionError(
                f"condition not met in {timeout_s}s; last /status: {last}\n"
                f"{self.log.read_text()[-3000:]}"
            ) from None

    def wait_exit(self, timeout_s: float = 60) -> int:
        """The daemon's exit status, once it exits on its own."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the supervisor did not exit within {timeout_s:g} s:\n"
                f"{self.log.read_text()[-3000:]}"
            ) from None

    def last_status(self) -> dict[str, Any]:
        """The /status the daemon saved as it exited (its runtime directory)."""
        path = Path(self.env["XDG_RUNTIME_DIR"]) / "k26-supervisor" / "last-status.json"
        assert path.is_file(), f"no {path}: {self.log.read_text()[-2000:]}"
        return json.loads(path.read_text())  # type: ignore[no-any-return]

    def cannot_start(self, timeout_s: float = 60) -> dict[str, Any]:
        """Start-up that cannot succeed: exit 79 and the saved /status, which says why."""
        code = self.wait_exit(timeout_s)
        assert code == EXIT_CANNOT_START, (code, self.log.read_text()[-3000:])
        last = self.last_status()
        assert last["supervisor"]["exit"]["code"] == EXIT_CANNOT_START, last["supervisor"]
        assert "start-up cannot succeed" in last["supervisor"]["exit"]["reason"]
        return last

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.notify.close()


# Tests whose subject is not the coverage warm-up play one shape of it (the path to
# READY stays the product's), not the default set's twenty (test_coverage.py does).
QUICK_COVERAGE = 'shapes = ["greedy"]'


def write_config(
    tmp: Path,
    units: list[tuple[StandinUnit, str, str | None]],
    extra: str = "",
    *,
    coverage: str | None = QUICK_COVERAGE,
) -> Path:
    """A config for ``units`` (unit, role, fallback); ``coverage``: the body of its
    [coverage] table, or None to leave the table to ``extra`` (or the defaults)."""
    port = free_port()
    body = (
        textwrap.dedent(
            f"""\
        [supervisor]
        bus = "user"
        listen = "127.0.0.1:{port}"
        job_timeout_s = 30
        state_dir = "{tmp / "daemon-state"}"

        [flashinfer]
        enabled = false

        [probe]
        timeout_s = 3
        startup_deadline_s = 30
        interval_s = 1
        failures_to_fail = 2
        stall_after_s = 120
        progress_interval_s = 5

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
        + (f"\n[coverage]\n{coverage}\n" if coverage is not None else "")
    )
    for unit, role, fallback in units:
        body += f'\n[[units]]\nname = "{unit.name}"\nrole = "{role}"\nurl = "{unit.url}"\n'
        if fallback:
            body += f'fallback = "{fallback}"\n'
    path = tmp / "config.toml"
    path.write_text(body)
    return path


def unit_status(status: dict[str, Any], name: str) -> dict[str, Any]:
    return status["units"][name]  # type: ignore[no-any-return]
