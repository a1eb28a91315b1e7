"""The stand-in's "model": a 64-word vocabulary and SGLang's sampling semantics.

Generation is a deterministic toy: each step draws logits from a PRNG seeded by
the previous token and the position, then decodes them the way SGLang would.
What matters is the parameter handling, copied from SGLang's ``SamplingParams``
(``python/sglang/srt/sampling/sampling_params.py``; see docs/sglang-shapes.md):

* a temperature below ``1e-6`` becomes ``top_k = 1`` (greedy), ``top_k = -1``
  becomes the whole vocabulary, and a batch whose ``top_k`` are all ``<= 1`` is
  "all greedy" and takes the argmax path; anything else is *sampled* and, on a
  real server, runs FlashInfer's sampling kernels;
* ``verify()``'s ranges raise ``ValueError`` (HTTP 400 with ``{"error": ...}``);
* an unknown key is a ``TypeError`` inside SGLang (``SamplingParams(**params)``),
  which FastAPI turns into a bare HTTP 500. The seed key is ``sampling_seed``;
  ``seed`` is the OpenAI API's name and the native ``/generate`` rejects it.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
CONTEXT_LEN = 4096
DEFAULT_MAX_NEW_TOKENS = 128

VOCAB: tuple[str, ...] = (
    "the", "a", "model", "server", "token", "sample", "probe", "unit", "ready", "warm",
    "cache", "kernel", "gpu", "memory", "batch", "queue", "river", "stone", "light", "quiet",
    "north", "south", "east", "west", "green", "blue", "red", "amber", "fast", "slow",
    "small", "large", "open", "closed", "early", "late", "bright", "dark", "one", "two",
    "three", "four", "five", "seven", "nine", "ten", "and", "or", "but", "so",
    "then", "now", "here", "there", "always", "never", "again", "still", "up", "down",
    "in", "out", "on", ".",
)  # fmt: skip
VOCAB_SIZE = len(VOCAB)

# SamplingParams' API fields (SGLang 0.5.x). Anything else is a TypeError there.
KNOWN_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
        "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
    }
)  # fmt: skip


class RequestError(ValueError):
    """A request SGLang rejects with ``ValueError``: HTTP 400, ``{"error": {...}}``."""


class InternalServerError(TypeError):
    """A request that raises a non-ValueError inside SGLang: a bare HTTP 500."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    sampling_seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        """SGLang's ``is_all_greedy`` test for this one request (``top_k <= 1``)."""
        return self.top_k <= 1


def _number(params: Mapping[str, object], key: str, default: float) -> float:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InternalServerError(f"'<' not supported for {key}={value!r}")
    return float(value)


def _integer(params: Mapping[str, object], key: str, default: int | None) -> int | None:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InternalServerError(f"{key} must be an integer, got {value!r}")
    return value


def parse_sampling_params(raw: object) -> SamplingParams:
    """Normalise and verify ``sampling_params`` as SGLang does."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InternalServerError("sampling_params must be an object")
    unknown = sorted(set(raw) - KNOWN_SAMPLING_KEYS)
    if unknown:
        raise InternalServerError(f"Unexpected keyword argument {unknown[0]!r}")
    temperature = _number(raw, "temperature", 1.0)
    top_p = _number(raw, "top_p", 1.0)
    min_p = _number(raw, "min_p", 0.0)
    top_k = _integer(raw, "top_k", -1)
    assert top_k is not None
    max_new_tokens = _integer(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    seed = _integer(raw, "sampling_seed", None)
    if 0 <= temperature < SAMPLING_EPS:
        temperature, top_k = 1.0, 1  # greedy
    if top_k == -1:
        top_k = TOP_K_ALL
    if not math.isfinite(temperature) or temperature < 0.0:
        raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new_tokens is None:
        max_new_tokens = CONTEXT_LEN
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    return SamplingParams(max_new_tokens, temperature, top_p, top_k, min_p, seed)


def tokenize(text: str) -> list[int]:
    """Words in the vocabulary map to themselves; others hash into it."""
    ids: list[int] = []
    for word in text.split():
        try:
            ids.append(VOCAB.index(word))
        except ValueError:
            ids.append(zlib.crc32(word.encode()) % VOCAB_SIZE)
    return ids


def detokenize(ids: Sequence[int]) -> str:
    return "".join(" " + VOCAB[i % VOCAB_SIZE] for i in ids)


def _logits(previous: int, position: int) -> list[float]:
    rng = random.Random(previous * 1_000_003 + position)
    return [rng.gauss(0.0, 2.0) for _ in range(VOCAB_SIZE)]


def _sample(logits: list[float], params: SamplingParams, rng: random.Random) -> int:
    peak = max(logits)
    weights = [math.exp((x - peak) / params.temperature) for x in logits]
    total = sum(weights)
    ranked = sorted(range(VOCAB_SIZE), key=lambda i: weights[i], reverse=True)
    ranked = ranked[: min(params.top_k, VOCAB_SIZE)]
    # top-p and min-p on the original probabilities, jointly (as the kernel does).
    kept: list[int] = []
    mass = 0.0
    for i in ranked:
        kept.append(i)
        mass += weights[i] / total
        if mass >= params.top_p:
            break
    floor = params.min_p * weights[ranked[0]]
    kept = [i for i in kept if weights[i] >= floor] or kept[:1]
    return rng.choices(kept, weights=[weights[i] for i in kept])[0]


def generate(prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """The completion's token ids. Greedy is the argmax; sampled requests repeat
    exactly for the same ``sampling_seed`` and differ without one."""
    if len(prompt_ids) >= CONTEXT_LEN:
        raise RequestError(
            f"The input ({len(prompt_ids)} tokens) is longer than the model's context "
            f"length ({CONTEXT_LEN} tokens)."
        )
    budget = min(params.max_new_tokens, CONTEXT_LEN - len(prompt_ids))
    rng = random.Random(params.sampling_seed)
    previous = (sum(prompt_ids) + len(prompt_ids)) % VOCAB_SIZE
    out: list[int] = []
    for position in range(budget):
        logits = _logits(previous, len(prompt_ids) + position)
        if params.is_greedy:
            token = max(range(VOCAB_SIZE), key=logits.__getitem__)
        else:
            token = _sample(logits, params, rng)
        out.append(token)
        previous = token
    return out
