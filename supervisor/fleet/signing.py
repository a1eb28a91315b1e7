"""Signed bundles: cosign's key-pair signature layout, so that a standard tool verifies them.

The pusher signs the artifact's manifest digest; a node configured with public keys
verifies before it writes a byte (docs/fleet.md, "Signed bundles"). The layout is
cosign's (sigstore/cosign ``specs/SIGNATURE_SPEC.md``), by key pair, no Fulcio, no
Rekor:

- the signature lives in the same repository as an OCI image manifest tagged
  ``sha256-<hex of the signed manifest's digest>.sig`` (tag-based discovery);
- each of its layers is a "simple signing" payload
  (``application/vnd.dev.cosign.simplesigning.v1+json``)::

    {"critical":{"identity":{"docker-reference":"<host>/<repository>"},
     "image":{"docker-manifest-digest":"sha256:..."},
     "type":"cosign container image signature"},"optional":null}

- with the base64 of an ASN.1 DER ECDSA signature over the payload's bytes (P-256,
  SHA-256: cosign's default) in the layer annotation
  ``dev.cosignproject.cosign/signature``;
- the manifest's config is the empty image config cosign writes, its ``diff_ids``
  the payloads' digests. Several signers append layers to one manifest.

Keys are PEM: the public key PKIX (``PUBLIC KEY``, what ``cosign verify --key``
reads), the private key PKCS#8 (``PRIVATE KEY``, or ``ENCRYPTED PRIVATE KEY`` with a
passphrase from a file). cosign's own ``ENCRYPTED COSIGN PRIVATE KEY`` (scrypt and
NaCl secretbox) is not read here. Every cryptographic operation is the
``cryptography`` library's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.core.errors import InputError
from supervisor.fleet import registry

if TYPE_CHECKING:  # imported where used: a node that verifies nothing never loads it
    from cryptography.hazmat.primitives.asymmetric import ec

SIMPLE_SIGNING: Final = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION: Final = "dev.cosignproject.cosign/signature"
SIGNATURE_TYPE: Final = "cosign container image signature"
IMAGE_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
# A payload is ~250 bytes; a signature manifest with more layers than this is not
# one a fleet made (each push of a new digest signs it once per key).
MAX_PAYLOAD_BYTES: Final = 64 << 10
MAX_SIGNATURES: Final = 64
_EPOCH: Final = "0001-01-01T00:00:00Z"  # cosign's config: a zero time


class SignatureError(InputError):
    """A bundle that no configured key vouches for: refused, nothing written (exit 65)."""


# --- keys ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublicKey:
    path: Path
    key: ec.EllipticCurvePublicKey

    @property
    def fingerprint(self) -> str:
        """sha256 of the DER public key, as ``openssl pkey -pubin -outform DER | sha256sum``."""
        return hashlib.sha256(_der(self.key)).hexdigest()


@dataclass(frozen=True)
class SigningKey:
    path: Path
    key: ec.EllipticCurvePrivateKey

    def public(self) -> PublicKey:
        return PublicKey(self.path, self.key.public_key())


def _der(key: ec.EllipticCurvePublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _read_secret(path: Path, what: str) -> bytes:
    """A file only its owner may read (mode 0600 or stricter); InputError naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{what} {path}: not a regular file")
        if mode & 0o077:
            raise InputError(
                f"{what} {path}: mode {stat.S_IMODE(mode):04o}, others may read it; "
                f"only its owner may (chmod 600 {path})"
            )
        return handle.read(1 << 20)


