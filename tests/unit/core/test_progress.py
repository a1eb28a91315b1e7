"""The forward-progress rule (core/progress.py), on SGLang 0.5.17's /metrics text."""

from __future__ import annotations

import pytest

from supervisor.core.progress import (
    MetricsUnreadable,
    ProgressJudge,
    ServerLoad,
    parse_sglang_metrics,
)

LABELS = 'model_name="k2",engine_type="unified",tp_rank="{tp}",pp_rank="0",moe_ep_rank="0"'


def metrics(running: int, queued: int, decode: float, prefill: float, tps: int = 2) -> str:
    """The shape of SGLang 0.5.17's exposition: one series per tp rank and mode."""
    lines = [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        *(f"sglang:num_running_reqs{{{LABELS.format(tp=t)}}} {running}" for t in range(tps)),
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
        "# TYPE sglang:num_queue_reqs gauge",
        *(f"sglang:num_queue_reqs{{{LABELS.format(tp=t)}}} {queued}" for t in range(tps)),
        "# HELP sglang:realtime_tokens_total Total number of tokens processed.",
        "# TYPE sglang:realtime_tokens_total counter",
        f'sglang:realtime_tokens_total{{{LABELS.format(tp=0)},mode="decode"}} {decode}',
        f'sglang:realtime_tokens_total{{{LABELS.format(tp=0)},mode="prefill_compute"}} {prefill}',
        "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
        "# TYPE sglang:generation_tokens_total counter",
        'sglang:generation_tokens_total{model_name="k2",engine_type="unified",'
        'is_streaming="false"} 7.0',
    ]
    return "\n".join(lines) + "\n"


def test_the_gauges_sum_over_ranks_and_the_counter_over_modes() -> None:
    load = parse_sglang_metrics(metrics(running=3, queued=1, decode=100, prefill=900))
    assert load == ServerLoad(6.0, 2.0, 1000.0, "sglang:realtime_tokens_total")


def test_without_the_realtime_counter_the_finished_request_counters_stand_in() -> None:
    text = "\n".join(ln for ln in metrics(1, 0, 5, 5).splitlines() if "realtime" not in ln)
    load = parse_sglang_metrics(text + "\n")
    assert load.tokens == 7.0 and "generation_tokens_total" in load.counter


@pytest.mark.parametrize("text", ["<html>not found</html>", "vllm:num_requests_running 1\n"])
def test_text_that_is_not_sglang_s_metrics_is_refused_by_name(text: str) -> None:
    with pytest.raises(MetricsUnreadable):
        parse_sglang_metrics(text)


def test_requests_in_flight_with_no_token_past_the_budget_is_a_stall() -> None:
    judge = ProgressJudge(stall_after_s=60.0, now=0.0)
    assert judge.observe(parse_sglang_metrics(metrics(2, 0, 50, 50)), 0.0) is None
    assert judge.observe(parse_sglang_metrics(metrics(2, 0, 80, 50)), 30.0) is None  # moved
    assert judge.observe(parse_sglang_metrics(metrics(2, 0, 80, 50)), 89.0) is None
    why = judge.observe(parse_sglang_metrics(metrics(2, 0, 80, 50)), 90.0)
    assert why is not None and why.startswith("4 requests running and 0 queued, but no token")
    assert "sglang:realtime_tokens_total flat at 130" in why


def test_an_idle_server_never_stalls() -> None:
    judge = ProgressJudge(stall_after_s=1.0, now=0.0)
    for now in range(0, 100, 10):
        assert judge.observe(parse_sglang_metrics(metrics(0, 0, 5, 5)), float(now)) is None


def test_a_long_prompt_prefilled_chunk_by_chunk_is_progress() -> None:
    """Each chunk (at most --chunked-prefill-size tokens) advances prefill_compute: a
    128k-token prompt in 16 chunks of 8,192 that take 50 s each never trips 60 s."""
    judge = ProgressJudge(stall_after_s=60.0, now=0.0)
    for chunk in range(17):
        text = metrics(1, 0, 0, 8192 * chunk)
        assert judge.observe(parse_sglang_metrics(text), 50.0 * chunk) is None


def test_a_compile_in_progress_restarts_the_clock() -> None:
    judge = ProgressJudge(stall_after_s=60.0, now=0.0)
    load = parse_sglang_metrics(metrics(1, 0, 10, 10))
    assert judge.observe(load, 0.0) is None
    judge.activity(50.0)  # ptxas in the unit's cgroup, or a Triton cache file
    assert judge.observe(load, 100.0) is None
    assert judge.observe(load, 110.0) is not None
