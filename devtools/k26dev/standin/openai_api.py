"""The stand-in's OpenAI ``/v1/completions`` and its logprobs, in SGLang 0.5.17's shapes.

SGLang serves OpenAI's completions API on the same engine as ``/generate``
(``srt/entrypoints/openai/serving_completions.py``): ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``logit_bias`` and friends become its sampling parameters, and
the answer is ``{"id", "object": "text_completion", "created", "model", "choices":
[{"index", "text", "logprobs", "finish_reason"}], "usage"}``. Standard library only.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k26dev.standin import model


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    sampling_params: dict[str, Any]
    n: int = 1


def parse_completion(body: object) -> CompletionRequest:
    """The request, as SGLang's pydantic model takes it; ValueError names what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("Input should be a valid dictionary or object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("prompt: Input should be a valid string")
    params: dict[str, Any] = {}
    for ours, theirs in (
        ("max_new_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("sampling_seed", "seed"),
        ("logit_bias", "logit_bias"),
        ("stop", "stop"),
    ):
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    bias = params.get("logit_bias")
    if bias is not None and not (
        isinstance(bias, dict) and all(isinstance(v, int | float) for v in bias.values())
    ):
        raise ValueError("logit_bias: Input should be a valid dictionary of token id to bias")
    n = body.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError("n: Input should be a positive integer")
    return CompletionRequest(prompt, params, n)


def completion_response(
    model_name: str, request: CompletionRequest, ids: Sequence[int]
) -> dict[str, Any]:
    prompt_tokens = len(model.tokenize(request.prompt))
    return {
        "id": uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {"index": 0, "text": model.detokenize(ids), "logprobs": None, "finish_reason": "length",
             "matched_stop": None}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
        },
    }  # fmt: skip


def logprobs(ids: Sequence[int], top: object) -> dict[str, Any]:
    """``/generate``'s meta_info with ``return_logprob``: ``[logprob, token_id, text]``
    per output token (the text None unless asked), and the top ones per position."""
    count = top if isinstance(top, int) and top > 0 else 0
    value = math.log(1.0 / max(2, model.VOCAB_SIZE // 8))
    out: dict[str, Any] = {
        "input_token_logprobs": [],
        "output_token_logprobs": [[value, i, None] for i in ids],
    }
    if count:
        out["output_top_logprobs"] = [
            [[value, (i + k) % model.VOCAB_SIZE, None] for k in range(count)] for i in ids
        ]
    return out