def _check_curve(key: object, path: Path, what: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        if isinstance(key.curve, ec.SECP256R1):
            return
        said = f"an ECDSA {key.curve.name} key"
    else:
        said = f"a {type(key).__name__.lstrip('_').removesuffix('Key')} key"
    raise InputError(
        f"{what} {path}: {said}; bundles are signed with ECDSA P-256 (prime256v1, "
        "cosign's default): `openssl ecparam -name prime256v1 -genkey -noout | "
        "openssl pkcs8 -topk8 -nocrypt` makes one"
    )


def load_signing_key(path: Path, passphrase_file: Path | None = None) -> SigningKey:
    """An ECDSA P-256 private key from a PKCS#8 PEM file of mode 0600, decrypted with the
    passphrase in ``passphrase_file`` (mode 0600 too) if it is encrypted. Blocking I/O;
    InputError naming the file and what to do."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    what = "signing key"
    data = _read_secret(path, what)
    password = None
    if passphrase_file is not None:
        password = _read_secret(passphrase_file, "passphrase file").rstrip(b"\r\n")
    if b"-----BEGIN ENCRYPTED COSIGN PRIVATE KEY-----" in data or (
        b"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----" in data
    ):
        raise InputError(
            f"{what} {path}: cosign's own encrypted format (scrypt and secretbox), which "
            "is not PKCS#8; make a PKCS#8 key with openssl and give it to cosign with "
            "`cosign import-key-pair` if cosign must sign with it too"
        )
    try:
        key = serialization.load_pem_private_key(data, password=password)
    except TypeError as exc:  # encrypted without a passphrase, or one given for a plain key
        if password is None:
            raise InputError(
                f"{what} {path}: encrypted; give its passphrase with --sign-passphrase-file"
            ) from None
        raise InputError(f"{what} {path}: {exc}") from None
    except ValueError as exc:
        if password is not None and b"ENCRYPTED PRIVATE KEY" in data:
            raise InputError(f"{what} {path}: cannot decrypt it: wrong passphrase?") from None
        raise InputError(f"{what} {path}: not a PEM PKCS#8 private key ({_first(exc)})") from None
    except UnsupportedAlgorithm as exc:
        raise InputError(f"{what} {path}: unsupported key ({exc})") from None
    _check_curve(key, path, what)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return SigningKey(path, key)


def load_public_key(path: Path) -> PublicKey:
    """An ECDSA P-256 public key from a PEM PKIX file (``cosign public-key`` writes one)
    that no one but its owner may change. Blocking I/O; InputError naming the file."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    what = "public key"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if stat.S_ISREG(mode) and mode & 0o022:
            raise InputError(
                f"{what} {path}: mode {stat.S_IMODE(mode):04o}, others may replace it and "
                f"so choose what this node trusts (chmod 644 {path})"
            )
        data = handle.read(1 << 20)
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise InputError(f"{what} {path}: not a PEM PKIX public key ({_first(exc)})") from None
    except UnsupportedAlgorithm as exc:
        raise InputError(f"{what} {path}: unsupported key ({exc})") from None
    _check_curve(key, path, what)
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return PublicKey(path, key)


def load_public_keys(paths: tuple[Path, ...] | list[Path]) -> list[PublicKey]:
    return [load_public_key(Path(p)) for p in paths]


def _first(exc: Exception) -> str:
    return str(exc).split("\n", 1)[0].split(". See", 1)[0] or type(exc).__name__


# --- payloads and signatures -----------------------------------------------------------


def signature_tag(digest: str) -> str:
    """Where cosign looks for ``digest``'s signatures: ``sha256-<hex>.sig``."""
    registry.check_reference(digest)
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}-{hexdigest}.sig"


def docker_reference(reg: registry.Registry) -> str:
    """The repository as a container tool names it: ``host[:port]/repository``."""
    return f"{reg.base.split('://', 1)[-1]}/{reg.repository}"


