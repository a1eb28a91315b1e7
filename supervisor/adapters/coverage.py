"""The coverage warm-up: every request shape of a unit's set, played once before READY.

``core.coverage`` says which shapes and what an answer means; this adapter asks the
server what the bodies need (its model name, its prefill chunk), sends each
shape's requests (a batch at once where the shape is a batch), times them and
judges each answer. Never raises for anything the server does: a failed shape
is a result, with the server's own words in ``detail``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx

from supervisor.adapters.probe import error_text
from supervisor.core.coverage import (
    CoverageReport,
    Shape,
    ShapeContext,
    ShapeOutcome,
    ShapeResult,
    judge,
)

MAX_BODY_BYTES = 4 << 20
_SNIPPET = 300


def _clean(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SNIPPET else text[: _SNIPPET - 3] + "..."


def _finish_reason(data: dict[str, Any]) -> str | None:
    meta = data.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("finish_reason"), dict):
        return str(meta["finish_reason"].get("message") or meta["finish_reason"])
    return None


def _message(body: bytes) -> str:
    return error_text(body, _clean, ("error.message", "error", "message", "detail"), _finish_reason)


def _shaped(endpoint: str, body: bytes) -> bool:
    """The endpoint's answer shape: /generate's text and meta_info (one, or a list for
    n > 1), OpenAI's choices."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if endpoint == "/generate":
        items = data if isinstance(data, list) else [data]
        return bool(items) and all(
            isinstance(i, dict)
            and isinstance(i.get("text"), str)
            and isinstance(i.get("meta_info"), dict)
            for i in items
        )
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("choices"), list)
        or not data["choices"]
    ):
        return False
    key = "message" if endpoint.endswith("/chat/completions") else "text"
    return all(isinstance(c, dict) and key in c for c in data["choices"])


def _aborted(body: bytes) -> str | None:
    """SGLang reports some refusals as a 200 whose finish_reason is an abort."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    for item in data if isinstance(data, list) else [data]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return _clean(str(finish.get("message") or "aborted"))
    return None


async def _one(
    http: httpx.AsyncClient, url: str, endpoint: str, body: Mapping[str, Any], timeout_s: float
) -> tuple[ShapeResult, str | None]:
    status: int | None = None
    data = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream(
                "POST", f"{url}{endpoint}", json=dict(body), timeout=timeout_s
            ) as response:
                status = response.status_code
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_BODY_BYTES:
                        return ShapeResult.FAILED, f"answer larger than {MAX_BODY_BYTES} bytes"
    except TimeoutError:
        return ShapeResult.FAILED, f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        where = "request" if status is None else "response"
        return ShapeResult.FAILED, f"{type(exc).__name__} during the {where}: {_clean(str(exc))}"
    raw = bytes(data)
    aborted = _aborted(raw) if status == 200 else None
    if aborted is not None:
        result = judge(400, aborted, shaped=False)
        return result, f"aborted: {aborted}"
    result = judge(status, _message(raw), shaped=status == 200 and _shaped(endpoint, raw))
    if result is ShapeResult.OK:
        return result, None
    detail = (
        f"HTTP {status}: {_message(raw)}"
        if status != 200
        else f"not {endpoint}'s answer: {_message(raw)}"
    )
    return result, detail


async def play(
    url: str,
    shapes: Sequence[Shape],
    *,
    timeout_s: float,
    client: httpx.AsyncClient | None = None,
    progress: Any = None,
) -> CoverageReport:
    """Each shape in order, its requests at once; stops at the first failed shape (the
    unit is not ready, and a dying server would only fail the rest)."""
    http = client if client is not None else httpx.AsyncClient(trust_env=False)
    started = time.monotonic()
    outcomes: list[ShapeOutcome] = []
    try:
        for shape in shapes:
            tic = time.perf_counter()
            answers: list[tuple[ShapeResult, str | None]] = []
            for wave in shape.waves():
                answers += await asyncio.gather(
                    *(_one(http, url, shape.endpoint, b, timeout_s) for b in wave)
                )
            took_ms = (time.perf_counter() - tic) * 1000.0
            worst = max(answers, key=lambda a: _RANK[a[0]])
            outcome = ShapeOutcome(shape.name, worst[0], took_ms, len(answers), worst[1])
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
            if outcome.result is ShapeResult.FAILED:
                break
    finally:
        if client is None:
            await http.aclose()
    ok = all(o.result is not ShapeResult.FAILED for o in outcomes)
    return CoverageReport(ok, datetime.now(UTC), time.monotonic() - started, tuple(outcomes))


_RANK = {ShapeResult.OK: 0, ShapeResult.REFUSED: 1, ShapeResult.FAILED: 2}


async def server_context(
    url: str, base: ShapeContext, *, client: httpx.AsyncClient, timeout_s: float = 10.0
) -> ShapeContext:
    """The bodies' facts from the server: its served model name, and a long prompt
    just past its prefill chunk (SGLang's /get_server_info), within its context."""
    ctx = base
    info = await _get_json(client, f"{url}/get_server_info", timeout_s)
    if isinstance(info, dict):
        chunk = info.get("chunked_prefill_size")
        context = info.get("context_length") or info.get("max_total_num_tokens")
        want = ctx.long_prompt_tokens
        if isinstance(chunk, int) and chunk > 0:
            want = chunk + 64
        if isinstance(context, int) and context > 0:
            want = min(want, max(16, context - ctx.max_new_tokens - 64))
        ctx = replace(ctx, long_prompt_tokens=want)
        running = info.get("max_running_requests")
        if isinstance(running, int) and running > 0:
            ctx = replace(ctx, max_batch=running)
    return replace(ctx, model=await served_model(url, client=client, timeout_s=timeout_s))


async def served_model(url: str, *, client: httpx.AsyncClient, timeout_s: float = 10.0) -> str:
    """The model name the OpenAI endpoints answer to (``/v1/models``), else "default"."""
    models = await _get_json(client, f"{url}/v1/models", timeout_s)
    if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        first = models["data"][0]
        if isinstance(first, dict) and isinstance(first.get("id"), str):
            return str(first["id"])
    return "default"


async def _get_json(client: httpx.AsyncClient, url: str, timeout_s: float) -> Any:
    try:
        response = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None
