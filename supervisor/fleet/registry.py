"""An OCI registry, through the OCI distribution API: blobs and manifests by digest.

What a fleet's bundles travel in (docs/fleet.md). Only the part of the API a cache
bundle needs, over ``httpx.AsyncClient`` so the daemon's event loop never waits on
the network or the disk (file chunks are read and written in a worker thread):

- ``HEAD /v2/<repo>/blobs/<digest>``: skip a blob the registry already holds;
- ``POST /v2/<repo>/blobs/uploads/`` then one ``PUT ...?digest=`` (monolithic), or
  ``PATCH`` chunks with ``Content-Range`` then ``PUT ...?digest=`` (chunked);
- ``PUT``/``GET /v2/<repo>/manifests/<tag or digest>``;
- ``GET /v2/<repo>/blobs/<digest>``, streamed to a file.

Everything fetched is checked against the digest it was asked by: a manifest's
bytes against the digest in the reference (or the registry's
``Docker-Content-Digest`` when asked by tag), a blob's bytes and size against its
descriptor, while they stream. A mismatch is an InputError naming the digest; the
partial file is removed. A registry that cannot be reached, times out or answers
with an error is an UnavailableError naming the registry and what it said; a
reference it does not hold is ``NotInRegistry``.

Credentials and TLS (``Access``; docs/fleet.md, "Registry credentials and TLS"), as
the distribution spec and Docker's token spec define them: a request answered 401
with ``WWW-Authenticate: Bearer realm=...,service=...,scope=...`` gets a token from
the realm (``GET`` with ``service`` and ``scope``, HTTP basic with the configured
credentials if any; its ``token`` or ``access_token``), kept per scope and sent as
``Authorization: Bearer`` from then on (a push asks for
``repository:<name>:pull,push``; a token refused later, e.g. expired, is fetched
once more); ``WWW-Authenticate: Basic`` gets the credentials as HTTP basic. They
come from a Docker-style ``config.json`` (``auths``) or a file of one
``USER:PASSWORD`` line, mode 0600; a PEM CA bundle can replace the trust store.
Credentials missing, refused, or not enough for what was asked: ``AuthRefused``
(exit 77), one line naming the registry, the user and the file, never the secret.

Where credentials go (as Docker, which authorizes only the hosts that challenged it):
the registry's origin (scheme, host, port) alone gets ``Authorization``, basic or
bearer; the realm gets the basic credentials when it asks for a token, and may be on
another host (Docker Hub's is), but never plain http under an https registry (a
downgrade: refused, UnavailableError). A request whose URL is on another origin (an
upload ``Location`` elsewhere, a storage backend's URL) is sent with no
``Authorization`` at all, not even the bearer token: a token is for the registry's
service, and an off-origin upload URL carries its own authorization (a pre-signed
URL) where the registry hands one out. Only a 401 from the registry's origin is
answered: one from elsewhere (a redirect's target, e.g. a CDN, or an upload
location) is an UnavailableError naming that origin, its realm never asked. Redirects
are followed, and httpx drops ``Authorization`` on every redirect off the origin (but
an http to https upgrade of the same host and default port).

What a registry sends is read as it arrives, never more than what it may hold: a
manifest its 4 MiB, a small blob its descriptor's size, a token service's answer
``MAX_CREDENTIALS_BYTES``, an error's body (read for its message only)
``MAX_ANSWER_BYTES``; past that, the rest is not read and the fetch is refused
naming what was fetched. Every request asks for ``Accept-Encoding: identity`` and
bytes are taken as sent (a compressed answer would let a few KiB on the wire become
gigabytes in memory): a manifest, blob or token sent with another content coding
anyway is refused.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import ssl
import stat
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Final, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import Field

from supervisor.core.config import split_registry
from supervisor.core.errors import AuthRefused, ConfigError, InputError, UnavailableError
from supervisor.fleet.archive import Strict, parse_json

MANIFEST_MEDIA_TYPE: Final = "application/vnd.oci.image.manifest.v1+json"
# Ours: the artifact, its config (the index of caches) and its layers.
ARTIFACT_TYPE: Final = "application/vnd.k26.jit-caches.v1"
CONFIG_MEDIA_TYPE = "application/vnd.k26.jit-caches.config.v1+json"
FLASHINFER_LAYER = "application/vnd.k26.flashinfer-bundle.v1.tar+gzip"
CACHE_LAYER = "application/vnd.k26.jit-cache.v1.tar+gzip"
LAYER_MEDIA_TYPES = (FLASHINFER_LAYER, CACHE_LAYER)
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
CACHE_ANNOTATION = "io.k26.cache"

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec's own limit for a manifest
CHUNK = 1 << 20
MAX_CREDENTIALS_BYTES = 1 << 20  # a credentials file, a token service's answer
MAX_ANSWER_BYTES = 64 << 10  # what is read of any other answer: an error's, an upload's

log = logging.getLogger("k26.registry")


class NotInRegistry(UnavailableError):
    """The registry holds no manifest (or blob) by that reference."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> tuple[str, int]:
    """``sha256:<hex>`` and size of a file. Blocking I/O."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size


def check_reference(reference: str) -> str:
    """A tag or a digest, as a manifest reference; InputError saying which rule failed."""
    if reference.startswith("sha256:"):
        if not DIGEST_RE.fullmatch(reference):
            raise InputError(f"digest {reference!r} is not sha256:<64 lowercase hex digits>")
        return reference
    if not TAG_RE.fullmatch(reference):
        raise InputError(
            f"tag {reference!r} is not a valid OCI tag (letters, digits, '_', '.', '-'; "
            "at most 128; not starting with '.' or '-')"
        )
    return reference


# --- the manifest --------------------------------------------------------------------


class Descriptor(Strict):
    mediaType: str = Field(min_length=1, max_length=255)
    digest: str = Field(pattern=DIGEST_RE.pattern)
    size: int = Field(ge=0)
    annotations: dict[str, str] | None = None


class Manifest(Strict):
    """An OCI image manifest carrying a k26 artifact (OCI 1.1: ``artifactType``)."""

    schemaVersion: Literal[2] = 2
    mediaType: Literal["application/vnd.oci.image.manifest.v1+json"] = MANIFEST_MEDIA_TYPE
    artifactType: Literal["application/vnd.k26.jit-caches.v1"] = ARTIFACT_TYPE
    config: Descriptor
    layers: tuple[Descriptor, ...] = Field(min_length=1)
    annotations: dict[str, str] = Field(default_factory=dict)

    def body(self) -> bytes:
        """The canonical bytes pushed (their sha256 is the manifest's digest)."""
        return self.model_dump_json(exclude_none=True).encode()


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """A k26 artifact's manifest, validated: InputError naming the field otherwise."""
    manifest = parse_json(Manifest, raw, f"{where}: not a k26 cache bundle: manifest")
    if manifest.config.mediaType != CONFIG_MEDIA_TYPE:
        raise InputError(
            f"{where}: not a k26 cache bundle: config media type "
            f"{manifest.config.mediaType!r}, expected {CONFIG_MEDIA_TYPE!r}"
        )
    seen: set[str] = set()
    for index, layer in enumerate(manifest.layers):
        if layer.mediaType not in LAYER_MEDIA_TYPES:
            raise InputError(
                f"{where}: manifest field layers.{index}.mediaType: {layer.mediaType!r} is "
                f"not a k26 layer ({', '.join(LAYER_MEDIA_TYPES)})"
            )
        cache = (layer.annotations or {}).get(CACHE_ANNOTATION)
        if not cache:
            raise InputError(
                f"{where}: manifest layers.{index} names no cache ({CACHE_ANNOTATION})"
            )
        if cache in seen:
            raise InputError(f"{where}: manifest lists the {cache} cache twice")
        seen.add(cache)
    return manifest


# --- credentials and TLS -----------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    """What reaching a registry takes beyond its address: a credentials file and a CA
    bundle, and the option that named each (every message about them names it)."""

    auth: Path | None = None
    ca: Path | None = None
    auth_option: str = "flashinfer.registry_auth"
    ca_option: str = "flashinfer.registry_ca"


@dataclass(frozen=True)
class Credentials:
    """A user and a password for one registry. The password is in no repr, message or
    log line; ``source`` says where they came from (a path, an ``auths`` key)."""

    username: str
    password: str = field(repr=False)
    source: str

    @property
    def who(self) -> str:
        return f"user {self.username!r} ({self.source})"

    def header(self) -> str:
        pair = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")


def registry_host(url: str) -> str:
    """``host[:port]``, lowercase, of a registry URL or a config.json ``auths`` key
    (``registry:5000``, ``https://registry:5000``, ``https://index.docker.io/v1/``)."""
    text = url.strip()
    return urlsplit(text if "://" in text else "//" + text).netloc.lower()


_JSON_SHAPE = '{"auths": {"HOST:PORT": {"auth": "<base64 of USER:PASSWORD>"}}}'
_warned: set[tuple[str, str]] = set()  # (what, path): each said once per process


def load_credentials(path: Path, host: str, option: str) -> Credentials:
    """The credentials for ``host`` in ``path``: a Docker-style config.json (``auths``
    -> host -> ``auth``, base64 of USER:PASSWORD, or ``username`` and ``password``),
    else a file of one ``USER:PASSWORD`` line. The file must be a regular file only
    its owner may read or write (mode 0600). ConfigError naming ``option``, the file
    and what to do otherwise; never a byte of its content. Blocking I/O (one small
    file)."""
    text = _read_private(path, option)
    if text.lstrip().startswith("{"):
        return _from_docker_config(text, path, host, option)
    lines = [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    user, sep, password = (lines[0] if len(lines) == 1 else "").partition(":")
    if not sep or not user or not password:
        raise ConfigError(
            f"{option} {path}: neither a Docker config.json ({_JSON_SHAPE}) nor one "
            "USER:PASSWORD line; write one of them"
        )
    return Credentials(user, password, str(path))


def _read_private(path: Path, option: str) -> str:
    where = f"{option} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: no such file; write the registry's credentials there (mode 0600), "
            f"or unset {option}"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot open it ({exc.strerror}); the supervisor's user must read it"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{where}: mode {mode:04o} lets others than its owner read or change the "
                f"registry credentials; refused: chmod 600 {path}"
            )
        data = os.read(fd, MAX_CREDENTIALS_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CREDENTIALS_BYTES:
        raise ConfigError(f"{where}: over {MAX_CREDENTIALS_BYTES} bytes; not a credentials file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text; not a credentials file") from None


def _from_docker_config(text: str, path: Path, host: str, option: str) -> Credentials:
    where = f"{option} {path}"
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:  # where it broke, never the text (secrets)
        raise ConfigError(
            f"{where}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); "
            f"a Docker config.json is {_JSON_SHAPE}"
        ) from None
    auths = document.get("auths") if isinstance(document, dict) else None
    if not isinstance(auths, dict):
        raise ConfigError(f'{where}: a JSON file with no "auths" object; expected {_JSON_SHAPE}')
    keys = [key for key in auths if registry_host(key) == host]
    if not keys:
        helpers = (
            " (credential helpers, credsStore and credHelpers, are not used)"
            if isinstance(document, dict)
            and ("credsStore" in document or "credHelpers" in document)
            else ""
        )
        known = ", ".join(sorted(auths)) or "none"
        raise ConfigError(
            f'{where}: "auths" has no entry for {host} (it has: {known}){helpers}; add '
            f'"{host}": {{"auth": "<base64 of USER:PASSWORD>"}}, or point {option} at the '
            "file that has it"
        )
    key = keys[0]
    at = f"{where}: auths.{key}"
    entry = auths[key]
    if not isinstance(entry, dict):
        raise ConfigError(f"{at}: not a JSON object")
    username, password = entry.get("username"), entry.get("password")
    if entry.get("auth"):
        try:
            pair = base64.b64decode(str(entry["auth"]), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            raise ConfigError(f"{at}.auth: not the base64 of USER:PASSWORD") from None
        username, sep, password = pair.partition(":")
        if not sep:
            raise ConfigError(f"{at}.auth: not the base64 of USER:PASSWORD (no ':')")
    tokens = [name for name in ("identitytoken", "registrytoken") if entry.get(name)]
    if not (isinstance(username, str) and username and isinstance(password, str) and password):
        if tokens:
            raise ConfigError(
                f"{at}: holds only an {tokens[0]} (an OAuth token, as `docker login` keeps "
                "for some registries), which k26-supervisor does not use; give it "
                '"username" and "password", or "auth"'
            )
        raise ConfigError(
            f'{at}: neither "auth" (base64 of USER:PASSWORD) nor "username" and "password"'
        )
    if tokens and (tokens[0], str(path)) not in _warned:
        _warned.add((tokens[0], str(path)))
        log.warning(
            "%s: %s.%s is ignored (k26-supervisor logs in with the username and password)",
            where,
            f"auths.{key}",
            tokens[0],
        )
    return Credentials(username, password, f"{path}, auths.{key}")


def load_ca(path: Path, option: str) -> ssl.SSLContext:
    """A TLS context that trusts the CAs of the PEM bundle ``path`` (and no other);
    ConfigError naming ``option`` otherwise. Blocking I/O (one small file)."""
    where = f"{option} {path}"
    try:
        return ssl.create_default_context(cafile=str(path))
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: no such file; it names the PEM bundle of the CA that signed the "
            "registry's certificate"
        ) from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{where}: no certificate OpenSSL accepts ({exc.reason or exc}); it must be a "
            "PEM bundle (-----BEGIN CERTIFICATE-----)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None


@dataclass(frozen=True)
class Challenge:
    """One challenge of ``WWW-Authenticate``: its scheme (lowercase) and parameters."""

    scheme: str
    params: dict[str, str]


_TCHARS = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_PARAM_RE = re.compile(rf'[\s,]*({_TCHARS})\s*=\s*(?:"((?:[^"\\]|\\.)*)"|({_TCHARS}))')
_SCHEME_RE = re.compile(rf"[\s,]*({_TCHARS})(?=[\s,]|$)")


def parse_challenges(values: Iterable[str]) -> list[Challenge]:
    """The challenges in ``WWW-Authenticate`` header values (RFC 9110 11.6.1: a scheme,
    then ``name=value`` or ``name="quoted"`` parameters, challenges comma-separated).
    Parameter names lowercase, quoted values unescaped. What does not parse ends that
    value's list (a token68 credential, as Negotiate sends, among them)."""
    found: list[Challenge] = []
    for value in values:
        pos, current = 0, None
        while pos < len(value) and value[pos:].strip(" \t,"):
            param = _PARAM_RE.match(value, pos)
            if param is not None and current is not None:
                name, quoted, plain = param.groups()
                text = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else plain
                current.params[name.lower()] = text
                pos = param.end()
                continue
            scheme = _SCHEME_RE.match(value, pos)
            if scheme is None:
                break
            current = Challenge(scheme.group(1).lower(), {})
            found.append(current)
            pos = scheme.end()
    return found


# --- the client ------------------------------------------------------------------------

_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def origin(url: httpx.URL | str) -> tuple[str, str, int]:
    """A URL's origin, ``(scheme, host, port)``, the port filled in for http(s): what
    a credential is tied to (RFC 6454)."""
    parts = httpx.URL(url)
    return parts.scheme, parts.host.lower(), parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)


def _show(where: tuple[str, str, int]) -> str:
    scheme, host, port = where
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + ("" if _DEFAULT_PORTS.get(scheme) == port else f":{port}")


def _encoded(response: httpx.Response) -> str | None:
    """The content coding of ``response`` when it has one (it was asked for none)."""
    coding = response.headers.get("Content-Encoding", "").strip().lower()
    return None if coding in ("", "identity") else coding


async def _read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """At most ``limit`` bytes of a streamed ``response``'s body, as sent (no content
    coding undone); None once there are more (the rest is then never read)."""
    try:
        held = response.content  # read already, by a transport that buffers (a mock)
    except httpx.ResponseNotRead:
        pass
    else:
        return held if len(held) <= limit else None
    buffer = bytearray()
    async for chunk in response.aiter_raw():
        buffer += chunk
        if len(buffer) > limit:
            return None
    return bytes(buffer)


def _buffered(response: httpx.Response, data: bytes) -> httpx.Response:
    """``response`` (closed, its headers, status and final request) with ``data`` as
    its body, as sent: ``Content-Encoding`` is dropped so that nothing decodes it."""
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-encoding"]
    return httpx.Response(
        response.status_code, headers=headers, content=data, request=response.request
    )


def _registry_error(response: httpx.Response) -> str:
    """What the registry said: its error codes and messages, else the status line."""
    text = ""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        errors = response.json().get("errors") or []
        text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors[:3])
    return f"HTTP {response.status_code}" + (f" ({text})" if text else "")


class Registry:
    """One repository of one registry: ``async with Registry(url) as reg: ...``.

    ``access`` names its credentials and CA bundle: both are read here (two small
    files), so that a bad one is said before anything runs (ConfigError)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        chunk_size: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        access: Access | None = None,
    ) -> None:
        try:
            self.base, self.repository = split_registry(url)
        except ValueError as exc:
            raise InputError(f"registry {url!r}: {exc}") from None
        self.url = f"{self.base}/{self.repository}"
        self.timeout_s = timeout_s
        # None: each blob in one PUT; a size: PATCH chunks of that many bytes.
        self.chunk_size = chunk_size
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.access = access or Access()
        auth, ca = self.access.auth, self.access.ca
        host = registry_host(self.base)
        self._credentials = (
            None if auth is None else load_credentials(auth, host, self.access.auth_option)
        )
        self._verify: ssl.SSLContext | bool = (
            True if ca is None else load_ca(ca, self.access.ca_option)
        )
        self._scheme: Literal["basic", "bearer"] | None = None  # as the registry asked
        self._tokens: dict[str, str] = {}  # bearer tokens, by the scope asked for
        self._realm = ""  # the token service's, for messages
        self._pushing = False  # then every token is asked for pull and push
        self._said_plain = False
        self._origin = origin(self.base)  # the one origin credentials are sent to

    async def __aenter__(self) -> Registry:
        self._client = httpx.AsyncClient(
            base_url=self.base,
            timeout=httpx.Timeout(self.timeout_s),
            follow_redirects=True,
            transport=self._transport,
            # Bytes as sent: no content coding to undo, no gzip bomb (docstring).
            headers={"User-Agent": "k26-supervisor", "Accept-Encoding": "identity"},
            verify=self._verify,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- plumbing --

    def _path(self, kind: str, reference: str = "") -> str:
        return f"/v2/{self.repository}/{kind}/{reference}"

    @contextlib.asynccontextmanager
    async def _errors(self, what: str) -> AsyncIterator[None]:
        try:
            yield
        except httpx.TimeoutException:
            raise UnavailableError(
                f"registry {self.url}: {what}: no answer within {self.timeout_s:g} s "
                "(a registry that slow, or a network that drops: check it, or give it "
                "longer with --timeout or flashinfer.registry_timeout_s)"
            ) from None
        except httpx.TransportError as exc:
            hint = "check that the registry runs and that this host reaches that address"
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                hint = (
                    "its certificate is not signed by a CA this host trusts: name the "
                    f"CA's PEM bundle in {self.access.ca_option}"
                )
            raise UnavailableError(
                f"registry {self.url}: {what}: unreachable ({type(exc).__name__}: {exc}); " + hint
            ) from None
        except httpx.TooManyRedirects:
            raise UnavailableError(
                f"registry {self.url}: {what}: redirected in a loop (more than "
                f"{self._client.max_redirects if self._client else 20} hops); check the "
                "registry's or its proxy's redirect rules"
            ) from None

    def _refuse(self, response: httpx.Response, what: str) -> UnavailableError:
        if response.status_code == 401:
            return self._unauthorized(what)
        if response.status_code == 403:
            return AuthRefused(
                f"registry {self.url}: {what}: {_registry_error(response)}: denied to "
                f"{self._who}; grant it access to {self.repository}, or configure other "
                "credentials"
            )
        if response.status_code == 404:
            return NotInRegistry(f"registry {self.url}: {what}: not found")
        return UnavailableError(f"registry {self.url}: {what}: {_registry_error(response)}")

    # -- authentication --

    @property
    def _who(self) -> str:
        if self._credentials is None:
            return "anonymous requests (no credentials configured)"
        return self._credentials.who

    @property
    def _configure(self) -> str:
        return (
            f"name a Docker config.json or a USER:PASSWORD file (mode 0600) in "
            f"{self.access.auth_option} (docs/fleet.md)"
        )

    def _scope(self, method: str) -> str:
        push = self._pushing or method not in ("GET", "HEAD")
        return f"repository:{self.repository}:{'pull,push' if push else 'pull'}"

    def _authorized(self, request: httpx.Request) -> httpx.Request:
        """``request`` with the credentials the registry asked for, if it has; none
        when it goes to another origin than the registry's (an upload location)."""
        if origin(request.url) != self._origin:
            request.headers.pop("Authorization", None)
            return request
        header = None
        if self._scheme == "basic" and self._credentials is not None:
            header = self._credentials.header()
        elif self._scheme == "bearer":
            token = self._tokens.get(self._scope(request.method))
            token = token or self._tokens.get(self._scope("PUT"))
            header = None if token is None else f"Bearer {token}"
        if header is not None:
            request.headers["Authorization"] = header
        return request

    def _unauthorized(self, what: str) -> AuthRefused:
        """A 401 with the credentials the registry asked for: they are not enough."""
        head = f"registry {self.url}: {what}: HTTP 401"
        if self._scheme == "bearer":
            actions = "pull,push" if self._pushing else "pull"
            fix = "configure other credentials" if self._credentials else self._configure
            return AuthRefused(
                f"{head} with a fresh token from {self._realm}: it grants {self._who} no "
                f"{actions} on {self.repository}; grant it, or {fix}"
            )
        if self._credentials is None:
            return AuthRefused(
                f"{head}: it asks for credentials and none are configured; " + self._configure
            )
        return AuthRefused(f"{head}: it refused the credentials of {self._who}; check them")

    def _challenger(self, response: httpx.Response, what: str) -> None:
        """UnavailableError unless the 401 ``response`` came from the registry's
        origin: another host's challenge (a redirect's target, an upload location)
        gets none of the registry's credentials, nor is its realm asked."""
        where = origin(response.url)
        if where != self._origin:
            raise UnavailableError(
                f"registry {self.url}: {what}: HTTP 401 from {_show(where)}, not the "
                f"registry's {_show(self._origin)} (a redirect or an upload location led "
                "there); the registry's credentials are not sent to another host, so it "
                "cannot be answered"
            )

    def _say_plain(self, url: str) -> None:
        if url.startswith("http://") and not self._said_plain:
            self._said_plain = True
            log.warning(
                "registry %s: sending credentials over plain http to %s; use https",
                self.url,
                url,
            )

    async def _login(self, response: httpx.Response, method: str, what: str) -> None:
        """Answer the 401 ``response``: a token from the realm its Bearer challenge
        names, or HTTP basic; AuthRefused when that cannot be."""
        challenges = parse_challenges(response.headers.get_list("WWW-Authenticate"))
        bearer = next((c for c in challenges if c.scheme == "bearer" and "realm" in c.params), None)
        if bearer is not None:
            self._scheme = "bearer"
            await self._fetch_token(bearer, method, what)
            return
        if any(c.scheme == "basic" for c in challenges):
            if self._credentials is None:
                raise self._unauthorized(what)
            if self._scheme == "basic":  # they were sent: refused
                raise self._unauthorized(what)
            self._scheme = "basic"
            self._say_plain(self.base)
            return
        said = ", ".join(sorted({c.scheme for c in challenges})) or "no challenge"
        raise AuthRefused(
            f"registry {self.url}: {what}: HTTP 401 ({said}): k26-supervisor speaks the "
            "Bearer token flow and HTTP basic, which this registry does not offer"
        )

    async def _fetch_token(self, challenge: Challenge, method: str, what: str) -> None:
        """A token for this request's scope (and the challenge's), kept by scope."""
        assert self._client is not None, "use Registry as an async context manager"
        realm = challenge.params["realm"]
        self._realm = realm
        where = f"{what}: token service {realm}"
        parts = urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UnavailableError(f"registry {self.url}: {where}: not an http(s) URL")
        if parts.scheme == "http" and self._origin[0] == "https":
            raise UnavailableError(
                f"registry {self.url}: {where}: plain http under an https registry, which "
                "would send the credentials and the token in the clear; refused (make the "
                "registry's token realm https)"
            )
        needed = self._scope(method)
        scopes = [*challenge.params.get("scope", "").split(), needed]
        service = challenge.params.get("service")
        pairs = [("service", service)] if service else []
        pairs += [("scope", scope) for scope in dict.fromkeys(scopes)]
        params = httpx.QueryParams(tuple(pairs))
        headers = {}
        if self._credentials is not None:
            headers["Authorization"] = self._credentials.header()
            self._say_plain(realm)
        request = self._client.build_request("GET", realm, params=params, headers=headers)
        answer = await self._transmit(request, where, stream=True)
        if answer.status_code in (401, 403):
            if self._credentials is None:
                raise AuthRefused(
                    f"registry {self.url}: {what}: it asks for credentials (a token from "
                    f"{realm}) and none are configured; {self._configure}"
                )
            raise AuthRefused(
                f"registry {self.url}: {where}: HTTP {answer.status_code}: it refused the "
                f"credentials of {self._who}; check them"
            )
        if answer.status_code != 200:
            raise UnavailableError(f"registry {self.url}: {where}: {_registry_error(answer)}")
        try:
            raw = await self._take(
                answer, MAX_CREDENTIALS_BYTES, where, "for a token", UnavailableError
            )
        finally:
            await answer.aclose()
        token = None
        with contextlib.suppress(ValueError):
            body = json.loads(raw)
            token = (
                body.get("token") or body.get("access_token") if isinstance(body, dict) else None
            )
        if not isinstance(token, str) or not token:
            raise UnavailableError(
                f"registry {self.url}: {where}: its answer holds no token (JSON with "
                '"token" or "access_token" expected)'
            )
        self._tokens[needed] = token

    # -- sending --

    async def _transmit(self, request: httpx.Request, what: str, stream: bool) -> httpx.Response:
        """The answer to ``request``; streamed (the caller reads and closes it) when
        ``stream`` and a 200, else read here, at most ``MAX_ANSWER_BYTES`` of it (an
        error's body is for its message; a longer one is cut there)."""
        assert self._client is not None, "use Registry as an async context manager"
        async with self._errors(what):
            response = await self._client.send(request, stream=True)
        if stream and response.status_code == 200:
            return response
        try:
            data = b""
            if _encoded(response) is None:
                async with self._errors(what):
                    data = await _read_capped(response, MAX_ANSWER_BYTES) or b""
        finally:
            await response.aclose()
        return _buffered(response, data)

    async def _take(
        self,
        response: httpx.Response,
        limit: int,
        what: str,
        why: str,
        error: type[UnavailableError] | type[InputError] = InputError,
    ) -> bytes:
        """The body of a streamed ``response``, read as it arrives: ``error`` naming
        ``what`` once it is over ``limit`` bytes (``why`` that limit; the rest is
        never read), or sent with a content coding (it was asked for none)."""
        coding = _encoded(response)
        if coding is not None:
            raise error(
                f"registry {self.url}: {what}: sent with Content-Encoding {coding!r}, "
                "though asked for identity; refused"
            )
        async with self._errors(what):
            data = await _read_capped(response, limit)
        if data is None:
            raise error(f"registry {self.url}: {what}: more than {limit} bytes {why}; refused")
        return data

    async def _send(
        self, make: Callable[[], httpx.Request], what: str, *, stream: bool = False
    ) -> httpx.Response:
        """Send ``make()``'s request with the credentials the registry asked for; on a
        401, log in as its challenge says and send a fresh ``make()`` once more (a
        body is made anew). A second 401 is AuthRefused."""
        request = self._authorized(make())
        response = await self._transmit(request, what, stream)
        if response.status_code != 401:
            return response
        await response.aclose()
        self._challenger(response, what)
        await self._login(response, request.method, what)
        response = await self._transmit(self._authorized(make()), what, stream)
        if response.status_code == 401:
            await response.aclose()
            self._challenger(response, what)
            raise self._unauthorized(what)
        return response

    def _request(self, method: str, url: str | httpx.URL, **kwargs: Any) -> httpx.Request:
        assert self._client is not None, "use Registry as an async context manager"
        return self._client.build_request(method, url, **kwargs)

    # -- blobs --

    async def blob_size(self, digest: str) -> int | None:
        """The size of a blob the registry holds, or None."""
        head = partial(self._request, "HEAD", self._path("blobs", digest))
        response = await self._send(head, digest)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._refuse(response, f"blob {digest}")
        return int(response.headers.get("Content-Length", "-1"))

    async def push_blob(self, source: Path | bytes, digest: str, size: int) -> bool:
        """Upload a blob unless the registry holds it already; True when uploaded.

        The registry checks the bytes against ``digest`` itself (the final PUT names it)."""
        self._pushing = True
        if await self.blob_size(digest) == size:
            return False
        what = f"upload of {digest}"
        post = partial(self._request, "POST", self._path("blobs", "uploads/"))
        started = await self._send(post, what)
        if started.status_code != 202 or "Location" not in started.headers:
            raise self._refuse(started, what)
        location = self._location(started)
        if self.chunk_size is not None:
            offset = 0
            async for chunk in _chunks(source, self.chunk_size):
                headers = {
                    "Content-Type": "application/octet-stream",
                    "Content-Range": f"{offset}-{offset + len(chunk) - 1}",
                    "Content-Length": str(len(chunk)),
                }
                patch = partial(self._request, "PATCH", location, content=chunk, headers=headers)
                patched = await self._send(patch, what)
                if patched.status_code != 202 or "Location" not in patched.headers:
                    raise self._refuse(patched, f"{what} (chunk at {offset})")
                location = self._location(patched)
                offset += len(chunk)
        final = httpx.URL(location).copy_merge_params({"digest": digest})
        length = 0 if self.chunk_size is not None else size
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}

        def put() -> httpx.Request:  # the body anew for each attempt
            body = b"" if self.chunk_size is not None else _chunks(source, CHUNK)
            return self._request("PUT", final, content=body, headers=headers)

        done = await self._send(put, what)
        if done.status_code != 201:
            raise self._refuse(done, what)
        said = done.headers.get("Docker-Content-Digest")
        if said is not None and said != digest:
            raise InputError(f"registry {self.url}: stored {digest} as {said}")
        return True

    def _location(self, response: httpx.Response) -> httpx.URL:
        return httpx.URL(self.base).join(response.headers["Location"])

    async def fetch_blob(self, digest: str, size: int, sink: Path) -> None:
        """Stream a blob to ``sink`` (created, owner-only), checking size and sha256 as
        the bytes arrive; on any failure ``sink`` is removed."""
        what = f"blob {digest}"
        get = partial(self._request, "GET", self._path("blobs", digest))
        response = await self._send(get, what, stream=True)
        try:
            if response.status_code != 200:
                raise self._refuse(response, what)
            fd = await asyncio.to_thread(
                os.open, sink, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
            hasher = hashlib.sha256()
            got = 0
            with os.fdopen(fd, "wb") as handle:
                async with self._errors(what):
                    async for chunk in response.aiter_raw(CHUNK):
                        got += len(chunk)
                        if got > size:
                            raise InputError(
                                f"registry {self.url}: {what}: more than the {size} bytes "
                                "its descriptor says; refused"
                            )
                        await asyncio.to_thread(_write_hashing, handle, hasher, chunk)
                await asyncio.to_thread(_flush, handle)
            if got != size:
                raise InputError(
                    f"registry {self.url}: {what}: {got} bytes, its descriptor says {size}; refused"
                )
            actual = "sha256:" + hasher.hexdigest()
            if actual != digest:
                raise InputError(
                    f"registry {self.url}: {what}: the bytes it sent hash to {actual}; refused"
                )
        except BaseException:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(sink.unlink)
            raise
        finally:
            await response.aclose()

    async def fetch_bytes(self, digest: str, size: int, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """A small blob (a config) in memory, checked like ``fetch_blob``."""
        what = f"blob {digest}"
        if size > limit:
            raise InputError(f"registry {self.url}: {what}: {size} bytes; at most {limit} expected")
        get = partial(self._request, "GET", self._path("blobs", digest))
        response = await self._send(get, what, stream=True)
        try:
            if response.status_code != 200:
                raise self._refuse(response, what)
            data = await self._take(response, size, what, "(its descriptor's size)")
        finally:
            await response.aclose()
        if len(data) != size or sha256_digest(data) != digest:
            raise InputError(
                f"registry {self.url}: {what}: {len(data)} bytes hashing to "
                f"{sha256_digest(data)}, its descriptor says {size} bytes of {digest}; refused"
            )
        return data

    # -- manifests --

    async def put_manifest(self, body: bytes, reference: str) -> str:
        """Store a manifest under a tag (or its digest); its digest."""
        check_reference(reference)
        digest = sha256_digest(body)
        what = f"manifest {reference}"
        self._pushing = True
        request = partial(
            self._request,
            "PUT",
            self._path("manifests", reference),
            content=body,
            headers={"Content-Type": MANIFEST_MEDIA_TYPE},
        )
        response = await self._send(request, what)
        if response.status_code != 201:
            raise self._refuse(response, what)
        said = response.headers.get("Docker-Content-Digest")
        if said is not None and said != digest:
            raise InputError(
                f"registry {self.url}: {what}: stored as {said}, its bytes are {digest}"
            )
        return digest

    async def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """The manifest's bytes and digest, checked: by digest, its bytes must hash to
        it; by tag, to what the registry says it is (``Docker-Content-Digest``)."""
        check_reference(reference)
        what = f"manifest {reference}"
        request = partial(
            self._request,
            "GET",
            self._path("manifests", reference),
            headers={"Accept": MANIFEST_MEDIA_TYPE},
        )
        response = await self._send(request, what, stream=True)
        try:
            if response.status_code != 200:
                raise self._refuse(response, what)
            data = await self._take(
                response, MAX_MANIFEST_BYTES, what, "(the distribution spec's limit for a manifest)"
            )
        finally:
            await response.aclose()
        digest = sha256_digest(data)
        expected = reference if reference.startswith("sha256:") else None
        expected = expected or response.headers.get("Docker-Content-Digest")
        if expected is not None and expected != digest:
            raise InputError(
                f"registry {self.url}: {what}: its bytes hash to {digest}, not {expected}; refused"
            )
        return data, digest


async def _chunks(source: Path | bytes, size: int) -> AsyncIterator[bytes]:
    """``source`` in pieces of ``size`` bytes; a file is read in a worker thread."""
    if isinstance(source, bytes):
        for at in range(0, len(source), size):
            yield source[at : at + size]
        return
    handle = await asyncio.to_thread(source.open, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, size):
            yield chunk
    finally:
        await asyncio.to_thread(handle.close)


def _write_hashing(handle: IO[bytes], hasher: Any, chunk: bytes) -> None:
    hasher.update(chunk)
    handle.write(chunk)


def _flush(handle: IO[bytes]) -> None:
    handle.flush()
    os.fsync(handle.fileno())
