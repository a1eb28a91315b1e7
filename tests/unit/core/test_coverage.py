"""The coverage warm-up's shapes (core/coverage.py) and their config ([coverage])."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from supervisor.adapters.config_file import load_config
from supervisor.core import coverage
from supervisor.core.config import InvalidConfig
from supervisor.core.coverage import (
    CoverageReport,
    CustomShape,
    ShapeContext,
    ShapeOutcome,
    ShapeResult,
    expand,
    judge,
    ramp_sizes,
)

CTX = ShapeContext(prompt="P", max_batch=16, long_prompt_tokens=900, model="tiny")


def shapes(*names: str, custom: tuple[CustomShape, ...] = ()) -> dict[str, coverage.Shape]:
    return {s.name: s for s in expand(names or (coverage.DEFAULT_SET,), custom, CTX)}


# --- the default set: every shape the issue names -----------------------------------


def test_the_default_set_covers_what_clients_send() -> None:
    got = shapes()
    wanted = {
        "greedy", "temperature", "top-k", "top-p", "min-p", "all-filters",
        "repetition-penalty", "frequency-penalty", "presence-penalty", "min-new-tokens",
        "logprobs", "parallel-n", "stop-strings", "long-output", "long-prompt",
        "prefix-repeat", "mixed-batch", "batch-ramp", "openai-completions",
    }  # fmt: skip
    assert wanted <= set(got)
    params = {n: s.body.get("sampling_params", {}) for n, s in got.items()}
    assert params["greedy"]["temperature"] == 0
    assert params["repetition-penalty"]["repetition_penalty"] != 1.0
    assert params["frequency-penalty"]["frequency_penalty"] != 0
    assert params["presence-penalty"]["presence_penalty"] != 0
    assert params["min-new-tokens"]["min_new_tokens"] > 0
    assert params["parallel-n"]["n"] > 1
    assert params["stop-strings"]["stop"]
    assert got["logprobs"].body["return_logprob"] and got["logprobs"].body["top_logprobs_num"]
    openai = got["openai-completions"]
    assert openai.endpoint == "/v1/completions"
    assert openai.body["model"] == "tiny" and "logit_bias" in openai.body and "seed" in openai.body
    # Every single-body shape but greedy samples (the mixed batch: see its own test).
    single = {n: p for n, p in params.items() if n not in ("greedy", "mixed-batch")}
    assert all(p.get("temperature", 1) > 0 for p in single.values())


def test_the_long_prompt_is_token_ids_of_the_length_the_server_allows() -> None:
    """Ids, not words: tokens per word vary several-fold between tokenizers."""
    body = shapes("long-prompt")["long-prompt"].body
    assert "text" not in body and len(body["input_ids"]) == 900
    assert all(100 <= i < 356 for i in body["input_ids"])


def test_the_prefix_repeat_comes_last_and_repeats_a_prompt_already_sent() -> None:
    order = [s.name for s in expand(("prefix-repeat", "greedy", "top-k"), (), CTX)]
    assert order[-1] == "prefix-repeat"
    sent = {s.body.get("text") for s in expand(("greedy",), (), CTX)}
    assert shapes("prefix-repeat")["prefix-repeat"].body["text"] in sent


def test_the_mixed_batch_is_concurrent_with_different_settings() -> None:
    mixed = shapes("mixed-batch")["mixed-batch"]
    (wave,) = mixed.waves()
    assert len(wave) == 16
    settings = {tuple(sorted(b["sampling_params"].items())) for b in wave}
    assert len(settings) >= 8
    assert any(b["sampling_params"].get("temperature") == 0 for b in wave)  # greedy among them


@pytest.mark.parametrize(
    ("limit", "sizes"),
    [
        (1, [2]),
        (2, [2]),
        (16, [2, 4, 8, 15, 16]),
        (48, [2, 4, 8, 15, 16, 31, 32, 47, 48]),
        (4096, [2, 4, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256]),
    ],
)
def test_the_ramp_has_a_size_for_each_kernel_variant_up_to_the_limit(
    limit: int, sizes: list[int]
) -> None:
    assert ramp_sizes(limit) == sizes


def test_every_batch_size_up_to_the_limit_selects_a_variant_the_ramp_played() -> None:
    def variant(size: int) -> tuple[int, str]:
        bucket = 1 << (size - 1).bit_length()
        return bucket, "1" if size == 1 else ("d16" if size % 16 == 0 else "any")

    for limit in (16, 48, 100, 256):
        played = {variant(s) for s in ramp_sizes(limit)} | {variant(1)}
        assert {variant(s) for s in range(1, limit + 1)} <= played, limit


def test_each_ramp_step_is_one_request_carrying_that_many_prompts() -> None:
    """A batch request reaches SGLang's scheduler whole, so the batch size is exact:
    concurrent single requests would batch however they happened to arrive."""
    ramp = shapes("batch-ramp")["batch-ramp"]
    waves = ramp.waves()
    assert [len(w) for w in waves] == [1, 1, 1, 1, 1]
    texts = [w[0]["text"] for w in waves]
    assert [len(t) for t in texts] == [2, 4, 8, 15, 16]
    assert all(len(set(t)) == len(t) for t in texts)  # distinct prompts: no prefix hit
    assert all(w[0]["sampling_params"]["temperature"] > 0 for w in waves)


def test_custom_shapes_and_each_name_once() -> None:
    mine = CustomShape("tools", "/v1/chat/completions", {"messages": []}, concurrent=3)
    got = expand(("greedy", "tools", "greedy", coverage.DEFAULT_SET), (mine,), CTX)
    names = [s.name for s in got]
    assert len(names) == len(set(names)) and "tools" in names
    (tools,) = [s for s in got if s.name == "tools"]
    assert tools.endpoint == "/v1/chat/completions" and len(tools.waves()[0]) == 3
    with pytest.raises(KeyError):
        expand(("nope",), (), CTX)


# --- what an answer means ----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "message", "shaped", "result"),
    [
        (200, "", True, ShapeResult.OK),
        (200, "", False, ShapeResult.FAILED),  # a 200 that is not SGLang's answer
        (500, "Internal Server Error", False, ShapeResult.FAILED),
        (None, "timeout", False, ShapeResult.FAILED),
        (400, "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not "
              "supported when the server is launched with --grammar-backend none", False,
         ShapeResult.REFUSED),
        (400, "top_p must be in (0, 1], got 2.0.", False, ShapeResult.FAILED),  # our bug
        (429, "is not supported right now", False, ShapeResult.FAILED),  # overload, not config
        (503, "not enabled", False, ShapeResult.FAILED),
    ],
)  # fmt: skip
def test_judge(status: int | None, message: str, shaped: bool, result: ShapeResult) -> None:
    assert judge(status, message, shaped=shaped) is result


def test_a_report_names_the_failed_shape_and_the_servers_answer() -> None:
    at = datetime(2026, 12, 2, tzinfo=UTC)
    report = CoverageReport(
        False,
        at,
        3.2,
        (
            ShapeOutcome("greedy", ShapeResult.OK, 10.0, 1),
            ShapeOutcome("json-schema", ShapeResult.REFUSED, 4.0, 1, "aborted: grammar off"),
            ShapeOutcome("repetition-penalty", ShapeResult.FAILED, 9.0, 1, "HTTP 500: boom"),
        ),
    )
    assert report.failed is not None and report.failed.name == "repetition-penalty"
    text = report.summary()
    assert "1 ok, 1 refused" in text and "1 failed" in text
    assert "repetition-penalty: HTTP 500: boom" in text
    data = report.to_json()
    assert data["at"] == "2026-12-02T00:00:00Z" and data["shapes"][1]["result"] == "refused"


# --- [coverage] in the config --------------------------------------------------------

UNIT = """
[flashinfer]
enabled = false

