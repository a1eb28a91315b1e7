"""Signed bundles through a real OCI registry: signed push, verified pull, and every
refusal with no file changed; then the signature checked by standard tools.

The registry is Debian's docker-registry (bench/fleet_registry.py), the bundle the
session's small FlashInfer build plus Triton's and inductor's caches
(test_registry.py's ``Node``); the keys are made by openssl. The variants (unsigned,
another key, a replayed or forged signature) are made with the registry client and
``signing`` itself, as an attacker who can push would make them; every pull goes
through the real CLI.

Interop: the real cosign (2.5.0, Debian 13's, unpacked by scripts/tools.sh) verifies
what we signed and refuses it under another key, and a node verifies what cosign signed
with a key pair cosign made. openssl verifies our signature over the payload the
registry serves.
Debian 12's skopeo 1.9.3 finds our ``.sig`` manifest and fetches its payload under a
``sigstoreSigned`` policy, but its containers/image (5.23.1, Debian) rejects every
image with "Debian-local change: sigstore disabled" (docs/fleet.md, "Signed
bundles"): the test checks that it got that far, and checks acceptance and
refusal instead where a skopeo can verify.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fleet_registry import RegistryProcess
from supervisor.adapters.warmup import Warmup
from supervisor.core.config import FlashInferSection
from supervisor.core.status import StatusBoard
from supervisor.flashinfer import cache
from supervisor.fleet import accepted, distribute, registry, signing
from supervisor.fleet.registry import Registry

from .builds import ARCH, SMALL_MODULE
from .test_registry import Node, k26, refused

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]


class Keys:
    """Two ECDSA P-256 pairs made by openssl: PKCS#8 private keys, PKIX public keys."""

    def __init__(self, base: Path) -> None:
        base.mkdir()
        self.build, self.build_pub = self.make(base, "build")
        self.other, self.other_pub = self.make(base, "other")

    @staticmethod
    def make(base: Path, name: str) -> tuple[Path, Path]:
        key, pub = base / f"{name}.key", base / f"{name}.pub"
        ec = subprocess.run(
            ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout"],
            capture_output=True, check=True,
        )  # fmt: skip
        subprocess.run(["openssl", "pkcs8", "-topk8", "-nocrypt", "-out", str(key)],
                       input=ec.stdout, capture_output=True, check=True)  # fmt: skip
        key.chmod(0o600)
        subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)],
                       capture_output=True, check=True)  # fmt: skip
        return key, pub


def signed_push(node: Node, url: str, base: Path) -> tuple[Keys, dict[str, Any]]:
    """Keys made in ``base``, the node's caches filled and pushed to ``url`` signed
    by the build key; the keys and the push's account."""
    keys = Keys(base / "keys")
    node.fill()
    return keys, node.push(url, "--sign-key", str(keys.build))


async def forge(url: str, good: str, other: Path) -> dict[str, str]:
    """What someone who can push makes of the signed bundle ``good``: a copy with one
    annotation changed (tagged ``tampered``), signed in turn by another key, by
    ``good``'s own signature manifest, and by ``good``'s signature over a payload
    rewritten to name the copy. Each signature manifest's bytes, by what it is."""
    async with Registry(url) as reg:
        raw, _ = await reg.get_manifest(good)
        manifest = registry.parse_manifest(raw, url)
        changed = manifest.model_copy(
            update={"annotations": {**manifest.annotations, "io.k26.arch": "evil"}}
        )
        tampered = await reg.put_manifest(changed.body(), "tampered")
        tag = signing.signature_tag(tampered)
        good_sig, _ = await reg.get_manifest(signing.signature_tag(good))
        await signing.sign_manifest(reg, signing.load_signing_key(other), tampered)
        other_sig, _ = await reg.get_manifest(tag)
        (layer,) = signing.parse_signatures(good_sig, url).layers
        payload = signing.payload(signing.docker_reference(reg), tampered)
        await reg.push_blob(payload, registry.sha256_digest(payload), len(payload))
        signature = (layer.annotations or {})[signing.SIGNATURE_ANNOTATION]
        forged, config = signing.with_layer(None, signing.signature_layer(payload, signature))
        await reg.push_blob(config, forged.config.digest, forged.config.size)
        return {
            "digest": tampered,
            "tag": tag,
            "other": other_sig.decode(),
            "replayed": good_sig.decode(),
            "forged": forged.body().decode(),
        }


