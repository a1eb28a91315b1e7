"""The server's own account of its start, parsed from real and older output."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from k26dev.standin.startup import StartupPlan, play
from supervisor.core.startup_log import GRAPH_KINDS, last_start, parse

REAL = Path(__file__).parents[1] / "samples" / "real-sglang-0.5.17"


@pytest.mark.parametrize(
    ("log", "load_weight", "tokenizer"),
    [
        ("warm-start-then-sigterm.log", 0.10, 22.24),
        ("cold-start-then-scheduler-sigkill.log", None, None),
        ("eagle3-cold-start.log", 0.14, 29.32),  # the EAGLE-3 server, cold caches
        ("eagle3-scheduler-sigkill-then-warm-restart.log", 0.08, 25.43),
    ],
)
def test_real_sglang_0517_output_on_an_h200(
    log: str, load_weight: float | None, tokenizer: float | None
) -> None:
    lines = (REAL / log).read_text().splitlines()
    timings = parse(last_start(lines))
    assert timings.source == "engine-timings"
    if load_weight is not None:
        assert timings.load_weight_s == load_weight and timings.tokenizer_s == tokenizer
    assert set(timings.cuda_graph_s) == set(GRAPH_KINDS)
    assert all(v == 0.0 for v in timings.cuda_graph_s.values())  # graphs were off there
    assert timings.kv_cache_s is not None and timings.scheduler_s is not None


def test_the_engine_line_with_graphs_and_a_draft() -> None:
    line = (
        "[2026-12-02 10:00:00] Engine startup timings (s): load_weight=3.10, "
        "kv_cache_allocation=1.20, scheduler_e2e=75.38, cuda_graph={prefill=0.00, "
        "decode=0.00, target_verify=12.50, draft_prefill=0.00, draft_decode=4.25, "
        "draft_extend=2.00}, tokenizer_e2e=90.24"
    )
    t = parse([line])
    assert (t.load_weight_s, t.kv_cache_s, t.scheduler_s, t.tokenizer_s) == (3.1, 1.2, 75.38, 90.24)
    assert t.cuda_graph_s["target_verify"] == 12.5 and t.cuda_graph_s["draft_decode"] == 4.25
    assert t.phases()["server_cuda_graph_draft_extend"] == 2.0


def test_the_stand_in_eagle3_start_reads_like_the_real_one() -> None:
    """The same lines, in the same order, as the real EAGLE-3 server's start on the
    H200 (tests/unit/samples/real-sglang-0.5.17/eagle3-cold-start.log)."""
    marks = (
        "Max running requests is reset to 48 for speculative decoding",
        "Load weight end. elapsed=",  # the target
        "type=LlamaForCausalLMEagle3",  # the draft
        "KV Cache is allocated.",
        "Memory pool end.",
        "max_total_num_tokens=",
        "Engine startup timings (s):",
    )

    def order(lines: list[str]) -> list[str]:
        return [m for line in lines for m in marks if m in line]

    real = (REAL / "eagle3-cold-start.log").read_text().splitlines()
    lines: list[str] = []
    assert play(StartupPlan(load_s=0.05, eagle3=True), lines.append, threading.Event())
    assert order(lines) == order(real)
    assert set(parse(lines).phases()) == set(parse(real).phases())
    for source in (lines, real):
        (budget,) = [ln for ln in source if "max_total_num_tokens=" in ln]
        assert "max_running_requests=48" in budget


def test_the_stand_in_prints_what_the_parser_reads() -> None:
    lines: list[str] = []
    plan = StartupPlan(load_s=0.05, eagle3=True, cuda_graphs=True)
    assert play(plan, lines.append, threading.Event())
    t = parse(lines)
    assert t.source == "engine-timings"
    assert t.load_weight_s is not None and t.load_weight_s > 0
    assert (
        t.cuda_graph_s["target_verify"] is not None and t.cuda_graph_s["draft_extend"] is not None
    )
    assert sum(1 for ln in lines if "type=LlamaForCausalLMEagle3" in ln) == 1
    assert sum(1 for ln in lines if "KV Cache is allocated" in ln) == 2  # target and draft


def test_older_releases_without_the_engine_line_tp_ranks_and_no_elapsed() -> None:
    """Before 0.5.17: no timings line; 'Load weight end.' without elapsed= in older
    releases (the log's own clock tells), the old capture line on every TP rank."""
    lines = [
        "[2025-03-08 12:28:00 TP0] Load weight begin. avail mem=78.50 GB",
        "[2025-03-08 12:28:00 TP1] Load weight begin. avail mem=78.50 GB",
        "[2025-03-08 12:28:09 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.float16, avail mem=62.00 GB",
        "[2025-03-08 12:28:11 TP1] Load weight end. type=LlamaForCausalLM, dtype=torch.float16, avail mem=62.00 GB",
        "[2025-03-08 12:29:28 TP0] Capture cuda graph end. Time elapsed: 7.23 s. avail mem=0.53 GB. mem usage=0.93 GB.",
        "[2025-03-08 12:29:28 TP1] Capture cuda graph end. Time elapsed: 7.25 s. avail mem=0.53 GB. mem usage=0.93 GB.",
    ]  # fmt: skip
    t = parse(lines)
    assert t.source == "phase-lines"
    assert t.load_weight_s == 11.0  # the slowest rank, not the sum of the ranks
    assert t.cuda_graph_s["decode"] == 7.25
    # What no line speaks of is unknown, never zero.
    assert t.kv_cache_s is None and t.tokenizer_s is None and t.scheduler_s is None
    assert t.cuda_graph_s["target_verify"] is None


def test_0516_phase_lines_with_a_draft() -> None:
    lines = [
        "[2026-07-01 10:00:00] Load weight end. elapsed=4.00 s, type=LlamaForCausalLM, avail mem=70.00 GB, mem usage=8.00 GB.",
        "[2026-07-01 10:00:02] Load weight end. elapsed=0.50 s, type=LlamaForCausalLMEagle3, avail mem=69.00 GB, mem usage=1.00 GB.",
        "[2026-07-01 10:00:30] Capture target verify CUDA graph end. elapsed=20.00 s, mem usage=1.00 GB, avail mem=9.00 GB.",
        "[2026-07-01 10:00:35] Capture draft decode CUDA graph end. elapsed=5.00 s, mem usage=0.20 GB, avail mem=8.80 GB.",
    ]  # fmt: skip
    t = parse(lines)
    assert t.load_weight_s == 4.5  # target and draft, one rank
    assert t.cuda_graph_s["target_verify"] == 20.0 and t.cuda_graph_s["draft_decode"] == 5.0


def test_nothing_said_is_all_unknown_and_jit_lines_are_kept() -> None:
    t = parse(["nothing about timings here"])
    assert t.source == "none" and all(v is None for v in t.phases().values())
    jit = parse(
        [
            "[2026-01-01 00:00:00 TP0] Entering DeepGEMM JIT Pre-Compile session. It may take a long time"
        ]
    )
    assert jit.jit_lines and "DeepGEMM" in jit.jit_lines[0]


def test_the_last_start_is_cut_from_a_file_that_holds_several() -> None:
    run = [
        "[2026-12-01 15:32:27] server_args=ServerArgs(model_path='/m')",
        "[2026-12-01 15:32:49] Engine startup timings (s): load_weight=9.99, kv_cache_allocation=0.00, "
        "scheduler_e2e=3.16, cuda_graph={prefill=0.00, decode=0.00, target_verify=0.00, draft_prefill=0.00, "
        "draft_decode=0.00, draft_extend=0.00}, tokenizer_e2e=22.24",
    ]  # fmt: skip
    second = [run[0], "Load weight end. elapsed=1.00 s, type=X, avail mem=1 GB, mem usage=1 GB."]
    t = parse(last_start([*run, "crashed", *second]))
    assert t.source == "phase-lines" and t.load_weight_s == 1.0  # not the first run's 9.99