[[units]]
name = "sglang-k26.service"
role = "autoregressive"
url = "http://127.0.0.1:30000"
"""


def problems(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "k26.toml"
    path.write_text(text)
    with pytest.raises(InvalidConfig) as info:
        load_config(path)
    assert info.value.exit_code == 78 and str(path) in str(info.value)
    return {p.path: p.message for p in info.value.problems}


def test_coverage_defaults_to_every_builtin_shape(tmp_path: Path) -> None:
    path = tmp_path / "k26.toml"
    path.write_text(UNIT)
    config = load_config(path)
    assert config.coverage.enabled and config.coverage_names("sglang-k26.service") == ("default",)


def test_a_unit_may_play_its_own_set_and_custom_shapes(tmp_path: Path) -> None:
    path = tmp_path / "k26.toml"
    path.write_text(
        UNIT.replace(
            'url = "http://127.0.0.1:30000"\n',
            'url = "http://127.0.0.1:30000"\ncoverage = ["greedy", "tools"]\n',
        )
        + '\n[coverage]\nshapes = ["default"]\n\n[[coverage.custom]]\nname = "tools"\n'
        'endpoint = "/v1/chat/completions"\nconcurrent = 4\n'
        '[coverage.custom.body]\nmessages = [{role = "user", content = "hi"}]\n'
    )
    config = load_config(path)
    assert config.coverage_names("sglang-k26.service") == ("greedy", "tools")
    (tools,) = config.coverage.custom_shapes()
    assert tools.endpoint == "/v1/chat/completions" and tools.concurrent == 4


@pytest.mark.parametrize(
    ("extra", "field", "needle"),
    [
        ('[coverage]\nshapes = ["greedy", "warp-speed"]\n', "coverage.shapes[1]", "warp-speed"),
        ("[coverage]\ntimeout_s = 0\n", "coverage.timeout_s", "greater than 0"),
        ("[coverage]\nmax_new_tokens = 500\n", "coverage.max_new_tokens", "64"),
        ('[[coverage.custom]]\nname = "greedy"\nbody = {}\n', "coverage.custom[0].name",
         "built-in"),
        ('[[coverage.custom]]\nname = "Bad Name"\nbody = {}\n', "coverage.custom[0].name",
         "lowercase"),
        ('[[coverage.custom]]\nname = "learned-decode-descent"\nbody = {}\n',
         "coverage.custom[0].name", "learned shapes'"),
        ("[coverage]\nlearned = 1\n", "coverage.learned", "true or false"),
        ('[[coverage.custom]]\nname = "x"\nendpoint = "/v2/magic"\nbody = {}\n',
         "coverage.custom[0].endpoint", "/generate"),
        ('[[coverage.custom]]\nname = "x"\nbody = {}\n[[coverage.custom]]\nname = "x"\n'
         "body = {}\n", "coverage.custom[1].name", "twice"),
        ('[[coverage.custom]]\nname = "x"\nbody = {}\nconcurrent = 0\n',
         "coverage.custom[0].concurrent", "at least 1"),
    ],
)  # fmt: skip
def test_a_bad_coverage_setting_names_its_field(
    tmp_path: Path, extra: str, field: str, needle: str
) -> None:
    found = problems(tmp_path, UNIT + "\n" + extra)
    assert field in found, found
    assert needle in found[field], found[field]


def test_a_units_unknown_shape_names_the_unit(tmp_path: Path) -> None:
    text = UNIT.replace(
        'url = "http://127.0.0.1:30000"\n', 'url = "http://127.0.0.1:30000"\ncoverage = ["nope"]\n'
    )
    found = problems(tmp_path, text)
    assert "units[0].coverage[0]" in found and "nope" in found["units[0].coverage[0]"]


# --- the decode descent: derived from the server -------------------------------------

# /server_info as sglang 0.5.17 answers it (the fields the descent reads): server
# arguments, the scheduler's handshake, and its internal state per DP rank.
SERVER_INFO = {
    "chunked_prefill_size": 8192,
    "context_length": None,  # not given on the command line
    "max_running_requests": None,
    "max_total_num_tokens": 300_000,
    "max_req_input_len": 4095,
    "speculative_algorithm": "EAGLE3",
    "speculative_num_draft_tokens": 3,
    "internal_states": [{"effective_max_running_requests_per_dp": 48}],
}


def test_the_server_s_own_facts_set_the_descent() -> None:
    ctx = coverage.with_server_facts(CTX, SERVER_INFO)
    assert ctx.max_running == 48  # the scheduler's, not the null argument
    assert ctx.context_length == 4096  # max_req_input_len is the context less one
    assert ctx.kv_tokens == 300_000
    assert ctx.tokens_per_step == 3  # a step may accept every draft token
    plan = coverage.plan_descent(ctx)
    assert plan.top == 48 and plan.capped_from is None
    # The context lets one set of requests hold every size, at the most a step yields.
    assert plan.steps(48) >= coverage.DESCENT_SLACK_STEPS + 48 * coverage.STEPS_PER_SIZE
    # Without speculative decoding a step yields one token; a null scheduler state
    # leaves the argument.
    plain = coverage.with_server_facts(
        CTX, {**SERVER_INFO, "speculative_algorithm": None, "internal_states": [],
              "max_running_requests": 64},
    )  # fmt: skip
    assert plain.tokens_per_step == 1 and plain.max_running == 64
    # An EAGLE-family server's radix cache keys token pairs; others' do not.
    assert ctx.radix_bigrams and not plain.radix_bigrams
    ngram = coverage.with_server_facts(CTX, {**SERVER_INFO, "speculative_algorithm": "NGRAM"})
    assert not ngram.radix_bigrams and ngram.tokens_per_step == 3


@pytest.mark.parametrize(
    ("facts", "tokens"),
    [
        ({}, 64),  # no page size said: one token a page; four times past each mod-16 residue
        ({"page_size": 1}, 64),
        ({"page_size": 64}, 128),  # FlashMLA's pages: past two of them
        ({"page_size": 64, "context_length": 100}, 36),  # within the context
        ({"page_size": 64, "context_length": 40}, 8),  # the coverage's own length at least
        ({"page_size": True}, 64), ({"page_size": -3}, 64), ({"page_size": "64"}, 64),
        ({"page_size": 1 << 40}, 2 * coverage.MAX_PAGE_SIZE),  # not believed past the cap
    ],
)  # fmt: skip
def test_the_long_output_passes_two_of_the_server_s_kv_pages(
    facts: dict[str, object], tokens: int
) -> None:
    ctx = coverage.with_server_facts(CTX, {**SERVER_INFO, "max_req_input_len": None, **facts})
    shape = coverage.builtin_shape("long-output", ctx)
    params = shape.body["sampling_params"]
    assert params["max_new_tokens"] == tokens, ctx
    assert params["ignore_eos"] is True and params["temperature"] > 0 and params["top_k"] > 1


@pytest.mark.parametrize(
    ("facts", "top", "why"),
    [
        ({"max_running": 4096, "kv_tokens": 10**7}, 256, "the descent's cap (256)"),
        # 45 tokens each: a 32-token prompt, 2 spare, 11 steps (a size held, and slack)
        ({"max_running": 4096, "kv_tokens": 8192}, 8192 * 8 // 10 // 45, "KV pool (8192"),
        ({"max_running": 12, "kv_tokens": 8192}, 12, ""),
    ],
)
def test_the_descent_is_capped_and_says_by_what(facts: dict[str, int], top: int, why: str) -> None:
    plan = coverage.plan_descent(replace(CTX, context_length=1024, **facts))
    assert plan.top == top
    assert (plan.capped_from is not None) == bool(why) and why in plan.cap_why
    # Every request of the first set fits the context and its share of the KV pool,
    # and the clock lasts at least one size.
    assert plan.budget(plan.top) <= 1024 - plan.prompt_tokens
    assert plan.top * (plan.budget(plan.top) + plan.prompt_tokens) <= facts["kv_tokens"]
    assert plan.steps(plan.top) >= coverage.DESCENT_SLACK_STEPS + coverage.STEPS_PER_SIZE


def test_the_descent_s_short_prompts_leave_a_bound_kv_pool_to_decode_steps() -> None:
    """On the H200 the tiny fallback (4096 running requests, an 8192-token KV pool)
    held one size per set of requests at the top with 32-token prompts: 4,946 requests
    for 136 sizes. The cap still assumes a short client request (32 tokens), but the
    descent's own prompts are 4 ids, so a set holds several sizes; none begins like
    another shape's prompt (its first id is its own), so no radix match moves another
    shape's counts."""
    ctx = replace(CTX, max_running=4096, kv_tokens=8192, context_length=1024)
    plan = coverage.plan_descent(ctx)
    sized_as_before = replace(plan, prompt_tokens=coverage.SIZING_PROMPT_TOKENS)
    assert plan.top == 8192 * 8 // 10 // 45  # capped as before
    assert plan.steps(plan.top) >= 3 * sized_as_before.steps(plan.top)  # 36 steps, not 8

    def sizes(p: coverage.Descent) -> int:  # a set holds at the top, a step a token
        return (p.steps(p.top) - coverage.DESCENT_SLACK_STEPS) // coverage.STEPS_PER_SIZE

    assert (sizes(sized_as_before), sizes(plan)) == (1, 10)
    ids = [coverage.descent_ids(i) for i in range(300)]
    assert {len(x) for x in ids} == {coverage.DESCENT_PROMPT_IDS} == {plan.prompt_tokens}
    firsts = set()
    for name in coverage.builtin_names():
        if name == "decode-descent":
            continue
        shape = coverage.builtin_shape(name, replace(ctx, kv_reset_at_finish=True))
        for body in (shape.body, *shape.batch, *shape.beside):
            prompts = body.get("input_ids") or []
            for prompt in prompts if prompts and isinstance(prompts[0], list) else [prompts]:
                if prompt:
                    firsts.add(prompt[0])
    assert {x[0] for x in ids} == {98} and 98 not in firsts


