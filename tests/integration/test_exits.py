"""Every exit seen and explained: real units, real signals, the real OOM killer.

Each case runs ``k26-supervisor watch`` as a real process against a stand-in
unit in the sandbox, causes the death for real, and waits (with a deadline)
for the JSON line that explains it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from k26dev import sandbox

from .conftest import StandinUnit, write_unit

pytestmark = pytest.mark.integration
DEADLINE_S = 30.0


class Watch:
    """A running ``k26-supervisor watch`` whose JSON lines we can wait for."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self.ready = threading.Event()
        self.stderr_lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr_lines.append(raw.rstrip())
            if "watching" in raw:
                self.ready.set()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(json.loads(raw))
                self._cond.notify_all()

    def next_exit(self, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
        with self._cond:
            ok = self._cond.wait_for(lambda: bool(self.lines), timeout=timeout_s)
            if not ok:
                err = (
                    self.proc.stderr.read()
                    if self.proc.poll() is not None and self.proc.stderr
                    else ""
                )
                raise AssertionError(f"no exit reported within {timeout_s}s {err}")
            return self.lines.pop(0)


@contextmanager
def watching(info: sandbox.SandboxInfo, *units: str) -> Iterator[Watch]:
    env = dict(os.environ, **info.env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "watch", "--bus", "user", *units],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield Watch(proc)
    finally:
        # SIGTERM runs the command's cleanup (supervisor/cli.py): its bus and journal
        # reads end first. Under a loaded CI worker that once took over 10 s; the
        # test's own deadline, and a kill past it, so that no watch is left behind.
        proc.terminate()
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise


def wait_loaded(unit: StandinUnit) -> None:
    unit.wait_output("standin: loaded")


def start(unit: StandinUnit) -> int:
    unit.systemctl("start", unit.name)
    wait_loaded(unit)
    pid = unit.main_pid()
    assert pid > 0
    return pid


@pytest.fixture
def watch_ready() -> Callable[..., None]:
    """watch says on stderr when it has subscribed and read every unit's state."""

    def ready(w: Watch, unit: StandinUnit) -> None:
        if not w.ready.wait(DEADLINE_S):
            raise AssertionError(f"watch never became ready: {w.stderr_lines}")

    return ready


def test_sigkill_of_the_main_pid_is_sigkill(
    bus_env: sandbox.SandboxInfo, standin_unit: Callable[..., StandinUnit], watch_ready: Any
) -> None:
    unit = standin_unit()
    pid = start(unit)
    with watching(bus_env, unit.name) as w:
        watch_ready(w, unit)
        os.kill(pid, signal.SIGKILL)
        rec = w.next_exit()
    assert rec["unit"] == unit.name and rec["cause"] == "sigkill"
    assert rec["main_pid"] == pid and rec["signal"] == 9 and rec["exit_code"] is None
    assert any("Result=signal" in line for line in rec["evidence"])
    assert rec["at"].startswith("20")


def test_memory_max_and_growth_is_oom_kill(
    bus_env: sandbox.SandboxInfo, standin_unit: Callable[..., StandinUnit], watch_ready: Any
) -> None:
    unit = standin_unit(
        "--fail",
        "grow-memory",
        "--grow-step-mib",
        "8",
        extra="MemoryMax=120M\nMemorySwapMax=0\n",
    )
    with watching(bus_env, unit.name) as w:
        watch_ready(w, unit)
        unit.systemctl("start", unit.name)
        rec = w.next_exit(60)
    assert rec["cause"] == "oom-kill", rec
    assert rec["signal"] == 9
    assert any("oom" in line.lower() and "kill" in line.lower() for line in rec["evidence"]), rec


def test_cuda_oom_exit_is_gpu_oom(
    bus_env: sandbox.SandboxInfo, standin_unit: Callable[..., StandinUnit], watch_ready: Any
) -> None:
    unit = standin_unit("--fail", "cuda-oom", "--load-seconds", "0.2")
    with watching(bus_env, unit.name) as w:
        watch_ready(w, unit)
        unit.systemctl("start", unit.name)
        rec = w.next_exit()
    assert rec["cause"] == "gpu-oom", rec
    # SGLang's launcher kills itself after a child failed: systemd sees signal 9.
    assert (rec["result"], rec["signal"], rec["exit_code"]) == ("signal", 9, None)
    assert any("out of memory" in line.lower() for line in rec["evidence"])


def test_flashinfer_sampling_crash_is_flashinfer_arch(
    bus_env: sandbox.SandboxInfo, standin_unit: Callable[..., StandinUnit], watch_ready: Any
) -> None:
    unit = standin_unit("--fail", "sampling-arch")
    start(unit)
    with watching(bus_env, unit.name) as w:
        watch_ready(w, unit)
        # Greedy, like SGLang's own health check: passes.
        assert httpx.get(f"{unit.url}/health_generate", timeout=10).status_code == 200
        # Sampled: the server dies mid-request.
        with pytest.raises(httpx.HTTPError):
            httpx.post(
                f"{unit.url}/generate",
                json={
                    "text": "hi",
                    "sampling_params": {
                        "temperature": 0.7,
                        "top_k": 20,
                        "top_p": 0.8,
                        "max_new_tokens": 4,
                    },
                },
                timeout=10,
            )
        rec = w.next_exit()
    assert rec["cause"] == "flashinfer-arch", rec
    assert any("sm75" in line or "arch" in line.lower() for line in rec["evidence"])


@pytest.mark.parametrize(
    ("flags", "result", "signal_number"),
    [((), "signal", 9), (("--stop-mode", "clean"), "success", None)],
    ids=["sglang-self-sigkill", "exit-0"],
)
def test_an_operator_stop_is_stopped_not_sigkill(
    bus_env: sandbox.SandboxInfo,
    standin_unit: Callable[..., StandinUnit],
    watch_ready: Any,
    flags: tuple[str, ...],
    result: str,
    signal_number: int | None,
) -> None:
    unit = standin_unit(*flags)
    start(unit)
    with watching(bus_env, unit.name) as w:
        watch_ready(w, unit)
        unit.systemctl("stop", unit.name)
        rec = w.next_exit()
    assert (rec["cause"], rec["result"], rec["signal"]) == ("stopped", result, signal_number), rec
    assert rec["stop_by"] == "operator"


def test_a_process_that_ends_on_its_own_with_0_is_clean(
    bus_env: sandbox.SandboxInfo, tmp_path: Any
) -> None:
    name = "k26t-exits-true.service"
    write_unit(bus_env, name, "/bin/sh -c 'read x < /dev/null; exit 0'", tmp_path / "t.out")
    with watching(bus_env, name) as w:
        assert w.ready.wait(DEADLINE_S)
        subprocess.run(
            ["systemctl", "--user", "start", name],
            env=dict(os.environ, **bus_env.env),
            check=True,
        )
        rec = w.next_exit()
    assert (rec["cause"], rec["stop_by"]) == ("clean", None), rec


def test_explain_reads_a_units_last_exit_from_systemd_after_the_fact(
    bus_env: sandbox.SandboxInfo, standin_unit: Callable[..., StandinUnit], watch_ready: Any
) -> None:
    unit = standin_unit("--fail", "cuda-oom", "--load-seconds", "0.2")
    with watching(bus_env, unit.name) as w:
        watch_ready(w, unit)
        unit.systemctl("start", unit.name)
        live = w.next_exit()
    # Later, a person asks: the same verdict, from systemd and the unit's output.
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "explain", "--bus", "user", unit.name, "--json"],
        env=dict(os.environ, **bus_env.env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["cause"] == live["cause"] == "gpu-oom", verdict
    assert verdict["main_pid"] == live["main_pid"]
    assert verdict["source"] == str(unit.output)
    assert any("CUDA out of memory" in line for line in verdict["evidence"])
    text = subprocess.run(
        [sys.executable, "-m", "supervisor", "explain", "--bus", "user", unit.name],
        env=dict(os.environ, **bus_env.env),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert text.startswith(f"{unit.name} at ") and ": gpu-oom" in text.splitlines()[0]
