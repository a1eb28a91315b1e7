"""The sampled probe against real HTTP servers on localhost.

``FakeSGLang`` is a deliberately small asyncio HTTP/1.1 server that can answer
each way a real server goes wrong (bad status, bad body, hang, dying mid-request).
At the end, the real stand-in (``python -m k26dev.standin``) is probed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from k26dev.ports import free_port
from supervisor.adapters.probe import (
    HealthProgress,
    ProbeFailure,
    ProbeParams,
    probe_once,
    sampled_probe,
    wait_healthy,
)
from supervisor.core.config import ProbeSection
from tests.unit.k26dev.test_standin import QUICK

ROOT = Path(__file__).resolve().parents[3]
SGLANG_OK = {
    "text": " Paris, the",
    "output_ids": [1, 2, 3, 4],
    "meta_info": {"id": "x", "prompt_tokens": 5, "completion_tokens": 4, "finish_reason": None},
}

Handler = Callable[["Request", asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    body: bytes


@dataclass
class FakeSGLang:
    """Routes: health answers come from ``health`` in turn (the last repeats)."""

    generate: Handler
    health: list[int] = field(default_factory=lambda: [200])
    requests: list[Request] = field(default_factory=list)
    port: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()  # fully closed before the test's loop ends

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        request = Request(method, path, body)
        self.requests.append(request)
        if path == "/health":
            status = self.health.pop(0) if len(self.health) > 1 else self.health[0]
            await respond(writer, status, b"")
        else:
            await self.generate(request, writer)


async def respond(
    writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json"
) -> None:
    writer.write(
        f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()


def answer(status: int, payload: Any) -> Handler:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()

    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        await respond(writer, status, raw)

    return handler


async def hang(request: Request, writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()  # until the server is closed


async def die(request: Request, writer: asyncio.StreamWriter) -> None:
    # Like a process killed mid-request: the kernel resets the connection.
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()


async def die_after_headers(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"text": ')
    await writer.drain()
    writer.transport.abort()


async def huge(request: Request, writer: asyncio.StreamWriter) -> None:
    await respond(writer, 200, b" " * (2 << 20))


@contextlib.asynccontextmanager
async def fake_server(
    generate: Handler, health: list[int] | None = None
) -> AsyncIterator[FakeSGLang]:
    fake = FakeSGLang(generate, health or [200])
    server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    try:
        yield fake
    finally:
        server.close()
        for task in fake.tasks:
            task.cancel()
        await asyncio.gather(*fake.tasks, return_exceptions=True)
        await server.wait_closed()


PARAMS = ProbeParams()


# --- parameters ---------------------------------------------------------------------


def test_params_are_sampled_not_greedy() -> None:
    sampling = PARAMS.sampling_params()
    assert sampling["temperature"] > 0
    assert sampling["top_k"] > 1
    assert 0 < sampling["top_p"] < 1
    assert sampling["sampling_seed"] == 1234  # SGLang's key; "seed" would be an HTTP 500
    assert PARAMS.request_body()["stream"] is False


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0.0}, {"top_k": 1}, {"top_k": 0}, {"top_p": 1.0}, {"top_p": 0.0},
     {"max_new_tokens": 0}, {"seed": -1}, {"prompt": ""}, {"temperature": float("nan")}],
)  # fmt: skip
def test_params_refuse_greedy_or_empty_requests(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ProbeParams(**kwargs)


def test_params_from_config() -> None:
    params = ProbeParams.from_config(ProbeSection(temperature=0.9, top_k=-1, seed=7))
    assert params.sampling_params()["top_k"] == -1
    assert params.seed == 7 and params.temperature == 0.9


# --- the sampled probe ----------------------------------------------------------------


async def test_a_good_answer_passes_and_sends_the_sampling_params() -> None:
    async with fake_server(answer(200, SGLANG_OK)) as fake:
        result = await sampled_probe(fake.url, PARAMS, timeout_s=5)
    assert result.ok, result.error
    assert result.reason is None and result.error is None
    assert result.completion_tokens == 4
    assert result.latency_ms is not None and result.latency_ms > 0
    sent = json.loads(fake.requests[0].body)
    assert fake.requests[0].path == "/generate"
    assert sent["text"] == PARAMS.prompt
    assert sent["sampling_params"] == PARAMS.sampling_params()
    doc = result.to_json()
    assert doc["ok"] is True and doc["error"] is None
    assert doc["sampling_params"]["top_p"] == 0.8
    assert set(doc) >= {"ok", "latency_ms", "completion_tokens", "sampling_params", "error"}
    json.dumps(doc)


@pytest.mark.parametrize(
    ("handler", "reason", "needle"),
    [
        (answer(500, b"Internal Server Error"), ProbeFailure.HTTP_STATUS, "HTTP 500"),
        (
            answer(400, {"error": {"message": "top_k must be -1 or at least 1"}}),
            ProbeFailure.HTTP_STATUS,
            "top_k must be",
        ),
        (answer(503, {"error": {"message": "still loading"}}), ProbeFailure.HTTP_STATUS, "503"),
        (answer(200, b"<html>hello</html>"), ProbeFailure.MALFORMED, "not JSON"),
        (answer(200, [SGLANG_OK]), ProbeFailure.MALFORMED, "JSON object"),
        (answer(200, {"meta_info": {"completion_tokens": 4}}), ProbeFailure.MALFORMED, "'text'"),
        (answer(200, {"text": "x"}), ProbeFailure.MALFORMED, "meta_info"),
        (
            answer(200, {"text": "", "meta_info": {"completion_tokens": 0}}),
            ProbeFailure.MALFORMED,
            "no tokens",
        ),
        (
            answer(200, {"text": "x", "meta_info": {"completion_tokens": "4"}}),
            ProbeFailure.MALFORMED,
            "not an integer",
        ),
        (
            answer(200, {"text": "x", "meta_info": {"completion_tokens": True}}),
            ProbeFailure.MALFORMED,
            "not an integer",
        ),
        (huge, ProbeFailure.MALFORMED, "larger than"),
        (die, ProbeFailure.SERVER_DIED, "dropped the connection"),
        (die_after_headers, ProbeFailure.SERVER_DIED, "mid-response"),
    ],
    ids=lambda v: getattr(v, "__name__", None) or str(v)[:20],
)
async def test_each_bad_answer_has_its_typed_reason(
    handler: Handler, reason: ProbeFailure, needle: str
) -> None:
    async with fake_server(handler) as fake:
        result = await sampled_probe(fake.url, PARAMS, timeout_s=5)
    assert not result.ok
    assert result.reason is reason, result.error
    assert result.error is not None and needle in result.error
    assert result.completion_tokens is None
    assert result.to_json()["reason"] == reason.value


async def test_a_server_that_never_answers_times_out() -> None:
    async with fake_server(hang) as fake:
        result = await sampled_probe(fake.url, PARAMS, timeout_s=0.3)
    assert result.reason is ProbeFailure.TIMEOUT
    assert result.latency_ms is not None and result.latency_ms >= 250


async def test_nothing_listening_is_connect_refused() -> None:
    result = await sampled_probe(f"http://127.0.0.1:{free_port()}", PARAMS, timeout_s=5)
    assert result.reason is ProbeFailure.CONNECT_REFUSED
    assert result.error is not None and "cannot connect" in result.error


async def test_error_text_from_the_server_cannot_forge_lines() -> None:
    async with fake_server(answer(500, b"boom\r\nX-Injected: yes\x1b[31m")) as fake:
        result = await sampled_probe(fake.url, PARAMS, timeout_s=5)
    assert result.error is not None
    assert "\n" not in result.error and "\x1b" not in result.error


async def test_proxy_settings_are_ignored_for_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{free_port()}")
    async with fake_server(answer(200, SGLANG_OK)) as fake:
        result = await sampled_probe(fake.url, PARAMS, timeout_s=5)
    assert result.ok, result.error


# --- waiting for /health ----------------------------------------------------------------


async def test_wait_healthy_polls_through_a_load_and_reports_progress() -> None:
    seen: list[HealthProgress] = []
    async with fake_server(answer(200, SGLANG_OK), health=[503, 503, 503, 200]) as fake:
        result = await wait_healthy(fake.url, 10, seen.append, poll_initial_s=0.01)
    assert result.ok and result.attempts == 4
    assert [p.status for p in seen] == [503, 503, 503, 200]
    assert seen[0].error == "/health answered HTTP 503"
    assert seen[-1].attempts == 4 and seen[-1].deadline_s == 10


async def test_wait_healthy_gives_up_at_the_deadline_with_the_last_reason() -> None:
    async with fake_server(answer(200, SGLANG_OK), health=[503]) as fake:
        result = await wait_healthy(fake.url, 0.3, poll_initial_s=0.01, poll_max_s=0.05)
    assert not result.ok
    assert result.reason is ProbeFailure.HTTP_STATUS
    assert result.error is not None and "0.3 s startup deadline" in result.error
    assert result.waited_s < 2


async def test_wait_healthy_keeps_trying_while_nothing_listens() -> None:
    result = await wait_healthy(f"http://127.0.0.1:{free_port()}", 0.2, poll_initial_s=0.01)
    assert not result.ok and result.reason is ProbeFailure.CONNECT_REFUSED
    assert result.attempts >= 2


async def test_probe_once_waits_then_probes() -> None:
    async with fake_server(answer(200, SGLANG_OK), health=[503, 200]) as fake:
        result = await probe_once(fake.url, PARAMS, startup_deadline_s=10, timeout_s=5)
    assert result.ok
    assert result.health_wait_s is not None
    assert [r.path for r in fake.requests] == ["/health", "/health", "/generate"]


async def test_probe_once_reports_a_server_that_never_became_healthy() -> None:
    async with fake_server(answer(200, SGLANG_OK), health=[503]) as fake:
        result = await probe_once(fake.url, PARAMS, startup_deadline_s=0.2, timeout_s=5)
    assert not result.ok and result.reason is ProbeFailure.HTTP_STATUS
    assert result.error is not None and "startup deadline" in result.error
    assert all(r.path == "/health" for r in fake.requests)


# --- the real stand-in ---------------------------------------------------------------------


@contextlib.contextmanager
def standin(*args: str, stop_s: float = 10) -> Iterator[str]:
    """Start ``python -m k26dev.standin --port 0`` and yield its URL. SGLang's 5 s
    SIGTERM poll and 5 s pause before crash diagnostics are shortened (a hung or
    crashed stand-in would hold each test that long). A server that holds a hung
    request never finishes draining after SIGTERM (SGLang waits for every request),
    so it gets ``stop_s`` before SIGKILL."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "k26dev.standin", "--port", "0", *QUICK, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the stand-in prints its address
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                yield match.group(1)
                break
        else:
            pytest.fail(f"the stand-in exited without listening (status {proc.wait()})")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def test_standin_passes_after_loading() -> None:
    with standin("--load-seconds", "0.5") as url:
        result = await probe_once(url, PARAMS, startup_deadline_s=30, timeout_s=10)
    assert result.ok, result.error
    assert result.completion_tokens == PARAMS.max_new_tokens


async def test_standin_sampling_arch_crash_is_server_died() -> None:
    with standin("--fail", "sampling-arch") as url:
        result = await probe_once(url, PARAMS, startup_deadline_s=30, timeout_s=10)
    assert not result.ok
    assert result.reason is ProbeFailure.SERVER_DIED, result.error


async def test_standin_sampled_hang_is_a_timeout() -> None:
    with standin("--fail", "sampled-hang", stop_s=0.5) as url:
        result = await probe_once(url, PARAMS, startup_deadline_s=30, timeout_s=0.5)
    assert result.reason is ProbeFailure.TIMEOUT, result.error
