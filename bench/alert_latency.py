"""From a death to the webhook: how long until a person is told, and where the time goes.

    flock /tmp/k26-heavy.lock .venv/bin/python bench/alert_latency.py [--runs 5] [--shipped]

Needs root (the confined systemd sandbox, and Alertmanager's mount namespace: see
tests/integration/alerting_stack.py). It brings up, all real: the sandbox with
``--runs`` stand-in SGLang units, the daemon (``python -m supervisor run``)
supervising them with ``max_failures = 1`` (so one death fails a unit: the death
is what the alert reports, not a restart budget running out), Prometheus scraping
it with the shipped scrape config and rules, Alertmanager with the shipped example
config, and a webhook receiver in this process.

Phase 1, per run: a ready unit's main process is SIGKILLed (at a random moment of
the scrape interval) and K26UnitFailed is awaited at the webhook. Each run kills a
different unit, so each alert is the first of its group (Alertmanager waits
group_wait, not group_interval). The time from the kill to the webhook is split:

  kill -> exit seen      the daemon read systemd's signal and classified the exit
                         (its log: "exit seen: ... monotonic=")
  exit -> failed         the daemon's policy put the unit in failed (its log)
  failed -> scraped      until Prometheus scraped k26_unit_failed = 1 (the sample's
                         timestamp): waiting for the scrape interval
  scraped -> active      until a rule evaluation saw it (the alert's activeAt):
                         waiting for the evaluation interval
  active -> firing       the rule's for: (K26UnitFailed has none: 0)
  firing -> webhook      Prometheus' notifier, Alertmanager's group_wait, the POST

Phase 2, ``--supervisor-runs`` times: the daemon itself is SIGKILLed and
K26SupervisorDown awaited (kill -> first failed scrape -> active -> firing after its
for: -> webhook); a new daemon is started before the next run.

Durations: ``--shipped`` runs the shipped rules, scrape config and Alertmanager
example unchanged (the evaluation interval, which prometheus.yml sets and the
shipped files do not, is 15 s). Without it, every duration of the rules and of
Alertmanager's grouping is divided by 60 and Prometheus scrapes and evaluates every
second, exactly as tests/integration/test_alerting.py runs them. The shipped
for:/group_wait contributions are also printed as arithmetic next to the measure.

The de-phasing sleep before each kill is the bench's only sleep. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k26dev import sandbox  # noqa: E402
from tests.integration import alerting_stack  # noqa: E402
from tests.integration.conftest import StandinUnit, free_port, write_unit  # noqa: E402
from tests.integration.daemon_harness import Supervisor, write_config  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

_LOG = re.compile(r"(exit seen|state): unit=(\S+)(?: (\w+))? monotonic=(\d+\.\d+)")
PHASE1 = ("kill->exit seen", "exit->failed", "failed->scraped", "scraped->active")
PHASE1 += ("active->firing", "firing->webhook", "kill->webhook")
PHASE2 = ("kill->down scrape", "scrape->active", "active->firing", "firing->webhook")
PHASE2 += ("kill->webhook",)


@dataclass
class Run:
    unit: str
    parts: dict[str, float] = field(default_factory=dict)  # seconds


def mono_to_wall(mono: float) -> float:
    return mono + (time.time() - time.monotonic())


def daemon_log_times(log: Path, unit: str, after_mono: float) -> dict[str, float]:
    """Monotonic times (this host's CLOCK_MONOTONIC) of the daemon's log lines."""
    found: dict[str, float] = {}
    for kind, name, state, mono in _LOG.findall(log.read_text(errors="replace")):
        t = float(mono)
        if name != unit or t < after_mono:
            continue
        key = "exit seen" if kind == "exit seen" else f"state {state}"
        found.setdefault(key, t)
    return found


def first_sample(stack: alerting_stack.Stack, selector: str, value: str, after: float) -> float:
    """Timestamp of the first sample of ``selector`` equal to ``value`` after ``after``."""
    (series,) = stack.prometheus.query(f"{selector}[10m]")
    for ts, v in series["values"]:
        if float(ts) >= after and v == value:
            return float(ts)
    raise AssertionError(f"no sample {selector} == {value} after {after}: {series['values']}")


def active_at(stack: alerting_stack.Stack, alertname: str, **labels: str) -> float:
    for alert in stack.prometheus.alerts():
        lab = alert["labels"]
        if lab["alertname"] == alertname and all(lab.get(k) == v for k, v in labels.items()):
            return alerting_stack.rfc3339(alert["activeAt"])
    raise AssertionError(f"{alertname} {labels} not active in Prometheus")


def webhook(stack: alerting_stack.Stack, timeout_s: float, **labels: str) -> tuple[Any, Any]:
    return wait_until(  # type: ignore[no-any-return]
        lambda: stack.webhook.first("firing", **labels), timeout_s, f"firing {labels}"
    )


def dephase(interval_s: float) -> None:
    time.sleep(random.uniform(0, interval_s))  # a random moment of the scrape cycle


def unit_death(
    stack: alerting_stack.Stack,
    sup: Supervisor,
    unit: StandinUnit,
    interval_s: float,
    timeout_s: float,
) -> Run:
    run = Run(unit.name)
    pid = unit.main_pid()
    assert pid > 1, unit.name
    dephase(interval_s)
    t_kill_mono, t_kill = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    note, alert = webhook(stack, timeout_s, alertname="K26UnitFailed", unit=unit.name)
    assert alert["labels"].get("cause") == "sigkill", alert["labels"]

    def both_logged() -> dict[str, float] | None:
        times = daemon_log_times(sup.log, unit.name, t_kill_mono)
        return times if "exit seen" in times and "state failed" in times else None

    logged = wait_until(both_logged, 10, "the daemon's log lines")
    exit_seen, failed = mono_to_wall(logged["exit seen"]), mono_to_wall(logged["state failed"])
    scraped = first_sample(stack, f'k26_unit_failed{{unit="{unit.name}"}}', "1", t_kill)
    active = active_at(stack, "K26UnitFailed", unit=unit.name)
    firing = alerting_stack.rfc3339(alert["startsAt"])
    received = note.received_wall
    run.parts = {
        "kill->exit seen": exit_seen - t_kill,
        "exit->failed": failed - exit_seen,
        "failed->scraped": scraped - failed,
        "scraped->active": active - scraped,
        "active->firing": firing - active,
        "firing->webhook": received - firing,
        "kill->webhook": received - t_kill,
    }
    return run


def supervisor_death(
    stack: alerting_stack.Stack, sup: Supervisor, interval_s: float, timeout_s: float
) -> Run:
    run = Run("k26-supervisor")
    before = len(stack.webhook.alerts(alertname="K26SupervisorDown"))
    dephase(interval_s)
    t_kill = time.time()
    sup.proc.kill()
    sup.proc.wait(timeout=10)
    note, alert = wait_until(
        lambda: next(
            (
                (n, a)
                for n, a in stack.webhook.alerts(alertname="K26SupervisorDown")[before:]
                if a["status"] == "firing"
            ),
            None,
        ),
        timeout_s,
        "K26SupervisorDown at the webhook",
    )
    down = first_sample(stack, f'up{{instance="127.0.0.1:{sup.port}"}}', "0", t_kill)
    active = active_at(stack, "K26SupervisorDown")
    firing = alerting_stack.rfc3339(alert["startsAt"])
    run.parts = {
        "kill->down scrape": down - t_kill,
        "scrape->active": active - down,
        "active->firing": firing - active,
        "firing->webhook": note.received_wall - firing,
        "kill->webhook": note.received_wall - t_kill,
    }
    return run


def _cell(value: float, width: int) -> str:
    return f"{0.0 if abs(value) < 0.005 else value:>{width}.2f}"  # no "-0.00"


def table(title: str, runs: list[Run], columns: tuple[str, ...]) -> None:
    print(f"\n{title}")
    width = max(len(c) for c in columns) + 2
    print(f"  {'run':>6s}" + "".join(f"{c:>{width}}" for c in columns))
    for n, run in enumerate(runs, 1):
        print(f"  {n:>6d}" + "".join(_cell(run.parts[c], width) for c in columns))
    for name, fn in (("min", min), ("median", statistics.median), ("max", max)):
        values = [fn([r.parts[c] for r in runs]) for c in columns]
        print(f"  {name:>6s}" + "".join(_cell(v, width) for v in values))


def shipped_arithmetic() -> None:
    rules = alerting_stack.RULES.read_text()
    am = alerting_stack.ALERTMANAGER.read_text()
    scrape = alerting_stack.SCRAPE.read_text()

    def grab(pattern: str, text: str) -> float:
        m = re.search(pattern, text)
        assert m, pattern
        return alerting_stack.seconds(m.group(1))

    s = grab(r"scrape_interval: (\w+)", scrape)
    e = alerting_stack.seconds(alerting_stack.SHIPPED_EVALUATION_INTERVAL)
    gw = grab(r"group_wait: (\w+)", am)
    down_for = grab(r"alert: K26SupervisorDown\n(?:.*\n)*?\s+for: (\w+)", rules)
    print("\nShipped durations, arithmetically (measured daemon and pipeline parts aside):")
    print(
        f"  K26UnitFailed (no for:): scrape wait 0..{s:g} s (mean {s / 2:g}) + evaluation wait "
        f"0..{e:g} s (mean {e / 2:g}) + group_wait {gw:g} s = {gw:g}..{s + e + gw:g} s, "
        f"mean {s / 2 + e / 2 + gw:g} s"
    )
    print(
        f"  K26SupervisorDown (for: {down_for:g} s): first failed scrape 0..{s:g} s + "
        f"evaluation 0..{e:g} s + for: {down_for:g} s (counted in evaluations) + group_wait "
        f"{gw:g} s = {down_for + gw:g}..{s + e + down_for + gw:g} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="unit deaths (one unit each)")
    parser.add_argument("--supervisor-runs", type=int, default=None, help="daemon kills")
    parser.add_argument("--shipped", action="store_true", help="shipped durations, unchanged")
    args = parser.parse_args()
    fast = not args.shipped
    supervisor_runs = args.supervisor_runs if args.supervisor_runs is not None else 3 if fast else 1
    if os.geteuid() != 0:
        print("needs root (systemd sandbox, Alertmanager's mount namespace)", file=sys.stderr)
        return 1
    interval = alerting_stack.seconds(
        alerting_stack.FAST_INTERVAL if fast else alerting_stack.SHIPPED_EVALUATION_INTERVAL
    )
    timeout = 60.0 if fast else 240.0
    with tempfile.TemporaryDirectory(prefix="k26-alert-bench-") as tmp:
        work = Path(tmp)
        with sandbox.running(work / "sandbox") as info:
            os.environ.update(info.env)
            units = []
            for n in range(args.runs):
                name = f"k26-bench-alert-{n}.service"
                port = free_port()
                cmd = f"{sys.executable} -m k26dev.standin --port {port}"
                cmd += " --sigterm-poll-seconds 0.2 --crash-diagnostics-seconds 0.2"
                write_unit(info, name, cmd, work / f"{name}.out")
                units.append(StandinUnit(name, port, work / f"{name}.out", info))
            config = write_config(work, [(u, "autoregressive", None) for u in units])
            text = config.read_text().replace("max_failures = 4", "max_failures = 1")
            config.write_text(text.replace("interval_s = 1\n", "interval_s = 5\n"))
            daemons = [Supervisor(info, config, _fresh(work, "d0"))]
            stack = None
            try:
                daemons[0].wait_status(lambda s: s["ready"] is True, timeout_s=120)
                stack = alerting_stack.start(
                    work / "alerting", [f"127.0.0.1:{daemons[0].port}"], fast=fast
                )
                stack.arm(timeout_s=120)
                mode = "fast (durations / 60, 1 s scrape and evaluation)" if fast else "shipped"
                print(
                    f"alert latency bench: {mode}; {args.runs} unit deaths, "
                    f"{supervisor_runs} supervisor deaths"
                )
                if fast:
                    print(f"  rule durations changed: {', '.join(stack.rule_changes)}")
                deaths = []
                for unit in units:
                    deaths.append(unit_death(stack, daemons[-1], unit, interval, timeout))
                    print(f"  unit death {len(deaths)}: {deaths[-1].parts['kill->webhook']:.2f} s")
                downs = []
                for n in range(supervisor_runs):
                    downs.append(supervisor_death(stack, daemons[-1], interval, timeout + 180))
                    print(f"  supervisor death {n + 1}: {downs[-1].parts['kill->webhook']:.2f} s")
                    if n + 1 == supervisor_runs:
                        break
                    # systemd would restart it; the alert's group must be flushed (its
                    # resolution sent) before the next death, or that one waits for
                    # group_interval instead of group_wait.
                    daemons.append(Supervisor(info, config, _fresh(work, f"d{n + 1}")))
                    daemons[-1].wait_status(lambda s: True, timeout_s=60)
                    resolved = len(stack.webhook.alerts(alertname="K26SupervisorDown"))
                    wait_until(
                        lambda r=resolved: (
                            len(stack.webhook.alerts(alertname="K26SupervisorDown")) > r
                        ),
                        timeout + 330,
                        "K26SupervisorDown resolved at the webhook",
                    )
                table("K26UnitFailed: SIGKILL of a ready unit -> webhook (seconds)", deaths, PHASE1)
                if downs:
                    table(
                        "K26SupervisorDown: SIGKILL of the daemon -> webhook (seconds)",
                        downs,
                        PHASE2,
                    )
                shipped_arithmetic()
            finally:
                if stack is not None:
                    stack.stop()
                for sup in daemons:
                    sup.stop()
                for unit in units:
                    unit.systemctl("stop", unit.name, check=False)
    return 0


def _fresh(work: Path, name: str) -> Path:
    directory = work / name
    directory.mkdir()
    return directory


if __name__ == "__main__":
    sys.exit(main())
