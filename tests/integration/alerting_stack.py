"""Real Prometheus and Alertmanager, and a webhook receiver, for the alerting tests
and bench/alert_latency.py.

Both servers are the binaries scripts/tools.sh unpacked (Debian's prometheus 2.42
and prometheus-alertmanager 0.25), run as child processes on free loopback ports
with a temporary config and data directory, and stopped by PID (SIGTERM, then
SIGKILL): never a system service. Their configs are made from the shipped files:

- Prometheus: deploy/prometheus/scrape-k26-supervisor.yml with its targets
  replaced by the daemons under test, plus the ``global``, ``rule_files`` and
  ``alerting`` sections a prometheus.yml has around it.
- Rules: deploy/prometheus/k26-supervisor.rules.yml, or (``fast``) a copy made by
  ``shorten_rules``, which divides every duration in it by 60 (``for: 2m`` ->
  ``for: 2s``, ``[30m]`` -> ``[30s]``, ``offset 1h`` -> ``offset 60s``) and changes
  nothing else: not an expression, a threshold, a label or an annotation.
- Alertmanager: deploy/alertmanager/k26-supervisor.yml with the receiver's URL
  replaced by the test's webhook and, when ``fast``, its group_wait,
  group_interval and repeat_interval divided by 60 (30s -> 500ms, 5m -> 5s,
  4h -> 4m).

When ``fast``, Prometheus scrapes and evaluates every second (shipped: 15 s, and
the evaluation interval is the host's prometheus.yml's; 15 s here) and re-sends
firing alerts every 2 s (FAST_RESEND_DELAY says why).

The rules are loaded only once every target was scraped (``Stack.arm``), as on a
Prometheus that has been running for a while.

Plain library code, no pytest: the bench imports it too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from k26dev import shared_cache
from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/k26-supervisor.rules.yml"
SCRAPE = ROOT / "deploy/prometheus/scrape-k26-supervisor.yml"
ALERTMANAGER = ROOT / "deploy/alertmanager/k26-supervisor.yml"
TOOLS = shared_cache.tools_dir()
TOOLS_BIN = TOOLS / "bin"
SHIPPED_TARGET = '["127.0.0.1:9436"]'
FACTOR = 60  # fast: every rule and Alertmanager duration divided by this
FAST_INTERVAL = "1s"  # fast: scrape and evaluation interval
SHIPPED_EVALUATION_INTERVAL = "15s"  # not in the shipped files: the host's choice
# fast: Prometheus re-sends firing alerts this often (its default: 1m). Arming
# reloads Prometheus, which forgets its Alertmanagers until its discovery manager's
# 5 s throttle has passed; an alert that fires meanwhile is sent to no one and only
# re-sent after this delay. (Alertmanager takes a firing alert as resolved after
# 4 x this delay without news, so it must not be so short that a stall resolves it.)
FAST_RESEND_DELAY = "2s"

_UNITS_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")


def seconds(duration: str) -> float:
    """A Prometheus duration ("1h30m", "500ms") in seconds."""
    parts = _DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(int(n) * _UNITS_S[u] for n, u in parts)


def divided(duration: str, factor: int = FACTOR) -> str:
    """``duration`` divided by ``factor``, spelled in whole seconds or milliseconds."""
    ms = round(seconds(duration) * 1000 / factor)
    if ms <= 0:
        raise ValueError(f"{duration} / {factor} is below a millisecond")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


# The places a duration can stand in the rules file: a rule's "for:", a range or
# subquery in brackets, and an "offset". Annotations and thresholds are left alone.
_RULE_DURATIONS = (
    re.compile(r"(?m)^(\s+for: )(\w+)(\s*)$"),
    re.compile(r"(\[)(\d+[smhd]\w*)(\])"),
    re.compile(r"(\[)(\d+[smhd]\w*)(:)"),
    re.compile(r"(:)(\d+[smhd]\w*)(\])"),
    re.compile(r"(\boffset )(\d+[smhd]\w*)(\b)"),
)


def shorten_rules(text: str, factor: int = FACTOR) -> tuple[str, list[str]]:
    """The rules with every duration divided by ``factor``, and what was changed."""
    changes: list[str] = []
    for pattern in _RULE_DURATIONS:

        def shorter(m: re.Match[str]) -> str:
            new = divided(m.group(2), factor)
            changes.append(f"{m.group(2)} -> {new}")
            return f"{m.group(1)}{new}{m.group(3)}"

        text = pattern.sub(shorter, text)
    return text, changes


_AM_DURATIONS = re.compile(r"(?m)^(\s*(?:group_wait|group_interval|repeat_interval): )(\w+)(\s*)$")
_AM_URL = re.compile(r"(?m)^(\s*- url: )(\S+)(\s*)$")


def alertmanager_config(text: str, webhook_url: str, *, fast: bool) -> str:
    """The shipped Alertmanager example, sending to ``webhook_url``; ``fast``: its
    grouping durations divided by FACTOR."""
    text, n = _AM_URL.subn(lambda m: f"{m.group(1)}{webhook_url}{m.group(3)}", text)
    if n != 1:
        raise ValueError(f"expected one webhook url in the Alertmanager example, found {n}")
    if fast:
        text, n = _AM_DURATIONS.subn(
            lambda m: f"{m.group(1)}{divided(m.group(2))}{m.group(3)}", text
        )
        if n < 3:
            raise ValueError("group_wait, group_interval, repeat_interval: not all found")
    return text


def prometheus_config(
    scrape_text: str, targets: list[str], rules: Path | None, alertmanager: str, *, fast: bool
) -> str:
    """A prometheus.yml around the shipped scrape config, scraping ``targets``, with
    the ``rules`` file (None: none yet)."""
    if SHIPPED_TARGET not in scrape_text:
        raise ValueError(f"the shipped scrape config has no {SHIPPED_TARGET} target")
    body = scrape_text.replace(SHIPPED_TARGET, json.dumps(targets))
    if fast:
        body = re.sub(
            r"(?m)^(\s+scrape_(?:interval|timeout): )\w+$", rf"\g<1>{FAST_INTERVAL}", body
        )
    evaluation = FAST_INTERVAL if fast else SHIPPED_EVALUATION_INTERVAL
    head = (
        f"global:\n  evaluation_interval: {evaluation}\n"
        f"rule_files: [{json.dumps(str(rules)) if rules else ''}]\n"
        "alerting:\n  alertmanagers:\n"
        f"    - static_configs: [{{targets: [{json.dumps(alertmanager)}]}}]\n"
    )
    return head + body


# --- the webhook -----------------------------------------------------------------------


@dataclass(frozen=True)
class Notification:
    received_wall: float  # time.time() when the POST was read
    received_mono: float
    body: dict[str, Any]

    @property
    def alerts(self) -> list[dict[str, Any]]:
        return list(self.body.get("alerts", []))


class Webhook:
    """Alertmanager's webhook receiver: records every POST, in order."""

    def __init__(self) -> None:
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                wall, mono = time.time(), time.monotonic()
                with hook._lock:
                    hook.notifications.append(Notification(wall, mono, json.loads(raw)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/k26-alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self) -> list[Notification]:
        with self._lock:
            return list(self.notifications)

    def alerts(self, **labels: str) -> list[tuple[Notification, dict[str, Any]]]:
        """(notification, alert) for each alert received with these labels."""
        return [
            (n, a)
            for n in self.received()
            for a in n.alerts
            if all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def first(self, status: str, **labels: str) -> tuple[Notification, dict[str, Any]] | None:
        for n, a in self.alerts(**labels):
            if a["status"] == status:
                return n, a
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the servers -------------------------------------------------------------------------


# Debian's alertmanager reads its default notification templates from this fixed
# path (upstream embeds them). The tools are unpacked, not installed, so the path is
# empty here: Alertmanager runs in a mount namespace of its own (unshare(1), root)
# where an overlay shows the unpacked files there. The host's /usr/share is untouched.
AM_SHARE = Path("/usr/share/prometheus/alertmanager")
UNPACKED_SHARE = TOOLS / "root/usr/share"


def with_alertmanager_share(argv: list[str]) -> list[str]:
    """``argv`` run where AM_SHARE holds Debian's templates (the same PID: exec)."""
    if (AM_SHARE / "default.tmpl").exists():
        return argv
    if not (UNPACKED_SHARE / "prometheus/alertmanager/default.tmpl").exists():
        raise RuntimeError(f"no Alertmanager templates in {UNPACKED_SHARE}: run scripts/tools.sh")
    mount = (
        f"mount -t overlay overlay -o lowerdir={shlex.quote(str(UNPACKED_SHARE))}:/usr/share "
        "/usr/share && exec " + " ".join(map(shlex.quote, argv))
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]


def tool(name: str) -> str:
    path = shutil.which(name) or (str(TOOLS_BIN / name) if (TOOLS_BIN / name).exists() else None)
    if path is None:
        raise RuntimeError(f"{name} not found: scripts/tools.sh unpacks it into {TOOLS_BIN}")
    return path


class Server:
    """A child process serving HTTP on 127.0.0.1:port, ready once /-/ready says so."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready within {timeout_s} s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s, to this process's PID only."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class Prometheus(Server):
    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, str] = {"query": expr}
        if at is not None:
            params["time"] = repr(at)
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10)
        data = r.json()
        if data.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {data}")
        return list(data["data"]["result"])

    def series(self, match: str) -> list[dict[str, str]]:
        r = httpx.get(f"{self.url}/api/v1/series", params={"match[]": match}, timeout=10)
        return list(r.json()["data"])

    def alerts(self) -> list[dict[str, Any]]:
        """Prometheus' own view: pending and firing alerts, with activeAt."""
        return list(httpx.get(f"{self.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"])

    def rule_groups(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/rules", timeout=10)
        return list(r.json()["data"]["groups"])


class Alertmanager(Server):
    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Alertmanager's alerts (active, silenced and inhibited) with these labels."""
        params = httpx.QueryParams([("filter", f'{k}="{v}"') for k, v in labels.items()])
        r = httpx.get(f"{self.url}/api/v2/alerts", params=params, timeout=10)
        return list(r.json())


@dataclass
class Stack:
    prometheus: Prometheus
    alertmanager: Alertmanager
    webhook: Webhook
    directory: Path
    fast: bool
    targets: list[str]
    rules: Path
    config: Path
    alertmanager_host: str
    rule_changes: list[str] = field(default_factory=list)
    armed_at: float | None = None  # time.time() once the rules were loaded

    def arm(self, timeout_s: float = 60) -> None:
        """Wait until every target was scraped and answered, then load the rules.

        Prometheus holds its first target update for 5 s (its discovery manager's
        throttle): with the rules loaded from the start, the shortened for: of
        K26SupervisorScrapeAbsent (5 s) would race it and fire at every start.
        """
        want = len(self.targets)
        self._wait(
            lambda: len(self.prometheus.query('up{job="k26-supervisor"} == 1')) == want,
            timeout_s,
            f"every target of {self.targets} scraped and up",
        )
        self.config.write_text(
            prometheus_config(
                SCRAPE.read_text(), self.targets, self.rules, self.alertmanager_host, fast=self.fast
            )
        )
        r = httpx.post(f"{self.prometheus.url}/-/reload", timeout=30)
        if r.status_code != 200:
            raise RuntimeError(f"prometheus reload: {r.status_code} {r.text}\n{self.logs()}")

        def evaluated() -> bool:
            groups = self.prometheus.rule_groups()
            return bool(groups) and all(not g["lastEvaluation"].startswith("0001-") for g in groups)

        self._wait(evaluated, timeout_s, "the rules loaded and evaluated once")

        def notifier_ready() -> bool:
            r = httpx.get(f"{self.prometheus.url}/api/v1/alertmanagers", timeout=10)
            return bool(r.json()["data"]["activeAlertmanagers"])

        self._wait(notifier_ready, timeout_s, "Prometheus sending to its Alertmanager again")
        self.armed_at = time.time()

    def _wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            for server in (self.prometheus, self.alertmanager):
                if server.proc.poll() is not None:
                    raise RuntimeError(f"{server.name} exited:\n{self.logs()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{what}: not within {timeout_s:g} s\n{self.logs()}")
            time.sleep(0.05)

    def stop(self) -> None:
        for server in (self.prometheus, self.alertmanager):
            server.stop()
        self.webhook.close()

    def logs(self) -> str:
        try:  # why a target is down, in Prometheus's own words
            r = httpx.get(f"{self.prometheus.url}/api/v1/targets", timeout=10)
            targets = "\n".join(
                f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}"
                for t in r.json()["data"]["activeTargets"]
            )
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            targets = f"(no target list: {exc!r})"
        return (
            f"--- targets ---\n{targets}\n"
            f"--- prometheus ---\n{self.prometheus.tail()}\n"
            f"--- alertmanager ---\n{self.alertmanager.tail()}"
        )


def start(directory: Path, targets: list[str], *, fast: bool = True) -> Stack:
    """Alertmanager, then Prometheus scraping ``targets`` (no rules until ``arm``);
    both ready, or both stopped again."""
    directory.mkdir(parents=True, exist_ok=True)
    webhook = Webhook()
    started: list[Server] = []
    try:
        am_port, prom_port = free_port(), free_port()
        am_config = directory / "alertmanager.yml"
        am_config.write_text(alertmanager_config(ALERTMANAGER.read_text(), webhook.url, fast=fast))
        alertmanager = Alertmanager(
            "alertmanager",
            with_alertmanager_share(
                [
                    tool("alertmanager"),
                    f"--config.file={am_config}",
                    f"--storage.path={directory / 'alertmanager-data'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",  # no gossip port: a single instance
                ]
            ),
            am_port,
            directory / "alertmanager.log",
        )
        started.append(alertmanager)
        rules = directory / RULES.name
        changes: list[str] = []
        if fast:
            text, changes = shorten_rules(RULES.read_text())
            rules.write_text(text)
        else:
            shutil.copy(RULES, rules)
        am_host = f"127.0.0.1:{am_port}"
        prom_config = directory / "prometheus.yml"
        prom_config.write_text(
            prometheus_config(SCRAPE.read_text(), targets, None, am_host, fast=fast)
        )
        prometheus = Prometheus(
            "prometheus",
            [
                tool("prometheus"),
                f"--config.file={prom_config}",
                f"--storage.tsdb.path={directory / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--web.enable-lifecycle",
                *([f"--rules.alert.resend-delay={FAST_RESEND_DELAY}"] if fast else []),
            ],
            prom_port,
            directory / "prometheus.log",
        )
        started.append(prometheus)
        alertmanager.wait_ready(30)
        prometheus.wait_ready(30)
        return Stack(
            prometheus=prometheus,
            alertmanager=alertmanager,
            webhook=webhook,
            directory=directory,
            fast=fast,
            targets=targets,
            rules=rules,
            config=prom_config,
            alertmanager_host=am_host,
            rule_changes=changes,
        )
    except BaseException:
        for server in started:
            server.stop()
        webhook.close()
        raise


def rfc3339(text: str) -> float:
    """Alertmanager's and Prometheus' timestamps (RFC 3339, up to ns) as Unix seconds."""
    m = re.fullmatch(r"(.*?T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(f"0.{m.group(2) or 0}")


def iter_panel_targets(
    dashboard: dict[str, Any],
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every target of every panel, rows' nested panels included."""
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield panel, target
