"""One client request must not take the service down: the action follows the evidence.

Real daemon, real systemd user manager (the sandbox), the stand-in SGLang playing
what real SGLang 0.5.17 did on an H200 for a ~900-token prompt under
``--context-length 1024``: a device-side assert, a cuBLAS failure, the SIGQUIT path,
and the driver's Xid for the scheduler's PID, written to the real ``/dev/kmsg``.

Kernel-log lines reach every daemon on the machine. Each test writes its Xid on a
fake PCI bus id of its own and for its own scheduler's PID, and the daemon attributes
an Xid that names a process to that process's cgroup (adapters/evidence.py): another
test's unit dying meanwhile does not take it as evidence. The tests that write one
run in one group (``kmsg``), one at a time.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import StandinUnit
from .daemon_harness import Supervisor
from .test_fault_matrix import DEADLINE_S, configure, metric, unit_of, wait_states

pytestmark = pytest.mark.integration
kmsg_group = pytest.mark.xdist_group("kmsg")

CONTEXT = 64  # tokens: a prompt of 48 or more plays the crash (3/4 of the context)


def long_prompt(unit: StandinUnit, timeout_s: float = 10.0) -> httpx.Response | None:
    """The request that crashed real SGLang: a prompt near the context length."""
    body = {"input_ids": list(range(1, CONTEXT - 8)), "sampling_params": {"max_new_tokens": 4}}
    try:
        return httpx.post(f"{unit.url}/generate", json=body, timeout=timeout_s)
    except httpx.HTTPError:
        return None  # the server died under it, as the real one did


def fake_pci(tmp_path: Path) -> str:
    """A PCI bus id no real GPU and no other test of this run uses."""
    n = (os.getpid() * 131 + len(str(tmp_path))) % 0xFF
    return f"00{n:02x}:7{n % 16:x}:00"


def xid_unit(
    standin_unit: Callable[..., StandinUnit], tmp_path: Path, fault: str, xid: int
) -> tuple[StandinUnit, str]:
    pci = fake_pci(tmp_path)
    # The faulting scheduler lives 1 s after its Xid (SGLang: 5 s), so every daemon on the
    # machine reads the record while it can still tell whose process it names.
    unit = standin_unit(
        "--fail", fault, "--context-length", str(CONTEXT), "--xid-pci", pci, "--xid", str(xid),
        "--crash-diagnostics-seconds", "1",
    )  # fmt: skip
    return unit, pci


def exit_of(sup: Supervisor, unit: StandinUnit, cause: str) -> dict[str, Any]:
    status = sup.wait_status(
        lambda s: (unit_of(s, unit.name)["last_exit"] or {}).get("cause") == cause
    )
    return unit_of(status, unit.name)["last_exit"]  # type: ignore[no-any-return]


@kmsg_group
def test_a_device_assert_with_xid_43_is_a_cuda_error_and_the_unit_serves_again(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit, pci = xid_unit(standin_unit, tmp_path, "device-assert", 43)
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)]))
    sup.notify.wait_for("READY=1", DEADLINE_S)
    long_prompt(unit)
    exit_ = exit_of(sup, unit, "cuda-error")
    assert exit_["summary"].startswith("CUDA failure: "), exit_
    assert f"the driver logged it as NVIDIA Xid 43 on GPU {pci}" in exit_["summary"]
    assert any(f"NVRM: Xid (PCI:{pci}): 43" in line for line in exit_["evidence"]), exit_
    assert any("device-side assert" in ln or "CUBLAS_STATUS" in ln for ln in exit_["evidence"])
    # No person: restarted under backoff, ready again, nothing failed.
    wait_states(sup, unit.name, "ready", "backoff", "ready")
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["state"] == "ready")
    assert unit_of(status, unit.name)["needs_person"] is False
    assert metric(sup, "k26_unit_needs_person", unit=unit.name) == 0.0
    served = status["serving"][unit.name]
    assert served["serving"] is True and served["unserved_s"] > 0


@kmsg_group
def test_a_hardware_xid_calls_a_person_and_keeps_the_fallback_off_the_gpus(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    eagle, pci = xid_unit(standin_unit, tmp_path, "device-assert", 48)
    fallback = standin_unit()
    sup = supervise(
        configure(tmp_path, [(eagle, "eagle3", fallback.name), (fallback, "autoregressive", None)])
    )
    sup.notify.wait_for("READY=1", DEADLINE_S)
    long_prompt(eagle)
    exit_ = exit_of(sup, eagle, "gpu-xid")
    assert exit_["summary"].startswith(f"NVIDIA Xid 48 on GPU {pci} (double-bit ECC error")
    status = sup.wait_status(lambda s: unit_of(s, eagle.name)["state"] == "failed")
    shown = unit_of(status, eagle.name)
    assert shown["needs_person"] is True and "its fallback" in (shown["reason"] or "")
    assert unit_of(status, fallback.name)["state"] == "stopped"
    assert fallback.show("ActiveState") == "inactive"
    assert metric(sup, "k26_unit_needs_person", unit=eagle.name) == 1.0
    assert status["serving"][eagle.name]["serving"] is False
    # The operator's reset (SIGUSR1) after a person checked the GPU: it serves again.
    os.kill(sup.proc.pid, signal.SIGUSR1)
    status = sup.wait_status(lambda s: unit_of(s, eagle.name)["state"] == "ready")
    assert unit_of(status, eagle.name)["needs_person"] is False
    assert fallback.show("ActiveState") == "inactive"


@kmsg_group
def test_a_hardware_xid_of_a_hung_unit_is_acted_on_as_it_is_read_not_at_a_death(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    """The GPU fell off the bus under a request: the driver logs Xid 79 for the
    scheduler, which hangs, alive, and nothing dies. The daemon acts on the Xid the
    moment it reads it: it stops the unit, fails it for a person and keeps the
    fallback off those GPUs. No stall has to be called first (the progress watch is
    off here, and the periodic probe every 60 s), and no death has to explain it."""
    eagle, pci = xid_unit(standin_unit, tmp_path, "stall", 79)
    fallback = standin_unit()
    sup = supervise(
        configure(
            tmp_path,
            [(eagle, "eagle3", fallback.name), (fallback, "autoregressive", None)],
            interval_s=60,
        )
    )
    sup.notify.wait_for("READY=1", DEADLINE_S)
    hung = threading.Thread(target=long_prompt, args=(eagle, 30.0), daemon=True)
    hung.start()
    status = sup.wait_status(lambda s: unit_of(s, eagle.name)["state"] == "failed")
    shown = unit_of(status, eagle.name)
    assert shown["needs_person"] is True
    reason = shown["reason"] or ""
    assert reason.startswith(f"NVIDIA Xid 79 on GPU {pci} (GPU has fallen off the bus)"), reason
    assert "neither it nor its fallback is started" in reason
    # Stopped by the supervisor (not dead on its own), and the fallback never ran.
    exit_ = sup.wait_status(lambda s: unit_of(s, eagle.name)["last_exit"] is not None)
    assert unit_of(exit_, eagle.name)["last_exit"]["cause"] in ("stopped", "gpu-xid")
    assert eagle.show("ActiveState") in ("inactive", "failed")
    assert fallback.show("ActiveState") == "inactive"
    assert fallback.show("NRestarts") == "0" and fallback.show("ExecMainStartTimestamp") == ""
    assert metric(sup, "k26_unit_needs_person", unit=eagle.name) == 1.0
    hung.join(timeout=DEADLINE_S)


@kmsg_group
def test_a_program_fault_past_the_failure_window_escalates_and_the_fallback_serves(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    eagle, _pci = xid_unit(standin_unit, tmp_path, "device-assert", 43)
    fallback = standin_unit()
    sup = supervise(
        configure(
            tmp_path,
            [(eagle, "eagle3", fallback.name), (fallback, "autoregressive", None)],
            max_failures=2,
        )
    )
    sup.notify.wait_for("READY=1", DEADLINE_S)
    long_prompt(eagle)  # the first occurrence: restarted, never escalated
    wait_states(sup, eagle.name, "ready", "backoff", "ready")
    assert unit_of(sup.status(), fallback.name)["state"] == "stopped"
    long_prompt(eagle)  # the second, within the window: failed, and the fallback serves
    status = sup.wait_status(
        lambda s: (
            unit_of(s, eagle.name)["state"] in ("failed", "standby")
            and unit_of(s, fallback.name)["state"] == "ready"
        )
    )
    assert unit_of(status, eagle.name)["last_exit"]["cause"] == "cuda-error"
    assert unit_of(status, eagle.name)["needs_person"] is False
    assert status["serving"][eagle.name]["serving"] is True
    assert (metric(sup, "k26_unserved_seconds_total", unit=eagle.name) or 0) > 0


@kmsg_group
def test_an_exit_0_after_an_engine_error_gets_the_error_s_verdict(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit, _pci = xid_unit(standin_unit, tmp_path, "crash-exit-0", 43)
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)]))
    sup.notify.wait_for("READY=1", DEADLINE_S)
    long_prompt(unit)
    exit_ = exit_of(sup, unit, "cuda-error")
    assert exit_["exit_code"] == 0 and exit_["signal"] is None, exit_
    assert "then it exited with status 0, unasked" in exit_["summary"]
    assert any("illegal memory access" in line for line in exit_["evidence"]), exit_
    wait_states(sup, unit.name, "ready", "backoff", "ready")


def test_a_stall_with_requests_running_leaves_ready_but_a_long_compile_does_not(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    """probe.stall_after_s = 1.5: a penalties request that compiles for 4 s (a ptxas
    child in the unit's cgroup, then the cache files) is in flight with no token the
    whole time, and is no stall; a request the scheduler hangs on is, well before the
    periodic probe (every 60 s here) could see it."""
    unit = standin_unit(
        "--enable-metrics", "--fail", "stall", "--context-length", str(CONTEXT),
        "--inductor-compile-seconds", "4",
    )  # fmt: skip
    sup = supervise(
        configure(
            tmp_path,
            [(unit, "autoregressive", None)],
            stall_after_s=1.5,
            progress_interval_s=0.2,
            interval_s=60,
        )
    )
    sup.notify.wait_for("READY=1", DEADLINE_S)
    body = {
        "text": "a compile under traffic",
        "sampling_params": {"max_new_tokens": 4, "frequency_penalty": 0.5, "temperature": 0.7},
    }
    answer = httpx.post(f"{unit.url}/generate", json=body, timeout=30)
    assert answer.status_code == 200
    # The watch hears of the compile's files by inotify, as the answer goes out: the
    # daemon may read the event after this test reads /status (seen under CI's load).
    status = sup.wait_status(
        lambda s: unit_of(s, unit.name)["jit_after_ready"]["count"] >= 1, DEADLINE_S
    )
    assert (
        unit_of(status, unit.name)["state"] == "ready"
        and unit_of(status, unit.name)["restarts"] == 0
    )
    hung = threading.Thread(target=long_prompt, args=(unit, 30.0), daemon=True)
    hung.start()
    status = sup.wait_status(
        lambda s: "stalled while serving" in (unit_of(s, unit.name)["reason"] or "")
    )
    reason = unit_of(status, unit.name)["reason"]
    assert "1 requests running and 0 queued, but no token" in reason, reason
    wait_states(sup, unit.name, "ready", "backoff", "ready")
    hung.join(timeout=DEADLINE_S)
