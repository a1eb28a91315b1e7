"""The Grafana dashboard: valid JSON, every panel queries something, and every
query uses a metric the supervisor exports (docs/architecture.md's table, or a
standard process_* metric, or Prometheus' `up`). Also tests the small PromQL
reader in deploy/metrics_lint.py that the check rests on.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SOURCE = Path(__file__).resolve().parents[3]
DASHBOARD = SOURCE / "deploy/grafana/k26-supervisor.json"


def load_lint() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "k26_metrics_lint", SOURCE / "deploy/metrics_lint.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lint = load_lint()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())  # fails on invalid JSON
    return data


@pytest.fixture(scope="module")
def documented() -> frozenset[str]:
    documented: frozenset[str] = lint.documented_metrics(
        (SOURCE / "docs/architecture.md").read_text()
    )
    return documented


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels.extend(panel.get("panels", []))
    return panels


def test_dashboard_has_the_fields_grafana_needs(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in all_panels(dashboard):
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


def test_every_panel_has_targets(dashboard: dict[str, Any]) -> None:
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        targets = panel.get("targets", [])
        assert targets, f"panel {panel['title']!r} has no targets"
        assert all(target.get("expr", "").strip() for target in targets), panel["title"]
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_query_uses_an_exported_metric(
    dashboard: dict[str, Any], documented: frozenset[str]
) -> None:
    assert lint.unknown_metrics(dashboard, documented) == []
    queried = {
        name for _, expr in lint.dashboard_queries(dashboard) for name in lint.metric_names(expr)
    }
    assert len(queried) >= 10, queried  # the reader found the queries at all


def test_an_unknown_metric_is_reported(
    dashboard: dict[str, Any], documented: frozenset[str]
) -> None:
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["targets"][0]["expr"] = 'rate(k26_unit_restart_total{unit=~"$unit"}[5m])'
    (problem,) = lint.unknown_metrics(broken, documented)
    assert "k26_unit_restart_total is not exported" in problem


def test_the_architecture_table_is_read(documented: frozenset[str]) -> None:
    assert {"k26_unit_state", "k26_unit_exits_total", "k26_build_info"} <= documented
    assert "k26_probe_latency_seconds_bucket" in documented  # histogram series
    assert "k26_probe_latency_seconds" not in documented  # no such series


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('up{job="k26-supervisor"}', {"up"}),
        (
            "histogram_quantile(0.95, sum by (unit, le) "
            '(rate(k26_probe_latency_seconds_bucket{unit=~"$unit"}[$__rate_interval])))',
            {"k26_probe_latency_seconds_bucket"},
        ),
        (
            "k26_unit_not_ready_seconds > 900 unless on (job, instance, unit) "
            'k26_unit_state{state="standby"} == 1',
            {"k26_unit_not_ready_seconds", "k26_unit_state"},
        ),
        ("sum(a offset 30m) by (x) / ignoring(y) group_left(z) b:rate5m", {"a", "b:rate5m"}),
        ('absent(k26_build_info{version="by (x)"})', {"k26_build_info"}),
        ("max_over_time((k26_unit_failed == 1)[3h:1m])", {"k26_unit_failed"}),
    ],
)
def test_promql_reader_finds_metric_names(expr: str, names: set[str]) -> None:
    assert lint.metric_names(expr) == names


def test_lint_command_passes_on_the_shipped_dashboard() -> None:
    assert lint.main([str(DASHBOARD)]) == 0
