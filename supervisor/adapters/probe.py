"""The sampled probe: proof that an SGLang server can really sample.

SGLang's own ``/health_generate`` asks for one greedy token, which goes through
``torch.argmax`` and never touches FlashInfer's sampling kernels, so it passes
while every real (sampled) request would crash the server. This probe waits for
``/health``, then POSTs ``/generate`` with ``temperature > 0``, ``top_k > 1`` and
``top_p < 1`` (so the top-k/top-p sampling path runs), a few new tokens and a
fixed seed, and passes only on an SGLang-shaped answer with at least one
completion token.

Every failure has one typed reason (``ProbeFailure``); httpx errors are mapped
here and never leak out. The adapter is small on purpose: ``wait_healthy`` and
``sampled_probe`` take an optional ``httpx.AsyncClient`` so tests and the daemon
can share or replace it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from supervisor.core.config import ProbeSection

MAX_BODY_BYTES = 1 << 20  # a few tokens' answer is a few hundred bytes
_SNIPPET = 200
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")


class ProbeFailure(StrEnum):
    CONNECT_REFUSED = "connect-refused"
    HTTP_STATUS = "http-status"
    TIMEOUT = "timeout"
    MALFORMED = "malformed"
    SERVER_DIED = "server-died"
    COVERAGE = "coverage"  # the coverage warm-up after it (adapters/coverage.py)


@dataclass(frozen=True, slots=True)
class ProbeParams:
    """What the probe asks for. Rejects values that would make the request greedy."""

    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    max_new_tokens: int = 4
    seed: int = 1234
    prompt: str = "The capital of France is"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k != -1 and self.top_k <= 1:
            raise ValueError(f"top_k must be > 1 or -1, got {self.top_k}")
        if not 0 < self.top_p < 1:
            raise ValueError(f"top_p must be between 0 and 1 (exclusive), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.prompt:
            raise ValueError("prompt must not be empty")

    @classmethod
    def from_config(cls, section: ProbeSection) -> ProbeParams:
        """What the config's [probe] table asks for: its keys of the same names."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)})

    def sampling_params(self) -> dict[str, Any]:
        """SGLang's ``sampling_params``; its seed key is ``sampling_seed``."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "sampling_seed": self.seed,
        }

    def request_body(self) -> dict[str, Any]:
        return {"text": self.prompt, "sampling_params": self.sampling_params(), "stream": False}


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    reason: ProbeFailure | None
    latency_ms: float | None
    completion_tokens: int | None
    sampling_params: Mapping[str, Any]
    error: str | None
    at: datetime
    url: str
    http_status: int | None = None
    health_wait_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": None if self.reason is None else self.reason.value,
            "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 3),
            "completion_tokens": self.completion_tokens,
            "sampling_params": dict(self.sampling_params),
            "error": self.error,
            "at": self.at.isoformat().replace("+00:00", "Z"),
            "url": self.url,
            "http_status": self.http_status,
            "health_wait_s": None if self.health_wait_s is None else round(self.health_wait_s, 3),
        }


@dataclass(frozen=True, slots=True)
class HealthProgress:
    """One poll of /health while waiting for the model to load."""

    url: str
    attempts: int
    elapsed_s: float
    deadline_s: float
    status: int | None  # the HTTP status of this poll, None if it got no answer
    error: str | None


@dataclass(frozen=True, slots=True)
class HealthResult:
    ok: bool
    reason: ProbeFailure | None  # of the last failed poll, when not ok
    waited_s: float
    attempts: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class _Failure:
    reason: ProbeFailure
    error: str
    status: int | None = None


def _clean(text: str, limit: int = _SNIPPET) -> str:
    text = _CONTROL_RE.sub(" ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _transport_failure(exc: httpx.HTTPError, what: str) -> _Failure:
    detail = _clean(str(exc)) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return _Failure(ProbeFailure.TIMEOUT, f"{what} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError):
        return _Failure(ProbeFailure.CONNECT_REFUSED, f"cannot connect: {detail}")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return _Failure(
            ProbeFailure.SERVER_DIED, f"the server dropped the connection mid-{what}: {detail}"
        )
    return _Failure(ProbeFailure.CONNECT_REFUSED, f"{type(exc).__name__}: {detail}")


def _client(client: httpx.AsyncClient | None) -> httpx.AsyncClient:
    # trust_env=False: a probe of a local server must not go through HTTP_PROXY.
    return client if client is not None else httpx.AsyncClient(trust_env=False)


async def wait_healthy(
    url: str,
    deadline_s: float,
    progress: Callable[[HealthProgress], None] | None = None,
    *,
    client: httpx.AsyncClient | None = None,
    request_timeout_s: float = 5.0,
    poll_initial_s: float = 0.1,
    poll_max_s: float = 2.0,
) -> HealthResult:
    """Poll ``{url}/health`` until it answers 200 or ``deadline_s`` passes.

    A server that is loading refuses connections or answers 503; both are
    retried, with intervals that grow from ``poll_initial_s`` to ``poll_max_s``.
    ``progress`` sees every poll.
    """
    owned = client is None
    http = _client(client)
    started = time.monotonic()
    attempts = 0
    interval = poll_initial_s
    last = _Failure(ProbeFailure.TIMEOUT, f"no answer from /health within {deadline_s:g} s")
    try:
        while True:
            attempts += 1
            remaining = deadline_s - (time.monotonic() - started)
            timeout = max(0.05, min(request_timeout_s, remaining))
            status: int | None = None
            try:
                response = await http.get(f"{url}/health", timeout=timeout)
                status = response.status_code
            except httpx.HTTPError as exc:
                last = _transport_failure(exc, "health check")
            else:
                if status == 200:
                    if progress is not None:
                        elapsed = time.monotonic() - started
                        progress(HealthProgress(url, attempts, elapsed, deadline_s, status, None))
                    return HealthResult(True, None, time.monotonic() - started, attempts)
                last = _Failure(ProbeFailure.HTTP_STATUS, f"/health answered HTTP {status}", status)
            elapsed = time.monotonic() - started
            if progress is not None:
                progress(HealthProgress(url, attempts, elapsed, deadline_s, status, last.error))
            if elapsed >= deadline_s:
                return HealthResult(
                    False,
                    last.reason,
                    elapsed,
                    attempts,
                    f"not healthy within the {deadline_s:g} s startup deadline "
                    f"({attempts} polls); last: {last.error}",
                )
            # Polling a loading server; the last poll lands on the deadline itself.
            await asyncio.sleep(min(interval, max(0.0, deadline_s - elapsed)))
            interval = min(interval * 2, poll_max_s)
    finally:
        if owned:
            await http.aclose()


async def sampled_probe(
    url: str,
    params: ProbeParams,
    timeout_s: float,
    *,
    client: httpx.AsyncClient | None = None,
) -> ProbeResult:
    """One sampled ``/generate``; never raises for anything the server does."""
    owned = client is None
    http = _client(client)
    sampling = MappingProxyType(params.sampling_params())
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            failure, tokens = await _generate(http, url, params, timeout_s)
    except TimeoutError:
        failure = _Failure(ProbeFailure.TIMEOUT, f"no answer within {timeout_s:g} s")
        tokens = None
    finally:
        if owned:
            await http.aclose()
    latency_ms = (time.perf_counter() - started) * 1000.0
    at = datetime.now(UTC)
    if failure is not None:
        return ProbeResult(
            False, failure.reason, latency_ms, None, sampling, failure.error, at, url,
            failure.status,
        )  # fmt: skip
    return ProbeResult(True, None, latency_ms, tokens, sampling, None, at, url, 200)


async def _generate(
    http: httpx.AsyncClient, url: str, params: ProbeParams, timeout_s: float
) -> tuple[_Failure | None, int | None]:
    """POST /generate; (failure, None) or (None, completion_tokens)."""
    status: int | None = None
    body = bytearray()
    try:
        async with http.stream(
            "POST", f"{url}/generate", json=params.request_body(), timeout=timeout_s
        ) as response:
            status = response.status_code
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    why = f"the answer is larger than {MAX_BODY_BYTES} bytes"
                    return _Failure(ProbeFailure.MALFORMED, why, status), None
    except httpx.HTTPError as exc:
        lost = _transport_failure(exc, "request" if status is None else "response")
        return replace(lost, status=status), None
    if status != 200:
        why = f"/generate answered HTTP {status}: {error_text(bytes(body))}"
        return _Failure(ProbeFailure.HTTP_STATUS, why, status), None
    failure, tokens = _check_shape(bytes(body))
    if failure is not None:
        return replace(failure, status=status), None
    return None, tokens


def error_text(
    body: bytes,
    clean: Callable[[str], str] = _clean,
    keys: Sequence[str] = ("error.message", "message", "detail"),
    otherwise: Callable[[dict[str, Any]], str | None] = lambda data: None,
) -> str:
    """What a server's answer says went wrong, on one line: the first string at one of
    ``keys`` (dotted paths into its JSON object), else what ``otherwise`` finds in that
    object, else the whole body. The coverage warm-up shares it with its own keys."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return clean(text) or "(empty body)"
    if isinstance(data, dict):
        for key in keys:
            found: Any = data
            for part in key.split("."):
                found = found.get(part) if isinstance(found, dict) else None
            if isinstance(found, str):
                return clean(found)
        if (other := otherwise(data)) is not None:
            return clean(other)
    return clean(text)


