"""Prometheus metrics, read from the StatusBoard at scrape time.

Owns the metric names, types, labels and help texts of docs/architecture.md.
Like client_python's ProcessCollector, nothing is pushed: ``BoardCollector``
turns the board's current state and counters into metric families whenever
the registry is collected. Each daemon (and each test) builds its own registry
with ``build_registry``; the global REGISTRY is never touched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector

from supervisor.core.status import UNIT_STATES, HistogramCounts, StatusBoard


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=[] if labels is None else labels)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _families() -> dict[str, Metric]:
    """Empty families, keyed by name: the single place names and help live."""
    families: list[Metric] = [
        _gauge(
            "k26_supervisor_ready",
            "1 when READY=1 was sent (every enabled unit passed a sampled probe).",
        ),
        _gauge(
            "k26_unit_state",
            "1 for the unit's current state, 0 for the others.",
            ["unit", "state"],
        ),
        _gauge(
            "k26_unit_ready",
            "1 when the unit passed its last sampled probe and is ready.",
            ["unit"],
        ),
        _gauge(
            "k26_unit_not_ready_seconds",
            "Seconds since the unit was last ready (0 while ready or in standby).",
            ["unit"],
        ),
        _counter("k26_unit_exits_total", "Classified exits of the unit.", ["unit", "cause"]),
        _counter("k26_unit_restarts_total", "Restarts issued by the supervisor.", ["unit"]),
        _gauge(
            "k26_unit_failed",
            "1 when the unit is failed (no more restarts until an operator acts).",
            ["unit"],
        ),
        _histogram(
            "k26_probe_latency_seconds",
            "Latency of successful sampled probes.",
            ["unit"],
        ),
        _counter("k26_probe_failures_total", "Failed sampled probes.", ["unit", "reason"]),
        _histogram(
            "k26_warmup_duration_seconds",
            "FlashInfer warm-up wall time.",
            ["arch"],
        ),
        _counter("k26_warmup_total", "FlashInfer warm-ups by result.", ["arch", "result"]),
        _gauge(
            "k26_warmup_last_ok",
            "1 when the last warm-up verification succeeded.",
            ["arch"],
        ),
        _gauge(
            "k26_fallback_engaged",
            "1 when the preferred unit is in standby and its fallback serves.",
            ["unit"],
        ),
        _gauge(
            "k26_sampling_backend_pytorch",
            "1 when the last-resort pytorch-sampling drop-in is active.",
            ["unit"],
        ),
        _gauge("k26_build_info", "The supervisor's version; always 1.", ["version"]),
    ]
    # CounterMetricFamily drops the _total suffix from .name; key on the exposed name.
    return {f"{f.name}_total" if f.type == "counter" else f.name: f for f in families}


METRIC_NAMES: tuple[str, ...] = tuple(_families())


def _buckets(counts: HistogramCounts) -> list[tuple[str, float]]:
    return [("+Inf" if math.isinf(le) else repr(le), float(n)) for le, n in counts.cumulative()]


def _add_histograms(family: Metric, series: Mapping[str, HistogramCounts]) -> None:
    assert isinstance(family, HistogramMetricFamily)
    for label, counts in series.items():
        family.add_metric([label], _buckets(counts), counts.total)


class BoardCollector:
    """A prometheus_client collector over a StatusBoard."""

    def __init__(self, board: StatusBoard) -> None:
        self._board = board

    def describe(self) -> Iterator[Metric]:
        # Lets the registry catch a second collector claiming the same names.
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        board = self._board
        f = _families()

        def gauge(name: str, labels: list[str], value: float) -> None:
            family = f[name]
            assert isinstance(family, GaugeMetricFamily)
            family.add_metric(labels, value)

        def counter(name: str, labels: list[str], value: float) -> None:
            family = f[name]
            assert isinstance(family, CounterMetricFamily)
            family.add_metric(labels, value)

        gauge("k26_supervisor_ready", [], float(board.ready))
        gauge("k26_build_info", [board.version], 1.0)
        for name, unit in board.units.items():
            for state in UNIT_STATES:
                gauge("k26_unit_state", [name, state], float(unit.state == state))
            gauge("k26_unit_ready", [name], float(unit.ready))
            gauge("k26_unit_not_ready_seconds", [name], board.not_ready_seconds(name))
            counter("k26_unit_restarts_total", [name], float(unit.restarts))
            gauge("k26_unit_failed", [name], float(unit.state == "failed"))
            gauge("k26_fallback_engaged", [name], float(unit.fallback_engaged))
            gauge("k26_sampling_backend_pytorch", [name], float(unit.sampling_backend == "pytorch"))
        for (name, cause), n in board.exits.items():
            counter("k26_unit_exits_total", [name, cause], float(n))
        for (name, reason), n in board.probe_failures.items():
            counter("k26_probe_failures_total", [name, reason], float(n))
        _add_histograms(f["k26_probe_latency_seconds"], board.probe_latency)
        _add_histograms(f["k26_warmup_duration_seconds"], board.warmup_duration)
        for (arch, result), n in board.warmups.items():
            counter("k26_warmup_total", [arch, result], float(n))
        for arch, ok in board.warmup_last_ok.items():
            gauge("k26_warmup_last_ok", [arch], float(ok))
        yield from f.values()


def build_registry(board: StatusBoard) -> CollectorRegistry:
    """A fresh registry with the board's metrics and this process's process_* metrics."""
    registry = CollectorRegistry()
    registry.register(BoardCollector(board))
    ProcessCollector(registry=registry)
    return registry
