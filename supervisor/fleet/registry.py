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
reference it does not hold is ``NotInRegistry``. No credentials: a registry that
asks for them is refused with that said.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any, Final, Literal

import httpx
from pydantic import Field

from supervisor.core.config import split_registry
from supervisor.core.errors import InputError, UnavailableError
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


# --- the client ------------------------------------------------------------------------


def _registry_error(response: httpx.Response) -> str:
    """What the registry said: its error codes and messages, else the status line."""
    text = ""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        errors = response.json().get("errors") or []
        text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors[:3])
    return f"HTTP {response.status_code}" + (f" ({text})" if text else "")


class Registry:
    """One repository of one registry: ``async with Registry(url) as reg: ...``."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        chunk_size: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
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

    async def __aenter__(self) -> Registry:
        self._client = httpx.AsyncClient(
            base_url=self.base,
            timeout=httpx.Timeout(self.timeout_s),
            follow_redirects=True,
            transport=self._transport,
            headers={"User-Agent": "k26-supervisor"},
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
            raise UnavailableError(
                f"registry {self.url}: {what}: unreachable ({type(exc).__name__}: {exc}); "
                "check that the registry runs and that this host reaches that address"
            ) from None

    def _refuse(self, response: httpx.Response, what: str) -> UnavailableError:
        if response.status_code in (401, 403):
            return UnavailableError(
                f"registry {self.url}: {what}: {_registry_error(response)}: it asks for "
                "credentials; k26-supervisor talks to registries that need none "
                "(put the bundles in a repository the nodes may read without a login)"
            )
        if response.status_code == 404:
            return NotInRegistry(f"registry {self.url}: {what}: not found")
        return UnavailableError(f"registry {self.url}: {what}: {_registry_error(response)}")

    async def _send(
        self, request: httpx.Request, what: str, *, stream: bool = False
    ) -> httpx.Response:
        assert self._client is not None, "use Registry as an async context manager"
        async with self._errors(what):
            return await self._client.send(request, stream=stream)

    def _request(self, method: str, url: str | httpx.URL, **kwargs: Any) -> httpx.Request:
        assert self._client is not None, "use Registry as an async context manager"
        return self._client.build_request(method, url, **kwargs)

    # -- blobs --

    async def blob_size(self, digest: str) -> int | None:
        """The size of a blob the registry holds, or None."""
        response = await self._send(self._request("HEAD", self._path("blobs", digest)), digest)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._refuse(response, f"blob {digest}")
        return int(response.headers.get("Content-Length", "-1"))

    async def push_blob(self, source: Path | bytes, digest: str, size: int) -> bool:
        """Upload a blob unless the registry holds it already; True when uploaded.

        The registry checks the bytes against ``digest`` itself (the final PUT names it)."""
        if await self.blob_size(digest) == size:
            return False
        what = f"upload of {digest}"
        started = await self._send(self._request("POST", self._path("blobs", "uploads/")), what)
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
                patched = await self._send(
                    self._request("PATCH", location, content=chunk, headers=headers), what
                )
                if patched.status_code != 202 or "Location" not in patched.headers:
                    raise self._refuse(patched, f"{what} (chunk at {offset})")
                location = self._location(patched)
                offset += len(chunk)
            body: bytes | AsyncIterator[bytes] = b""
            length = 0
        else:
            body, length = _chunks(source, CHUNK), size
        final = httpx.URL(location).copy_merge_params({"digest": digest})
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}
        done = await self._send(self._request("PUT", final, content=body, headers=headers), what)
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
        response = await self._send(
            self._request("GET", self._path("blobs", digest)), what, stream=True
        )
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
        response = await self._send(self._request("GET", self._path("blobs", digest)), what)
        if response.status_code != 200:
            raise self._refuse(response, what)
        data = response.content
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
        request = self._request(
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
        request = self._request(
            "GET", self._path("manifests", reference), headers={"Accept": MANIFEST_MEDIA_TYPE}
        )
        response = await self._send(request, what)
        if response.status_code != 200:
            raise self._refuse(response, what)
        data = response.content
        if len(data) > MAX_MANIFEST_BYTES:
            raise InputError(f"registry {self.url}: {what}: {len(data)} bytes; too large")
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
