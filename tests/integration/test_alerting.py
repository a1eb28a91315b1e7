"""The whole alerting path, for real: a death ends as a notification, a recovery resolves it.

Each test runs the real daemon (``k26-supervisor run``) supervising stand-in SGLang
units in the confined systemd sandbox, a real Prometheus scraping it with the
shipped scrape config and alert rules, and a real Alertmanager with the shipped
example config, whose receiver is a webhook served by the test. See
tests/integration/alerting_stack.py for how the shipped files are turned into the
test's (durations divided by 60, addresses replaced; nothing else).

Scenarios (issue 16):

1. a unit that keeps failing its sampled probe until it is failed: K26UnitFailed
   reaches the webhook with the unit, the cause and the evidence summary, and is
   resolved after the operator's fix, SIGUSR1 and a good probe. Beside it, a unit
   whose port is taken (a cause no restart heals) fires K26UnitWillNotHeal, which
   resolves once the port is free and the unit reset;
2. the supervisor killed with SIGKILL fires K26SupervisorDown; a new one resolves it;
3. a serving venv that breaks under a READY daemon, then its unit crashes: the
   warm-up before the restart cannot succeed and fires K26FlashInferWarmupFailed
   (and, its unit failed, K26UnitFailed with cause warmup); with that daemon and a
   healthy one scraped, every panel query of deploy/grafana/ returns series. The
   operator fixes the serving venv and sends SIGUSR1: a warm-up, and both resolve;
4. a flapping unit (killed each time it is ready) sends one restart-loop
   notification, not one per death; once it is failed, the failure alert inhibits
   the restart-loop one, as the shipped Alertmanager example configures. Reset and
   left alone, both resolve.

Each test prints its timeline (seconds after the fault): run with ``-s`` to see it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k26dev import sandbox
from tests.waiting import wait_until

from . import alerting_stack
from .alerting_stack import Notification, Stack
from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/k26-supervisor.json"
# Panel queries that may come back empty, with the reason (the warm-up panels are fed
# by the daemon whose warm-up fails). Their metric names are checked against the
# documented ones in tests/unit/deploy/test_grafana.py either way.
DELIBERATELY_EMPTY: dict[str, str] = {
    "Registry pulls": "neither daemon here has a registry configured (the counter and its "
    "results are tested through a real registry in test_registry_signing.py)",
    "Bundle used": "set at the first READY after a bundle pull (test_bundle_effective.py)",
}


# ---------------------------------------------------------------- plumbing


@pytest.fixture
def alerting(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Factory: Prometheus + Alertmanager + webhook for these targets; stopped after."""
    made: list[Stack] = []

    def start(*targets: str) -> Stack:
        made.append(alerting_stack.start(tmp_path / f"alerting{len(made)}", list(targets)))
        return made[-1]

    yield start
    for stack in made:
        stack.stop()


@pytest.fixture
def daemons(bus_env: sandbox.SandboxInfo) -> Iterator[Callable[[Path, Path], Supervisor]]:
    """Factory: a real daemon for ``config``, its log and notify socket in ``directory``."""
    made: list[Supervisor] = []

    def start(config: Path, directory: Path) -> Supervisor:
        directory.mkdir(parents=True, exist_ok=True)
        made.append(Supervisor(bus_env, config, directory))
        return made[-1]

    yield start
    for sup in made:
        sup.stop()


