"""Signed bundles without a registry process: keys, payloads, signatures, and the
signature manifest through an in-memory OCI registry (httpx's MockTransport).

The real registry, the CLI and openssl/skopeo interop are
tests/integration/test_registry_signing.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from supervisor.core.config import FlashInferSection
from supervisor.core.errors import InputError
from supervisor.fleet import registry, signing

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
URL = "http://registry.test:5000/k26/bundles"


def pem_private(
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, password: bytes = b""
) -> bytes:
    crypt = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt)


def pem_public(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def write(path: Path, data: bytes, mode: int) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.fixture
def pair(tmp_path: Path) -> tuple[signing.SigningKey, signing.PublicKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    private = write(tmp_path / "build.key", pem_private(key), 0o600)
    public = write(tmp_path / "build.pub", pem_public(key), 0o644)
    return signing.load_signing_key(private), signing.load_public_key(public)


def other_key(tmp_path: Path) -> signing.SigningKey:
    key = ec.generate_private_key(ec.SECP256R1())
    return signing.load_signing_key(write(tmp_path / "other.key", pem_private(key), 0o600))


# --- the payload and the signature --------------------------------------------------------


def test_the_payload_is_cosigns_simple_signing_layout() -> None:
    data = signing.payload("registry.test:5000/k26/bundles", DIGEST_A)
    assert data == (
        b'{"critical":{"identity":{"docker-reference":"registry.test:5000/k26/bundles"},'
        b'"image":{"docker-manifest-digest":"' + DIGEST_A.encode() + b'"},'
        b'"type":"cosign container image signature"},"optional":null}'
    )
    assert signing.signed_digest(data) == DIGEST_A
    assert signing.signature_tag(DIGEST_A) == "sha256-" + "a" * 64 + ".sig"
    assert signing.docker_reference(registry.Registry(URL)) == "registry.test:5000/k26/bundles"


def test_a_signature_verifies_with_its_key_only(
    pair: tuple[signing.SigningKey, signing.PublicKey], tmp_path: Path
) -> None:
    private, public = pair
    data = signing.payload("r/k26", DIGEST_A)
    signature = signing.sign(private, data)
    der = base64.b64decode(signature)
    assert der[0] == 0x30  # an ASN.1 DER SEQUENCE (r, s), as cosign and openssl write it
    assert signing.verifies(public, data, signature)
    assert not signing.verifies(other_key(tmp_path).public(), data, signature)
    assert not signing.verifies(public, data.replace(b"a", b"b"), signature)
    assert not signing.verifies(public, data, "not base64!")
    assert not signing.verifies(public, data, base64.b64encode(b"\x30\x00").decode())
    assert public.fingerprint == private.public().fingerprint


def test_a_payload_that_is_not_a_signature_of_a_digest_is_refused() -> None:
    for body, said in (
        (b"[]", "not a simple-signing payload"),
        (b'{"critical": {}}', "not a simple-signing payload"),
        (
            json.dumps({"critical": {"type": "atomic container signature", "image": {}}}).encode(),
            "not a simple-signing payload",
        ),
        (
            json.dumps(
                {
                    "critical": {
                        "type": "atomic container signature",
                        "image": {"docker-manifest-digest": DIGEST_A},
                    }
                }
            ).encode(),
            "type is 'atomic container signature'",
        ),
        (signing.payload("r", "sha256:short"), "names no manifest digest"),
    ):
        with pytest.raises(InputError, match=re.escape(said)):
            signing.signed_digest(body)


# --- keys -------------------------------------------------------------------------------


def test_a_private_key_others_may_read_is_refused_naming_the_file(tmp_path: Path) -> None:
    key = write(tmp_path / "k.pem", pem_private(ec.generate_private_key(ec.SECP256R1())), 0o640)
    with pytest.raises(InputError) as caught:
        signing.load_signing_key(key)
    assert str(caught.value) == (
        f"signing key {key}: mode 0640, others may read it; only its owner may (chmod 600 {key})"
    )
    key.chmod(0o400)
    assert signing.load_signing_key(key).path == key
    with pytest.raises(InputError, match=f"signing key {tmp_path / 'none'}: cannot read it"):
        signing.load_signing_key(tmp_path / "none")
    (tmp_path / "link").symlink_to(key)
    with pytest.raises(InputError, match="cannot read it"):
        signing.load_signing_key(tmp_path / "link")


def test_keys_that_are_not_pem_or_not_p256_are_refused_naming_the_file(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.pem", b"-----BEGIN PRIVATE KEY-----\nnope\n", 0o600)
    with pytest.raises(InputError, match=f"^signing key {bad}: not a PEM PKCS#8 private key"):
        signing.load_signing_key(bad)
    p384 = ec.generate_private_key(ec.SECP384R1())
    wrong = write(tmp_path / "p384.pem", pem_private(p384), 0o600)
    with pytest.raises(InputError, match=f"^signing key {wrong}: an ECDSA secp384r1 key; .*P-256"):
        signing.load_signing_key(wrong)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    wrong = write(tmp_path / "rsa.pem", pem_private(rsa_key), 0o600)
    with pytest.raises(InputError, match=f"^signing key {wrong}: a RSAPrivate key; .*P-256"):
        signing.load_signing_key(wrong)
    cosign = write(
        tmp_path / "cosign.key",
        b"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\neyJr\n"
        b"-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n",
        0o600,
    )
    with pytest.raises(InputError, match="cosign's own encrypted format"):
        signing.load_signing_key(cosign)

    garbage = write(tmp_path / "pub.pem", b"hello", 0o644)
    with pytest.raises(InputError, match=f"^public key {garbage}: not a PEM PKIX public key"):
        signing.load_public_key(garbage)
    wrong = write(tmp_path / "p384.pub", pem_public(p384), 0o644)
    with pytest.raises(InputError, match=f"^public key {wrong}: an ECDSA secp384r1 key"):
        signing.load_public_key(wrong)
    writable = write(
        tmp_path / "ok.pub", pem_public(ec.generate_private_key(ec.SECP256R1())), 0o664
    )
    with pytest.raises(InputError, match=f"public key {writable}: mode 0664, others may replace"):
        signing.load_public_key(writable)
    with pytest.raises(InputError, match=f"public key {tmp_path / 'no.pub'}: cannot read it"):
        signing.load_public_keys([tmp_path / "no.pub"])


def test_an_encrypted_key_takes_its_passphrase_from_a_private_file(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    locked = write(tmp_path / "k.pem", pem_private(key, b"s3cret"), 0o600)
    passphrase = write(tmp_path / "pass", b"s3cret\n", 0o600)
    loaded = signing.load_signing_key(locked, passphrase)
    assert loaded.key.private_numbers() == key.private_numbers()
    with pytest.raises(InputError, match=f"signing key {locked}: encrypted; give its passphrase"):
        signing.load_signing_key(locked)
    wrong = write(tmp_path / "wrong", b"nope\n", 0o600)
    with pytest.raises(InputError, match=f"signing key {locked}: cannot decrypt it"):
        signing.load_signing_key(locked, wrong)
    passphrase.chmod(0o644)
    with pytest.raises(InputError, match=f"passphrase file {passphrase}: mode 0644"):
        signing.load_signing_key(locked, passphrase)


def test_the_config_takes_absolute_key_paths() -> None:
    section = FlashInferSection.model_validate(
        {"registry_keys": ["/etc/k26-supervisor/keys/build.pub"]}
    )
    assert section.registry_keys == (Path("/etc/k26-supervisor/keys/build.pub"),)
    assert FlashInferSection().registry_keys == ()
    with pytest.raises(ValueError, match="must be absolute paths"):
        FlashInferSection.model_validate({"registry_keys": ["keys/build.pub"]})
    with pytest.raises(ValueError, match="lists a key twice"):
        FlashInferSection.model_validate({"registry_keys": ["/k.pub", "/k.pub"]})


# --- through a registry ---------------------------------------------------------------------


class MemoryRegistry:
    """Just enough of the distribution API, in memory: blobs, uploads, manifests."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if "/blobs/uploads/" in path:
            if request.method == "POST":
                return httpx.Response(202, headers={"Location": "/v2/k26/bundles/blobs/uploads/1"})
            digest = request.url.params["digest"]
            self.blobs[digest] = request.read()
            return httpx.Response(201, headers={"Docker-Content-Digest": digest})
        kind, _, reference = path.rpartition("/")
        if kind.endswith("/blobs"):
            blob = self.blobs.get(reference)
            if blob is None:
                return httpx.Response(404)
            headers = {"Content-Length": str(len(blob))}
            return httpx.Response(
                200, content=b"" if request.method == "HEAD" else blob, headers=headers
            )
        if request.method == "PUT":
            body = request.read()
            self.manifests[reference] = body
            digest = registry.sha256_digest(body)
            self.manifests[digest] = body
            return httpx.Response(201, headers={"Docker-Content-Digest": digest})
        found = self.manifests.get(reference)
        if found is None:
            return httpx.Response(404)
        return httpx.Response(
            200, content=found, headers={"Docker-Content-Digest": registry.sha256_digest(found)}
        )


