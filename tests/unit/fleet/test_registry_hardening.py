"""The registry client against a hostile registry, without one (``httpx.MockTransport``):
where its credentials may go, and how much of what it sends is read.

- credentials: an upload ``Location`` or a redirect on another origin gets no
  ``Authorization``; a 401 from another origin is not answered (its realm never
  asked); an https registry's token realm may not be plain http;
- memory: a manifest, a small blob, a token answer or an error body is read as it
  arrives and never much past its limit; a compressed one (a gzip bomb) is refused
  unread. Each body is served by a generator that counts what was taken from it.

The ordinary flows are tests/unit/fleet/test_registry_auth.py.
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from supervisor.core.errors import AuthRefused, InputError, UnavailableError
from supervisor.fleet import registry
from supervisor.fleet.registry import Access, Registry

HOST = "registry.test:5000"
URL = f"https://{HOST}/k26/bundles"
ORIGIN = f"https://{HOST}"
USER, PASSWORD = "ci-bot", "s3cr3t"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
BLOB = b"blob"
DIGEST = registry.sha256_digest(BLOB)
PIECE = 64 << 10  # what each generator yields at a time, as a socket read would


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {HOST: {"username": USER, "password": PASSWORD}}}))
    path.chmod(0o600)
    return path


ENDLESS = 64 << 20  # far past every limit; finite, so that reading it all fails, not hangs


class Counted:
    """A response body of ``total`` bytes, ``piece`` after ``piece``, counting the bytes
    taken from it (across every response it is the body of)."""

    def __init__(self, piece: bytes = b"x" * PIECE, total: int = ENDLESS) -> None:
        self.piece = piece
        self.total = total
        self.taken = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent = 0
        while sent < self.total:
            piece = self.piece[: self.total - sent]
            sent += len(piece)
            self.taken += len(piece)
            yield piece


@functools.cache
def bomb() -> bytes:
    """gzip of 64 MiB of zeros: about 64 KiB on the wire, 1000 times that decoded."""
    return gzip.compress(bytes(64 << 20), compresslevel=9)


def bombed() -> Counted:
    return Counted(bomb(), total=len(bomb()))


Handler = Callable[[httpx.Request], httpx.Response]


def netloc(url: httpx.URL | str) -> tuple[str, str, int | None]:
    """The mock's own idea of an origin (not the client's, which is under test)."""
    parts = httpx.URL(url)
    return parts.scheme, parts.host, parts.port


class Net:
    """The registry at ``ORIGIN`` wanting ``scheme`` (basic or bearer, token realm
    ``realm``) and whatever other hosts ``others`` serves; records every request."""

    def __init__(
        self,
        scheme: str = "basic",
        *,
        realm: str = "https://auth.test/token",
        serve: Handler | None = None,
        others: Handler | None = None,
    ) -> None:
        self.scheme = scheme
        self.realm = realm
        self.serve = serve or (lambda request: httpx.Response(200, content=BLOB))
        self.others = others or (lambda request: httpx.Response(404))
        self.seen: list[httpx.Request] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if netloc(request.url) == netloc(self.realm):
            if request.headers.get("Authorization") != BASIC:
                return httpx.Response(401)
            return httpx.Response(200, json={"token": "tok"})
        if netloc(request.url) != netloc(ORIGIN):
            return self.others(request)
        given = request.headers.get("Authorization")
        if self.scheme == "basic" and given != BASIC:
            return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        if self.scheme == "bearer" and given != "Bearer tok":
            challenge = f'Bearer realm="{self.realm}",service="registry.test"'
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        return self.serve(request)

    def client(self, auth: Path | None, url: str = URL) -> Registry:
        return Registry(url, transport=httpx.MockTransport(self.handler), access=Access(auth))

    def sent(self, host: str) -> list[str | None]:
        """The Authorization of each request to ``host``."""
        return [r.headers.get("Authorization") for r in self.seen if r.url.host == host]


# --- where the credentials go ----------------------------------------------------------


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
async def test_an_upload_location_on_another_host_gets_no_authorization(
    creds: Path, scheme: str
) -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":
            return httpx.Response(404)
        return httpx.Response(202, headers={"Location": "http://evil.example/uploads/1?x=1"})

    def others(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, headers={"Docker-Content-Digest": DIGEST})

    net = Net(scheme, serve=serve, others=others)
    async with net.client(creds) as reg:
        assert await reg.push_blob(BLOB, DIGEST, len(BLOB))
    assert net.sent("evil.example") == [None]  # the PUT: neither Basic nor the token
    put = next(r for r in net.seen if r.url.host == "evil.example")
    assert put.method == "PUT" and put.url.params["digest"] == DIGEST
    # Basic went to the registry (basic) or the realm (bearer), and nowhere else.
    basic_to = {r.url.host for r in net.seen if r.headers.get("Authorization") == BASIC}
    assert basic_to == ({"registry.test"} if scheme == "basic" else {"auth.test"})


async def test_an_upload_location_on_the_registrys_origin_keeps_its_credentials(
    creds: Path,
) -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":
            return httpx.Response(404)
        if request.method == "POST":  # absolute, default port spelled out or not
            return httpx.Response(202, headers={"Location": f"{ORIGIN}/v2/k26/bundles/up/1"})
        return httpx.Response(201)

    net = Net("bearer", serve=serve)
    async with net.client(creds) as reg:
        assert await reg.push_blob(BLOB, DIGEST, len(BLOB))
    assert net.sent("registry.test")[-1] == "Bearer tok"


@pytest.mark.parametrize("challenge", ['Bearer realm="http://evil2.example/token"', "Basic"])
@pytest.mark.parametrize("fetch", ["fetch_bytes", "fetch_blob"])
async def test_a_401_from_where_the_registry_redirected_is_not_answered(
    creds: Path, tmp_path: Path, challenge: str, fetch: str
) -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        return httpx.Response(307, headers={"Location": "http://cdn.example/blob"})

    def others(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})

    net = Net("basic", serve=serve, others=others)
    async with net.client(creds) as reg:
        with pytest.raises(UnavailableError) as caught:
            if fetch == "fetch_bytes":
                await reg.fetch_bytes(DIGEST, len(BLOB))
            else:
                await reg.fetch_blob(DIGEST, len(BLOB), tmp_path / "blob")
    assert not isinstance(caught.value, AuthRefused)
    assert str(caught.value) == (
        f"registry {URL}: blob {DIGEST}: HTTP 401 from http://cdn.example, not the "
        f"registry's {ORIGIN} (a redirect or an upload location led there); the "
        "registry's credentials are not sent to another host, so it cannot be answered"
    )
    assert not [r for r in net.seen if r.url.host == "evil2.example"]
    # httpx dropped Authorization on the redirect off the origin, each time.
    assert set(net.sent("cdn.example")) == {None}
    assert not (tmp_path / "blob").exists()


async def test_a_redirect_keeps_authorization_on_the_origin_only(creds: Path) -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/moved"):
            return httpx.Response(307, headers={"Location": "https://cdn.example/blob"})
        return httpx.Response(307, headers={"Location": f"{ORIGIN}/v2/k26/bundles/moved"})

    def others(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=BLOB)

    net = Net("bearer", serve=serve, others=others)
    async with net.client(creds) as reg:
        assert await reg.fetch_bytes(DIGEST, len(BLOB)) == BLOB
    assert net.sent("registry.test") == [None, "Bearer tok", "Bearer tok"]
    assert net.sent("cdn.example") == [None]


async def test_a_401_off_the_origin_after_logging_in_is_not_answered_either(
    creds: Path,
) -> None:
    net = Net("basic")
    net.serve = lambda request: httpx.Response(307, headers={"Location": "https://other.example/b"})
    net.others = lambda request: httpx.Response(401, headers={"WWW-Authenticate": "Basic"})
    async with net.client(creds) as reg:
        with pytest.raises(UnavailableError, match=r"HTTP 401 from https://other\.example,"):
            await reg.get_manifest("latest")
    assert net.sent("registry.test") == [None, BASIC]
    assert net.sent("other.example") == [None]


@pytest.mark.parametrize("realm", ["http://registry.test:5000/token", "http://auth.test/token"])
async def test_an_http_realm_under_an_https_registry_is_refused(creds: Path, realm: str) -> None:
    net = Net("bearer", realm=realm)
    async with net.client(creds) as reg:
        with pytest.raises(UnavailableError) as caught:
            await reg.get_manifest("latest")
    assert str(caught.value) == (
        f"registry {URL}: manifest latest: token service {realm}: plain http under an "
        "https registry, which would send the credentials and the token in the clear; "
        "refused (make the registry's token realm https)"
    )
    assert [r.url.path for r in net.seen] == ["/v2/k26/bundles/manifests/latest"]


@pytest.fixture
def plain_creds(tmp_path: Path) -> Path:
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"auths": {"plain.test": {"username": USER, "password": PASSWORD}}}))
    path.chmod(0o600)
    return path


async def test_a_plain_http_registry_may_have_a_plain_http_realm(
    plain_creds: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = plain_creds

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.test":
            assert request.headers.get("Authorization") == BASIC
            return httpx.Response(200, json={"token": "tok"})
        if request.headers.get("Authorization") != "Bearer tok":
            realm = 'Bearer realm="http://auth.test/token"'
            return httpx.Response(401, headers={"WWW-Authenticate": realm})
        return httpx.Response(200, content=BLOB)

    transport = httpx.MockTransport(handler)
    with caplog.at_level(logging.WARNING, logger="k26.registry"):
        async with Registry(
            "http://plain.test/k26/b", transport=transport, access=Access(path)
        ) as r:
            assert await r.fetch_bytes(DIGEST, len(BLOB)) == BLOB
    assert "sending credentials over plain http" in caplog.text


def test_origins_fill_in_default_ports() -> None:
    assert registry.origin("https://Registry.Test/v2/") == ("https", "registry.test", 443)
    assert registry.origin("https://registry.test:443/x") == registry.origin(
        "https://registry.test"
    )
    assert registry.origin("http://registry.test/x") != registry.origin("https://registry.test")
    assert registry.origin("https://registry.test:5000") != registry.origin("https://registry.test")


# --- how much is read ------------------------------------------------------------------


def every_request_asks_for_identity(net: Net) -> None:
    assert net.seen and {r.headers.get("Accept-Encoding") for r in net.seen} == {"identity"}


async def test_a_gzip_bomb_manifest_is_refused_unread(creds: Path) -> None:
    body = bombed()
    net = Net("basic")
    net.serve = lambda request: httpx.Response(
        200, headers={"Content-Encoding": "gzip"}, content=body
    )
    async with net.client(creds) as reg:
        with pytest.raises(InputError) as caught:
            await reg.get_manifest("latest")
    assert str(caught.value) == (
        f"registry {URL}: manifest latest: sent with Content-Encoding 'gzip', though "
        "asked for identity; refused"
    )
    assert body.taken <= PIECE  # nothing of it decoded, at most a socket read taken
    every_request_asks_for_identity(net)


async def test_an_endless_manifest_is_cut_at_the_limit(creds: Path) -> None:
    body = Counted()
    net = Net("basic", serve=lambda request: httpx.Response(200, content=body))
    async with net.client(creds) as reg:
        with pytest.raises(InputError) as caught:
            await reg.get_manifest("latest")
    limit = registry.MAX_MANIFEST_BYTES
    assert str(caught.value) == (
        f"registry {URL}: manifest latest: more than {limit} bytes (the distribution "
        "spec's limit for a manifest); refused"
    )
    assert limit < body.taken <= limit + PIECE


async def test_a_small_blob_is_read_up_to_its_descriptors_size(creds: Path) -> None:
    body = Counted()
    net = Net("basic", serve=lambda request: httpx.Response(200, content=body))
    async with net.client(creds) as reg:
        with pytest.raises(InputError, match=r"more than 4 bytes \(its descriptor's size\)"):
            await reg.fetch_bytes(DIGEST, len(BLOB))
        gzipped = bombed()
        net.serve = lambda request: httpx.Response(
            200, headers={"Content-Encoding": "gzip"}, content=gzipped
        )
        with pytest.raises(InputError, match="Content-Encoding 'gzip'"):
            await reg.fetch_bytes(DIGEST, len(BLOB))
    assert body.taken <= PIECE and gzipped.taken <= PIECE


@pytest.mark.parametrize("gzipped", [False, True])
async def test_a_token_answer_is_read_up_to_max_credentials_bytes(
    creds: Path, gzipped: bool
) -> None:
    body = bombed() if gzipped else Counted()
    headers = {"Content-Encoding": "gzip"} if gzipped else {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.test":
            return httpx.Response(200, headers=headers, content=body)
        challenge = 'Bearer realm="https://auth.test/token"'
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})

    async with Registry(URL, transport=httpx.MockTransport(handler), access=Access(creds)) as r:
        with pytest.raises(UnavailableError) as caught:
            await r.get_manifest("latest")
    head = f"registry {URL}: manifest latest: token service https://auth.test/token: "
    if gzipped:
        assert str(caught.value) == (
            head + "sent with Content-Encoding 'gzip', though asked for identity; refused"
        )
        assert body.taken <= PIECE
    else:
        limit = registry.MAX_CREDENTIALS_BYTES
        assert str(caught.value) == head + f"more than {limit} bytes for a token; refused"
        assert limit < body.taken <= limit + PIECE
    assert not isinstance(caught.value, AuthRefused)


@pytest.mark.parametrize("status", [500, 404, 401])
async def test_an_error_body_is_read_for_its_message_only(creds: Path, status: int) -> None:
    message = json.dumps({"errors": [{"code": "BOOM", "message": "no"}]}).encode()
    body = Counted(message + b" " * PIECE)  # far past the cap: no JSON as a whole

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    async with Registry(URL, transport=httpx.MockTransport(handler), access=Access(creds)) as r:
        with pytest.raises(UnavailableError) as caught:
            await r.get_manifest("latest")
    assert "\n" not in str(caught.value)
    if status == 500:  # cut at its cap, it is no JSON: the status line alone
        assert str(caught.value) == f"registry {URL}: manifest latest: HTTP 500"
    assert body.taken <= registry.MAX_ANSWER_BYTES + 2 * PIECE


async def test_a_short_error_body_still_gives_its_message_and_a_gzipped_one_none(
    creds: Path,
) -> None:
    said = json.dumps({"errors": [{"code": "BOOM", "message": "no"}]}).encode()
    answers = [
        httpx.Response(500, content=Counted(said, total=len(said))),
        httpx.Response(500, headers={"Content-Encoding": "gzip"}, content=bombed()),
    ]
    transport = httpx.MockTransport(lambda request: answers.pop(0))
    async with Registry(URL, transport=transport, access=Access(creds)) as r:
        with pytest.raises(UnavailableError, match=r"manifest latest: HTTP 500 \(BOOM: no\)$"):
            await r.get_manifest("latest")
        with pytest.raises(UnavailableError, match=r"manifest latest: HTTP 500$"):
            await r.get_manifest("latest")


async def test_what_fits_is_read_whole_through_the_stream(creds: Path) -> None:
    body = Counted(total=registry.MAX_MANIFEST_BYTES)  # at the limit, not past it
    net = Net("basic", serve=lambda request: httpx.Response(200, content=body))
    async with net.client(creds) as reg:
        data, got = await reg.get_manifest("latest")
    assert len(data) == registry.MAX_MANIFEST_BYTES == body.taken
    assert got == registry.sha256_digest(data)


async def test_a_redirect_loop_is_one_line_not_a_traceback() -> None:
    """A registry (or its proxy) that redirects a manifest to itself forever."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(307, headers={"Location": str(request.url)})

    async with Registry(URL, transport=httpx.MockTransport(handler), access=Access(None)) as r:
        with pytest.raises(UnavailableError) as caught:
            await r.get_manifest("latest")
    assert str(caught.value).startswith(f"registry {URL}: manifest latest: redirected in a loop")