def test_a_smaller_set_of_requests_carries_more_tokens_each() -> None:
    plan = coverage.plan_descent(
        replace(CTX, max_running=200, kv_tokens=20_000, context_length=4096)
    )
    assert plan.budget(10) > plan.budget(200)
    assert plan.budget(1) == 4096 - plan.prompt_tokens - 64  # the context binds alone
    assert plan.clock_budget(10) < plan.budget(10)  # the clock ends before the rest


def test_the_descent_shape_streams_with_the_server_s_sampling() -> None:
    ctx = coverage.with_server_facts(CTX, SERVER_INFO)
    (shape,) = expand(("decode-descent",), (), ctx)
    assert shape.descent is not None and shape.descent.top == 48
    assert shape.body["stream"] is True
    sampling = shape.body["sampling_params"]
    assert sampling["ignore_eos"] and sampling["temperature"] > 0 and sampling["top_k"] > 1


REAL = Path(__file__).resolve().parents[3] / "bench" / "gpu" / "results"


@pytest.mark.parametrize(
    ("sample", "facts"),
    [
        # The tiny EAGLE-3 server and K2 (DeepseekV3, 2 layers), real SGLang 0.5.17 on
        # the H200 (2026-12-04): what /server_info said, as the GPU script kept it.
        ("h200-2026-12-04-eagle3-graphs-decode-server-info.json", (48, 1024, 8192, 3)),
        ("h200-2026-12-04-k2-graphs-on-server-info.json", (64, 4096, 32768, 1)),
    ],
)
def test_the_facts_read_from_a_real_server_s_own_answer(
    sample: str, facts: tuple[int, int, int, int]
) -> None:
    info = json.loads((REAL / sample).read_text())
    ctx = coverage.with_server_facts(CTX, info)
    assert (ctx.max_running, ctx.context_length, ctx.kv_tokens, ctx.tokens_per_step) == facts


