"""The coverage warm-up's request shapes, and what an answer to each means (pure).

A sampled probe proves one request shape. Real traffic brings others, and on a
real SGLang each new shape can compile kernels while serving: penalties through
torch inductor, ``n > 1`` and mixed batches through Triton, a prefix-cache hit
through Triton (measured on an H200, see ``docs/field-facts`` of the project).
Before READY the supervisor plays every shape of the unit's set once, so that
nothing is left to compile under live traffic.

A shape is an endpoint, a JSON body (built from the probe's prompt and, for the
long prompt, the server's own chunked-prefill size) and how many copies go at
once. ``judge`` turns an HTTP answer into ``ok``, ``refused`` (the server's own
configuration declines the feature, e.g. ``--grammar-backend none``: reported,
not a failure) or ``failed`` (a 5xx, a dropped connection, a timeout, an answer
that is not SGLang's shape: the unit is not ready).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

DEFAULT_SET = "default"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# What SGLang says when its own configuration declines a feature (HTTP 400).
_REFUSALS = re.compile(
    r"not supported when the server is launched with|is not supported|not enabled|"
    r"is disabled|--enable-[a-z-]+ is required|unsupported",
    re.IGNORECASE,
)


class ShapeResult(StrEnum):
    OK = "ok"
    REFUSED = "refused"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ShapeContext:
    """What the built-in bodies are made from."""

    prompt: str = "The capital of France is"
    seed: int = 1234
    max_new_tokens: int = 8
    long_prompt_tokens: int = 800  # a chunked prefill: more than the server's chunk
    model: str = "default"  # the name the OpenAI endpoints answer to
    # The largest batch the ramp sends at once: the server's max_running_requests,
    # capped (a server that may run 4096 at once is not asked to, before READY).
    max_batch: int = 16
    # The decode descent's facts, from the server (``server_facts``): how many
    # requests it runs at once, its context, and how many tokens one decode step can
    # produce per request (speculative decoding's draft tokens; else 1).
    max_running: int | None = None
    context_length: int | None = None
    kv_tokens: int | None = None  # the KV pool's size (max_total_num_tokens)
    tokens_per_step: int = 1
    # The descent's stated cap: decode batches above it are not played (reported).
    descent_cap: int = 256
    # SGLang's radix cache keys an EAGLE server's prompts by token pairs
    # (``RadixKey.maybe_to_bigram_view(is_eagle)``, 0.5.17): a prefix of N ids that
    # an earlier prompt shared caches N - 1 of them. Replays that set a cached count
    # (core/learned_shapes.py) share one id more there.
    radix_bigrams: bool = False
    # Whether every request's end hands KV slots back: SGLang 0.5.17's allocator then
    # rebuilds its free list (``torch.cat``), so the next slice starts at offset 0.
    # With speculative decoding every end does (the over-allocated draft slots, and an
    # EAGLE radix key's unkeyed last token), and without a radix cache (ChunkCache
    # frees all). Otherwise an end of a prompt nothing else cached hands nothing
    # back, and the offset is the count of slots handed out since the last free.
    kv_reset_at_finish: bool = False
    page_size: int = 1  # the KV pool's page, in tokens (``--page-size``)


# Steps in a row the batch runs at a size before it counts as held (``held_sizes``),
# and the clock's streamed chunks (a step or more each) between two of its aborts.
# Every end of a request hands KV slots back on a speculative server, and SGLang
# 0.5.17's allocator then starts its free list over: the step after an end takes its
# slots at offset 0, the next at the offset that step handed out, the batch's own
# count of slots. Triton keys a pointer on 16-byte alignment, and the EAGLE draft's
# ``assign_req_to_token_pool`` takes a pointer to that slice: on the H100
# (2026-12-05) a descent that held each size one step, every one of them just after
# an end, made its aligned variants only, and the client matrix then compiled an
# unaligned one after READY. Two steps run each size at both offsets.
HELD_STEPS = 2
DESCENT_SLACK_STEPS = 4  # steps spent before the batch runs (it is taken in at once)


@dataclass(frozen=True, slots=True)
class Descent:
    """Decode batches of every size from ``top`` down to 1, each held for a few steps.

    Kernels on the decode path specialise on the batch size in ways no single rule
    describes: SGLang 0.5.17's EAGLE draft decode (``generate_draft_decode_kv_indices``)
    takes every integer as a ``tl.constexpr``, its stride among them, so each distinct
    number of sequences is a compile of its own where no CUDA graph captured it;
    others key on ``next_power_of_2(bs)`` or on Triton's 1 / multiple-of-16 classes.
    Playing every size covers any function of the batch size without guessing one,
    and costs ``top`` requests, not the ``top*(top+1)/2`` of a batch per size: the
    requests decode together and are aborted one at a time (``/abort_request``), so
    the running batch steps down through every size. The last request of a set is
    the clock: a request is aborted every ``held_steps`` of its chunks (a chunk is
    at least one decode step). Which sizes ran is read afterwards from each
    request's own count of decode steps at its end (``held_sizes``), not from when
    the aborts were answered: a size that two aborts landing together skipped is
    played again. A request carries only as many tokens as the context and the KV
    pool allow, so a long descent runs in sets of fresh requests, each going as far
    down as its clock lasts."""

    top: int
    context: int  # tokens a request may hold: the server's context length
    per_step: int  # tokens one decode step can yield per request
    kv_tokens: int | None = None  # the KV pool, which a set's requests share
    prompt_tokens: int = 4  # each of the descent's prompts (``descent_ids``)
    capped_from: int | None = None  # the server's limit, when above ``top``
    cap_why: str = ""  # what set ``top`` below that limit
    # Steps in a row each size is held (an abort every as many of the clock's chunks),
    # and must have run to count (``held_sizes``); a later round holds longer
    # (``Shape.defer``).
    held_steps: int = HELD_STEPS

    def budget(self, requests: int) -> int:
        """max_new_tokens for each of ``requests`` decoding at once: within the
        context, and within the KV pool, which they fill together (past it the
        scheduler would hold some back or retract them, and the batch would not be
        the one played); each step may take a slot per draft token besides."""
        budget = self.context - self.prompt_tokens - 64
        if self.kv_tokens:
            share = int(self.kv_tokens * 0.8) // max(1, requests)
            budget = min(budget, share - self.prompt_tokens - 2 * self.per_step)
        return max(self.per_step, budget)

    def clock_budget(self, requests: int) -> int:
        """max_new_tokens for the clock: two steps' worth fewer than the others, so
        that it ends first when every request yields as many tokens a step (always,
        without speculative decoding). With it, another may run out first: that
        batch is cut short, seen, and played again."""
        return max(self.per_step, self.budget(requests) - 2 * self.per_step)

    def steps(self, requests: int) -> int:
        """Decode steps the clock surely lasts (the most tokens per step); its first
        token comes from the prefill, not a step."""
        return max(1, (self.clock_budget(requests) - 1) // self.per_step)


# A size costs the clock's chunks between two aborts, and a step where one carried two:
# a first round's (a deferred round holds longer, and runs in more sets of requests).
STEPS_PER_SIZE = HELD_STEPS + 1


def held_sizes(last_steps: Sequence[int | None], *, steps: int = HELD_STEPS) -> set[int]:
    """The decode batch sizes a set of requests surely ran at for ``steps`` steps in
    a row (``HELD_STEPS``), from the decode steps each of them made (``last_steps``,
    read from its end: None where the server did not say). They were taken in
    together, so step ``s`` of each is the batch's.

    A request that made ``e`` steps was in steps 1 to ``e``, and in ``e + 1`` too on
    SGLang 0.5.17's overlap scheduler: it launches the next batch before it processes
    the last, so a request finished there (an abort's ``to_finish``, or its length)
    runs one more forward whose output is dropped; without overlap it does not.
    Either way the sizes the batch ran at, step by step, are the counts
    ``#{e >= s}``, the overlap's one step later each (its first, the full batch, is
    among them): they do not depend on which way the server schedules, nor does how
    many steps each size lasted, but for the full batch's first size, one step longer
    on the overlap scheduler (counted here as without: the fewer). An unknown count
    proves nothing: then no size is."""
    if any(e is None for e in last_steps):
        return set()
    counts = [e for e in last_steps if e is not None]
    runs = Counter(sum(e >= step for e in counts) for step in range(1, max(counts, default=0) + 1))
    return {size for size, run in runs.items() if run >= steps}


# The prompt a batch of requests is taken to have where the KV pool caps the descent:
# a short client request's. (The descent's own prompts are shorter, ``descent_ids``,
# so that the pool's tokens go to decode steps, not to prompts.)
SIZING_PROMPT_TOKENS = 32
DESCENT_PROMPT_IDS = 4


def descent_ids(index: int) -> list[int]:
    """The ``index``th prompt of a descent's batch: ``DESCENT_PROMPT_IDS`` ids, its
    first (98) one no other coverage prompt begins with, so that no other shape's
    cached-token count meets them in the radix cache."""
    return [98, 100 + index % 250, 352, 353][:DESCENT_PROMPT_IDS]


def plan_descent(ctx: ShapeContext) -> Descent:
    """The descent for this server: from its max running requests down, capped at
    ``ctx.descent_cap`` and at the batch its KV pool can hold of short client
    requests (``SIZING_PROMPT_TOKENS``) each lasting long enough to hold one size.

    Its own requests carry ``DESCENT_PROMPT_IDS`` ids each: on a server whose KV pool binds,
    what the prompts do not take goes to decode steps, and a set of requests holds
    more sizes (on the H200, 2026-12-05, the tiny fallback's 8192-token pool and
    32-token text prompts held one size per set at the top: 4,946 requests for 136
    sizes, 11.4 s)."""
    limit = ctx.max_running if ctx.max_running and ctx.max_running > 0 else ctx.max_batch
    top, why = min(limit, ctx.descent_cap), f"the descent's cap ({ctx.descent_cap})"
    per_step = max(1, ctx.tokens_per_step)
    if ctx.kv_tokens:
        # Enough tokens each that the clock surely holds one size.
        steps = DESCENT_SLACK_STEPS + STEPS_PER_SIZE + 4
        need = SIZING_PROMPT_TOKENS + 2 * per_step + steps * per_step
        fits = int(ctx.kv_tokens * 0.8) // need
        if fits < top:
            top, why = fits, f"what the KV pool ({ctx.kv_tokens} tokens) holds at once"
    top = max(1, top)
    context = ctx.context_length if ctx.context_length and ctx.context_length > 0 else 4096
    return Descent(
        top=top,
        context=context,
        per_step=per_step,
        kv_tokens=ctx.kv_tokens,
        prompt_tokens=DESCENT_PROMPT_IDS,
        capped_from=limit if limit > top else None,
        cap_why=why if limit > top else "",
    )


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    endpoint: str
    body: Mapping[str, Any]
    concurrent: int = 1  # copies sent at once (a batch)
    why: str = ""
    # Bodies of the other requests of a mixed batch, when they differ from ``body``.
    batch: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    # Sent as consecutive batches of these sizes (a ramp), not all at once.
    steps: tuple[int, ...] = ()
    # Played as a decode descent (streamed requests, aborted one by one), not as bodies.
    descent: Descent | None = None
    # Played after SGLang's /flush_cache: an empty radix cache and KV allocator, so
    # that its prompts' cached tokens and KV slot offsets are what the shape says.
    flush_first: bool = False
    # A streamed request that decodes beside the waves (``companion``): started first,
    # the waves go out once its first token is in, and it is aborted after them. While
    # it decodes, each step hands out KV slots, so a prefill sent meanwhile starts at an
    # offset no request mix sets on its own (see ``kv_reset_at_finish``). One for each
    # round in turn (``rounds``): round r goes beside ``beside[(r - 1) % len(beside)]``.
    beside: tuple[Mapping[str, Any], ...] = ()
    # The cache entries the shape is played for, as (cache, variant, kernel): where the
    # player can see the unit's caches, a shape whose entries are all there is not
    # played (unless ``always``), and one played is played again, up to ``rounds``
    # times, until they are.
    until: tuple[tuple[str, str, str], ...] = ()
    rounds: int = 1
    # Played even when its ``until`` entries are all there: a shape that is there for
    # variants no start has seen yet (the learned decode descent walks every batch
    # size, not only those learned), where ``until`` says only whether it made those.
    always: bool = False
    # Its rounds after the first go after every other shape, and only where none made
    # its ``until``; a descent's round r holds each size r times as many steps. The
    # learned descent's: it names every variant logged beside a decode batch, most of
    # which later shapes make (rounds in place would replay it for them in vain), and
    # a variant keyed on where a step's KV slots begin meets both alignments at a size
    # only by chance where a trained draft accepts a varying count of tokens a step.
    defer: bool = False

    def bodies(self) -> list[Mapping[str, Any]]:
        if self.batch:
            return list(self.batch)
        return [self.body] * self.concurrent

    def waves(self) -> list[list[Mapping[str, Any]]]:
        """The bodies, in the batches they go out in."""
        bodies = self.bodies()
        if not self.steps:
            return [bodies]
        out, at = [], 0
        for size in self.steps:
            out.append(bodies[at : at + size])
            at += size
        return out


def valid_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name))


def _generate(
    ctx: ShapeContext, text: str | list[str] | None = None, **params: Any
) -> dict[str, Any]:
    sampling = {"max_new_tokens": ctx.max_new_tokens, **params}
    return {"text": text if text is not None else ctx.prompt, "sampling_params": sampling}


def _long_prompt_ids(ctx: ShapeContext) -> list[int]:
    # Token ids, not words: only the server's count matters, and tokens per word vary
    # several-fold between tokenizers (an H200 run's byte-level BPE of 512 tokens made
    # 5239 tokens of 952 words and refused them as longer than the context). Ids 100 to
    # 355 exist in every vocabulary a served model has.
    return [100 + i % 256 for i in range(max(16, ctx.long_prompt_tokens))]


_MIXED = (
    {"temperature": 0.0},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.5},
    {"temperature": 0.8, "min_p": 0.1},
    {"temperature": 0.7, "repetition_penalty": 1.1},
    {"temperature": 0.7, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
)

_BUILTIN: dict[str, tuple[str, Callable[[ShapeContext], Shape]]] = {}


def _builtin(name: str, why: str) -> Callable[[Callable[[ShapeContext], Shape]], None]:
    def register(make: Callable[[ShapeContext], Shape]) -> None:
        _BUILTIN[name] = (why, make)

    return register


def _sampled(name: str, why: str, *, seeded: bool = False, **params: Any) -> None:
    """A built-in shape that is one /generate with these sampling ``params`` (and the
    context's seed after them when ``seeded``)."""

    def make(c: ShapeContext) -> Shape:
        sampling = {**params, "sampling_seed": c.seed} if seeded else params
        return Shape(name, "/generate", _generate(c, **sampling))

    _BUILTIN[name] = (why, make)


_sampled("greedy", "temperature 0: torch.argmax, the path /health_generate takes", temperature=0.0)
_sampled(
    "temperature", "temperature only: the simple multinomial path", seeded=True, temperature=0.8
)
_sampled(
    "top-k", "top_k alone: FlashInfer's top-k sampling", seeded=True, temperature=1.0, top_k=20
)
_sampled(
    "top-p", "top_p alone: FlashInfer's top-p sampling", seeded=True, temperature=1.0, top_p=0.9
)
_sampled(
    "min-p",
    "min_p: top-k and top-p renorm, then FlashInfer's min-p sampling",
    seeded=True,
    temperature=1.0,
    min_p=0.1,
)
_sampled(
    "all-filters",
    "temperature, top_k, top_p and min_p together",
    seeded=True,
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
)
_sampled(
    "repetition-penalty",
    "a penalty: torch inductor compiles on first use",
    temperature=0.7,
    repetition_penalty=1.1,
)
_sampled(
    "frequency-penalty",
    "a penalty: the penalizer's own kernels",
    temperature=0.7,
    frequency_penalty=0.5,
)
_sampled(
    "presence-penalty",
    "a penalty: the penalizer's own kernels",
    temperature=0.7,
    presence_penalty=0.5,
)
_sampled(
    "min-new-tokens",
    "min_new_tokens: a penalizer that masks EOS",
    seeded=True,
    temperature=0.7,
    min_new_tokens=2,
)


@_builtin("logprobs", "return_logprob with top logprobs")
def _(c: ShapeContext) -> Shape:
    body = {**_generate(c, temperature=0.7), "return_logprob": True, "top_logprobs_num": 5}
    return Shape("logprobs", "/generate", body)


_sampled(
    "parallel-n",
    "n > 1: parallel sampling, a batch from one request",
    temperature=0.8,
    top_p=0.9,
    n=4,
)
_sampled("stop-strings", "stop strings", seeded=True, temperature=0.7, stop=["\n\n", " END"])
# A long decode's length: no SGLang 0.5.17 kernel takes a request's length as a
# constexpr; Triton specialises an integer argument on divisibility by 16 (and on 1),
# which a decode passes every 16 tokens, and the paged allocator takes a new page
# every page_size tokens. So: four times past every residue mod 16, and past two of
# the server's KV pages. It was 256 tokens, a guess: on the H100 (2026-12-05) those
# 256 steps took 1.2 to 2.7 s of the coverage and compiled nothing, cold caches or
# wiped ones (``ShapeOutcome.compiled``).
LONG_OUTPUT_MIN_TOKENS = 64


def long_output_tokens(ctx: ShapeContext) -> int:
    """The long output's new tokens, within the server's context (its prompt is short)."""
    want = max(LONG_OUTPUT_MIN_TOKENS, 2 * ctx.page_size)
    if ctx.context_length is not None:
        want = min(want, max(ctx.max_new_tokens, ctx.context_length - 64))
    return want


@_builtin("long-output", "a decode past 16-token boundaries and two KV pages, EOS ignored")
def _(c: ShapeContext) -> Shape:
    body = _generate(
        c, temperature=0.7, top_k=20, max_new_tokens=long_output_tokens(c), ignore_eos=True
    )
    return Shape("long-output", "/generate", body)


@_builtin("long-prompt", "a prompt longer than the server's prefill chunk: chunked prefill")
def _(c: ShapeContext) -> Shape:
    body = {
        "input_ids": _long_prompt_ids(c),
        "sampling_params": {"max_new_tokens": c.max_new_tokens, "temperature": 0.7},
    }
    return Shape("long-prompt", "/generate", body)


_sampled(
    "prefix-repeat",
    "the probe's prompt again: a prefix-cache hit",
    seeded=True,
    temperature=0.7,
    top_k=20,
    top_p=0.8,
)


@_builtin("mixed-batch", "16 concurrent requests with mixed sampling settings")
def _(c: ShapeContext) -> Shape:
    batch = tuple(_generate(c, f"{c.prompt} ({i})", **_MIXED[i % len(_MIXED)]) for i in range(16))
    return Shape("mixed-batch", "/generate", batch[0], concurrent=16, batch=batch)


MAX_RAMP = 256


def _triton_class(size: int) -> str:
    """How Triton specialises an integer argument: 1, a multiple of 16, or other."""
    return "1" if size == 1 else ("d16" if size % 16 == 0 else "any")


def _next_power_of_two(size: int) -> int:
    return 1 << (size - 1).bit_length()


def ramp_sizes(max_batch: int) -> list[int]:
    """Prefill batch sizes, one per (``next_power_of_2``, Triton class) pair up to
    ``max_batch`` (capped at MAX_RAMP), the largest of each: 2, 4, 8, 15, 16, 31, 32,
    ... A prefill batch is taken in once per request, so sizes cannot be stepped
    through as decode batches are (``decode-descent`` plays every decode size); this
    covers the kernels known to key a prefill batch that way, such as EAGLE's
    ``assign_req_to_token_pool``."""
    top = max(2, min(max_batch, MAX_RAMP))
    largest: dict[tuple[int, str], int] = {}
    for size in range(2, top + 1):
        largest[(_next_power_of_two(size), _triton_class(size))] = size
    return sorted(largest.values())


@_builtin("batch-ramp", "one batch per batch-size kernel variant, up to the server's limit")
def _(c: ShapeContext) -> Shape:
    # Kernels specialised on the batch size (the EAGLE-3 draft path's next power of
    # two, Triton's 1 / multiple-of-16 / other). Each size is ONE request carrying that
    # many prompts: SGLang hands a batch request to its scheduler at once, so they run
    # as one batch of exactly that size. Concurrent single requests would not: how
    # many of them share a forward depends on when each arrives (measured: 16 at once
    # ran as batches of 1 and 2 against a fast server). The batches go one after another.
    sizes = ramp_sizes(c.max_batch)
    batch = tuple(
        _generate(
            c, [f"{c.prompt} [{size}.{i}]" for i in range(size)], temperature=0.7,
            max_new_tokens=2,
        )
        for size in sizes
    )  # fmt: skip
    return Shape("batch-ramp", "/generate", batch[0], concurrent=len(batch), batch=batch,
                 steps=(1,) * len(sizes))  # fmt: skip


@_builtin(
    "decode-descent",
    "every decode batch size from the server's max running requests down to 1",
)
def _(c: ShapeContext) -> Shape:
    plan = plan_descent(c)
    body = {
        "input_ids": descent_ids(0),  # each set's requests their own (``descent_ids``)
        "sampling_params": {
            "max_new_tokens": plan.budget(plan.top),  # each set sets its own
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "ignore_eos": True,
        },
        "stream": True,
    }
    return Shape("decode-descent", "/generate", body, concurrent=plan.top, descent=plan)


# Prefill token counts by Triton's integer classes: 1, a multiple of 16, anything else.
ALIGNMENT_TOKENS = (1, 16, 17)


def _fresh_ids(index: int, count: int) -> list[int]:
    """``count`` token ids that share no prefix with any other prompt the coverage
    sends (its own first token, then one no other prompt follows it with), so that
    the radix cache matches nothing and the prefill takes exactly ``count`` new KV
    slots. Ids 100 to 355 exist in every vocabulary a served model has."""
    head = [130 + index % 120, 353]
    return (head + [354] * count)[:count]


COMPANION_TOKENS = 4096  # at most, for a companion's decode (the context caps it)
ALIGNMENT_PLAYS = 12  # plays of each size beside a companion, where ends reset the offset


def companion(ctx: ShapeContext, index: int = 0, *, slots: int = 4) -> dict[str, Any]:
    """A streamed request that decodes for as long as the context lets it (see
    ``Shape.beside``): a prompt no other one shares, sampled, its end ignored.

    Its prompt is ``slots`` ids, the KV slots its prefill takes: that is where the
    first wave's prefill starts. The first token comes from the prefill and the wave
    goes out on it, and the scheduler takes a waiting prefill before any decode step
    (on the H200, 2026-12-05, every wave beside a 4-id companion was prefilled right
    after it, at offset 4, 36 rounds out of 36). A request's first decode step on a
    speculative server takes an even reserve (``get_alloc_reserve_per_decode``: twice
    the per-step length), so even a step between keeps the parity."""
    head = [99, 140 + index % 100, 355, 353]  # 99: no other coverage prompt begins so
    prompt = (head + [354] * max(0, slots - len(head)))[: max(1, slots)]
    room = (ctx.context_length or COMPANION_TOKENS + 64) - len(prompt) - 8
    budget = max(1, min(COMPANION_TOKENS, room))
    sampling = {"max_new_tokens": budget, "temperature": 0.7, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": sampling, "stream": True}


@_builtin(
    "prefill-alignment",
    "each prefill size class at both 16-byte alignments of the KV slots it writes",
)
def _(c: ShapeContext) -> Shape:
    # The KV-store kernels (set_mla_kv_buffer, write_req_to_token_pool_triton, the
    # draft's assign_req_to_token_pool, ...) take out_cache_loc, a slice of the
    # allocator's free slots: Triton specialises a pointer on 16-byte alignment, so an
    # int64 slice starting at an odd offset is a variant of its own. Measured on the
    # H200 (K2, graphs on): a 700-token prompt after an odd count of slots compiled
    # set_mla_kv_buffer_kernel after READY. In SGLang 0.5.17 the offset is the count of
    # slots handed out since the allocator last took slots back (``free`` rebuilds the
    # free list with torch.cat; sglang/srt/mem_cache/allocator/token.py).
    bodies: list[dict[str, Any]] = []
    index = 0

    def prefill(count: int) -> None:
        nonlocal index
        sampling = {"max_new_tokens": 1, "temperature": 0.7}
        bodies.append({"input_ids": _fresh_ids(index, count), "sampling_params": sampling})
        index += 1

    if c.kv_reset_at_finish:
        # Every end takes slots back (speculative decoding), so one prefill after
        # another always starts at offset 0. Beside a companion that decodes, the
        # offset is what its steps took since the last end (the first play: its
        # prompt's 4 slots, the first token coming from its prefill), which varies
        # with how many draft tokens each step accepted and how many steps passed.
        # Each size goes ALIGNMENT_PLAYS times (on the stand-in all 6 variants in 30
        # runs of 30; bench/coverage_alignment.py). What it misses is learned after
        # READY and made, until it is there, at the next start (core/learned_shapes.py).
        for count in ALIGNMENT_TOKENS:
            for _ in range(ALIGNMENT_PLAYS):
                prefill(count)
        batch = tuple(bodies)
        return Shape("prefill-alignment", "/generate", batch[0], concurrent=len(batch),
                     batch=batch, steps=(1,) * len(batch), beside=(companion(c),))  # fmt: skip
    # Without: a prefill alone (max_new_tokens 1, nothing cached) moves the offset by
    # exactly its length. So each size goes twice, with 1 or 2 slots between,
    # whichever makes the second land at the other parity. An eviction (when free
    # slots run out) resets the offset: then the second play may repeat the first's
    # parity, and a later start's learning remains.
    for count in ALIGNMENT_TOKENS:
        prefill(count)
        prefill(1 if count % 2 == 0 else 2)
        prefill(count)
    batch = tuple(bodies)
    return Shape("prefill-alignment", "/generate", batch[0], concurrent=len(batch),
                 batch=batch, steps=(1,) * len(batch))  # fmt: skip


@_builtin("openai-completions", "the OpenAI endpoint, with logit_bias and seed")
def _(c: ShapeContext) -> Shape:
    body = {
        "model": c.model,
        "prompt": c.prompt,
        "max_tokens": c.max_new_tokens,
        "temperature": 0.7,
        "seed": c.seed,
        "logit_bias": {"11": -100, "13": 5},
    }
    return Shape("openai-completions", "/v1/completions", body)


_sampled(
    "json-schema",
    "constrained decoding: the grammar backend compiles the schema",
    temperature=0.7,
    json_schema=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


MAX_PAGE_SIZE = 1024  # a page past this is not believed (the long output would be long)

# SGLang 0.5.17's ``SpeculativeAlgorithm.is_eagle()``: the radix cache's bigram view.
BIGRAM_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "FROZEN_KV_MTP"})


def with_server_facts(ctx: ShapeContext, info: Mapping[str, Any]) -> ShapeContext:
    """``ctx`` with what SGLang's ``/server_info`` says: the prefill chunk (the long
    prompt goes just past it, within the context), how many requests run at once
    (``internal_states[0].effective_max_running_requests_per_dp``, the scheduler's
    own; the server argument may be null), the context length, and the tokens one
    decode step can yield per request (``speculative_num_draft_tokens`` when a
    speculative algorithm runs), and whether its radix cache keys token pairs (an
    EAGLE-family algorithm: ``ShapeContext.radix_bigrams``)."""
    chunk = _positive(info.get("chunked_prefill_size"))
    context = _positive(info.get("context_length"))
    if context is None and (longest := _positive(info.get("max_req_input_len"))) is not None:
        context = longest + 1  # the scheduler's own: the context less one token
    want = ctx.long_prompt_tokens
    if chunk is not None:
        want = chunk + 64
    if context is not None:
        want = min(want, max(16, context - ctx.max_new_tokens - 64))
    running = _positive(info.get("max_running_requests"))
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        running = _positive(states[0].get("effective_max_running_requests_per_dp")) or running
    per_step = 1
    algorithm = str(info.get("speculative_algorithm") or "").upper()
    if algorithm:
        per_step = _positive(info.get("speculative_num_draft_tokens")) or 1
    return replace(
        ctx,
        long_prompt_tokens=want,
        max_batch=running or ctx.max_batch,
        max_running=running,
        context_length=context,
        kv_tokens=_positive(info.get("max_total_num_tokens")),
        tokens_per_step=per_step,
        radix_bigrams=algorithm in BIGRAM_ALGORITHMS,
        # --disable-radix-cache: 0.5.17's ChunkCache frees all of a request's slots
        # at its end (mem_cache/chunk_cache.py), speculative or not.
        kv_reset_at_finish=bool(algorithm) or info.get("disable_radix_cache") is True,
        page_size=min(_positive(info.get("page_size")) or 1, MAX_PAGE_SIZE),
    )


def builtin_shape(name: str, ctx: ShapeContext) -> Shape:
    """Built-in shape ``name`` for ``ctx``; KeyError for an unknown name."""
    return _BUILTIN[name][1](ctx)


def builtin_names() -> tuple[str, ...]:
    return tuple(_BUILTIN)


def describe(name: str) -> str:
    return _BUILTIN[name][0]


@dataclass(frozen=True, slots=True)
class CustomShape:
    """A shape of the operator's own (``[[coverage.custom]]``)."""

    name: str
    endpoint: str
    body: Mapping[str, Any]
    concurrent: int = 1


def expand(names: Sequence[str], custom: Sequence[CustomShape], ctx: ShapeContext) -> list[Shape]:
    """The shapes a unit plays, in order: ``default`` is every built-in shape; other
    names are a built-in or a custom shape. Each appears once. KeyError names an
    unknown one (the config checks names before this runs)."""
    by_name = {c.name: c for c in custom}
    out: dict[str, Shape] = {}
    for name in names:
        if name == DEFAULT_SET:
            for builtin in _BUILTIN:
                out.setdefault(builtin, _BUILTIN[builtin][1](ctx))
        elif name in by_name:
            c = by_name[name]
            out.setdefault(name, Shape(name, c.endpoint, dict(c.body), c.concurrent, "custom"))
        elif name in _BUILTIN:
            out.setdefault(name, _BUILTIN[name][1](ctx))
        else:
            raise KeyError(name)
    # The prefix repeat only hits the cache after its prompt was served once.
    shapes = list(out.values())
    shapes.sort(key=lambda s: s.name == "prefix-repeat")
    return shapes


@dataclass(frozen=True, slots=True)
class ShapeOutcome:
    name: str
    result: ShapeResult
    duration_ms: float
    requests: int
    detail: str | None = None  # the server's answer (refused, failed), or how it went
    # What the unit's JIT caches gained while the shape played, per cache (Triton:
    # variants, one hash directory each; elsewhere files, less their suffixes); None
    # where the caches could not be read. A compile holds the server's scheduler, so
    # it is what this shape's requests made, and where the caches were cold, most of
    # its time (docs/gpu.md).
    compiled: tuple[tuple[str, int], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "result": str(self.result),
            "duration_ms": round(self.duration_ms, 3),
            "requests": self.requests,
            "detail": self.detail,
            "compiled": None if self.compiled is None else dict(self.compiled),
        }


def gained(
    before: Mapping[str, frozenset[str]], after: Mapping[str, frozenset[str]]
) -> tuple[tuple[str, int], ...]:
    """Per cache, how many entries ``after`` has that ``before`` had not (caches that
    gained none left out, names in order)."""
    out = []
    for cache in sorted(after):
        n = len(after[cache] - before.get(cache, frozenset()))
        if n:
            out.append((cache, n))
    return tuple(out)


def add_compiled(
    a: tuple[tuple[str, int], ...] | None, b: tuple[tuple[str, int], ...] | None
) -> tuple[tuple[str, int], ...] | None:
    """Two counts of ``ShapeOutcome.compiled`` summed (a shape's later rounds); None
    where either was not measured."""
    if a is None or b is None:
        return None
    total = dict(a)
    for cache, n in b:
        total[cache] = total.get(cache, 0) + n
    return tuple(sorted(total.items()))


@dataclass(frozen=True, slots=True)
class CoverageReport:
    ok: bool
    at: datetime
    duration_s: float
    shapes: tuple[ShapeOutcome, ...] = field(default_factory=tuple)

    @property
    def failed(self) -> ShapeOutcome | None:
        return next((s for s in self.shapes if s.result is ShapeResult.FAILED), None)

    def summary(self) -> str:
        counts = {r: sum(1 for s in self.shapes if s.result is r) for r in ShapeResult}
        text = (
            f"{counts[ShapeResult.OK]} ok, {counts[ShapeResult.REFUSED]} refused by the "
            f"server's configuration, {counts[ShapeResult.FAILED]} failed, "
            f"in {self.duration_s:.2f} s"
        )
        measured = [s.compiled for s in self.shapes if s.compiled is not None]
        if measured:
            total: Counter[str] = Counter()
            for each in measured:
                total.update(dict(each))
            said = ", ".join(f"{cache} {n}" for cache, n in sorted(total.items())) or "nothing"
            text += f"; compiled: {said}"
        failed = self.failed
        if failed is not None:
            text += f"; {failed.name}: {failed.detail}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "at": self.at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
            "duration_s": round(self.duration_s, 3),
            "shapes": [s.to_json() for s in self.shapes],
        }


def refusal(status: int, message: str) -> bool:
    """An answer by which the server's own configuration declines the feature."""
    return 400 <= status < 500 and status not in (408, 429) and bool(_REFUSALS.search(message))


def judge(status: int | None, message: str, *, shaped: bool) -> ShapeResult:
    """``status`` None: no answer (timeout, dropped connection). ``shaped``: a 200
    whose body is the endpoint's answer shape."""
    if status == 200 and shaped:
        return ShapeResult.OK
    if status is not None and refusal(status, message):
        return ShapeResult.REFUSED
    return ShapeResult.FAILED
