"""StatusServer against real sockets on localhost: endpoints, limits, hostile clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.adapters.http import StatusServer
from supervisor.adapters.metrics import build_registry
from supervisor.commands.status import listen_url
from supervisor.core.config import parse_config
from supervisor.core.errors import ConfigError, OSLevelError
from supervisor.core.status import ProbeInfo, StatusBoard, utc_now

DEADLINE_S = 5.0
READ_TIMEOUT_S = 0.3
_MIN_CONFIG = {
    "flashinfer": {"enabled": False},
    "units": [
        {"name": "sglang-k26.service", "role": "autoregressive", "url": "http://127.0.0.1:1"}
    ],
}


@pytest.fixture
def board() -> StatusBoard:
    board = StatusBoard(version="0.1.0", config_path="/etc/k26/supervisor.toml")
    board.add_unit("sglang-k26.service", "autoregressive")
    board.add_unit("sglang-k26-fallback.service", "fallback", state="standby")
    board.set_state("sglang-k26.service", "ready")
    board.record_probe("sglang-k26.service", ProbeInfo(True, utc_now(), 12.3, None, 4))
    return board


async def _started(
    board: StatusBoard,
    *,
    read_timeout_s: float = READ_TIMEOUT_S,
    write_timeout_s: float = 10.0,
    max_connections: int = 256,
) -> StatusServer:
    server = StatusServer(
        "127.0.0.1:0",
        lambda: board.snapshot().to_json(),
        build_registry(board),
        read_timeout_s=read_timeout_s,
        write_timeout_s=write_timeout_s,
        linger_s=0.2,
        max_connections=max_connections,
    )
    await server.start()
    return server


@pytest.fixture
async def server(board: StatusBoard) -> AsyncIterator[StatusServer]:
    server = await _started(board)
    yield server
    await server.close()


@pytest.fixture
async def client(server: StatusServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        yield client


class Response:
    def __init__(self, head: bytes, body: bytes) -> None:
        status_line, *lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split(" ")[1])
        self.headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines if ln)}
        self.body = body


async def _read_response(reader: asyncio.StreamReader, *, head_only: bool = False) -> Response:
    async with asyncio.timeout(DEADLINE_S):
        head = (await reader.readuntil(b"\r\n\r\n"))[:-4]
        response = Response(head, b"")
        if not head_only:
            response.body = await reader.readexactly(int(response.headers["content-length"]))
        return response


async def _exchange(port: int, data: bytes) -> tuple[Response | None, bytes]:
    """Send raw bytes; return the first response (if any) and everything after it up to EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(DEADLINE_S):
            raw = await reader.read(-1)
    finally:
        writer.close()
    if not raw:
        return None, b""
    head, _, rest = raw.partition(b"\r\n\r\n")
    response = Response(head, b"")
    length = int(response.headers.get("content-length", "0"))
    response.body, rest = rest[:length], rest[length:]
    return response, rest


async def _healthy(port: int) -> bool:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/healthz")
    return response.status_code == 200 and response.text == "ok\n"


# --- endpoints ---------------------------------------------------------------


async def test_status_is_the_board_as_json(client: httpx.AsyncClient, board: StatusBoard) -> None:
    response = await client.get("/status")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == board.snapshot().to_json()
    assert response.json()["units"]["sglang-k26.service"]["ready"] is True


async def test_metrics_is_prometheus_text(client: httpx.AsyncClient) -> None:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert {"k26_build_info", "k26_unit_state", "process_cpu_seconds"} <= names


async def test_metrics_speaks_openmetrics_when_asked(client: httpx.AsyncClient) -> None:
    accept = "application/openmetrics-text; version=1.0.0"
    response = await client.get("/metrics", headers={"Accept": accept})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")


