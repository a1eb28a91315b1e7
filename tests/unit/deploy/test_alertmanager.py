"""The shipped Alertmanager example, and the test copies the live alerting tests make.

deploy/alertmanager/k26-supervisor.yml must pass ``amtool check-config``, route every
k26 alert, and name in its inhibit rules only alerts the rules file has. The live
tests (tests/integration/test_alerting.py) run the shipped files with durations
divided by 60: that rewriting must change durations and nothing else, and what it
makes must still pass promtool and amtool.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration import alerting_stack

SOURCE = Path(__file__).resolve().parents[3]
EXAMPLE = SOURCE / "deploy/alertmanager/k26-supervisor.yml"
RULES = SOURCE / "deploy/prometheus/k26-supervisor.rules.yml"
ALERT_NAMES = re.findall(r"(?m)^\s*- alert: (\S+)\s*$", RULES.read_text())


def tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is needed: scripts/tools.sh puts it in the shared cache (scripts/cache-dir.sh)"
        )
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60, check=False)


def test_amtool_accepts_the_example() -> None:
    done = tool("amtool", "check-config", str(EXAMPLE))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 inhibit rules" in done.stdout and "1 receivers" in done.stdout


@pytest.mark.parametrize(
    ("alertname", "severity"),
    [("K26UnitFailed", "critical"), ("K26UnitRestartLoop", "warning")],
)
def test_every_severity_reaches_the_receiver(alertname: str, severity: str) -> None:
    done = tool(
        "amtool",
        "config",
        "routes",
        "test",
        f"--config.file={EXAMPLE}",
        f"alertname={alertname}",
        f"severity={severity}",
        "instance=127.0.0.1:9436",
        "unit=sglang-k26.service",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "k26-oncall"


def test_the_inhibit_rules_name_alerts_that_exist() -> None:
    text = EXAMPLE.read_text()
    named = set()
    for pattern in re.findall(r'alertname\s*=~?\s*"([^"]+)"', text):
        if pattern == "K26.*":
            continue
        named.update(pattern.split("|"))
    assert named, "no alert named in the example"
    assert named <= set(ALERT_NAMES), named - set(ALERT_NAMES)
    # A failure inhibits what it implies, for the same unit only.
    assert "equal: [instance, unit]" in text
    assert re.search(r"K26UnitFailed\|K26UnitWillNotHeal\|K26GpuXidNeedsPerson", text)


def test_grouping_keeps_each_alert_of_each_unit_its_own_group() -> None:
    assert re.search(r"(?m)^  group_by: \[alertname, instance, unit\]$", EXAMPLE.read_text())


# --- the test copies ------------------------------------------------------------------


def test_shortened_rules_differ_from_the_shipped_ones_in_durations_only(tmp_path: Path) -> None:
    shipped = RULES.read_text()
    short, changes = alerting_stack.shorten_rules(shipped)
    assert changes, "nothing was shortened"
    assert all(
        alerting_stack.seconds(old) == 60 * alerting_stack.seconds(new)
        for old, new in (c.split(" -> ") for c in changes)
    ), changes
    duration = re.compile(r"\b\d+(?:ms|[smhd])\b")
    assert duration.sub("D", shipped) == duration.sub("D", short)
    # Every for: and every range window is covered.
    assert len(changes) == len(re.findall(r"\bfor: |\[\d+[smhd]|\boffset \d", shipped))
    (tmp_path / "short.rules.yml").write_text(short)
    done = tool("promtool", "check", "rules", str(tmp_path / "short.rules.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("duration", "expected"), [("30s", "500ms"), ("5m", "5s"), ("4h", "240s")])
def test_durations_divide(duration: str, expected: str) -> None:
    assert alerting_stack.divided(duration) == expected


def test_the_test_alertmanager_config_passes_amtool(tmp_path: Path) -> None:
    config = alerting_stack.alertmanager_config(
        EXAMPLE.read_text(), "http://127.0.0.1:1/hook", fast=True
    )
    assert "url: http://127.0.0.1:1/hook" in config and "group_wait: 500ms" in config
    (tmp_path / "am.yml").write_text(config)
    done = tool("amtool", "check-config", str(tmp_path / "am.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("fast", [True, False])
def test_the_test_prometheus_config_passes_promtool(tmp_path: Path, fast: bool) -> None:
    shutil.copy(RULES, tmp_path / RULES.name)
    config = alerting_stack.prometheus_config(
        alerting_stack.SCRAPE.read_text(),
        ["127.0.0.1:1", "127.0.0.1:2"],
        tmp_path / RULES.name,
        "127.0.0.1:3",
        fast=fast,
    )
    (tmp_path / "prometheus.yml").write_text(config)
    done = tool("promtool", "check", "config", str(tmp_path / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("scrape_interval: 1s" in config) is fast
    assert '"127.0.0.1:1", "127.0.0.1:2"' in config
