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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
_sampled(
    "long-output",
    "256 new tokens, EOS ignored: long decodes",
    temperature=0.7,
    top_k=20,
    max_new_tokens=256,
    ignore_eos=True,
)


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
    """One batch size for each kernel variant a batch size can select, up to
    ``max_batch`` (capped at MAX_RAMP): SGLang's draft-path kernels take
    ``next_power_of_2(num_seqs)`` as a constexpr and ``num_seqs`` as an integer
    Triton specialises (1, a multiple of 16, other). On the H200 a ramp of powers of
    two left the bucket of 16 with 12 sequences to compile under traffic; each
    (bucket, class) pair gets its largest size here: 2, 4, 8, 15, 16, 31, 32, ..."""
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
    detail: str | None = None  # the server's answer, for refused and failed shapes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "result": str(self.result),
            "duration_ms": round(self.duration_ms, 3),
            "requests": self.requests,
            "detail": self.detail,
        }


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
