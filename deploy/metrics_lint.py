#!/usr/bin/env python3
"""Check that dashboards query only metrics k26-supervisor exports.

    deploy/metrics_lint.py [DASHBOARD.json ...]   (default: deploy/grafana/*.json)

The exported metrics are the table in docs/architecture.md, plus the standard
process_* collector metrics and Prometheus' own `up`. A histogram row stands
for its _bucket, _sum and _count series only. The PromQL reading is deliberately
small: it drops strings, label matchers, ranges, grouping clauses and numbers,
and what is left that is not a keyword or a function call is a metric name.
The tests use the same functions on the alert rules.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent.parent
ARCHITECTURE = SOURCE / "docs/architecture.md"
PROMETHEUS_SYNTHETIC = frozenset({"up"})
STANDARD_PREFIXES = ("process_",)

_TABLE_ROW = re.compile(r"^\|\s*(k26_[a-z0-9_]+)\s*\|\s*(\w+)\s*\|", re.MULTILINE)
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "bool", "inf", "nan"}
)
_STRIP = (
    re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`'),  # string literals
    re.compile(r"\$\{[^}]*\}|\$\w+"),  # Grafana variables
    re.compile(r"\{[^}]*\}"),  # label matchers
    re.compile(r"\[[^\]]*\]"),  # ranges and subqueries
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),
    re.compile(r"(?<![\w:])\d[\w.]*"),  # numbers and durations
)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def documented_metrics(markdown: str) -> frozenset[str]:
    """Every series name the architecture table promises, histogram parts included."""
    names: set[str] = set()
    for name, kind in _TABLE_ROW.findall(markdown):
        if kind == "histogram":  # a histogram has no series under its own name
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return frozenset(names)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    for pattern in _STRIP:
        expr = pattern.sub(" ", expr)
    names = set()
    for match in _IDENT.finditer(expr):
        rest = expr[match.end() :].lstrip()
        if match.group() not in _KEYWORDS and not rest.startswith("("):
            names.add(match.group())
    return names


def is_known(name: str, documented: frozenset[str]) -> bool:
    return name in documented or name in PROMETHEUS_SYNTHETIC or name.startswith(STANDARD_PREFIXES)


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))  # rows may nest panels
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            # label_values(SELECTOR, label): only the selector is PromQL.
            found = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", text)
            yield f"variable {variable['name']!r}", found.group(1) if found else text


def unknown_metrics(dashboard: dict[str, Any], documented: frozenset[str]) -> list[str]:
    return [
        f"{where}: {name} is not exported (docs/architecture.md)"
        for where, expr in dashboard_queries(dashboard)
        for name in sorted(metric_names(expr))
        if not is_known(name, documented)
    ]


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or sorted((SOURCE / "deploy/grafana").glob("*.json"))
    documented = documented_metrics(ARCHITECTURE.read_text())
    problems = []
    for path in paths:
        problems += [
            f"{path}: {p}" for p in unknown_metrics(json.loads(path.read_text()), documented)
        ]
    print("\n".join(problems) or f"ok: {len(paths)} dashboard(s) query only exported metrics")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