def client(memory: MemoryRegistry) -> registry.Registry:
    return registry.Registry(URL, transport=httpx.MockTransport(memory))


async def test_a_signature_is_cosigns_manifest_and_verifies(
    pair: tuple[signing.SigningKey, signing.PublicKey], tmp_path: Path
) -> None:
    private, public = pair
    memory = MemoryRegistry()
    async with client(memory) as reg:
        signed = await signing.sign_manifest(reg, private, DIGEST_A)
        assert signed == {
            "tag": signing.signature_tag(DIGEST_A),
            "added": True,
            "key": public.fingerprint,
        }
        # Signing the same digest with the same key again adds nothing.
        assert (await signing.sign_manifest(reg, private, DIGEST_A))["added"] is False
        assert await signing.verify_manifest(reg, DIGEST_A, [public], "here") == public

        raw = json.loads(memory.manifests[signed["tag"]])
        assert raw["mediaType"] == registry.MANIFEST_MEDIA_TYPE
        assert raw["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
        (layer,) = raw["layers"]
        assert layer["mediaType"] == "application/vnd.dev.cosign.simplesigning.v1+json"
        data = memory.blobs[layer["digest"]]
        assert layer["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert json.loads(data)["critical"]["image"]["docker-manifest-digest"] == DIGEST_A
        assert signing.verifies(public, data, layer["annotations"][signing.SIGNATURE_ANNOTATION])
        config = json.loads(memory.blobs[raw["config"]["digest"]])
        assert config["rootfs"] == {"type": "layers", "diff_ids": [layer["digest"]]}

        # A second signer appends its layer; either key verifies.
        other = other_key(tmp_path)
        assert (await signing.sign_manifest(reg, other, DIGEST_A))["added"] is True
        assert len(json.loads(memory.manifests[signed["tag"]])["layers"]) == 2
        found = await signing.verify_manifest(reg, DIGEST_A, [other.public()], "here")
        assert found.path == other.path


async def test_unsigned_other_key_and_replayed_signatures_are_refused_naming_the_digest(
    pair: tuple[signing.SigningKey, signing.PublicKey], tmp_path: Path
) -> None:
    private, public = pair
    memory = MemoryRegistry()
    where = f"{URL}@{DIGEST_A}"
    async with client(memory) as reg:
        with pytest.raises(signing.SignatureError) as caught:
            await signing.verify_manifest(reg, DIGEST_A, [public], where)
        said = str(caught.value)
        assert said.startswith(f"{where}: refused, not signed by a configured key ({public.path})")
        assert f"unsigned (no signature manifest {signing.signature_tag(DIGEST_A)})" in said
        assert "\n" not in said and caught.value.exit_code == 65

        await signing.sign_manifest(reg, other_key(tmp_path), DIGEST_A)
        with pytest.raises(signing.SignatureError, match="none of its 1 signature"):
            await signing.verify_manifest(reg, DIGEST_A, [public], where)

        # Our signature of B, put where A's signatures are: it verifies, but is B's.
        await signing.sign_manifest(reg, private, DIGEST_B)
        memory.manifests[signing.signature_tag(DIGEST_A)] = memory.manifests[
            signing.signature_tag(DIGEST_B)
        ]
        with pytest.raises(signing.SignatureError, match=f"is of {DIGEST_B}, not this manifest"):
            await signing.verify_manifest(reg, DIGEST_A, [public], where)

        memory.manifests[signing.signature_tag(DIGEST_A)] = b'{"layers": "no"}'
        with pytest.raises(signing.SignatureError, match="its signature manifest is not one"):
            await signing.verify_manifest(reg, DIGEST_A, [public], where)