def _check_shape(body: bytes) -> tuple[_Failure | None, int | None]:
    """SGLang's single-prompt answer: {"text": str, "meta_info": {"completion_tokens": n}}."""

    def bad(why: str) -> tuple[_Failure, None]:
        return _Failure(ProbeFailure.MALFORMED, why), None

    try:
        data = json.loads(body)
    except ValueError:
        return bad(f"the answer is not JSON: {_clean(body.decode('utf-8', 'replace'))!r}")
    if not isinstance(data, dict):
        return bad(f"expected a JSON object, got {type(data).__name__}")
    if not isinstance(data.get("text"), str):
        return bad("the answer has no 'text' string")
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        return bad("the answer has no 'meta_info' object")
    tokens = meta.get("completion_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        return bad(f"meta_info.completion_tokens is not an integer: {tokens!r}")
    if tokens < 1:
        return bad(f"the server generated no tokens (completion_tokens={tokens})")
    return None, tokens


async def probe_once(
    url: str,
    params: ProbeParams,
    *,
    startup_deadline_s: float,
    timeout_s: float,
    progress: Callable[[HealthProgress], None] | None = None,
) -> ProbeResult:
    """What ``k26-supervisor probe`` does: wait for /health, then one sampled probe."""
    async with httpx.AsyncClient(trust_env=False) as http:
        health = await wait_healthy(url, startup_deadline_s, progress, client=http)
        if not health.ok:
            assert health.reason is not None
            return ProbeResult(
                False,
                health.reason,
                None,
                None,
                MappingProxyType(params.sampling_params()),
                health.error,
                datetime.now(UTC),
                url,
                health_wait_s=health.waited_s,
            )
        result = await sampled_probe(url, params, timeout_s, client=http)
    return replace(result, health_wait_s=health.waited_s)
