"""The fault matrix: every fault of the issue, for real, against the real daemon.

Each case runs ``k26-supervisor run`` against stand-in SGLang units (or a tiny
HTTP server unit where the stand-in has no such fault) in the confined systemd
sandbox, with a real notify socket, causes the fault for real and waits, with
deadlines, for the outcome the issue asks for.

The daemon's STATUS= summary (``starting: a.service=loading b.service=ready``),
sent on the notify socket after every event it handles, gives the full history
of a unit's states, so short-lived states (``backoff`` for 0.2 s) are never
missed between two polls of /status.

Notes on the cases:

- "crash on the first sampled request" runs with FlashInfer warm-up disabled
  (a cold warm-up is a real nvcc build of several minutes): the unit must never
  be reported ready and must end ``failed``.
- "kill -9 of the supervisor while a unit is warming": with warm-up disabled
  there is no ``warming`` state, so the unit is caught in ``loading`` (a stand-in
  with ``--load-seconds``), which is the same question: work in flight, a unit
  half-way up, a new supervisor that must take it over without restarting it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k26dev import sandbox
from tests.waiting import wait_for_text

from .conftest import StandinUnit, free_port, write_unit
from .daemon_harness import Supervisor, write_config

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0
_SUMMARY = re.compile(r"^STATUS=(?:ready|ready \(degraded\)|starting): (.*)$", re.M)

# A tiny SGLang look-alike for faults the stand-in does not play. Modes:
# hang-first: the first /generate never answers, later ones answer normally.
FAKE_SGLANG = textwrap.dedent(
    """\
    import http.server, json, sys, threading

    port, mode = int(sys.argv[1]), sys.argv[2]
    lock = threading.Lock()
    count = 0


    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send(self, code, body):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.send(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self):
            global count
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                count += 1
                n = count
            print(f"fake: generate {n}", flush=True)
            if mode == "hang-first" and n == 1:
                threading.Event().wait()
            answer = {"text": " Paris", "meta_info": {"completion_tokens": 4, "id": str(n)}}
            self.send(200 if self.path == "/generate" else 404, json.dumps(answer).encode())


    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("fake: serving", flush=True)
    server.serve_forever()
    """
)


# ---------------------------------------------------------------- helpers


def configure(
    tmp: Path, units: list[tuple[StandinUnit, str, str | None]], **overrides: object
) -> Path:
    """``test_daemon.write_config`` with some of its numbers changed (``key=value``)."""
    path = write_config(tmp, units)
    text = path.read_text()
    for key, value in overrides.items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {shown}", text)
        assert n == 1, f"{key} is not a line of the base config"
    path.write_text(text)
    return path


def unit_of(status: dict[str, Any], name: str) -> dict[str, Any]:
    return status["units"][name]  # type: ignore[no-any-return]


def metric(sup: Supervisor, name: str, **labels: str) -> float | None:
    """The value of one sample of /metrics, or None when it is not exported."""
    text = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def states_seen(sup: Supervisor, unit: str) -> list[str]:
    """Every state of ``unit`` the daemon announced in its STATUS= summary, in order."""
    seen: list[str] = []
    for _, message in list(sup.notify.messages):
        for match in _SUMMARY.finditer(message):
            for token in match.group(1).split():
                name, _, state = token.rpartition("=")
                if name == unit and (not seen or seen[-1] != state):
                    seen.append(state)
    return seen


def wait_notify(
    sup: Supervisor,
    pred: Callable[[list[str]], bool],
    what: Callable[[], str] | str,
    timeout_s: float = DEADLINE_S,
    *,
    give_up: str | None = None,
) -> None:
    """Wait until ``pred`` holds for the notify messages received so far.

    ``give_up``: a message that means the outcome can no longer come (fail now).
    """

    def done(messages: list[str]) -> bool:
        if give_up is not None and any(give_up in m for m in messages):
            return True
        return pred(messages) or sup.proc.poll() is not None

    cond = sup.notify._cond
    with cond:
        cond.wait_for(lambda: done([m for _, m in sup.notify.messages]), timeout=timeout_s)
        messages = [m for _, m in sup.notify.messages]
    if not pred(messages):
        why = f"{give_up!r} came first" if give_up and any(give_up in m for m in messages) else ""
        raise AssertionError(
            f"{what if isinstance(what, str) else what()}: not seen within {timeout_s}s "
            f"{why} (supervisor rc={sup.proc.poll()}); last messages: {messages[-8:]}\n"
            f"{sup.log.read_text()[-3000:]}"
        )


def wait_states(
    sup: Supervisor,
    unit: str,
    *wanted: str,
    timeout_s: float = DEADLINE_S,
    give_up: str | None = None,
) -> None:
    """Wait until ``unit`` went through ``wanted`` in this order (other states between)."""

    def went_through(_: list[str]) -> bool:
        it = iter(states_seen(sup, unit))
        return all(any(s == w for s in it) for w in wanted)

    wait_notify(
        sup,
        went_through,
        lambda: f"{unit} states {wanted} (seen {states_seen(sup, unit)})",
        timeout_s,
        give_up=give_up,
    )


def never_ready(sup: Supervisor, unit: str) -> None:
    """``unit`` was never ready, and no READY=1 said every unit passed a sampled
    generation (a degraded start-up, where another unit serves, may say READY=1)."""
    assert "ready" not in states_seen(sup, unit), states_seen(sup, unit)
    ready = [m for _, m in sup.notify.messages if "READY=1" in m]
    assert all(f"degraded: {unit}" in m for m in ready), ready


def wait_output(path: Path, needle: str, timeout_s: float = DEADLINE_S) -> None:
    wait_for_text(path, needle, timeout_s)


def kill_pid(pid: int, sig: signal.Signals) -> None:
    assert pid > 1, f"refusing to signal pid {pid}"
    os.kill(pid, sig)


@pytest.fixture
def custom_unit(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> Iterator[Callable[..., StandinUnit]]:
    """Factory: a unit running ``exec_start`` (``{port}`` filled in) in the session sandbox."""
    made: list[StandinUnit] = []

    def make(name: str, exec_start: str, extra: str = "") -> StandinUnit:
        port = free_port()
        output = tmp_path / f"{name}.out"
        write_unit(bus_env, name, exec_start.format(port=port), output, extra)
        made.append(StandinUnit(name, port, output, bus_env))
        return made[-1]

    yield make
    for u in made:
        u.systemctl("stop", u.name, check=False)
        u.systemctl("reset-failed", u.name, check=False)
        (bus_env.unit_dir / u.name).unlink(missing_ok=True)


def fake_sglang(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SGLANG)
    return f"{sys.executable} {script} {{port}} {mode}"


# ---------------------------------------------------------------- the matrix


def test_sigkill_is_seen_restarted_and_ready_again(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)]))
    sup.notify.wait_for("READY=1", DEADLINE_S)
    pid = unit.main_pid()
    kill_pid(pid, signal.SIGKILL)
    status = sup.wait_status(
        lambda s: (
            (unit_of(s, unit.name)["last_exit"] or {}).get("cause") == "sigkill"
            and unit_of(s, unit.name)["state"] == "ready"
            and unit_of(s, unit.name)["restarts"] >= 1
        )
    )
    u = unit_of(status, unit.name)
    assert u["last_exit"]["signal"] == 9 and u["last_exit"]["main_pid"] == pid
    assert u["main_pid"] not in (None, 0, pid) and unit.main_pid() == u["main_pid"]
    wait_states(sup, unit.name, "ready", "backoff", "ready")
    assert metric(sup, "k26_unit_exits_total", unit=unit.name, cause="sigkill") == 1.0
    assert (metric(sup, "k26_unit_restarts_total", unit=unit.name) or 0) >= 1


def test_cgroup_oom_is_oom_kill_restarted_and_ready_again(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # Ready first (the first sampled probes pass), then the third /generate starts
    # the growth, which the kernel ends under MemoryMax=.
    unit = standin_unit(
        "--fail",
        "grow-memory",
        "--fail-after-requests",
        "2",
        "--grow-step-mib",
        "8",
        extra="MemoryMax=150M\nMemorySwapMax=0\n",
    )
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)], max_failures=10))
    sup.notify.wait_for("READY=1", DEADLINE_S)
    wait_states(sup, unit.name, "ready", "backoff", "ready")
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["restarts"] >= 1)
    u = unit_of(status, unit.name)
    assert u["last_exit"]["cause"] == "oom-kill", u["last_exit"]
    assert u["last_exit"]["signal"] == 9
    assert any("oom" in line.lower() for line in u["last_exit"]["evidence"]), u["last_exit"]
    assert (metric(sup, "k26_unit_exits_total", unit=unit.name, cause="oom-kill") or 0) >= 1
    assert metric(sup, "k26_unit_exits_total", unit=unit.name, cause="sigkill") in (None, 0.0)


def test_cuda_oom_is_gpu_oom(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--fail", "cuda-oom", "--load-seconds", "0.3")
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)]))
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["last_exit"] is not None)
    exit_ = unit_of(status, unit.name)["last_exit"]
    assert exit_["cause"] == "gpu-oom", exit_
    # SGLang's launcher kills itself after its scheduler failed: signal 9, not status 1.
    assert exit_["exit_code"] is None and exit_["signal"] == 9
    assert any("CUDA out of memory" in line for line in exit_["evidence"]), exit_
    assert (metric(sup, "k26_unit_exits_total", unit=unit.name, cause="gpu-oom") or 0) >= 1
    never_ready(sup, unit.name)


def test_crash_on_first_sampled_request_is_never_ready_and_ends_failed(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # FlashInfer warm-up disabled (see the module docstring): nothing can fix it. A
    # second unit serves, so start-up ends degraded and the daemon stays up to tell.
    unit = standin_unit("--fail", "sampling-arch")
    well = standin_unit()
    sup = supervise(
        configure(tmp_path, [(unit, "autoregressive", None), (well, "autoregressive", None)])
    )
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["state"] == "failed")
    u = unit_of(status, unit.name)
    assert u["last_exit"]["cause"] == "flashinfer-arch", u["last_exit"]
    assert u["ready"] is False and status["ready"] is False
    # Greedy health passed every time: the unit got as far as the sampled probe.
    assert "probing" in states_seen(sup, unit.name)
    never_ready(sup, unit.name)
    assert metric(sup, "k26_unit_failed", unit=unit.name) == 1.0
    assert (metric(sup, "k26_unit_exits_total", unit=unit.name, cause="flashinfer-arch") or 0) >= 1


def test_hang_on_sampled_request_fails_the_probe_by_its_deadline(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--fail", "sampled-hang")
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)], timeout_s=2))
    status = sup.wait_status(
        lambda s: (unit_of(s, unit.name)["last_probe"] or {}).get("ok") is False
    )
    u = unit_of(status, unit.name)
    probe = u["last_probe"]
    # Ended by its own deadline (2 s), not by the unit and not much later.
    assert 1900 <= probe["latency_ms"] <= 2000 + 3000, probe
    assert "2 s" in probe["error"] or "time" in probe["error"].lower(), probe
    assert u["ready"] is False and u["state"] != "ready" and status["ready"] is False
    assert (metric(sup, "k26_probe_failures_total", unit=unit.name, reason="timeout") or 0) >= 1
    # failures_to_fail (2) timeouts in a row: the unit is taken down and backs off.
    wait_states(sup, unit.name, "probing", "backoff")
    never_ready(sup, unit.name)
    assert metric(sup, "k26_unit_ready", unit=unit.name) == 0.0


def test_a_unit_the_supervisor_takes_down_for_hanging_is_restarted(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # After failures_to_fail timeouts the supervisor stops the unit itself; that
    # stop is its own, not an operator's, so a restart must follow the backoff.
    unit = standin_unit("--fail", "sampled-hang")
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)], timeout_s=1))
    wait_states(sup, unit.name, "probing", "backoff", "starting", give_up="stopped by an operator")
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["restarts"] >= 1)
    assert unit_of(status, unit.name)["state"] not in ("stopped", "ready")
    assert not any("stopped by an operator" in m for _, m in sup.notify.messages)
    never_ready(sup, unit.name)


def test_load_slower_than_its_deadline_fails_to_start_and_backs_off(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit("--load-seconds", "600")
    sup = supervise(configure(tmp_path, [(unit, "autoregressive", None)], startup_deadline_s=2))
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["state"] == "loading")
    first_pid = unit_of(status, unit.name)["main_pid"] or unit.main_pid()
    wait_states(sup, unit.name, "loading", "backoff", "starting", give_up="stopped by an operator")
    wait_notify(
        sup, lambda ms: any("startup deadline" in m for m in ms), "a startup-deadline message"
    )
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["restarts"] >= 1)
    assert (metric(sup, "k26_unit_restarts_total", unit=unit.name) or 0) >= 1
    # The slow process was stopped by the supervisor and a new one started.
    sup.wait_status(
        lambda s: (
            unit_of(s, unit.name)["main_pid"] not in (None, 0, first_pid)
            and unit_of(s, unit.name)["state"] in ("loading", "backoff")
        )
    )
    never_ready(sup, unit.name)


def test_crash_loop_backs_off_then_fails(
    custom_unit: Callable[..., StandinUnit],
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = custom_unit("k26t-crashloop.service", "/bin/sh -c 'echo crashing; exit 3'")
    # A second unit serves, so start-up ends degraded and the daemon stays up to tell.
    well = standin_unit()
    sup = supervise(
        configure(tmp_path, [(unit, "autoregressive", None), (well, "autoregressive", None)])
    )
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["state"] == "failed")
    u = unit_of(status, unit.name)
    assert u["last_exit"]["cause"] == "exit-code" and u["last_exit"]["exit_code"] == 3, u
    # max_failures (4) failures: three restarts with backoff between them, then failed.
    assert u["restarts"] == 3, u
    wait_states(sup, unit.name, "backoff", "backoff", "backoff", "failed")
    assert metric(sup, "k26_unit_failed", unit=unit.name) == 1.0
    assert metric(sup, "k26_unit_state", unit=unit.name, state="failed") == 1.0
    assert metric(sup, "k26_unit_state", unit=unit.name, state="backoff") == 0.0
    assert (metric(sup, "k26_unit_exits_total", unit=unit.name, cause="exit-code") or 0) == 4
    wait_notify(sup, lambda ms: any("FAILED" in m for m in ms), "a FAILED status")
    assert unit.show("ActiveState") in ("inactive", "failed")


def test_supervisor_kill9_while_a_unit_is_loading(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # Warm-up is disabled, so "warming" does not exist; "loading" is caught instead.
    slow = standin_unit("--load-seconds", "8")
    healthy = standin_unit()
    config = configure(
        tmp_path, [(slow, "autoregressive", None), (healthy, "autoregressive", None)]
    )
    first = supervise(config)
    first.wait_status(
        lambda s: (
            unit_of(s, slow.name)["state"] == "loading"
            and unit_of(s, healthy.name)["state"] == "ready"
        )
    )
    slow_pid, healthy_pid = slow.main_pid(), healthy.main_pid()
    assert slow_pid > 1 and healthy_pid > 1
    first.proc.kill()
    first.proc.wait(timeout=10)
    assert slow.show("ActiveState") == "active" and slow.main_pid() == slow_pid

    second = supervise(config)
    second.notify.wait_for("READY=1", DEADLINE_S)
    status = second.status()
    for unit, pid in ((slow, slow_pid), (healthy, healthy_pid)):
        u = unit_of(status, unit.name)
        assert u["state"] == "ready" and u["restarts"] == 0 and u["last_exit"] is None, u
        assert unit.main_pid() == pid and u["main_pid"] == pid, (unit.name, u)
    # Taken over where it was: never (re)started, never warmed, just waited for.
    assert slow.output.read_text().count("standin: loading model") == 1
    assert states_seen(second, healthy.name) == ["ready"]
    assert "starting" not in states_seen(second, slow.name)


def test_supervisor_kill9_while_a_unit_is_probing(
    custom_unit: Callable[..., StandinUnit],
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # The first sampled /generate never answers: the first supervisor is killed
    # with that probe in flight; the next probe (the new supervisor's) succeeds.
    probed = custom_unit("k26t-probing.service", fake_sglang(tmp_path, "hang-first"))
    healthy = standin_unit()
    config = configure(
        tmp_path,
        [(probed, "autoregressive", None), (healthy, "autoregressive", None)],
        timeout_s=120,
    )
    first = supervise(config)
    first.wait_status(
        lambda s: (
            unit_of(s, probed.name)["state"] == "probing"
            and unit_of(s, healthy.name)["state"] == "ready"
        )
    )
    wait_output(probed.output, "fake: generate 1")
    probed_pid, healthy_pid = probed.main_pid(), healthy.main_pid()
    assert probed_pid > 1 and healthy_pid > 1
    first.proc.kill()
    first.proc.wait(timeout=10)

    second = supervise(config)
    second.notify.wait_for("READY=1", DEADLINE_S)
    status = second.status()
    for unit, pid in ((probed, probed_pid), (healthy, healthy_pid)):
        u = unit_of(status, unit.name)
        assert u["state"] == "ready" and u["restarts"] == 0 and u["last_exit"] is None, u
        assert unit.main_pid() == pid, unit.name
    assert unit_of(status, probed.name)["last_probe"]["ok"] is True
    assert states_seen(second, healthy.name) == ["ready"]


def test_systemd_manager_reexec_is_reconnected_and_state_stays_right(
    fresh_sbx: sandbox.SandboxInfo, tmp_path: Path
) -> None:
    name = "k26t-reexec.service"
    port = free_port()
    output = tmp_path / f"{name}.out"
    cmd = f"{sys.executable} -m k26dev.standin --port {port}"
    write_unit(fresh_sbx, name, cmd, output)
    unit = StandinUnit(name, port, output, fresh_sbx)
    sup = Supervisor(fresh_sbx, configure(tmp_path, [(unit, "autoregressive", None)]), tmp_path)
    try:
        sup.notify.wait_for("READY=1", DEADLINE_S)
        pid = unit.main_pid()
        before = sup.status()
        unit.systemctl("daemon-reexec")
        wait_output(sup.log, "D-Bus reconnected")
        # /status stays right: same process, still ready, probes still passing.
        probes = {unit_of(before, name)["last_probe"]["at"]}

        def still_right(s: dict[str, Any]) -> bool:
            u = unit_of(s, name)
            assert u["state"] == "ready" and u["main_pid"] == pid, u
            assert u["active_state"] == "active" and u["restarts"] == 0, u
            probes.add(u["last_probe"]["at"])
            return len(probes) >= 3

        sup.wait_status(still_right)
        assert unit.main_pid() == pid
        # Still subscribed after the re-exec: a SIGKILL is seen and recovered.
        kill_pid(pid, signal.SIGKILL)
        status = sup.wait_status(
            lambda s: (
                (unit_of(s, name)["last_exit"] or {}).get("cause") == "sigkill"
                and unit_of(s, name)["state"] == "ready"
                and unit_of(s, name)["restarts"] >= 1
            )
        )
        assert unit_of(status, name)["main_pid"] not in (None, 0, pid)
    finally:
        sup.stop()
        unit.systemctl("stop", name, check=False)


def test_sighup_with_a_broken_config_keeps_the_old_one(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    config = configure(tmp_path, [(unit, "autoregressive", None)])
    sup = supervise(config)
    sup.notify.wait_for("READY=1", DEADLINE_S)
    before = sup.status()
    config.write_text(config.read_text().replace("interval_s = 1", "interval_s = 'often'"))
    sup.proc.send_signal(signal.SIGHUP)
    wait_notify(
        sup,
        lambda ms: any(m.startswith("STATUS=") and "invalid" in m for m in ms),
        "a STATUS= message about the invalid config",
    )
    message = next(m for _, m in sup.notify.messages if "invalid" in m)
    assert str(config) in message and "probe.interval_s" in message, message
    probes = {unit_of(before, unit.name)["last_probe"]["at"]}

    def unchanged(s: dict[str, Any]) -> bool:
        assert s["supervisor"] == before["supervisor"] and s["ready"] is True, s
        u = unit_of(s, unit.name)
        assert u["state"] == "ready" and u["main_pid"] == before["units"][unit.name]["main_pid"]
        probes.add(u["last_probe"]["at"])
        return len(probes) >= 3  # still probing every second: the old interval

    sup.wait_status(unchanged)
    assert sup.proc.poll() is None
    assert httpx.get(f"http://127.0.0.1:{sup.port}/healthz", timeout=5).status_code == 200
    # Still fully alive after the bad reload: a SIGKILL is handled as before.
    kill_pid(unit.main_pid(), signal.SIGKILL)
    sup.wait_status(
        lambda s: (
            (unit_of(s, unit.name)["last_exit"] or {}).get("cause") == "sigkill"
            and unit_of(s, unit.name)["state"] == "ready"
        )
    )


def test_sighup_is_not_a_restart_of_the_units(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    # The control case for the one above: a valid SIGHUP reloads and touches nothing.
    unit = standin_unit()
    config = configure(tmp_path, [(unit, "autoregressive", None)])
    sup = supervise(config)
    sup.notify.wait_for("READY=1", DEADLINE_S)
    pid = unit.main_pid()
    sup.proc.send_signal(signal.SIGHUP)
    wait_output(sup.log, "SIGHUP: configuration reloaded")
    status = sup.status()
    assert unit_of(status, unit.name)["state"] == "ready" and unit.main_pid() == pid
    assert not any("invalid" in m for _, m in sup.notify.messages)


def test_sighup_applies_every_runtime_section_at_once(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    config = configure(tmp_path, [(unit, "autoregressive", None)])
    sup = supervise(config)
    sup.notify.wait_for("READY=1", DEADLINE_S)
    # One failure in the window is now enough to give up on a unit.
    config.write_text(config.read_text().replace("max_failures = 4", "max_failures = 1"))
    sup.proc.send_signal(signal.SIGHUP)
    wait_output(sup.log, "SIGHUP: configuration reloaded")
    kill_pid(unit.main_pid(), signal.SIGKILL)
    status = sup.wait_status(lambda s: unit_of(s, unit.name)["state"] == "failed")
    assert unit_of(status, unit.name)["restarts"] == 0


def test_sighup_with_a_key_that_needs_a_restart_changes_nothing(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    config = configure(tmp_path, [(unit, "autoregressive", None)])
    sup = supervise(config)
    sup.notify.wait_for("READY=1", DEADLINE_S)
    text = config.read_text()
    listen = re.search(r'listen = "([^"]+)"', text)
    assert listen is not None
    moved = text.replace(listen.group(1), f"127.0.0.1:{free_port()}")
    # The runtime key in the same file must not sneak in either: all or nothing.
    config.write_text(moved.replace("max_failures = 4", "max_failures = 1"))
    sup.proc.send_signal(signal.SIGHUP)
    wait_notify(
        sup,
        lambda ms: any("supervisor.listen" in m and "not applied" in m for m in ms),
        "a STATUS= message naming supervisor.listen",
    )
    assert httpx.get(f"http://127.0.0.1:{sup.port}/healthz", timeout=5).status_code == 200
    kill_pid(unit.main_pid(), signal.SIGKILL)
    status = sup.wait_status(
        lambda s: (
            unit_of(s, unit.name)["restarts"] >= 1 and unit_of(s, unit.name)["state"] == "ready"
        )
    )
    assert unit_of(status, unit.name)["last_exit"]["cause"] == "sigkill"