async def test_healthz_reports_loop_lag(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.text == "ok\n"
    assert 0.0 <= float(response.headers["x-loop-lag-seconds"]) < DEADLINE_S


@pytest.mark.parametrize("path", ["/status", "/metrics", "/healthz"])
async def test_head_has_headers_but_no_body(server: StatusServer, path: str) -> None:
    get, _ = await _exchange(
        server.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    head, rest = await _exchange(
        server.port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert get is not None and head is not None
    assert head.status == 200
    assert head.headers["content-type"] == get.headers["content-type"]
    assert int(head.headers["content-length"]) > 0
    assert head.body == b"" and rest == b""


@pytest.mark.parametrize("target", ["/status?pretty=1", "/healthz?", "http://localhost/healthz"])
async def test_query_strings_and_absolute_targets(client: httpx.AsyncClient, target: str) -> None:
    server_port = client.base_url.port
    response, _ = await _exchange(
        server_port or 0, f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert response is not None and response.status == 200


@pytest.mark.parametrize(
    "path",
    ["/", "/status/", "/status/../metrics", "/%73tatus", "/STATUS", "/metricsx", "*", "status"],
)
async def test_unknown_paths_are_404(server: StatusServer, path: str) -> None:
    response, _ = await _exchange(
        server.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert response is not None and response.status == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"])
async def test_other_methods_are_405_with_allow(server: StatusServer, method: str) -> None:
    response, _ = await _exchange(
        server.port, f"{method} /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert response is not None and response.status == 405
    assert response.headers["allow"] == "GET, HEAD"


async def test_post_with_a_body_is_answered_and_closed(server: StatusServer) -> None:
    body = b"x" * 100_000
    request = b"POST /status HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    response, rest = await _exchange(server.port, request)
    assert response is not None and response.status == 405
    assert response.headers["connection"] == "close"
    assert rest == b""


async def test_status_fn_failure_is_500_and_the_server_lives(board: StatusBoard) -> None:
    def broken() -> Mapping[str, object]:
        raise RuntimeError("board exploded")

    server = StatusServer("127.0.0.1:0", broken, build_registry(board))
    await server.start()
    try:
        response, _ = await _exchange(
            server.port, b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert response is not None and response.status == 500
        assert await _healthy(server.port)
    finally:
        await server.close()


# --- connections -------------------------------------------------------------


async def test_keep_alive_and_pipelining(server: StatusServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        first = await _read_response(reader)
        second = await _read_response(reader)
        writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        third = await _read_response(reader)
        assert [first.status, second.status, third.status] == [200, 200, 200]
        assert first.headers["connection"] == "keep-alive"
        assert json.loads(third.body)["ready"] is False
    finally:
        writer.close()


@pytest.mark.parametrize("connection", [b"", b"Connection: keep-alive\r\n"])
async def test_http_1_0_is_served_without_host_and_closed(
    server: StatusServer, connection: bytes
) -> None:
    # h11 never keeps an HTTP/1.0 connection alive, even when asked to.
    response, rest = await _exchange(
        server.port, b"GET /healthz HTTP/1.0\r\n" + connection + b"\r\n"
    )
    assert response is not None and response.status == 200
    assert response.headers["connection"] == "close"
    assert rest == b""


async def test_idle_connection_is_closed_silently(server: StatusServer) -> None:
    response, _ = await _exchange(server.port, b"")
    assert response is None


async def test_idle_after_an_answer_is_closed_silently(server: StatusServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader)).status == 200
        async with asyncio.timeout(DEADLINE_S):
            assert await reader.read(-1) == b""  # after read_timeout_s: no 408, just EOF
    finally:
        writer.close()


async def test_a_second_head_left_unfinished_gets_408(server: StatusServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /status HTTP/1.1\r\n")
        assert (await _read_response(reader)).status == 200
        async with asyncio.timeout(DEADLINE_S):
            assert (await reader.read(-1)).startswith(b"HTTP/1.1 408 ")
    finally:
        writer.close()


async def test_slow_client_gets_408_after_the_read_timeout(server: StatusServer) -> None:
    started = time.monotonic()
    response, _ = await _exchange(server.port, b"GET /status HTTP/1.1\r\nHost: slo")
    assert response is not None and response.status == 408
    assert time.monotonic() - started >= READ_TIMEOUT_S * 0.9


async def test_dribbling_bytes_does_not_extend_the_deadline(server: StatusServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)

    async def drip() -> None:
        writer.write(b"GET /status HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError):
            while True:
                await asyncio.sleep(READ_TIMEOUT_S / 10)  # the client's pace, not a wait
                writer.write(b"X-Drip: 1\r\n")
                await writer.drain()

    started = time.monotonic()
    dripping = asyncio.create_task(drip())
    try:
        async with asyncio.timeout(DEADLINE_S):
            answer = await reader.read(-1)
    finally:
        dripping.cancel()
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < READ_TIMEOUT_S * 5


async def test_a_client_that_never_reads_is_cut_off(board: StatusBoard) -> None:
    server = await _started(board, write_timeout_s=READ_TIMEOUT_S)
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 100

    async def pipeline_forever() -> None:
        while True:  # never reads: the server's sends back up until its write timeout
            writer.write(request)
            await writer.drain()

    try:
        async with asyncio.timeout(DEADLINE_S):
            with pytest.raises(ConnectionError):
                await pipeline_forever()
        assert await _healthy(server.port)
    finally:
        writer.close()
        await server.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /status\r\n\r\n",
        b"GET /status HTTP/1.1 extra\r\n\r\n",
        b"GET  /status HTTP/1.1\r\n\r\n",
        b"GET /status HTTP/1.x\r\n\r\n",
        b"\x00\xff\xfe\xfd\r\n\r\n",
        b"GET /st\xc3\xa4tus HTTP/1.1\r\n\r\n",
        b"GET /status HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
        b"GET /status HTTP/1.1\r\nHost: x\r\nBad Name: x\r\n\r\n",
        b"GET /status HTTP/1.1\r\n folded: x\r\n\r\n",  # a fold with nothing to fold into
        b"GET /status HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",
    ],
)
async def test_malformed_requests_are_400(server: StatusServer, request_bytes: bytes) -> None:
    response, _ = await _exchange(server.port, request_bytes)
    assert response is not None and response.status == 400
    assert response.headers["connection"] == "close"
    assert await _healthy(server.port)


async def test_http_2_request_line_is_505(server: StatusServer) -> None:
    response, _ = await _exchange(server.port, b"GET /status HTTP/2.0\r\n\r\n")
    assert response is not None and response.status == 505


async def test_binary_junk_without_newlines_never_hangs_the_server(server: StatusServer) -> None:
    tls_client_hello = bytes.fromhex("160301020001000200fc0303") + bytes(range(256)) * 2
    junk = bytes(b for b in tls_client_hello if b != 0x0A)
    response, _ = await _exchange(server.port, junk)
    # h11 refuses at once a first byte that cannot start a request line (TLS's 0x16).
    assert response is not None and response.status in (400, 408, 414)
    assert await _healthy(server.port)


@pytest.mark.parametrize(
    "headers",
    [
        b"X-Big: " + b"a" * 9000 + b"\r\n",
        b"".join(b"X-%d: 1\r\n" % i for i in range(100)),  # and Host: 101
        b"X-Huge: " + b"a" * 200_000 + b"\r\n",
    ],
    ids=["9KiB-header", "101-lines", "200KB-line"],
)
async def test_oversized_headers_are_431(server: StatusServer, headers: bytes) -> None:
    response, _ = await _exchange(
        server.port, b"GET /status HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    )
    assert response is not None and response.status == 431
    assert await _healthy(server.port)


async def test_a_hundred_headers_are_fine(server: StatusServer) -> None:
    headers = b"".join(b"X-%d: 1\r\n" % i for i in range(98)) + b"Connection: close\r\n"
    response, _ = await _exchange(
        server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    )
    assert response is not None and response.status == 200


async def test_oversized_headers_via_httpx_get_431(client: httpx.AsyncClient) -> None:
    response = await client.get("/status", headers={"X-Big": "a" * 20_000})
    assert response.status_code == 431


@pytest.mark.parametrize("length", [3_000, 100_000])
async def test_huge_uri_is_414(server: StatusServer, length: int) -> None:
    target = "/status?" + "q" * length
    response, _ = await _exchange(server.port, f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert response is not None and response.status == 414
    assert await _healthy(server.port)


async def test_200_concurrent_requests(board: StatusBoard) -> None:
    # Client and server share one event loop here: on a loaded machine a connection the
    # server accepted can wait longer than the fixture's short read timeout for its
    # request, and would be closed as idle. This test is about concurrency, not that.
    server = await _started(board, read_timeout_s=DEADLINE_S)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    paths = ["/status", "/metrics", "/healthz", "/nope"]
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", limits=limits, timeout=DEADLINE_S
        ) as client:
            responses = await asyncio.gather(*(client.get(paths[i % 4]) for i in range(200)))
    finally:
        await server.close()
    codes = [r.status_code for r in responses]
    assert codes.count(200) == 150 and codes.count(404) == 50


async def test_connections_over_the_limit_are_dropped(board: StatusBoard) -> None:
    server = await _started(board, max_connections=2, read_timeout_s=DEADLINE_S * 2)
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            held.append((reader, writer))
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _read_response(reader)).status == 200  # now counted as open
        try:
            response, _ = await _exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        except ConnectionError:
            response = None  # reset: the server aborted before reading the request
        assert response is None
        for reader, writer in held:
            writer.write_eof()
            async with asyncio.timeout(DEADLINE_S):
                assert await reader.read(-1) == b""  # the server has let go of it
            writer.close()
        assert await _healthy(server.port)
    finally:
        await server.close()


async def test_close_ends_open_connections(board: StatusBoard) -> None:
    server = await _started(board, read_timeout_s=DEADLINE_S * 10)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await _read_response(reader)
    async with asyncio.timeout(DEADLINE_S):
        await server.close()
        assert await reader.read(-1) == b""
    writer.close()


# --- what h11 decides ----------------------------------------------------------


async def test_http_1_1_without_host_is_400(server: StatusServer) -> None:
    # RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request that lacks Host.
    response, _ = await _exchange(server.port, b"GET /healthz HTTP/1.1\r\n\r\n")
    assert response is not None and response.status == 400
    assert response.headers["connection"] == "close"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX : y\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n",
        b"\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=[
        "two-hosts",
        "two-lengths",
        "negative-length",
        "absurd-length",
        "space-before-colon",
        "C0-in-value",
        "blank-line-first",
    ],
)
async def test_ambiguous_or_unclean_heads_are_400(
    server: StatusServer, request_bytes: bytes
) -> None:
    response, rest = await _exchange(server.port, request_bytes)
    assert response is not None and response.status == 400
    assert response.headers["connection"] == "close" and rest == b""
    assert await _healthy(server.port)


async def test_unsupported_transfer_coding_is_501(server: StatusServer) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
    response, _ = await _exchange(server.port, request)
    assert response is not None and response.status == 501


async def test_smuggling_with_length_and_chunked_gets_one_answer_then_close(
    server: StatusServer,
) -> None:
    # Content-Length says the body is "0\r\n\r\n"; chunked says it ends there and a second
    # request follows. h11 frames by Transfer-Encoding; the server answers the first
    # request only and closes (RFC 9112 6.1), so the hidden request is never served.
    smuggled = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" % (5 + len(smuggled))
    ) + smuggled
    response, rest = await _exchange(server.port, request)
    assert response is not None and response.status == 200 and response.body == b"ok\n"
    assert response.headers["connection"] == "close"
    assert rest == b""


async def test_get_with_a_body_is_answered_and_closed(server: StatusServer) -> None:
    body = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"  # a body, not a second request
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    response, rest = await _exchange(server.port, request + body)
    assert response is not None and response.status == 200
    assert response.headers["connection"] == "close" and rest == b""


async def test_obs_fold_is_unfolded_into_the_header_above(server: StatusServer) -> None:
    # RFC 9112 5.2 lets a server replace obs-fold with a space; h11 does, so the folded
    # line is the rest of Accept (as a header line of its own it would be a 400).
    request = (
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;\r\n"
        b" version=1.0.0\r\nConnection: close\r\n\r\n"
    )
    response, _ = await _exchange(server.port, request)
    assert response is not None and response.status == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text")


async def test_bare_lf_line_endings_are_accepted(server: StatusServer) -> None:
    response, _ = await _exchange(
        server.port, b"GET /healthz HTTP/1.1\nHost: x\nConnection: close\n\n"
    )
    assert response is not None and response.status == 200 and response.body == b"ok\n"


async def test_eof_in_the_middle_of_a_head_is_400(server: StatusServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"GET /status HTTP/1.1\r\nHo")
        writer.write_eof()
        async with asyncio.timeout(DEADLINE_S):
            answer = await reader.read(-1)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400 ")


async def test_pipelined_requests_are_answered_in_order(server: StatusServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    paths = ["/healthz", "/status", "/nope", "/metrics", "/healthz"]
    try:
        writer.write(b"".join(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % p.encode() for p in paths))
        writer.write(b"HEAD /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = [await _read_response(reader) for _ in paths]
        last = await _read_response(reader, head_only=True)
        async with asyncio.timeout(DEADLINE_S):
            assert await reader.read(-1) == b""  # nothing after the HEAD's headers, then EOF
    finally:
        writer.close()
    assert [a.status for a in answers] == [200, 200, 404, 200, 200]
    assert answers[0].body == answers[4].body == b"ok\n"
    assert "units" in json.loads(answers[1].body)
    assert answers[3].headers["content-type"].startswith("text/plain; version=0.0.4")
    assert [a.headers["connection"] for a in answers] == ["keep-alive"] * len(paths)
    assert last.status == 200 and last.headers["connection"] == "close"


async def test_head_refused_for_a_long_uri_has_no_body(server: StatusServer) -> None:
    target = "/status?" + "q" * 3_000
    response, rest = await _exchange(
        server.port, f"HEAD {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    )
    assert response is not None and response.status == 414
    assert response.body == b"" and rest == b""


# --- listen addresses (the grammar: tests/unit/core/test_config.py) --------------


@pytest.mark.parametrize("listen", ["9436", "::1:9436", "[nope]:1", "127.0.0.1:70000"])
def test_a_bad_listen_address_is_a_config_error(board: StatusBoard, listen: str) -> None:
    with pytest.raises(ConfigError, match=f"listen '{re.escape(listen)}'"):
        StatusServer(listen, lambda: {}, build_registry(board))


async def test_ipv6_loopback(board: StatusBoard) -> None:
    assert socket.has_ipv6, "this Python has no IPv6; the status server must serve [::1]"
    server = StatusServer("[::1]:0", lambda: {}, build_registry(board))
    try:
        await server.start()
    except OSLevelError as exc:
        pytest.fail(f"cannot serve on [::1] ({exc}); IPv6 loopback must work here and in CI")
    try:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://[::1]:{server.port}/status")
        assert response.json() == {}
    finally:
        await server.close()


async def test_ipv6_listen_from_the_config_end_to_end(board: StatusBoard) -> None:
    with socket.socket(socket.AF_INET6) as probe:  # a free port: the config refuses 0
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    section = parse_config({**_MIN_CONFIG, "supervisor": {"listen": f"[::1]:{port}"}}).supervisor
    server = StatusServer(section.listen, lambda: {"v6": True}, build_registry(board))
    await server.start()
    try:
        assert server.port == port
        url = listen_url(section.listen_host, section.listen_port)
        assert url == f"http://[::1]:{port}"
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/status")).json() == {"v6": True}
    finally:
        await server.close()


async def test_port_in_use_is_an_os_level_error(server: StatusServer, board: StatusBoard) -> None:
    other = StatusServer(f"127.0.0.1:{server.port}", lambda: {}, build_registry(board))
    with pytest.raises(OSLevelError, match="cannot listen"):
        await other.start()