async def put_signature(url: str, tag: str, body: str) -> None:
    async with Registry(url) as reg:
        await reg.put_manifest(body.encode(), tag)


def test_only_a_bundle_signed_by_a_configured_key_is_installed(
    node: Node, registry_proc: RegistryProcess, tmp_path: Path
) -> None:
    url = registry_proc.url
    keys, pushed = signed_push(node, url, tmp_path)
    digest = pushed["digest"]
    assert pushed["signature"]["tag"] == signing.signature_tag(digest)
    assert pushed["signature"]["added"] is True
    before = node.files()
    node.wipe()
    node.build.restore()  # FlashInfer warm here: a pull would replace it
    unchanged = node.all_files()
    pull = ["flashinfer", "bundle", "pull", *node.args(), *node.state_args(), "--registry", url]
    trusted = ["--verify-key", str(keys.build_pub)]

    # Signed, but by a key this node does not trust.
    said = refused(k26(*pull, "--verify-key", str(keys.other_pub)), 65)
    assert f"{url}@{digest}: refused, not signed by a configured key ({keys.other_pub})" in said
    assert "none of its 1 signature(s) verifies" in said and "nothing written" in said
    assert node.all_files() == unchanged

    # A copy with one annotation changed: unsigned; signed by another key; carrying
    # the original's signature manifest; carrying a payload rewritten to name it.
    forged = asyncio.run(forge(url, digest, keys.other))
    copy = ["--tag", "tampered", *trusted]
    said = refused(k26(*pull, *copy), 65)
    assert f"{url}@{forged['digest']}: refused" in said and "none of its 1 signature" in said
    for body, expected in (
        ("replayed", f"a signature by {keys.build_pub} is of {digest}, not this manifest"),
        ("forged", "none of its 1 signature(s) verifies with these keys"),
    ):
        asyncio.run(put_signature(url, forged["tag"], forged[body]))
        said = refused(k26(*pull, *copy), 65)
        assert f"{url}@{forged['digest']}: refused" in said and expected in said, body
    asyncio.run(delete_manifest(registry_proc, forged["tag"]))
    said = refused(k26(*pull, *copy), 65)
    assert f"unsigned (no signature manifest {forged['tag']})" in said
    assert node.all_files() == unchanged
    assert not list(cache.cache_root(node.workspace).glob("k26-pull-work/*"))

    # Any one trusted key will do; without keys, the old behaviour and one warning.
    node.wipe()
    done = k26(*pull, "--verify-key", str(keys.other_pub), *trusted)
    assert done.returncode == 0, done.stderr
    assert f"signature: verified with {keys.build_pub}" in done.stdout
    assert "without verifying" not in done.stderr
    assert node.files() == before
    node.wipe()
    done = k26(*pull, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verified_by"] is None
    warned = [line for line in done.stderr.splitlines() if "without verifying" in line]
    assert len(warned) == 1 and digest in warned[0], done.stderr
    assert node.files() == before

    check_with_standard_tools(registry_proc, digest, keys)

    # cosign's own signature, by a key pair cosign made, is what a node verifies too.
    theirs = cosign_signs(registry_proc, digest, tmp_path / "cosign")
    node.wipe()
    done = k26(*pull, "--verify-key", str(theirs))
    assert done.returncode == 0, done.stderr
    assert f"signature: verified with {theirs}" in done.stdout
    assert node.files() == before


async def delete_manifest(registry_proc: RegistryProcess, tag: str) -> None:
    """The registry forgets a tag's manifest (its storage is ours: delete is enabled)."""
    async with httpx.AsyncClient(base_url=registry_proc.base) as client:
        repo = registry_proc.url.removeprefix(registry_proc.base + "/")
        got = await client.head(
            f"/v2/{repo}/manifests/{tag}", headers={"Accept": registry.MANIFEST_MEDIA_TYPE}
        )
        digest = got.headers["Docker-Content-Digest"]
        gone = await client.delete(f"/v2/{repo}/manifests/{digest}")
        assert gone.status_code == 202, gone.text


def cosign() -> str:
    """The real cosign (scripts/tools.sh unpacks Debian 13's; on PATH in tests)."""
    found = shutil.which("cosign")
    if found is None:
        pytest.fail("cosign not found: scripts/tools.sh unpacks it (scripts/dev.sh test runs it)")
    return found


def run_cosign(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    """cosign by key pair alone: no transparency log, plain HTTP to the test's registry,
    its home (and any config it would write) in the test's directory."""
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "COSIGN_PASSWORD": "k26-test"}
    return subprocess.run([cosign(), *args], capture_output=True, text=True, env=env, timeout=60)


def cosign_verifies(registry_proc: RegistryProcess, digest: str, keys: Keys) -> None:
    """``cosign verify --key`` accepts what we pushed with the key that signed it, and
    refuses it with another; the payload it prints names the digest."""
    image = f"{registry_proc.url.removeprefix('http://')}@{digest}"
    home = keys.build.parent / "cosign-home"
    flags = ["--insecure-ignore-tlog=true", "--allow-http-registry", image]
    ours = run_cosign(["verify", "--key", str(keys.build_pub), *flags], home)
    assert ours.returncode == 0, ours.stderr
    assert "The signatures were verified against the specified public key" in ours.stderr
    (claims,) = json.loads(ours.stdout)
    assert claims["critical"]["image"] == {"docker-manifest-digest": digest}
    other = run_cosign(["verify", "--key", str(keys.other_pub), *flags], home)
    assert other.returncode != 0 and "no matching signatures" in other.stderr, other.stderr


def cosign_signs(registry_proc: RegistryProcess, digest: str, work: Path) -> Path:
    """cosign makes a key pair of its own and signs ``digest`` (appended to the
    signature manifest already there); its public key."""
    work.mkdir()
    made = run_cosign(["generate-key-pair", "--output-key-prefix", str(work / "cosign")], work)
    assert made.returncode == 0, made.stderr
    image = f"{registry_proc.url.removeprefix('http://')}@{digest}"
    signed = run_cosign(
        ["sign", "--key", str(work / "cosign.key"), "--tlog-upload=false", "--yes",
         "--allow-http-registry", image],
        work,
    )  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    tag = signing.signature_tag(digest)
    base, repo = registry_proc.base, registry_proc.url.removeprefix(registry_proc.base + "/")
    accept = {"Accept": registry.MANIFEST_MEDIA_TYPE}
    layers = httpx.get(f"{base}/v2/{repo}/manifests/{tag}", headers=accept).json()["layers"]
    assert len(layers) == 2  # ours, then cosign's
    return work / "cosign.pub"


def check_with_standard_tools(registry_proc: RegistryProcess, digest: str, keys: Keys) -> None:
    """cosign verifies what we signed; openssl verifies the signature over the payload as
    the registry serves them (over plain HTTP, not through our client); skopeo goes as
    far as it can."""
    cosign_verifies(registry_proc, digest, keys)
    base, repo = registry_proc.base, registry_proc.url.removeprefix(registry_proc.base + "/")
    accept = {"Accept": registry.MANIFEST_MEDIA_TYPE}
    tag = "sha256-" + digest.removeprefix("sha256:") + ".sig"
    manifest = httpx.get(f"{base}/v2/{repo}/manifests/{tag}", headers=accept).json()
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.dev.cosign.simplesigning.v1+json"
    work = keys.build.parent
    payload = work / "payload.json"
    payload.write_bytes(httpx.get(f"{base}/v2/{repo}/blobs/{layer['digest']}").content)
    critical = json.loads(payload.read_bytes())["critical"]
    assert critical == {
        "identity": {"docker-reference": registry_proc.url.removeprefix("http://")},
        "image": {"docker-manifest-digest": digest},
        "type": "cosign container image signature",
    }
    der = work / "signature.der"
    der.write_bytes(base64.b64decode(layer["annotations"]["dev.cosignproject.cosign/signature"]))
    for pub, verdict in ((keys.build_pub, "Verified OK"), (keys.other_pub, "Verification failure")):
        done = subprocess.run(
            ["openssl", "dgst", "-sha256", "-verify", str(pub), "-signature", str(der), str(payload)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.stdout.strip() == verdict, (pub, done.stdout, done.stderr)

    reference = registry_proc.url.removeprefix("http://")
    (work / "registries.d").mkdir()
    (work / "registries.d" / "k26.yaml").write_text(
        f"docker:\n  {reference}:\n    use-sigstore-attachments: true\n"
    )

    def skopeo(pub: Path, image: str) -> subprocess.CompletedProcess[str]:
        policy = work / "policy.json"
        requirement = {"type": "sigstoreSigned", "keyPath": str(pub),
                       "signedIdentity": {"type": "matchRepository"}}  # fmt: skip
        policy.write_text(json.dumps({
            "default": [{"type": "reject"}],
            "transports": {"docker": {reference: [requirement]}},
        }))  # fmt: skip
        out = work / f"copy-{pub.stem}"
        return subprocess.run(
            ["skopeo", "--debug", "--policy", str(policy), "--registries.d",
             str(work / "registries.d"), "copy", "--src-tls-verify=false",
             f"docker://{reference}@{image}", f"dir:{out}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    ours = skopeo(keys.build_pub, digest)
    if "Debian-local change: sigstore disabled" in ours.stderr:
        # Debian 12: the attachment is found and fetched, then every image rejected.
        assert ours.returncode != 0
        assert f"Looking for sigstore attachments in {reference}:{tag}" in ours.stderr
        assert "Found a sigstore attachment manifest with 1 layers" in ours.stderr
        assert f"Fetching sigstore attachment 1/1: {layer['digest']}" in ours.stderr
        return
    assert ours.returncode == 0, ours.stderr  # a skopeo that verifies: ours accepted
    theirs = skopeo(keys.other_pub, digest)
    assert theirs.returncode != 0 and "Source image rejected" in theirs.stderr, theirs.stderr


async def test_the_daemon_installs_only_what_its_configured_keys_signed(
    node: Node, registry_proc: RegistryProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys, pushed = signed_push(node, registry_proc.url, tmp_path)
    digest = pushed["digest"]
    before = node.files()
    node.wipe()
    node.build.restore()  # FlashInfer warm (nothing to build); Triton's, inductor's cold

    def daemon(key: Path) -> tuple[Warmup, StatusBoard]:
        cfg = FlashInferSection.model_validate(
            {
                "python": node.build.python,
                "arch": ARCH,
                "workspace": node.workspace,
                "modules": (SMALL_MODULE,),
                "env_file": node.env_file,
                "registry": registry_proc.url,
                "registry_timeout_s": 5.0,
                "registry_keys": [str(key)],
            }
        )
        board = StatusBoard(version="test", config_path="test")
        return Warmup(cfg, board, accepted_record=accepted.record_path(node.state)), board

    warm, board = daemon(keys.other_pub)
    with caplog.at_level(logging.WARNING):
        outcome = await warm.ensure(recheck=False, patch_allowed=False)
    assert outcome.ok and outcome.built == (), outcome.error  # warmed here, from its own cache
    shown = board.snapshot().warmup
    assert shown is not None and shown.error is not None
    assert (
        f"registry bundle refused, the cache left as it was: {registry_proc.url}@{digest}: "
        f"refused, not signed by a configured key ({keys.other_pub})" in shown.error
    )
    assert not node.triton.exists() and not node.inductor.exists()
    assert board.bundle_pulls == {
        "installed": 0, "current": 0, "absent": 0, "refused": 1, "failed": 0
    }  # fmt: skip

    warm, board = daemon(keys.build_pub)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        outcome = await warm.ensure(recheck=False, patch_allowed=False)
    assert outcome.ok and outcome.built == (), outcome.error
    shown = board.snapshot().warmup
    assert shown is not None and shown.error is None
    assert node.files() == before
    assert not [r for r in caplog.records if "without verifying" in r.getMessage()]
    assert board.bundle_pulls["installed"] == 1 and board.bundle_pulls["refused"] == 0


async def older_signed(url: str, good: str, key: Path, created_at: str) -> str:
    """``good`` as its build host made and signed it earlier: its config's created_at
    set back, pushed under a tag of its own and signed with the build key; its digest."""
    async with Registry(url) as reg:
        raw, _ = await reg.get_manifest(good)
        manifest = registry.parse_manifest(raw, url)
        config = distribute.parse_config(
            await reg.fetch_bytes(manifest.config.digest, manifest.config.size), url
        )
        body = config.model_copy(update={"created_at": created_at}).model_dump_json().encode()
        digest = registry.sha256_digest(body)
        await reg.push_blob(body, digest, len(body))
        descriptor = manifest.config.model_copy(update={"digest": digest, "size": len(body)})
        older = manifest.model_copy(update={"config": descriptor}).body()
        made = await reg.put_manifest(older, "older")
        await signing.sign_manifest(reg, signing.load_signing_key(key), made)
        return made


async def retag(url: str, digest: str, tag: str) -> None:
    """Point ``tag`` at the manifest ``digest`` (its bytes as the registry holds them)."""
    async with Registry(url) as reg:
        raw, _ = await reg.get_manifest(digest)
        assert await reg.put_manifest(raw, tag) == digest


def test_a_signed_tag_cannot_be_rolled_back_to_an_older_signed_bundle(
    node: Node, registry_proc: RegistryProcess, tmp_path: Path
) -> None:
    url = registry_proc.url
    keys, pushed = signed_push(node, url, tmp_path)
    digest, (tag,) = pushed["digest"], pushed["tags"]
    old = asyncio.run(older_signed(url, digest, keys.build, "2026-01-01T00:00:00Z"))
    pull = ["flashinfer", "bundle", "pull", *node.args(), *node.state_args(), "--registry", url,
            "--verify-key", str(keys.build_pub)]  # fmt: skip

    node.wipe()
    done = k26(*pull)  # by the node's own tag: the newest, accepted and remembered
    assert done.returncode == 0, done.stderr
    # In the daemon's state directory: the units' group can write the workspace.
    record = json.loads(accepted.record_path(node.state).read_text())
    assert record["tags"][f"{url}:{tag}"]["digest"] == digest
    assert not list(node.workspace.rglob(accepted.ACCEPTED_NAME))

    # Whoever can push (with no key) points the tag at the older signed bundle.
    asyncio.run(retag(url, old, tag))
    node.wipe()
    unchanged = node.all_files()
    said = refused(k26(*pull), 65)
    assert (
        f"{url}@{old}: refused, older than the bundle this node accepted from {url}:{tag} " in said
    )
    assert f"({digest}, created " in said and "this one 2026-01-01T00:00:00Z" in said
    assert node.all_files() == unchanged
    doctor = k26("flashinfer", "doctor", *node.args(), *node.state_args(), "--module", SMALL_MODULE)
    assert (
        f"accepted from {url}:{tag}: {digest} (created {record['tags'][f'{url}:{tag}']['created_at']}"
        f", verified with {keys.build_pub}): an older signed bundle there is refused"
    ) in doctor.stdout, doctor.stdout + doctor.stderr
    # The operator goes back on purpose: by digest, neither checked nor remembered.
    done = k26(*pull, "--digest", old)
    assert done.returncode == 0, done.stderr
    assert json.loads(accepted.record_path(node.state).read_text()) == record
    # The tag forward again: accepted.
    asyncio.run(retag(url, digest, tag))
    node.wipe()
    done = k26(*pull)
    assert done.returncode == 0, done.stderr
    assert f"pulled {url}@{digest}" in done.stdout
