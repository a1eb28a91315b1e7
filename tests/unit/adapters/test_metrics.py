"""The StatusBoard, its /status JSON, and the metrics collected from it (fresh registry each)."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries

from supervisor.adapters.learned_shapes import status_json
from supervisor.adapters.metrics import (
    METRIC_NAMES,
    SUMMARY_MAX_CHARS,
    BoardCollector,
    build_registry,
    failure_cause,
)
from supervisor.core.bundle_use import BundleUse, Served
from supervisor.core.coverage import CoverageReport, ShapeOutcome, ShapeResult
from supervisor.core.learned_shapes import LearnedShape, parse_batch_line
from supervisor.core.startup_log import ServerTimings
from supervisor.core.status import (
    BUNDLE_PULL_RESULTS,
    EXIT_CAUSES,
    JIT_CACHES,
    PROBE_FAILURE_REASONS,
    UNIT_STATES,
    WARMUP_RESULTS,
    ExitInfo,
    ProbeInfo,
    StatusBoard,
    WarmupInfo,
    iso8601,
)
from supervisor.core.timeline import StartTimeline

MAIN = "sglang-k26.service"
FALLBACK = "sglang-k26-fallback.service"
T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def board(clock: FakeClock) -> StatusBoard:
    board = StatusBoard(
        version="0.1.0",
        config_path="/etc/k26/supervisor.toml",
        pid=4321,
        started_at=T0,
        monotonic=clock,
        wall=lambda: T0,
    )
    board.add_unit(MAIN, "autoregressive")
    board.add_unit(FALLBACK, "fallback", state="standby")
    return board


def _ok_probe(latency_ms: float = 12.3) -> ProbeInfo:
    return ProbeInfo(ok=True, at=T0, latency_ms=latency_ms, completion_tokens=4)


def _samples(board: StatusBoard) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(build_registry(board)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(board: StatusBoard, name: str, **labels: str) -> float:
    return _samples(board)[(name, tuple(sorted(labels.items())))]


# --- the /status schema --------------------------------------------------------


def test_snapshot_json_is_the_documented_schema(board: StatusBoard) -> None:
    board.set_state(MAIN, "ready")
    board.set_systemd(MAIN, active_state="active", main_pid=4242)
    board.record_probe(MAIN, _ok_probe())
    board.record_exit(MAIN, ExitInfo("sigkill", T0, 4200, None, 9, ("Killed process 4200",)))
    board.record_restart(MAIN)
    board.record_warmup("12.0", "warm", 3.0, ok=True)
    why = "FlashInfer 0.7.4's gate accepts 12.0 as installed: no patch to wait for"
    board.set_warmup_plan(MAIN, "overlapped", why)
    board.record_coverage(
        MAIN,
        CoverageReport(
            True,
            T0,
            1.5,
            (
                ShapeOutcome("greedy", ShapeResult.OK, 12.5, 1, None, (("triton", 2),)),
                ShapeOutcome(
                    "json-schema", ShapeResult.REFUSED, 3.0, 1, "HTTP 400: grammar is off"
                ),
            ),
        ),
    )
    labels = {"unit": MAIN, "shape": "greedy", "cache": "triton"}
    assert _value(board, "k26_coverage_shape_compiled_entries", **labels) == 2
    assert ("k26_coverage_shape_compiled_entries", tuple(sorted(
        (labels | {"shape": "json-schema"}).items()))) not in _samples(board)  # fmt: skip
    board.set_jit_watched(MAIN, ["/var/cache/sglang-k26/triton"])
    board.record_jit_after_ready(
        MAIN, "triton", "get_num_kv_splits_triton", "/var/cache/sglang-k26/triton/AB/k.cubin"
    )
    line = (
        "[2025-06-01 12:00:00] Prefill batch, #new-seq: 5, #new-token: 40, #cached-token: 0, "
        "token usage: 0.00, #running-req: 0, #queue-req: 0"
    )
    batch = parse_batch_line(line)
    assert batch is not None
    learned = LearnedShape(
        "triton",
        "generate_draft_decode_kv_indices",
        "C5A2",
        "2025-06-01T12:00:00Z",
        "2025-06-01T12:00:00Z",
        signature="generate_draft_decode_kv_indices(*i64:16, i32)",
        batches=(batch,),
    )
    path = Path("/var/lib/k26-supervisor/k26-learned-shapes.json")
    board.set_learned_shapes(MAIN, status_json(path, [learned]))
    board.record_start(
        MAIN,
        StartTimeline(
            MAIN,
            "start",
            T0,
            T0,
            61.5,
            {"warm-up": 0.0, "start job": 0.1, "load": 60.0, "probe": 0.4, "coverage": 1.0},
            server=ServerTimings(
                load_weight_s=0.11,
                kv_cache_s=1.2,
                scheduler_s=5.38,
                tokenizer_s=33.24,
                cuda_graph_s={"decode": 3.7},
                source="engine-timings",
            ),
        ),
        None,
    )
    board.set_ready(True)
    assert board.snapshot().to_json() == {
        "ready": True,
        "supervisor": {
            "version": "0.1.0",
            "started_at": "2025-06-01T12:00:00Z",
            "pid": 4321,
            "config": "/etc/k26/supervisor.toml",
        },
        "units": {
            MAIN: {
                "role": "autoregressive",
                "state": "ready",
                "ready": True,
                "since": "2025-06-01T12:00:00Z",
                "restarts": 1,
                "main_pid": 4242,
                "active_state": "active",
                "fallback_engaged": False,
                "sampling_backend": "flashinfer",
                "reason": None,
                "held_by_operator": False,
                "needs_person": False,
                "warmup": {"mode": "overlapped", "why": why},
                "last_exit": {
                    "cause": "sigkill",
                    "summary": "",
                    "at": "2025-06-01T12:00:00Z",
                    "main_pid": 4200,
                    "exit_code": None,
                    "signal": 9,
                    "evidence": ["Killed process 4200"],
                },
                "last_probe": {
                    "ok": True,
                    "at": "2025-06-01T12:00:00Z",
                    "latency_ms": 12.3,
                    "error": None,
                    "completion_tokens": 4,
                },
                "coverage": {
                    "ok": True,
                    "at": "2025-06-01T12:00:00Z",
                    "duration_s": 1.5,
                    "shapes": [
                        {
                            "name": "greedy",
                            "result": "ok",
                            "duration_ms": 12.5,
                            "requests": 1,
                            "detail": None,
                            "compiled": {"triton": 2},
                        },
                        {
                            "name": "json-schema",
                            "result": "refused",
                            "duration_ms": 3.0,
                            "requests": 1,
                            "detail": "HTTP 400: grammar is off",
                            "compiled": None,
                        },
                    ],
                },
                "jit_after_ready": {
                    "count": 1,
                    "watched": ["/var/cache/sglang-k26/triton"],
                    "latest": [
                        {
                            "cache": "triton",
                            "kernel": "get_num_kv_splits_triton",
                            "path": "/var/cache/sglang-k26/triton/AB/k.cubin",
                            "at": "2025-06-01T12:00:00Z",
                        }
                    ],
                },
                "learned_shapes": {
                    "path": "/var/lib/k26-supervisor/k26-learned-shapes.json",
                    "count": 1,
                    "replayable": 1,
                    "latest": [
                        {
                            "cache": "triton",
                            "kernel": "generate_draft_decode_kv_indices",
                            "variant": "C5A2",
                            "signature": "generate_draft_decode_kv_indices(*i64:16, i32)",
                            "first_seen": "2025-06-01T12:00:00Z",
                            "last_seen": "2025-06-01T12:00:00Z",
                            "seen": 1,
                            "batches": [
                                {
                                    "kind": "prefill",
                                    "running_req": 0,
                                    "new_seq": 5,
                                    "new_token": 40,
                                    "cached_token": 0,
                                    "queue_req": 0,
                                    "stamp": "2025-06-01 12:00:00",
                                    "line": line,
                                }
                            ],
                            "replay": ["learned-prefill-5x40"],
                        }
                    ],
                },
                "last_start": {
                    "kind": "start",
                    "began_at": "2025-06-01T12:00:00Z",
                    "ready_at": "2025-06-01T12:00:00Z",
                    "total_s": 61.5,
                    "cause": None,
                    "phases_s": {
                        "warm-up": 0.0,
                        "start job": 0.1,
                        "load": 60.0,
                        "probe": 0.4,
                        "coverage": 1.0,
                    },
                    "overlapped_warmup_s": None,
                    "server": {
                        "source": "engine-timings",
                        "load_weight_s": 0.11,
                        "kv_cache_allocation_s": 1.2,
                        "scheduler_e2e_s": 5.38,
                        "tokenizer_e2e_s": 33.24,
                        "cuda_graph_s": {"decode": 3.7},
                        "jit_lines": [],
                    },
                },
                "last_recovery": None,
            },
            FALLBACK: {
                "role": "fallback",
                "state": "standby",
                "ready": False,
                "since": "2025-06-01T12:00:00Z",
                "restarts": 0,
                "main_pid": None,
                "active_state": "unknown",
                "fallback_engaged": False,
                "sampling_backend": "flashinfer",
                "reason": None,
                "held_by_operator": False,
                "needs_person": False,
                "warmup": None,
                "last_exit": None,
                "last_probe": None,
                "coverage": None,
                "jit_after_ready": {"count": 0, "watched": [], "latest": []},
                "learned_shapes": None,
                "last_start": None,
                "last_recovery": None,
            },
        },
        "serving": {},
        "warmup": {
            "arch": "12.0",
            "state": "warm",
            "at": "2025-06-01T12:00:00Z",
            "error": None,
            "duration_s": 3.0,
            "mode": "overlapped",
            "why": why,
        },
        "bundle": None,
    }


def test_warmup_is_null_until_known(board: StatusBoard) -> None:
    assert board.snapshot().to_json()["warmup"] is None
    board.set_warmup(WarmupInfo(arch="12.0", state="running"))
    assert board.snapshot().to_json()["warmup"]["state"] == "running"


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        (datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC), "2025-01-02T03:04:05Z"),
        (
            datetime(2025, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2))),
            "2025-01-02T03:04:05Z",
        ),
        (datetime(2025, 1, 2, 3, 4, 5), "2025-01-02T03:04:05Z"),
        (None, None),
    ],
)
def test_iso8601_is_utc_with_z(at: datetime | None, expected: str | None) -> None:
    assert iso8601(at) == expected


def test_snapshot_is_frozen_against_later_updates(board: StatusBoard) -> None:
    before = board.snapshot()
    board.set_state(MAIN, "starting")
    assert before.units[MAIN].state == "stopped"
    assert board.snapshot().units[MAIN].state == "starting"


def test_since_moves_only_on_a_state_change(clock: FakeClock) -> None:
    now = [T0]
    board = StatusBoard(version="0", config_path="c", monotonic=clock, wall=lambda: now[0])
    board.add_unit(MAIN, "autoregressive")
    now[0] = T0 + timedelta(seconds=5)
    board.set_state(MAIN, "starting")
    now[0] = T0 + timedelta(seconds=9)
    board.set_state(MAIN, "starting")
    board.record_restart(MAIN)
    assert board.unit(MAIN).since == T0 + timedelta(seconds=5)


def test_ready_needs_state_ready_and_a_passing_probe(board: StatusBoard) -> None:
    board.set_state(MAIN, "ready")
    assert not board.unit(MAIN).ready
    board.record_probe(MAIN, _ok_probe())
    assert board.unit(MAIN).ready
    board.record_probe(MAIN, ProbeInfo(False, T0, None, "timed out"), failure_reason="timeout")
    assert not board.unit(MAIN).ready


def test_board_rejects_unknown_spellings(board: StatusBoard) -> None:
    with pytest.raises(ValueError, match="unit state"):
        board.set_state(MAIN, "running")
    with pytest.raises(ValueError, match="exit cause"):
        board.record_exit(MAIN, ExitInfo("oom", T0, None, None, None))
    with pytest.raises(ValueError, match="failure_reason"):
        board.record_probe(MAIN, ProbeInfo(False, T0, None, "x"))
    with pytest.raises(ValueError, match="probe failure reason"):
        board.record_probe(MAIN, ProbeInfo(False, T0, None, "x"), failure_reason="weird")
    with pytest.raises(ValueError, match="warm-up result"):
        board.record_warmup("12.0", "cached", 1.0, ok=True)
    with pytest.raises(ValueError, match="bundle pull result"):
        board.record_bundle_pull("rolled-back")
    with pytest.raises(KeyError, match="not on the board"):
        board.record_restart("nope.service")
    with pytest.raises(ValueError, match="already"):
        board.add_unit(MAIN, "autoregressive")


def test_spellings_match_the_core_enums() -> None:
    from supervisor.adapters.probe import ProbeFailure
    from supervisor.core.classify import ExitCause
    from supervisor.core.events import UnitState
    from supervisor.core.jit_caches import JitCache

    assert tuple(UnitState) == UNIT_STATES
    assert tuple(ExitCause) == EXIT_CAUSES
    assert tuple(ProbeFailure) == PROBE_FAILURE_REASONS
    assert tuple(JitCache) == JIT_CACHES


def test_the_core_enums_are_accepted_as_spellings(board: StatusBoard) -> None:
    from supervisor.core.classify import ExitCause
    from supervisor.core.events import UnitState

    board.set_state(MAIN, UnitState.BACKOFF)
    board.record_exit(MAIN, ExitInfo(ExitCause.OOM_KILL, T0, 1, None, 9))
    assert _value(board, "k26_unit_exits_total", unit=MAIN, cause="oom-kill") == 1
    assert _value(board, "k26_unit_state", unit=MAIN, state="backoff") == 1
    assert board.snapshot().to_json()["units"][MAIN]["last_exit"]["cause"] == "oom-kill"


# --- metrics -----------------------------------------------------------------


def test_exactly_the_documented_families(board: StatusBoard) -> None:
    text = generate_latest(build_registry(board)).decode()
    exposed = {
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text)
        if not f.name.startswith("process_")
    }
    assert exposed == set(METRIC_NAMES)
    assert len(METRIC_NAMES) == 29
    types = {
        f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("k26_")
    }
    assert types["k26_probe_latency_seconds"] == "histogram"
    assert types["k26_warmup_duration_seconds"] == "histogram"
    assert types["k26_unit_exits"] == "counter"
    assert types["k26_unit_state"] == "gauge"


def test_every_state_is_exported_with_one_hot(board: StatusBoard) -> None:
    board.set_state(MAIN, "backoff")
    samples = _samples(board)
    for unit, current in ((MAIN, "backoff"), (FALLBACK, "standby")):
        values = {
            state: samples[("k26_unit_state", (("state", state), ("unit", unit)))]
            for state in UNIT_STATES
        }
        assert values == {state: float(state == current) for state in UNIT_STATES}


def test_exit_and_probe_failure_counters_start_at_zero(board: StatusBoard) -> None:
    samples = _samples(board)
    for unit in (MAIN, FALLBACK):
        for cause in EXIT_CAUSES:
            assert samples[("k26_unit_exits_total", (("cause", cause), ("unit", unit)))] == 0
        for reason in PROBE_FAILURE_REASONS:
            assert samples[("k26_probe_failures_total", (("reason", reason), ("unit", unit)))] == 0
        assert samples[("k26_unit_restarts_total", (("unit", unit),))] == 0


def test_counters_count(board: StatusBoard) -> None:
    board.record_exit(MAIN, ExitInfo("gpu-oom", T0, 1, 1, None))
    board.record_exit(MAIN, ExitInfo("gpu-oom", T0, 2, 1, None))
    board.record_restart(MAIN)
    board.record_probe(
        MAIN, ProbeInfo(False, T0, None, "refused"), failure_reason="connect-refused"
    )
    assert _value(board, "k26_unit_exits_total", unit=MAIN, cause="gpu-oom") == 2
    assert _value(board, "k26_unit_exits_total", unit=FALLBACK, cause="gpu-oom") == 0
    assert _value(board, "k26_unit_restarts_total", unit=MAIN) == 1
    assert _value(board, "k26_probe_failures_total", unit=MAIN, reason="connect-refused") == 1


def test_probe_latency_histogram(board: StatusBoard) -> None:
    board.record_probe(MAIN, _ok_probe(12.3))
    board.record_probe(MAIN, _ok_probe(700.0))
    board.record_probe(MAIN, ProbeInfo(False, T0, 5.0, "500"), failure_reason="http-status")
    name = "k26_probe_latency_seconds"
    assert _value(board, f"{name}_bucket", unit=MAIN, le="0.01") == 0
    assert _value(board, f"{name}_bucket", unit=MAIN, le="0.025") == 1
    assert _value(board, f"{name}_bucket", unit=MAIN, le="1.0") == 2
    assert _value(board, f"{name}_bucket", unit=MAIN, le="+Inf") == 2
    assert _value(board, f"{name}_count", unit=MAIN) == 2
    assert _value(board, f"{name}_sum", unit=MAIN) == pytest.approx(0.7123)
    assert _value(board, f"{name}_count", unit=FALLBACK) == 0


def test_unit_gauges(board: StatusBoard) -> None:
    board.set_state(MAIN, "failed")
    board.set_fallback_engaged(FALLBACK, True)
    board.set_sampling_backend(FALLBACK, "pytorch")
    board.set_ready(True)
    assert _value(board, "k26_unit_failed", unit=MAIN) == 1
    assert _value(board, "k26_unit_failed", unit=FALLBACK) == 0
    assert _value(board, "k26_fallback_engaged", unit=FALLBACK) == 1
    assert _value(board, "k26_sampling_backend_pytorch", unit=FALLBACK) == 1
    assert _value(board, "k26_sampling_backend_pytorch", unit=MAIN) == 0
    assert _value(board, "k26_supervisor_ready") == 1
    assert _value(board, "k26_build_info", version="0.1.0") == 1


def test_not_ready_seconds_follows_the_monotonic_clock(
    board: StatusBoard, clock: FakeClock
) -> None:
    clock.now += 30
    assert _value(board, "k26_unit_not_ready_seconds", unit=MAIN) == 30
    assert _value(board, "k26_unit_not_ready_seconds", unit=FALLBACK) == 0  # standby
    board.set_state(MAIN, "ready")
    board.record_probe(MAIN, _ok_probe())
    assert _value(board, "k26_unit_ready", unit=MAIN) == 1
    assert _value(board, "k26_unit_not_ready_seconds", unit=MAIN) == 0
    clock.now += 100
    board.set_state(MAIN, "backoff")
    clock.now += 7
    board.set_state(MAIN, "starting")  # still not ready: the count keeps running
    clock.now += 3
    assert _value(board, "k26_unit_ready", unit=MAIN) == 0
    assert _value(board, "k26_unit_not_ready_seconds", unit=MAIN) == 10


def test_warmup_metrics(board: StatusBoard) -> None:
    assert not any(name.startswith("k26_warmup_total") for name, _ in _samples(board))
    board.record_warmup("12.0", "built", 200.0, ok=True)
    board.record_warmup("12.0", "failed", 50.0, ok=False, error="nvcc missing")
    for result in WARMUP_RESULTS:
        expected = 1 if result in ("built", "failed") else 0
        assert _value(board, "k26_warmup_total", arch="12.0", result=result) == expected
    assert _value(board, "k26_warmup_last_ok", arch="12.0") == 0
    assert _value(board, "k26_warmup_duration_seconds_bucket", arch="12.0", le="60.0") == 1
    assert _value(board, "k26_warmup_duration_seconds_count", arch="12.0") == 2
    assert _value(board, "k26_warmup_duration_seconds_sum", arch="12.0") == 250
    assert board.snapshot().warmup == WarmupInfo("12.0", "failed", T0, "nvcc missing", 50.0)


def test_bundle_pulls_exist_at_zero_once_a_registry_is_configured(board: StatusBoard) -> None:
    assert not any(name.startswith("k26_bundle_pulls") for name, _ in _samples(board))
    board.declare_bundle_pulls()
    for result in BUNDLE_PULL_RESULTS:
        assert _value(board, "k26_bundle_pulls_total", result=result) == 0
    board.record_bundle_pull("refused")
    board.record_bundle_pull("refused")
    board.record_bundle_pull("installed")
    assert _value(board, "k26_bundle_pulls_total", result="refused") == 2
    assert _value(board, "k26_bundle_pulls_total", result="installed") == 1
    assert _value(board, "k26_bundle_pulls_total", result="failed") == 0


def test_the_bundle_s_age_at_the_pull_is_from_its_created_at(board: StatusBoard) -> None:
    name = "k26_bundle_age_at_pull_seconds"
    made = 1796083200.0  # 2026-12-01T00:00:00Z
    assert not any(n == name for n, _ in _samples(board))  # before a pull got a bundle
    board.set_bundle_served(Served("sha256:aa", "2026-12-01T00:00:00Z", made + 8 * 86400))
    assert _value(board, name, digest="sha256:aa") == 8 * 86400
    # A later pull got another bundle (installed or already here): one series, its own.
    board.set_bundle_served(Served("sha256:bb", "2026-12-08T12:00:00+00:00", made + 8 * 86400))
    assert [labels for n, labels in _samples(board) if n == name] == [(("digest", "sha256:bb"),)]
    assert _value(board, name, digest="sha256:bb") == 0.5 * 86400
    # An unsigned bundle's created_at is whatever its pusher wrote: no age, no series.
    board.set_bundle_served(Served("sha256:cc", "last week", made))
    assert not any(n == name for n, _ in _samples(board))


def test_status_shows_when_the_pulled_bundle_was_made(board: StatusBoard) -> None:
    board.set_bundle(
        BundleUse(
            "sha256:aa",
            "http://r:5000/k26/b",
            "2026-12-04T00:00:00Z",
            created_at="2026-12-01T00:00:00Z",
        )
    )
    shown = board.snapshot().to_json()["bundle"]
    assert shown["created_at"] == "2026-12-01T00:00:00Z"
    assert shown["pulled_at"] == "2026-12-04T00:00:00Z" and shown["effective"] is None


def test_collector_reads_state_at_scrape_time(board: StatusBoard) -> None:
    registry = build_registry(board)
    before = generate_latest(registry)
    board.record_restart(MAIN)
    after = generate_latest(registry)
    assert b'k26_unit_restarts_total{unit="sglang-k26.service"} 0.0' in before
    assert b'k26_unit_restarts_total{unit="sglang-k26.service"} 1.0' in after


def test_registries_are_independent_and_guard_names(board: StatusBoard) -> None:
    first, second = build_registry(board), build_registry(board)
    assert first is not second
    registry = CollectorRegistry()
    registry.register(BoardCollector(board))
    with pytest.raises(DuplicateTimeseries):
        registry.register(BoardCollector(board))


def test_process_metrics_are_included(board: StatusBoard) -> None:
    samples = _samples(board)
    assert ("process_resident_memory_bytes", ()) in samples


def test_label_values_are_escaped(clock: FakeClock) -> None:
    board = StatusBoard(version='0.1.0+"odd"\n', config_path="c", monotonic=clock)
    board.add_unit('we"ird\\unit.service', "autoregressive")
    samples = _samples(board)
    assert samples[("k26_build_info", (("version", '0.1.0+"odd"\n'),))] == 1


def test_promtool_accepts_a_real_scrape(board: StatusBoard) -> None:
    if shutil.which("promtool") is None:
        pytest.fail(
            "promtool is needed: scripts/tools.sh puts it in the shared cache (scripts/cache-dir.sh)"
        )
    board.set_state(MAIN, "ready")
    board.record_probe(MAIN, _ok_probe())
    board.record_exit(MAIN, ExitInfo("oom-kill", T0, 1, None, 9))
    board.record_probe(FALLBACK, ProbeInfo(False, T0, None, "x"), failure_reason="timeout")
    board.record_warmup("12.0", "built", 120.0, ok=True)
    board.set_state(FALLBACK, "failed")  # k26_unit_failure_info with a quoted summary
    board.set_reason(FALLBACK, 'exited (gpu-xid): "Xid 79" needs a person', held_by_operator=False)
    board.set_bundle_served(Served("sha256:" + "a" * 64, "2026-12-01T00:00:00Z", 1796083200.0))
    scrape = generate_latest(build_registry(board))
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=scrape,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert re.search(rb"^k26_unit_exits_total\{", scrape, re.M)
    assert re.search(rb'^k26_unit_failure_info\{cause="gpu-xid",', scrape, re.M)
    assert re.search(rb"^k26_bundle_age_at_pull_seconds\{digest=", scrape, re.M)


# --- k26_unit_failure_info: why a unit is failed, for the alerts ---------------------


def _failure_info(board: StatusBoard, unit: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(labels), value)
        for (name, labels), value in _samples(board).items()
        if name == "k26_unit_failure_info" and dict(labels)["unit"] == unit
    ]


def test_failure_info_is_one_series_per_unit_zero_until_failed(board: StatusBoard) -> None:
    assert _failure_info(board, MAIN) == [({"unit": MAIN, "cause": "none", "summary": ""}, 0)]
    board.record_exit(MAIN, ExitInfo("port-in-use", T0, 7, 1, None, (), "port already in use"))
    board.set_state(MAIN, "failed")
    board.set_reason(MAIN, "exited (port-in-use): free the port", held_by_operator=False)
    assert _failure_info(board, MAIN) == [
        ({"unit": MAIN, "cause": "port-in-use", "summary": "port already in use"}, 1)
    ]
    board.set_state(MAIN, "starting")  # an operator's reset
    assert _failure_info(board, MAIN) == [({"unit": MAIN, "cause": "none", "summary": ""}, 0)]


def test_failure_summary_is_one_capped_line(board: StatusBoard) -> None:
    board.set_state(MAIN, "failed")
    board.set_reason(MAIN, "start job ended 'failed'\n" + "x " * 400, held_by_operator=False)
    ((labels, value),) = _failure_info(board, MAIN)
    assert value == 1 and labels["cause"] == "start-job"
    assert "\n" not in labels["summary"] and len(labels["summary"]) <= SUMMARY_MAX_CHARS
    assert labels["summary"].startswith("start job ended 'failed' x x") and labels[
        "summary"
    ].endswith("...")


def test_failure_summary_of_an_exit_is_the_classifier_s_else_the_reason(
    board: StatusBoard,
) -> None:
    # The exit that ended it was a sigkill: its summary. A later "stopped" exit
    # (the supervisor's own stop after failed probes) is not the cause: the reason.
    board.record_exit(MAIN, ExitInfo("sigkill", T0, 7, None, 9, (), "killed by SIGKILL"))
    board.set_state(MAIN, "failed")
    board.set_reason(MAIN, "1 failures within 60 s, last: exited (sigkill)", held_by_operator=False)
    assert _failure_info(board, MAIN)[0][0]["summary"] == "killed by SIGKILL"
    board.record_exit(MAIN, ExitInfo("stopped", T0, 8, None, 9, (), "stopped: SIGKILL"))
    reason = "1 failures within 60 s, last: 2 sampled probes failed in a row, last: timeout: 2 s"
    board.set_reason(MAIN, reason, held_by_operator=False)
    ((labels, _),) = _failure_info(board, MAIN)
    assert labels["cause"] == "probe-timeout" and labels["summary"] == reason


def _failed_reason(policy_changes: dict[str, object], steps: list[object]) -> str:
    """Drive the real core machine (core/machine.py) and return its reason once failed.

    ``steps``: events, or callables taking the last-issued op per action type and
    returning an event, or a Timer to fire.
    """
    from supervisor.core.events import CancelTimer, ScheduleTimer, Timer, TimerFired
    from supervisor.core.machine import Machine, UnitPolicy

    policy = UnitPolicy(**{"max_failures": 1, **policy_changes})  # type: ignore[arg-type]
    machine = Machine(MAIN, policy, now=1000.0)
    ops: dict[str, int] = {}
    timers: dict[Timer, float] = {}  # as the daemon keeps them, from the actions
    now = 1000.0
    for step in steps:
        if isinstance(step, Timer):
            now = timers.pop(step)
            event = TimerFired(step)
        else:
            now += 1.0
            event = step(ops) if callable(step) else step
        for action in machine.handle(event, now):  # type: ignore[arg-type]
            if hasattr(action, "op"):
                ops[type(action).__name__] = action.op
            if isinstance(action, ScheduleTimer):
                timers[action.timer] = action.at
            elif isinstance(action, CancelTimer):
                timers.pop(action.timer, None)
    assert str(machine.state) == "failed", machine.state
    assert machine.reason
    return machine.reason


def _walks() -> dict[str, tuple[dict[str, object], list[object]]]:
    from supervisor.core.events import (
        HealthOk,
        JobDone,
        ManagementRefused,
        ProbeFailed,
        ProbeOk,
        StartRequested,
        Timer,
        UnitExited,
        WarmupFailed,
    )

    cold = {"warmup_enabled": False}
    loading = [StartRequested(), lambda o: JobDone(o["StartUnit"], "done")]
    probing = [*loading, lambda o: HealthOk(o["WaitHealthy"])]
    ready = [*probing, lambda o: ProbeOk(o["SampledProbe"], 12.0, 4)]
    timeout = [lambda o: ProbeFailed(o["SampledProbe"], "timeout", "no answer within 2 s")]
    return {
        "probe-timeout": (
            {**cold, "probe_failures_to_fail": 2},
            [*probing, *timeout, Timer.PROBE, *timeout],
        ),
        "sigkill": (cold, [*ready, UnitExited("sigkill")]),
        "nccl": (cold, [*ready, UnitExited("nccl")]),
        "port-in-use": ({**cold, "max_failures": 5}, [*ready, UnitExited("port-in-use")]),
        "model-load": ({**cold, "max_failures": 5}, [*loading, UnitExited("model-load")]),
        "gpu-xid": (
            {**cold, "max_failures": 5},
            [*ready, UnitExited("gpu-xid", needs_person=True)],
        ),
        "gpu-driver": (
            {**cold, "max_failures": 5},
            [*loading, UnitExited("gpu-driver", needs_person=True)],
        ),
        "not-healthy": (
            cold,
            [*loading, lambda o: ProbeFailed(o["WaitHealthy"], "connect-refused", "refused")],
        ),
        "warmup": ({}, [StartRequested(), lambda o: WarmupFailed(o["RunWarmup"], "no nvcc")]),
        "flashinfer-arch": (
            {},
            [StartRequested(), lambda o: WarmupFailed(o["RunWarmup"], "SM120", True)],
        ),
        "start-job": (cold, [StartRequested(), lambda o: JobDone(o["StartUnit"], "failed")]),
        "other": (cold, [*ready, ManagementRefused("polkit refused the restart")]),
    }


@pytest.mark.parametrize("cause", list(_walks()))
def test_failure_cause_of_each_way_the_real_machine_fails(cause: str, board: StatusBoard) -> None:
    policy, steps = _walks()[cause]
    board.set_state(MAIN, "failed")
    board.set_reason(MAIN, _failed_reason(policy, steps), held_by_operator=False)
    assert failure_cause(board.unit(MAIN)) == cause, board.unit(MAIN).reason
    ((labels, value),) = _failure_info(board, MAIN)
    assert (labels["cause"], value) == (cause, 1)


def test_failure_cause_for_a_load_deadline_is_not_healthy(board: StatusBoard) -> None:
    from supervisor.core.events import JobDone, StartRequested, Timer

    reason = _failed_reason(
        {"warmup_enabled": False},
        [StartRequested(), lambda o: JobDone(o["StartUnit"], "done"), Timer.LOAD_DEADLINE],
    )
    board.set_state(MAIN, "failed")
    board.set_reason(MAIN, reason, held_by_operator=False)
    assert failure_cause(board.unit(MAIN)) == "not-healthy", reason


def test_every_exit_cause_that_fails_a_unit_keeps_its_spelling(board: StatusBoard) -> None:
    board.set_state(MAIN, "failed")
    for cause in EXIT_CAUSES:
        board.set_reason(
            MAIN, f"3 failures within 60 s, last: exited ({cause})", held_by_operator=False
        )
        assert failure_cause(board.unit(MAIN)) == cause


def test_the_time_with_nothing_serving_is_summed_per_group(
    board: StatusBoard, clock: FakeClock
) -> None:
    """k26_serving and k26_unserved_seconds_total, and /status's serving section: the
    seconds a group (a unit and its fallback) had no ready unit, summed across gaps."""
    for now, serving in ((100.0, False), (103.0, True), (110.0, False)):
        clock.now = now
        board.set_serving(MAIN, [MAIN, FALLBACK], serving)
    clock.now = 112.5
    shown = board.snapshot().to_json()["serving"][MAIN]
    assert shown["units"] == [MAIN, FALLBACK] and shown["serving"] is False
    assert shown["unserved_s"] == 5.5 and shown["unserved_since"] == "2025-06-01T12:00:00Z"
    assert _value(board, "k26_unserved_seconds_total", unit=MAIN) == 5.5
    assert _value(board, "k26_serving", unit=MAIN) == 0.0
    clock.now = 120.0
    board.set_serving(MAIN, [MAIN, FALLBACK], True)
    assert board.snapshot().to_json()["serving"][MAIN]["unserved_s"] == 13.0
    assert _value(board, "k26_serving", unit=MAIN) == 1.0
