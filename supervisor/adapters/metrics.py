"""Prometheus metrics, read from the StatusBoard at scrape time.

Owns the metric names, types, labels and help texts of docs/architecture.md.
Like client_python's ProcessCollector, nothing is pushed: ``BoardCollector``
turns the board's current state and counters into metric families whenever
the registry is collected. Each daemon (and each test) builds its own registry
with ``build_registry``; the global REGISTRY is never touched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector

from supervisor.core.coverage import ShapeResult
from supervisor.core.events import UnitState
from supervisor.core.status import (
    EXIT_CAUSES,
    PROBE_FAILURE_REASONS,
    UNIT_STATES,
    HistogramCounts,
    StatusBoard,
    UnitStatus,
)

# k26_unit_failure_info's summary label is capped: one line, at most this long.
SUMMARY_MAX_CHARS = 200
# k26_unit_failure_info's cause while the unit is not failed (value 0, empty summary).
NOT_FAILED = "none"


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
        _gauge(
            "k26_unit_failure_info",
            "1 while the unit is failed, labelled with why (cause) and what to do (summary); "
            'otherwise 0 with cause="none".',
            ["unit", "cause", "summary"],
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
            "k26_unit_needs_person",
            "1 while the unit is failed for a fault of the GPUs' own (a hardware or driver "
            "Xid, the driver stack): a person must act, and its fallback is not started.",
            ["unit"],
        ),
        _gauge(
            "k26_serving",
            "1 while a unit of the group (named by its preferred unit) is ready.",
            ["unit"],
        ),
        _counter(
            "k26_unserved_seconds_total",
            "Seconds since the supervisor started during which no unit of the group "
            "(named by its preferred unit) was ready.",
            ["unit"],
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
        _gauge(
            "k26_bundle_effective",
            "1 when the latest pulled cache bundle prevented every build through the first "
            "READY after the pull, 0 when a cache rebuilt (absent before that READY).",
            ["digest"],
        ),
        _gauge(
            "k26_bundle_age_at_pull_seconds",
            "How old the bundle the registry gave at the latest pull that got one (installed "
            "or already here) was at that pull, from its created_at: a registry that keeps "
            "serving an old bundle shows here (absent before such a pull).",
            ["digest"],
        ),
        _counter(
            "k26_bundle_pulls_total",
            "Registry pulls of a cache bundle by the warm-up, by result: installed, current "
            "(the registry's bundle already here), absent (none for this node), refused "
            "(unsigned, mis-signed, rolled back, not this node's, a hostile archive: nothing "
            "written), failed (the registry, the disk).",
            ["result"],
        ),
        _gauge(
            "k26_bundle_rebuilt_files",
            "Compiled artifacts a cache gained between the latest bundle pull and READY: "
            "files the bundle should have carried.",
            ["digest", "cache"],
        ),
        _counter(
            "k26_jit_after_ready_total",
            "Files a JIT cache of the unit gained while it was ready: a kernel compiled "
            "under live traffic that the coverage warm-up did not cover.",
            ["unit", "cache"],
        ),
        _gauge(
            "k26_coverage_shape_duration_seconds",
            "Wall time of each request shape of the unit's last coverage warm-up.",
            ["unit", "shape"],
        ),
        _gauge(
            "k26_coverage_shape_result",
            "1 for the result (ok, refused, failed) of each shape of the unit's last "
            "coverage warm-up, 0 for the others.",
            ["unit", "shape", "result"],
        ),
        _gauge(
            "k26_coverage_shape_compiled_entries",
            "Entries each JIT cache of the unit gained while each shape of its last "
            "coverage warm-up played (Triton: variants; elsewhere files less their "
            "suffixes): what the shape's requests compiled before READY.",
            ["unit", "shape", "cache"],
        ),
        _histogram(
            "k26_start_phase_seconds",
            "Where each start that ended in READY spent its time: the supervisor's phases "
            "(warmup, start_job, load, probe, coverage; backoff for a recovery) and the "
            "server's own (server_*, from its start-up lines).",
            ["unit", "phase"],
        ),
        _gauge(
            "k26_coverage_duration_seconds",
            "Wall time of the unit's last coverage warm-up, all shapes.",
            ["unit"],
        ),
    ]
    # CounterMetricFamily drops the _total suffix from .name; key on the exposed name.
    return {f"{f.name}_total" if f.type == "counter" else f.name: f for f in families}


METRIC_NAMES: tuple[str, ...] = tuple(_families())


# What put a unit in ``failed``, read from the reason core/machine.py gives it (one
# line, for a person); tests/unit/adapters/test_metrics.py drives the real machine
# down each path, so a change of wording there fails a test rather than a label.
_EXITED = re.compile(r"\bexited \(([a-z-]+)\)")
_PROBES = re.compile(r"sampled probes failed in a row, last: ([a-z-]+)")
_REASON_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"/health never answered|not healthy within"), "not-healthy"),
    (re.compile(r"FlashInfer rejects the GPU arch"), "flashinfer-arch"),
    (re.compile(r"warm-up"), "warmup"),
    (re.compile(r"start job"), "start-job"),
    (re.compile(r"stalled while serving"), "stalled"),
)


def failure_cause(unit: UnitStatus) -> str:
    """Why a failed unit is failed, as a short spelling for the cause label.

    An exit cause (the k26_unit_exits_total spellings) when an exit ended it;
    ``probe-<reason>`` when sampled probes did (a k26_probe_failures_total reason);
    ``not-healthy`` (never answered /health in time), ``warmup``, ``start-job``;
    ``other`` for anything else (a refused start, say): the summary tells.
    """
    reason = unit.reason or ""
    exited = _EXITED.search(reason)
    if exited and exited.group(1) in EXIT_CAUSES:
        return exited.group(1)
    probes = _PROBES.search(reason)
    if probes and probes.group(1) in PROBE_FAILURE_REASONS:
        return f"probe-{probes.group(1)}"
    for pattern, cause in _REASON_CAUSES:
        if pattern.search(reason):
            return cause
    return "other"


def failure_summary(unit: UnitStatus, cause: str) -> str:
    """One line for the alert: the classifier's summary of the exit that ended the
    unit (it quotes the evidence), else the supervisor's reason; capped."""
    exit_ = unit.last_exit
    if exit_ is not None and exit_.cause == cause and exit_.summary:
        text = exit_.summary
    else:
        text = unit.reason or ""
    text = " ".join(text.split())
    if len(text) > SUMMARY_MAX_CHARS:
        text = text[: SUMMARY_MAX_CHARS - 3].rstrip() + "..."
    return text


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
                gauge("k26_unit_state", [name, str(state)], float(unit.state is state))
            gauge("k26_unit_ready", [name], float(unit.ready))
            gauge("k26_unit_not_ready_seconds", [name], board.not_ready_seconds(name))
            counter("k26_unit_restarts_total", [name], float(unit.restarts))
            gauge("k26_unit_failed", [name], float(unit.state is UnitState.FAILED))
            # One series per unit at a time: its labels change when it fails.
            if unit.state is UnitState.FAILED:
                cause = failure_cause(unit)
                gauge("k26_unit_failure_info", [name, cause, failure_summary(unit, cause)], 1.0)
            else:
                gauge("k26_unit_failure_info", [name, NOT_FAILED, ""], 0.0)
            gauge("k26_fallback_engaged", [name], float(unit.fallback_engaged))
            gauge("k26_unit_needs_person", [name], float(unit.needs_person))
            gauge("k26_sampling_backend_pytorch", [name], float(unit.sampling_backend == "pytorch"))
            if unit.coverage is not None:
                gauge("k26_coverage_duration_seconds", [name], unit.coverage.duration_s)
                for shape in unit.coverage.shapes:
                    gauge(
                        "k26_coverage_shape_duration_seconds",
                        [name, shape.name],
                        shape.duration_ms / 1000.0,
                    )
                    for outcome in ShapeResult:
                        gauge(
                            "k26_coverage_shape_result",
                            [name, shape.name, str(outcome)],
                            float(shape.result is outcome),
                        )
                    for cache, n in shape.compiled or ():
                        gauge(
                            "k26_coverage_shape_compiled_entries",
                            [name, shape.name, cache],
                            float(n),
                        )
        for group, info in board.serving.items():
            gauge("k26_serving", [group], float(info.serving))
            counter("k26_unserved_seconds_total", [group], info.unserved_s)
        for (name, cause), n in board.exits.items():
            counter("k26_unit_exits_total", [name, str(cause)], float(n))
        for (name, reason), n in board.probe_failures.items():
            counter("k26_probe_failures_total", [name, reason], float(n))
        _add_histograms(f["k26_probe_latency_seconds"], board.probe_latency)
        _add_histograms(f["k26_warmup_duration_seconds"], board.warmup_duration)
        for (arch, result), n in board.warmups.items():
            counter("k26_warmup_total", [arch, result], float(n))
        for arch, ok in board.warmup_last_ok.items():
            gauge("k26_warmup_last_ok", [arch], float(ok))
        phases = f["k26_start_phase_seconds"]
        assert isinstance(phases, HistogramMetricFamily)
        for (name, phase), counts in board.start_phases.items():
            phases.add_metric([name, phase], _buckets(counts), counts.total)
        for (name, cache), n in board.jit_after_ready.items():
            counter("k26_jit_after_ready_total", [name, cache], float(n))
        for result, n in board.bundle_pulls.items():
            counter("k26_bundle_pulls_total", [result], float(n))
        served = board.bundle_served
        if served is not None and (age := served.age_at_pull()) is not None:
            gauge("k26_bundle_age_at_pull_seconds", [served.digest], age)
        use = board.bundle
        if use is not None and use.effective is not None:
            gauge("k26_bundle_effective", [use.digest], float(use.effective))
            for rebuilt in use.rebuilt:
                gauge("k26_bundle_rebuilt_files", [use.digest, rebuilt.cache], float(rebuilt.files))
        yield from f.values()


def build_registry(board: StatusBoard) -> CollectorRegistry:
    """A fresh registry with the board's metrics and this process's process_* metrics."""
    registry = CollectorRegistry()
    registry.register(BoardCollector(board))
    ProcessCollector(registry=registry)
    return registry