def test_prefill_alignment_plays_beside_a_companion_where_every_end_resets_the_offset() -> None:
    """Without speculative decoding a prefill alone moves the KV slot offset by its
    length, so 1 or 2 slots between two plays flip the parity; with it (sglang 0.5.17)
    every request's end hands slots back and the next starts at 0, so the plays go
    beside a request that decodes, several times each."""
    plain = coverage.builtin_shape("prefill-alignment", coverage.ShapeContext())
    assert plain.beside == ()
    counts = [len(b["input_ids"]) for b in plain.bodies()]
    assert counts == [1, 2, 1, 16, 1, 16, 17, 2, 17]
    ctx = coverage.with_server_facts(
        coverage.ShapeContext(),
        {"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 3,
         "context_length": 1024},
    )  # fmt: skip
    shape = coverage.builtin_shape("prefill-alignment", ctx)
    (companion,) = shape.beside
    assert companion["stream"] is True and companion["sampling_params"]["ignore_eos"] is True
    counts = [len(b["input_ids"]) for b in shape.bodies()]
    plays = coverage.ALIGNMENT_PLAYS
    assert counts == [c for c in coverage.ALIGNMENT_TOKENS for _ in range(plays)]
    assert [len(w) for w in shape.waves()] == [1] * len(counts)  # one after another