def payload(reference: str, digest: str) -> bytes:
    """The simple-signing payload for the manifest ``digest``, as cosign writes it."""
    body = {
        "critical": {
            "identity": {"docker-reference": reference},
            "image": {"docker-manifest-digest": digest},
            "type": SIGNATURE_TYPE,
        },
        "optional": None,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def sign(key: SigningKey, data: bytes) -> str:
    """The base64 of an ASN.1 DER ECDSA P-256 signature over sha256(``data``)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    return base64.b64encode(key.key.sign(data, ec.ECDSA(hashes.SHA256()))).decode()


def verifies(key: PublicKey, data: bytes, signature: str) -> bool:
    """Whether ``signature`` (base64 DER) is ``key``'s over ``data``."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        return False
    try:
        key.key.verify(raw, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def signed_digest(data: bytes) -> str:
    """The manifest digest a verified payload vouches for; InputError saying what is
    wrong with it. Checked only after its signature verified."""
    try:
        body = json.loads(data)
        critical = body["critical"]
        kind = critical["type"]
        digest = critical["image"]["docker-manifest-digest"]
    except (ValueError, KeyError, TypeError):
        raise InputError("its payload is not a simple-signing payload") from None
    if kind != SIGNATURE_TYPE:
        raise InputError(f"its payload's type is {kind!r}, not {SIGNATURE_TYPE!r}")
    if not isinstance(digest, str) or not registry.DIGEST_RE.fullmatch(digest):
        raise InputError(f"its payload names no manifest digest ({digest!r})")
    return digest


# --- the signature manifest ------------------------------------------------------------


class _Lenient(BaseModel):
    """A signature manifest another tool (cosign) may have written: unknown fields kept
    out of the way, not refused."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class SignatureManifest(_Lenient):
    schemaVersion: int = 2
    mediaType: str = registry.MANIFEST_MEDIA_TYPE
    config: registry.Descriptor
    layers: tuple[registry.Descriptor, ...] = Field(max_length=MAX_SIGNATURES)

    def body(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


def parse_signatures(raw: bytes, where: str) -> SignatureManifest:
    try:
        return SignatureManifest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top)"
        raise SignatureError(
            f"{where}: its signature manifest is not one: field {field}: {first['msg']}"
        ) from None


def image_config(layers: tuple[registry.Descriptor, ...]) -> bytes:
    """The config cosign gives a signature manifest: an empty image whose layers are
    the payloads."""
    body = {
        "architecture": "",
        "created": _EPOCH,
        "history": [{"created": _EPOCH}],
        "os": "",
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        "config": {},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def signature_layer(data: bytes, signature: str) -> registry.Descriptor:
    return registry.Descriptor(
        mediaType=SIMPLE_SIGNING,
        digest=registry.sha256_digest(data),
        size=len(data),
        annotations={SIGNATURE_ANNOTATION: signature},
    )


def with_layer(
    existing: SignatureManifest | None, layer: registry.Descriptor
) -> tuple[SignatureManifest, bytes]:
    """``existing`` (or none) with ``layer`` appended, and its new config's bytes."""
    layers = (*(() if existing is None else existing.layers), layer)
    config = image_config(layers)
    manifest = SignatureManifest(
        config=registry.Descriptor(
            mediaType=IMAGE_CONFIG, digest=registry.sha256_digest(config), size=len(config)
        ),
        layers=layers,
    )
    return manifest, config


async def _existing(reg: registry.Registry, tag: str, where: str) -> SignatureManifest | None:
    try:
        raw, _ = await reg.get_manifest(tag)
    except registry.NotInRegistry:
        return None
    return parse_signatures(raw, where)


async def _payloads(reg: registry.Registry, manifest: SignatureManifest) -> list[tuple[bytes, str]]:
    """Each simple-signing layer's payload (checked against its digest) and signature."""
    found: list[tuple[bytes, str]] = []
    for layer in manifest.layers:
        signature = (layer.annotations or {}).get(SIGNATURE_ANNOTATION)
        if layer.mediaType != SIMPLE_SIGNING or not signature:
            continue
        if layer.size > MAX_PAYLOAD_BYTES:
            continue
        try:
            data = await reg.fetch_bytes(layer.digest, layer.size, MAX_PAYLOAD_BYTES)
        except registry.NotInRegistry:
            continue
        found.append((data, signature))
    return found


async def sign_manifest(reg: registry.Registry, key: SigningKey, digest: str) -> dict[str, Any]:
    """Sign the manifest ``digest`` in ``reg``'s repository, cosign's way: the payload
    blob, the config blob, then the ``.sig`` manifest (appended to one already there,
    unless it holds this key's signature of ``digest`` already)."""
    tag = signature_tag(digest)
    where = f"{reg.url}:{tag}"
    existing = await _existing(reg, tag, where)
    public = key.public()
    if existing is not None:
        for data, signature in await _payloads(reg, existing):
            if verifies(public, data, signature):
                try:
                    if signed_digest(data) == digest:
                        return {"tag": tag, "added": False, "key": public.fingerprint}
                except InputError:
                    continue
    data = payload(docker_reference(reg), digest)
    layer = signature_layer(data, sign(key, data))
    manifest, config = with_layer(existing, layer)
    await reg.push_blob(data, layer.digest, layer.size)
    await reg.push_blob(config, manifest.config.digest, manifest.config.size)
    await reg.put_manifest(manifest.body(), tag)
    return {"tag": tag, "added": True, "key": public.fingerprint}


async def verify_manifest(
    reg: registry.Registry, digest: str, keys: list[PublicKey], where: str
) -> PublicKey:
    """The configured key that signed the manifest ``digest``; SignatureError (one line,
    naming the digest) when none did. Reads the registry only."""
    assert keys, "verify_manifest takes at least one key"
    tag = signature_tag(digest)
    names = ", ".join(str(k.path) for k in keys)
    refused = f"{where}: refused, not signed by a configured key ({names})"
    try:
        existing = await _existing(reg, tag, where)
    except SignatureError as exc:
        raise SignatureError(f"{refused}: {str(exc).removeprefix(where + ': ')}") from None
    if existing is None:
        raise SignatureError(f"{refused}: unsigned (no signature manifest {tag}); nothing written")
    try:
        payloads = await _payloads(reg, existing)
    except InputError as exc:  # a payload blob that is not its digest
        raise SignatureError(f"{refused}: {exc}; nothing written") from None
    wrong: list[str] = []
    for data, signature in payloads:
        for key in keys:
            if not verifies(key, data, signature):
                continue
            try:
                named = signed_digest(data)
            except InputError as exc:
                wrong.append(f"a signature by {key.path}: {exc}")
                continue
            if named == digest:
                return key
            wrong.append(f"a signature by {key.path} is of {named}, not this manifest")
    if wrong:
        said = "; ".join(wrong)
    elif payloads:
        said = f"none of its {len(payloads)} signature(s) verifies with these keys"
    else:
        said = f"its signature manifest {tag} holds no cosign signature"
    raise SignatureError(f"{refused}: {said}; nothing written")