def configure(directory: Path, units: list[StandinUnit], **overrides: object) -> Path:
    """daemon_harness.write_config (in ``directory``) with some of its numbers changed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = write_config(directory, [(u, "autoregressive", None) for u in units])
    text = path.read_text()
    for key, value in overrides.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert n == 1, f"{key} is not a line of the base config"
    path.write_text(text)
    return path


def target(sup: Supervisor) -> str:
    return f"127.0.0.1:{sup.port}"


def serving(sup: Supervisor) -> None:
    """Wait until the daemon answers /status (so Prometheus' first scrape succeeds)."""
    sup.wait_status(lambda s: True, timeout_s=DEADLINE_S)


class Timeline:
    """What reached the webhook, in seconds after ``t0`` (time.time()), for the log."""

    def __init__(self, name: str, stack: Stack, *daemon_logs: Path) -> None:
        self.name = name
        self.stack = stack
        self.daemon_logs = daemon_logs  # their tails go into a failed wait's message
        self.t0 = time.time()
        self.events: list[tuple[float, str]] = []

    def mark(self, what: str) -> None:
        self.events.append((time.time(), what))

    def at(self, iso: str, what: str) -> None:
        self.events.append((alerting_stack.rfc3339(iso), what))

    def start(self, what: str) -> None:
        self.t0 = time.time()
        self.mark(what)

    def wait(
        self, status: str, timeout_s: float = DEADLINE_S, **labels: str
    ) -> tuple[Notification, dict[str, Any]]:
        """The first alert with ``status`` (firing, resolved) and ``labels`` to arrive."""
        hook = self.stack.webhook
        try:
            found = wait_until(
                lambda: hook.first(status, **labels), timeout_s, f"a {status} {labels}"
            )
        except AssertionError as exc:
            seen = [(a["status"], a["labels"]) for n in hook.received() for a in n.alerts]
            tails = "".join(
                f"\n--- {log} ---\n{log.read_text(errors='replace')[-6000:]}"
                for log in self.daemon_logs
            )
            raise AssertionError(
                f"{exc}\nreceived: {seen}\nPrometheus alerts: {self.stack.prometheus.alerts()}\n"
                f"{self.stack.logs()}{tails}"
            ) from None
        note, alert = found
        self.events.append((note.received_wall, f"{alert['labels']['alertname']} {status}"))
        return found

    def report(self) -> str:
        rows = [f"  +{at - self.t0:6.2f} s  {what}" for at, what in sorted(self.events)]
        text = f"[alerting] {self.name}\n" + "\n".join(rows)
        print(text)
        return text


def alerts_in(stack: Stack, **labels: str) -> list[tuple[str, str]]:
    """(alertname, status) of every alert the webhook got with these labels, in order."""
    return [(a["labels"]["alertname"], a["status"]) for _, a in stack.webhook.alerts(**labels)]


def reset_operator(sup: Supervisor) -> None:
    sup.proc.send_signal(signal.SIGUSR1)  # what `systemctl kill -s SIGUSR1` does


# ---------------------------------------------------------------- 1. probe failure


@pytest.mark.parametrize(
    ("stop_flags", "extra"),
    [
        # As SGLang: the drain waits for the hung request, so TimeoutStopSec ends it
        # (systemd sets Result=timeout before its SIGKILL lands).
        ((), "TimeoutStopSec=2\n"),
        # A plain server: SIGTERM kills it at once (the stop job is over before the
        # supervisor has read the signals that publish it).
        (("--stop-mode", "sigterm"), ""),
    ],
    ids=["stop-timeout", "sigterm-death"],
)
def test_a_unit_failing_its_sampled_probe_is_notified_then_resolved_by_the_reset(
    standin_unit: Callable[..., StandinUnit],
    daemons: Callable[[Path, Path], Supervisor],
    alerting: Callable[..., Stack],
    bus_env: sandbox.SandboxInfo,
    tmp_path: Path,
    stop_flags: tuple[str, ...],
    extra: str,
) -> None:
    # Hangs on every sampled request (greedy /health passes); the supervisor takes
    # it down after failures_to_fail probes, twice (max_failures), then fails it.
    hung = standin_unit("--fail", "sampled-hang", *stop_flags, extra=extra)
    # Its port is taken before it starts: port-in-use, which no restart heals.
    blocked = standin_unit()
    # A unit that serves throughout: with it, start-up ends degraded (READY=1) and the
    # daemon stays up to tell; with nothing serving it would fail its start instead.
    well = standin_unit()
    holder = socket.socket()
    holder.bind(("127.0.0.1", blocked.port))
    holder.listen()
    try:
        config = configure(
            tmp_path / "d", [hung, blocked, well], timeout_s=1, failures_to_fail=2, max_failures=2
        )
        sup = daemons(config, tmp_path / "d")
        serving(sup)
        stack = alerting(target(sup))
        stack.arm()
        tl = Timeline("1. sampled probe fails until failed; port in use", stack)
        tl.start("daemon started, rules armed")

        _, failed = tl.wait("firing", alertname="K26UnitFailed", unit=hung.name)
        status = unit_status(sup.status(), hung.name)
        assert status["state"] == "failed", status
        tl.at(status["since"], "the hung unit failed (/status since)")
        tl.at(unit_status(sup.status(), blocked.name)["since"], "the blocked unit failed")
        labels, notes = failed["labels"], failed["annotations"]
        assert labels["cause"] == "probe-timeout", labels
        assert labels["severity"] == "critical" and labels["instance"] == target(sup)
        # The evidence summary: the supervisor's own reason (no exit ended it), capped.
        reason = " ".join(status["reason"].split())
        assert reason.startswith(labels["summary"].removesuffix("...")), (labels, status)
        assert "sampled probes failed in a row, last: timeout" in labels["summary"]
        assert labels["summary"] in notes["description"] and "SIGUSR1" in notes["description"]
        assert notes["summary"].startswith(f"{hung.name} is failed (probe-timeout)")

        _, port = tl.wait("firing", alertname="K26UnitWillNotHeal", unit=blocked.name)
        assert port["labels"]["cause"] == "port-in-use", port["labels"]
        assert "Errno 98" in port["labels"]["summary"], port["labels"]
        assert "ss -ltnp" in port["annotations"]["description"]
        # Each failure is told once, by the alert for its kind.
        assert ("K26UnitFailed", "firing") not in alerts_in(stack, unit=blocked.name)

        # The operator fixes both (a server that answers; the port freed), then resets.
        unit_file = bus_env.unit_dir / hung.name
        unit_file.write_text(unit_file.read_text().replace(" --fail sampled-hang", ""))
        hung.systemctl("daemon-reload")
        holder.close()
        tl.mark("operator: fixed both, SIGUSR1")
        reset_operator(sup)
        sup.wait_status(
            lambda s: all(unit_status(s, u.name)["state"] == "ready" for u in (hung, blocked)),
            timeout_s=DEADLINE_S,
        )
        tl.mark("both units ready (a sampled probe passed)")
        _, resolved = tl.wait("resolved", alertname="K26UnitFailed", unit=hung.name)
        assert resolved["labels"] == labels  # the same alert, now resolved
        assert alerting_stack.rfc3339(resolved["endsAt"]) > alerting_stack.rfc3339(
            resolved["startsAt"]
        )
        tl.wait("resolved", alertname="K26UnitWillNotHeal", unit=blocked.name)
    finally:
        holder.close()
    tl.report()
    assert alerts_in(stack, unit=hung.name) == [
        ("K26UnitFailed", "firing"),
        ("K26UnitFailed", "resolved"),
    ]


# ---------------------------------------------------------------- 2. supervisor down


def test_a_supervisor_killed_with_sigkill_fires_supervisor_down(
    standin_unit: Callable[..., StandinUnit],
    daemons: Callable[[Path, Path], Supervisor],
    alerting: Callable[..., Stack],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    config = configure(tmp_path / "d", [unit])
    first = daemons(config, tmp_path / "d")
    first.notify.wait_for("READY=1", DEADLINE_S)
    stack = alerting(target(first))
    stack.arm()
    tl = Timeline("2. supervisor kill -9", stack)

    tl.start("kill -9 of the supervisor")
    first.proc.kill()
    first.proc.wait(timeout=10)
    _, down = tl.wait("firing", alertname="K26SupervisorDown")
    assert down["labels"]["instance"] == target(first), down["labels"]
    assert down["labels"]["severity"] == "critical"
    assert "systemctl status k26-supervisor.service" in down["annotations"]["description"]

    # systemd would restart it (Restart=on-failure); here the test does.
    second = daemons(config, tmp_path / "d2")
    tl.mark("a new supervisor started")
    second.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready")
    tl.wait("resolved", alertname="K26SupervisorDown")
    tl.report()
    assert [a for a, _ in alerts_in(stack)] == ["K26SupervisorDown", "K26SupervisorDown"]


# ---------------------------------------------------------------- 3. warm-up, dashboard


NONSENSE_PYTHON = (
    '#!/bin/sh\necho \'K26-RESULT {"identity": {"flashinfer": 5}, "flashinfer": 5}\'\n'
)


def test_warm_up_failure_fires_its_alert_and_every_panel_query_returns_series(
    standin_unit: Callable[..., StandinUnit],
    daemons: Callable[[Path, Path], Supervisor],
    alerting: Callable[..., Stack],
    tmp_path: Path,
    serving_07: tuple[Path, dict[str, str]],
) -> None:
    # Daemon A: warm-up off, one healthy unit (probe latency, readiness).
    healthy = standin_unit()
    sup_a = daemons(configure(tmp_path / "a", [healthy]), tmp_path / "a")
    # Daemon B: FlashInfer warm-up on, through an interpreter that is the real serving
    # venv's for now: a real warm-up (a cold build of a small module), then READY.
    python = tmp_path / "python"
    real_python, _ = serving_07
    python.write_text(f'#!/bin/sh\nexec "{real_python}" "$@"\n')
    python.chmod(0o755)
    cold = standin_unit()
    config_b = configure(tmp_path / "b", [cold])
    config_b.write_text(
        config_b.read_text().replace(
            "[flashinfer]\nenabled = false\n",
            f'[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
            f'workspace = "{tmp_path / "ws"}"\nwarmup_attempts = 2\n'
            'modules = ["api_log_stats"]\n'
            f'env_file = "{real_python.parent.parent / "k26-build.env"}"\n',
        )
    )
    # Every event fed to its units' machines in its log (see a failure's message).
    text = config_b.read_text()
    config_b.write_text(text.replace("[supervisor]\n", '[supervisor]\nlog_level = "debug"\n', 1))
    sup_b = daemons(config_b, tmp_path / "b")
    sup_a.notify.wait_for("READY=1", DEADLINE_S)
    sup_b.notify.wait_for("READY=1", 300)
    # Then the serving venv breaks under the running daemon (an upgrade gone wrong: its
    # interpreter answers nonsense), and the unit crashes. No restart without a warm
    # cache, and no warm-up can succeed now. (Before READY=1 the daemon would fail its
    # own start instead, exit 79: K26SupervisorDown's case, section 2.)
    python.write_text(NONSENSE_PYTHON)
    stack = alerting(target(sup_a), target(sup_b))
    stack.arm()
    tl = Timeline("3. warm-up cannot succeed", stack, sup_b.log)
    tl.start("rules armed; the serving venv broken; SIGKILL to daemon B's unit")
    os.kill(cold.main_pid(), signal.SIGKILL)

    _, warm = tl.wait("firing", alertname="K26FlashInferWarmupFailed")
    assert warm["labels"]["instance"] == target(sup_b) and warm["labels"]["arch"] == "12.0"
    assert warm["labels"]["severity"] == "warning"
    assert "warmup.error" in warm["annotations"]["description"]
    _, failed = tl.wait("firing", alertname="K26UnitFailed", unit=cold.name)
    assert failed["labels"]["cause"] == "warmup", failed["labels"]
    assert "warm-up" in failed["labels"]["summary"]
    tl.report()
    fired = {a for a, _ in alerts_in(stack)}
    assert fired == {"K26FlashInferWarmupFailed", "K26UnitFailed"}, alerts_in(stack)
    assert not alerts_in(stack, instance=target(sup_a))

    check_dashboard(stack, [target(sup_a), target(sup_b)])

    # The operator fixes the serving venv (its interpreter is the real one again) and
    # hands the unit back: a warm-up, a start, a sampled probe, and both resolve.
    python.write_text(f'#!/bin/sh\nexec "{real_python}" "$@"\n')
    tl.mark("operator: fixed the serving venv, SIGUSR1")
    reset_operator(sup_b)
    sup_b.wait_status(
        lambda s: unit_status(s, cold.name)["state"] == "ready" and s["warmup"]["state"] == "warm",
        timeout_s=300,
    )
    tl.mark("warm-up done, unit ready (a sampled probe passed)")
    _, warm_ok = tl.wait("resolved", alertname="K26FlashInferWarmupFailed")
    assert warm_ok["labels"]["instance"] == target(sup_b), warm_ok["labels"]
    _, unit_ok = tl.wait("resolved", alertname="K26UnitFailed", unit=cold.name)
    assert unit_ok["labels"]["cause"] == "warmup", unit_ok["labels"]
    tl.report()
    got = sorted(alerts_in(stack))
    assert got == [
        ("K26FlashInferWarmupFailed", "firing"),
        ("K26FlashInferWarmupFailed", "resolved"),
        ("K26UnitFailed", "firing"),
        ("K26UnitFailed", "resolved"),
    ], got


def _grafana_regex(values: list[str]) -> str:
    """A multi-value variable set to All, as Grafana puts it into a =~ matcher."""
    joined = "|".join(re.escape(v) for v in values)
    return "(" + joined.replace("\\", "\\\\") + ")"


def check_dashboard(stack: Stack, instances: list[str]) -> None:
    """Every panel target of the dashboard, run against the live Prometheus."""
    dashboard = json.loads(DASHBOARD.read_text())
    prom = stack.prometheus
    # The template variables, as Grafana's label_values() asks for them.
    found = sorted({s["instance"] for s in prom.series("k26_build_info")})
    assert found == sorted(instances), found
    instance = _grafana_regex(found)
    units = sorted({s["unit"] for s in prom.series(f'k26_unit_state{{instance=~"{instance}"}}')})
    assert len(units) == 2, units
    # Grafana's $__rate_interval: max(4 x scrape interval, step + scrape interval).
    rate_interval = f"{4 * alerting_stack.seconds(alerting_stack.FAST_INTERVAL):g}s"
    variables = {
        "$__rate_interval": rate_interval,
        "$__range": "1h",  # an instant query over the dashboard's range
        "$instance": instance,
        "$unit": _grafana_regex(units),
    }
    results: dict[str, int] = {}
    numbers: dict[str, int] = {}  # of those, how many hold a number (not NaN: 0/0)
    titles = set()
    for panel, tgt in alerting_stack.iter_panel_targets(dashboard):
        expr = tgt["expr"]
        for name, value in variables.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"a variable left in {panel['title']}: {expr}"
        where = f"{panel['title']} [{tgt['refId']}]"
        titles.add(panel["title"])
        if panel["title"] in DELIBERATELY_EMPTY:
            results[where] = len(prom.query(expr))
            continue
        # Rates need two samples in their window: give them a few scrapes.
        series = wait_until(lambda e=expr: prom.query(e), 30, f"series for {where}: {expr}")
        results[where] = len(series)
        numbers[where] = sum(1 for r in series if r["value"][1] not in ("NaN", "+Inf", "-Inf"))
    assert set(DELIBERATELY_EMPTY) <= titles, "a deliberately empty panel that does not exist"
    print("[alerting] dashboard queries: series returned (of which numbers, not NaN)")
    for where, n in results.items():
        print(f"  {n:3d} ({numbers.get(where, 0):3d})  {where}")
    assert len(results) == len(list(alerting_stack.iter_panel_targets(dashboard))) >= 23
    # Issue 25: the start-timeline panel holds numbers, one per phase of daemon A's
    # start (the supervisor's own and the stand-in server's account of its load).
    where_b = "Where restarts spend their time [B]"
    assert numbers[where_b] >= 5, (where_b, results[where_b], numbers[where_b])


# ---------------------------------------------------------------- 4. flapping, no storm


def test_a_flapping_unit_sends_no_storm_and_its_failure_inhibits_the_loop_alert(
    standin_unit: Callable[..., StandinUnit],
    daemons: Callable[[Path, Path], Supervisor],
    alerting: Callable[..., Stack],
    tmp_path: Path,
) -> None:
    # systemd's own start limit (5 in 10 s) would end the flapping before the
    # supervisor's budget does; the shipped units have a backstop of their own.
    unit = standin_unit(extra="[Unit]\nStartLimitIntervalSec=0\n")
    kills = 8
    config = configure(tmp_path / "d", [unit], max_failures=kills, failure_window_s=300)
    sup = daemons(config, tmp_path / "d")
    sup.notify.wait_for("READY=1", DEADLINE_S)
    stack = alerting(target(sup))
    stack.arm()
    tl = Timeline(f"4. flapping: {kills} kills, each once the unit is ready", stack)
    tl.start("first kill")
    for n in range(kills):
        sup.wait_status(
            lambda s, n=n: (
                unit_status(s, unit.name)["state"] == "ready"
                and unit_status(s, unit.name)["restarts"] == n
            )
        )
        pid = unit.main_pid()
        assert pid > 1
        os.kill(pid, signal.SIGKILL)
        if n:
            tl.mark(f"kill {n + 1}")
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "failed")
    tl.mark("unit failed")
    _, failed = tl.wait("firing", alertname="K26UnitFailed", unit=unit.name)
    assert failed["labels"]["cause"] == "sigkill", failed["labels"]
    loop = stack.webhook.first("firing", alertname="K26UnitRestartLoop", unit=unit.name)
    assert loop is not None, alerts_in(stack)
    tl.events.append((loop[0].received_wall, "K26UnitRestartLoop firing"))

    # Still firing in Prometheus (restarts within its window), but muted by the failure.
    def inhibited() -> list[dict[str, Any]]:
        found = stack.alertmanager.alerts(alertname="K26UnitRestartLoop", unit=unit.name)
        return [a for a in found if a["status"]["state"] == "suppressed"]

    (muted,) = wait_until(inhibited, 30, "the restart-loop alert inhibited")
    assert muted["status"]["inhibitedBy"], muted
    tl.mark("K26UnitRestartLoop inhibited by K26UnitFailed (Alertmanager API)")
    tl.report()

    metrics = httpx.get(f"http://{target(sup)}/metrics", timeout=5).text
    deaths = f'k26_unit_exits_total{{cause="sigkill",unit="{unit.name}"}} {float(kills)}'
    assert deaths in metrics
    # Eight deaths, seven restarts, two dozen state changes: two notifications, one per
    # alert, each in its own group (alertname, instance, unit).
    got = alerts_in(stack, unit=unit.name)
    assert sorted(got) == [("K26UnitFailed", "firing"), ("K26UnitRestartLoop", "firing")], got
    for note in stack.webhook.received():
        assert set(note.body["groupLabels"]) <= {"alertname", "instance", "unit"}, note.body

    # The flapping stops (nothing kills it any more); the operator hands it back. The
    # failure resolves once it is ready, the loop once its restarts leave the window.
    tl.mark("operator: SIGUSR1, no more kills")
    reset_operator(sup)
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready")
    tl.mark("unit ready (a sampled probe passed)")
    tl.wait("resolved", alertname="K26UnitFailed", unit=unit.name)
    tl.wait("resolved", alertname="K26UnitRestartLoop", unit=unit.name, timeout_s=120)
    tl.report()
    got = alerts_in(stack, unit=unit.name)
    assert sorted(got) == [
        ("K26UnitFailed", "firing"),
        ("K26UnitFailed", "resolved"),
        ("K26UnitRestartLoop", "firing"),
        ("K26UnitRestartLoop", "resolved"),
    ], got
