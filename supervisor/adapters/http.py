"""The read-only HTTP/1.1 server: GET/HEAD /status, /metrics and /healthz.

Owns HTTP on asyncio streams, nothing else: no framework, no new dependency.
Requests are parsed strictly and bounded (head size, header count, URI length,
time to send a head, time to take a response) so that a broken or hostile
client costs one short-lived connection, never the event loop. Anything it
cannot parse is answered with a 4xx when possible and the connection closed.

Rendering happens on the loop: /status is a json.dumps of a small mapping and
/metrics a generate_latest over a handful of series (about 1 ms for two units,
see bench/http_load.py), cheaper than a thread hand-off and free of locking
around the StatusBoard.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import ipaddress
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from supervisor import __version__
from supervisor.core.errors import ConfigError, OSLevelError

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9436"
ALLOWED_METHODS = ("GET", "HEAD")
PATHS = ("/status", "/metrics", "/healthz")

_REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([\x21-\x7e]+) HTTP/(\d)\.(\d)")
_HEADER_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_BAD_VALUE_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TEXT = "text/plain; charset=utf-8"
_LINGER_BYTES = 256 * 1024


def parse_listen(listen: str) -> tuple[str, int]:
    """'127.0.0.1:9436', '[::1]:9436' or 'localhost:0' into (host, port)."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"listen {listen!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"listen {listen!r}: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ConfigError(f"listen {listen!r}: write IPv6 addresses in brackets, e.g. [::1]:9436")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    minor_version: int
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ', '

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if "close" in tokens:
            return False
        return self.minor_version >= 1 or "keep-alive" in tokens

    @property
    def has_body(self) -> bool:
        return "transfer-encoding" in self.headers or self.headers.get(
            "content-length", "0"
        ).strip() not in ("", "0")


class _Refused(Exception):
    """The request cannot be served; answer with ``status`` and close."""

    def __init__(self, status: HTTPStatus, why: str) -> None:
        super().__init__(why)
        self.status = status


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
        self._host, self._requested_port = parse_listen(listen)
        self._status_fn = status_fn
        self._registry = registry
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self._linger_s = linger_s
        self._max_header_bytes = max_header_bytes
        self._max_header_lines = max_header_lines
        self._max_uri_bytes = max_uri_bytes
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
        try:
            await self._serve(reader, writer)
        except _Refused as exc:
            log.debug("%s: %d %s", peer, exc.status, exc)
            with contextlib.suppress(OSError, TimeoutError):
                await self._write(writer, _response(exc.status, f"{exc.status.phrase}\n"))
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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = bytearray()  # bytes read past the current head (pipelining)
        while True:
            head = await self._read_head(reader, buffer)
            if head is None:
                return
            request = self._parse(head)
            keep_alive = request.keep_alive and not request.has_body
            await self._write(writer, await self._handle(request, keep_alive))
            if not keep_alive:
                if request.has_body or buffer:  # unread input would turn our close into RST
                    await self._linger(reader, writer)
                return

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
                    chunk = await reader.read(64 * 1024)
                    if not chunk:
                        break
                    drained += len(chunk)

    async def _read_head(self, reader: asyncio.StreamReader, buffer: bytearray) -> bytes | None:
        """The next request head, or None when the client is done (EOF, or idle too long).

        One deadline covers the whole head, so a client dribbling bytes cannot
        hold the connection past read_timeout_s.
        """
        max_line = self._max_uri_bytes + 64  # method, spaces, version
        try:
            async with asyncio.timeout(self._read_timeout_s):
                while True:
                    # RFC 9112 2.2: ignore blank lines before a request line.
                    del buffer[: len(buffer) - len(buffer.lstrip(b"\r\n"))]
                    end, sep = _head_end(buffer)
                    first_line = buffer.find(b"\n")
                    if (first_line if first_line >= 0 else len(buffer)) > max_line:
                        raise _Refused(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
                    header_part = buffer[first_line + 1 : end if end >= 0 else len(buffer)]
                    if first_line >= 0 and (
                        len(header_part) > self._max_header_bytes
                        or header_part.count(b"\n") >= self._max_header_lines + (end < 0)
                    ):
                        raise _Refused(
                            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too big"
                        )
                    if end >= 0:
                        head = bytes(buffer[:end])
                        del buffer[: end + len(sep)]
                        return head
                    chunk = await reader.read(64 * 1024)
                    if not chunk:
                        if buffer:
                            log.debug("client closed mid-request")
                        return None
                    buffer += chunk
        except TimeoutError:
            if buffer:
                raise _Refused(HTTPStatus.REQUEST_TIMEOUT, "head not received in time") from None
            return None  # an idle keep-alive connection

    def _parse(self, head: bytes) -> _Request:
        request_line, *header_lines = head.split(b"\n")
        request_line = request_line.rstrip(b"\r")
        match = _REQUEST_LINE.fullmatch(request_line)
        if match is None:
            raise _Refused(HTTPStatus.BAD_REQUEST, f"malformed request line {request_line[:80]!r}")
        method_b, target_b, major, minor = match.groups()
        if len(target_b) > self._max_uri_bytes:
            raise _Refused(HTTPStatus.REQUEST_URI_TOO_LONG, f"URI of {len(target_b)} bytes")
        if major != b"1":
            raise _Refused(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"HTTP major version {major!r}")
        headers: dict[str, str] = {}
        for raw in header_lines:
            name, colon, value = raw.rstrip(b"\r").partition(b":")
            if not colon or _HEADER_NAME.fullmatch(name) is None:
                raise _Refused(HTTPStatus.BAD_REQUEST, f"malformed header line {raw[:80]!r}")
            value = value.strip(b" \t")
            if _BAD_VALUE_BYTES.search(value):
                raise _Refused(HTTPStatus.BAD_REQUEST, f"control bytes in header {name[:40]!r}")
            key = name.decode("ascii").lower()
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        return _Request(
            method=method_b.decode("ascii"),
            path=_path_of(target_b.decode("ascii")),
            minor_version=int(minor),
            headers=headers,
        )

    # --- endpoints -------------------------------------------------------------

    async def _handle(self, request: _Request, keep_alive: bool) -> bytes:
        head = request.method == "HEAD"
        if request.path not in PATHS:
            return _response(HTTPStatus.NOT_FOUND, "not found\n", head=head, keep_alive=keep_alive)
        if request.method not in ALLOWED_METHODS:
            return _response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                "method not allowed\n",
                keep_alive=keep_alive,
                extra=(("Allow", ", ".join(ALLOWED_METHODS)),),
            )
        body: str | bytes
        extra: tuple[tuple[str, str], ...] = ()
        try:
            if request.path == "/status":
                body = json.dumps(self._status_fn(), separators=(",", ":")) + "\n"
                content_type = "application/json"
            elif request.path == "/metrics":
                encoder, content_type = choose_encoder(request.headers.get("accept", ""))
                body = encoder(self._registry)
            else:  # /healthz: answering at all proves the loop turns
                body, content_type = "ok\n", _TEXT
                extra = (("X-Loop-Lag-Seconds", f"{await _loop_lag_s():.6f}"),)
        except Exception:
            log.exception("rendering %s failed", request.path)
            return _response(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "internal error\n",
                head=head,
                keep_alive=keep_alive,
            )
        return _response(
            HTTPStatus.OK,
            body,
            head=head,
            keep_alive=keep_alive,
            content_type=content_type,
            extra=extra,
        )


def _head_end(buffer: bytearray) -> tuple[int, bytes]:
    """Where the head ends and its terminator (CRLF CRLF, or a lenient LF LF), or (-1, b'')."""
    found = [(i, sep) for sep in (b"\r\n\r\n", b"\n\n", b"\n\r\n") if (i := buffer.find(sep)) >= 0]
    return min(found) if found else (-1, b"")


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
    status: HTTPStatus,
    body: str | bytes,
    *,
    head: bool = False,
    keep_alive: bool = False,
    content_type: str = _TEXT,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
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
    lines = [f"HTTP/1.1 {status.value} {status.phrase}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else payload)
