"""The read-only HTTP/1.1 server: GET/HEAD /status, /metrics and /healthz.

Owns the sockets, the limits and the three routes; h11 owns the protocol.
Bytes read from asyncio streams go into an ``h11.Connection(h11.SERVER)`` and
come out as events, and every response goes back out through it, so the
request-line and header grammar, message framing (Content-Length against
Transfer-Encoding), keep-alive and pipelining are decided by the standard
sans-I/O HTTP/1.1 state machine (httpcore's, under httpx) rather than by
hand-written parsing a security review would have to read. Among its
decisions: an HTTP/1.1 request without exactly one Host is a 400 (RFC 9112
3.2), as is a blank line before the request line; obs-fold is unfolded into
the header above and bare LF ends a line; HTTP/1.0 is served but never kept
alive; a Transfer-Encoding other than chunked is a 501.

What h11 leaves to its user is here: bounds on the head (its size, through
h11's ``max_incomplete_event_size`` and a check of each parsed head; the
header count; the URI length), on the time to send a head and to take a
response, and on open connections; GET and HEAD only; no request body (one is
never read, and the connection closes after the answer); HTTP/1.x only. A
request h11 rejects is answered with its ``error_status_hint`` (400, 431, 501)
and the connection closed, lingering so that the client reads the answer
rather than a reset. A broken or hostile client costs one short-lived
connection, never the event loop. The listen address is read by
``core.config.split_listen``, the package's one parser of them.

Rendering happens on the loop: /status is a json.dumps of a small mapping and
/metrics a generate_latest over a handful of series (about 1 ms for two units,
see bench/http_load.py), cheaper than a thread hand-off and free of locking
around the StatusBoard.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import re
from collections.abc import Callable, Mapping
from http import HTTPStatus
from urllib.parse import urlsplit

import h11
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from supervisor import __version__
from supervisor.core.config import split_listen
from supervisor.core.errors import ConfigError, OSLevelError

log = logging.getLogger(__name__)

ALLOWED_METHODS = ("GET", "HEAD")
PATHS = ("/status", "/metrics", "/healthz")

# h11 admits C0 controls other than NUL and whitespace in field values; nothing here wants them.
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TEXT = "text/plain; charset=utf-8"
_READ_BYTES = 64 * 1024
_LINGER_BYTES = 256 * 1024


class _Refused(Exception):
    """The request cannot be served; answer with ``status`` and close."""

    def __init__(self, status: HTTPStatus, why: str, *, head: bool = False) -> None:
        super().__init__(why)
        self.status = status
        self.head = head  # the refused request was a HEAD: the answer has no body


class StatusServer:
    """Serves /status (JSON from ``status_fn``), /metrics (``registry``) and /healthz."""

    def __init__(
        self,
        listen: str,
        status_fn: Callable[[], Mapping[str, object]],
        registry: CollectorRegistry,
        *,
        read_timeout_s: float = 10.0,
        write_timeout_s: float = 10.0,
        linger_s: float = 1.0,
        max_header_bytes: int = 8 * 1024,
        max_header_lines: int = 100,
        max_uri_bytes: int = 2 * 1024,
        max_connections: int = 256,
    ) -> None:
        try:  # port 0 (the kernel picks) is for tests and benchmarks; the config refuses it
            self._host, self._requested_port = split_listen(listen, allow_port_zero=True)
        except ValueError as exc:
            raise ConfigError(f"listen {listen!r}: {exc}") from None
        self._status_fn = status_fn
        self._registry = registry
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self._linger_s = linger_s
        self._max_header_bytes = max_header_bytes
        self._max_header_lines = max_header_lines
        self._max_uri_bytes = max_uri_bytes
        self._max_request_line = max_uri_bytes + 64  # method, spaces, version
        self._max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._on_connection, self._host, self._requested_port
            )
        except OSError as exc:
            where = f"{self._host}:{self._requested_port}"
            raise OSLevelError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
        log.info("serving /status /metrics /healthz on %s:%d", self._host, self.port)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        # Aborting the transports ends every handler through its own EOF path;
        # cancelling them instead trips asyncio 3.11's stream callback into logging errors.
        for writer in self._connections.values():
            writer.transport.abort()
        if self._connections:
            _, stuck = await asyncio.wait(self._connections, timeout=self._write_timeout_s)
            for task in stuck:
                task.cancel()
        await self._server.wait_closed()
        self._server = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("StatusServer is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    # --- connections -----------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = writer.get_extra_info("peername")
        if len(self._connections) >= self._max_connections:
            log.warning("refusing %s: %d connections open", peer, len(self._connections))
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        # drain() then waits until the kernel holds every byte, so closing loses nothing.
        writer.transport.set_write_buffer_limits(high=0)
        # A head that is still incomplete at this size is refused (431, or 414 for the line).
        max_head = self._max_request_line + self._max_header_bytes
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        try:
            await self._serve(conn, reader, writer)
        except _Refused as exc:
            log.debug("%s: %d %s", peer, exc.status, exc)
            with contextlib.suppress(OSError, TimeoutError):
                body = f"{exc.status.phrase}\n"
                await self._write(writer, _response(conn, exc.status, body, head=exc.head))
            await self._linger(reader, writer)
        except (ConnectionError, TimeoutError) as exc:
            log.debug("%s: connection dropped: %r", peer, exc)
        except Exception:
            log.exception("%s: unexpected error; closing the connection", peer)
        finally:
            del self._connections[task]
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a client that stopped reading gets no more
            else:
                writer.close()

    async def _serve(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            request = await self._read_request(conn, reader)
            if request is None:
                return
            has_body = _has_body(request)
            if not has_body:
                conn.next_event()  # its EndOfMessage, which needs no further bytes
            # A body is never read: answer, then close (h11 turns keep-alive into close
            # for a client that asked for close or speaks HTTP/1.0).
            await self._write(writer, await self._handle(conn, request, keep_alive=not has_body))
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                if has_body or conn.trailing_data[0]:  # unread input would turn close into RST
                    await self._linger(reader, writer)
                return
            conn.start_next_cycle()

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader
    ) -> h11.Request | None:
        """The next request's head, or None when the client is done (EOF, or idle too long).

        One deadline covers the whole head, so a client dribbling bytes cannot
        hold the connection past read_timeout_s.
        """
        try:
            async with asyncio.timeout(self._read_timeout_s):
                while (event := conn.next_event()) is h11.NEED_DATA:
                    conn.receive_data(await reader.read(_READ_BYTES))  # b"": EOF
        except TimeoutError:
            if conn.trailing_data[0]:
                raise _Refused(HTTPStatus.REQUEST_TIMEOUT, "head not received in time") from None
            return None  # an idle keep-alive connection
        except h11.RemoteProtocolError as exc:
            status = HTTPStatus(exc.error_status_hint)
            if status is HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
                pending = conn.trailing_data[0]
                if pending.find(b"\n", 0, self._max_request_line + 1) < 0:
                    status = HTTPStatus.REQUEST_URI_TOO_LONG  # still in the request line
            raise _Refused(status, str(exc)) from None
        if not isinstance(event, h11.Request):
            return None  # ConnectionClosed: the client is done
        self._check_limits(event)
        return event

    def _check_limits(self, request: h11.Request) -> None:
        """What h11 does not bound in a head that arrived whole."""
        head = request.method == b"HEAD"
        if len(request.target) > self._max_uri_bytes:
            why = f"URI of {len(request.target)} bytes"
            raise _Refused(HTTPStatus.REQUEST_URI_TOO_LONG, why, head=head)
        if not request.http_version.startswith(b"1."):
            why = f"HTTP version {request.http_version!r}"
            raise _Refused(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, why, head=head)
        header_bytes = sum(len(name) + len(value) + 4 for name, value in request.headers)
        if len(request.headers) > self._max_header_lines or header_bytes > self._max_header_bytes:
            raise _Refused(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too big", head=head)
        for name, value in request.headers:
            if _CONTROL_BYTES.search(value):
                why = f"control bytes in header {name[:40]!r}"
                raise _Refused(HTTPStatus.BAD_REQUEST, why, head=head)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self._write_timeout_s):
            await writer.drain()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then drain unread input briefly so the client reads our answer, not RST."""
        with contextlib.suppress(OSError, TimeoutError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(self._linger_s):
                drained = 0
                while drained < _LINGER_BYTES:
                    chunk = await reader.read(_READ_BYTES)
                    if not chunk:
                        break
                    drained += len(chunk)

    # --- endpoints -------------------------------------------------------------

    async def _handle(
        self, conn: h11.Connection, request: h11.Request, *, keep_alive: bool
    ) -> bytes:
        method = request.method.decode("ascii")  # h11 admits only token bytes
        path = _path_of(request.target.decode("ascii"))  # ... and only visible ASCII here
        head = method == "HEAD"
        if path not in PATHS:
            return _response(
                conn, HTTPStatus.NOT_FOUND, "not found\n", head=head, keep_alive=keep_alive
            )
        if method not in ALLOWED_METHODS:
            return _response(
                conn,
                HTTPStatus.METHOD_NOT_ALLOWED,
                "method not allowed\n",
                keep_alive=keep_alive,
                extra=(("Allow", ", ".join(ALLOWED_METHODS)),),
            )
        body: str | bytes
        extra: tuple[tuple[str, str], ...] = ()
        try:
            if path == "/status":
                body = json.dumps(self._status_fn(), separators=(",", ":")) + "\n"
                content_type = "application/json"
            elif path == "/metrics":
                encoder, content_type = choose_encoder(_header(request, b"accept"))
                body = encoder(self._registry)
            else:  # /healthz: answering at all proves the loop turns
                body, content_type = "ok\n", _TEXT
                extra = (("X-Loop-Lag-Seconds", f"{await _loop_lag_s():.6f}"),)
        except Exception:
            log.exception("rendering %s failed", path)
            return _response(
                conn,
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "internal error\n",
                head=head,
                keep_alive=keep_alive,
            )
        return _response(
            conn,
            HTTPStatus.OK,
            body,
            head=head,
            keep_alive=keep_alive,
            content_type=content_type,
            extra=extra,
        )


def _has_body(request: h11.Request) -> bool:
    """Whether a body follows the head (h11 has checked Content-Length is digits)."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and int(value) > 0)
        for name, value in request.headers
    )


def _header(request: h11.Request, name: bytes) -> str:
    """A header's value, repeated fields joined with ', ' ('' if absent)."""
    return ", ".join(value.decode("latin-1") for key, value in request.headers if key == name)


async def _loop_lag_s() -> float:
    """How long the callbacks already queued on the loop take: one trip round it."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.sleep(0)
    return loop.time() - start


def _path_of(target: str) -> str:
    """The path of an origin-form or absolute-form target; no decoding, no normalising."""
    if target.startswith("/"):
        return target.partition("?")[0].partition("#")[0]
    if target.lower().startswith(("http://", "https://")):
        return urlsplit(target).path or "/"
    return target  # '*' or junk: matches no route


def _response(
    conn: h11.Connection,
    status: HTTPStatus,
    body: str | bytes,
    *,
    head: bool = False,
    keep_alive: bool = False,
    content_type: str = _TEXT,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """One whole response, serialised by ``conn`` (which also moves its state on)."""
    payload = body.encode() if isinstance(body, str) else body
    headers = [
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Server", f"k26-supervisor/{__version__}"),
        ("Content-Type", content_type),
        ("Content-Length", str(len(payload))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("Connection", "keep-alive" if keep_alive else "close"),
        *extra,
    ]
    data = conn.send(h11.Response(status_code=status.value, reason=status.phrase, headers=headers))
    if payload and not head:
        data += conn.send(h11.Data(data=payload))
    return data + conn.send(h11.EndOfMessage())