def _ran(lasts: list[int], extra: int) -> list[int]:
    """The batch size at each decode step when each request made ``lasts[i]`` steps
    and stays ``extra`` steps more (1: the overlap scheduler's dropped forward)."""
    return [sum(e + extra >= s for e in lasts) for s in range(1, max(lasts) + extra + 1)]


@pytest.mark.parametrize("extra", [0, 1])
def test_held_sizes_are_the_ones_the_batch_ran_at_whichever_way_the_server_schedules(
    extra: int,
) -> None:
    """Each request's decode steps at its end say which batches ran; a request that
    stopped at step e is in step e + 1 on an overlap scheduler, not otherwise. The
    sizes named are the ones that ran, either way."""
    cases = {
        # Aborted every step from 6 requests down to 2, the clock (12 steps) last.
        (3, 4, 5, 6, 12, 12): {6, 5, 4, 3, 2},
        # Two aborts that landed at the same step: the size between never ran.
        (3, 5, 5, 9, 12, 12): {6, 5, 3, 2},
        # A request that ended by itself at the same step as an abort.
        (4, 4, 7, 9): {4, 2, 1},
        # One aborted before its first decode step: on an overlap scheduler the
        # batch of 3 ran once, which only the end of that step would tell.
        (0, 4, 4): {2},
    }
    for lasts, held in cases.items():
        assert coverage.held_sizes(lasts, steps=1) == held
        ran = set(_ran(list(lasts), extra))
        assert held <= ran and ran - held <= ({len(lasts)} if extra else set())
    assert coverage.held_sizes([3, None, 12]) == set()


@pytest.mark.parametrize("extra", [0, 1])
def test_a_size_is_held_when_the_batch_ran_at_it_two_steps_in_a_row(extra: int) -> None:
    """Every end hands KV slots back on a speculative server, and the allocator's
    free list starts over: the first step after it takes slots at offset 0, the
    second at the batch's own count of them. On the H100 (2026-12-05) a descent that
    held each size one step made only the aligned variant of the draft's
    ``assign_req_to_token_pool``; a size held one step is played again. How many steps
    each size lasted does not depend on the scheduler either."""
    assert coverage.HELD_STEPS == 2
    cases = {
        # Aborted every two steps from 6 down to 2, the clock (14 steps) last.
        (2, 4, 6, 8, 14, 14): {6, 5, 4, 3, 2},
        # An abort a step late: the size after it ran one step only.
        (2, 3, 5, 7, 12, 12): {6, 4, 3, 2},
        # Aborted every step: nothing but the last size held.
        (1, 2, 3, 4, 9, 9): {2},
    }
    for lasts, held in cases.items():
        assert coverage.held_sizes(lasts) == held
        runs = _ran(list(lasts), extra)
        assert {n for n in set(runs) if runs.count(n) >= 2} == held | (
            {len(lasts)} if extra else set()
        )
