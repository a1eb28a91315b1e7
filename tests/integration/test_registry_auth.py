"""Cache bundles through registries that want credentials, over TLS with a CA made here.

Two real registries, each Debian's docker-registry (the CNCF distribution server
2.8, as in tests/integration/test_registry.py) started per test on a free port with
a certificate signed by a throwaway CA made in the test (``cryptography``):

- **htpasswd and TLS**: HTTP basic against a bcrypt htpasswd file (made by Apache's
  ``htpasswd``, apache2-utils, since docker-registry reads bcrypt only);
- **a Bearer token realm**: the registry's ``auth: token`` with a
  ``rootcertbundle``; the realm is a minimal token service served by the test
  itself over TLS (``TokenService``): it checks HTTP basic credentials and issues
  RS256 JWTs (header and claims written here as JSON, the signature made by
  ``cryptography``) that carry the requested access its user may have, the
  signing certificate in ``x5c``, chained to the CA the registry trusts.

Everything goes through the real CLI or the daemon's own warm-up, over real HTTPS;
the bundle is the session's small FlashInfer build with Triton's and inductor's
caches beside it (test_registry.py's ``Node``). The password is random per run, and
every output (stdout, stderr, the log, ``/status``) is searched for it and for its
base64 form.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import logging
import secrets
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bench.fleet_registry import RegistryProcess
from supervisor.adapters.warmup import Warmup
from supervisor.core.config import FlashInferSection
from supervisor.core.status import StatusBoard
from supervisor.fleet import accepted

from .builds import ARCH, SMALL_MODULE
from .test_registry import Node, k26, refused

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]

USER, READER = "k26-ci", "k26-reader"
REPOSITORY = "k26/bundles"
SERVICE, ISSUER = "k26-test-registry", "k26-test-issuer"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# --- a CA, certificates, credentials ---------------------------------------------------


@dataclass
class Pki:
    """A throwaway CA; a server certificate for 127.0.0.1 and a token-signing one,
    both signed by it."""

    ca: Path
    server: tuple[Path, Path]  # certificate, key
    token_key: rsa.RSAPrivateKey
    token_cert: bytes  # DER


def make_pki(directory: Path) -> Pki:
    now = datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "k26 test CA")])

    def builder(subject: str, key: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
        )

    ca = (
        builder("k26 test CA", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    issuer_id = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        builder("127.0.0.1", server_key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(issuer_id, False)
        .sign(ca_key, hashes.SHA256())
    )
    token_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    token = (
        builder("k26 test token issuer", token_key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(issuer_id, False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(server.public_bytes(pem))
    (directory / "server.key").write_bytes(
        server_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (directory / "server.key").chmod(0o600)
    return Pki(
        directory / "ca.pem",
        (directory / "server.pem", directory / "server.key"),
        token_key,
        token.public_bytes(serialization.Encoding.DER),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class Secrets:
    """A random password for each user, and what must never be shown."""

    passwords: dict[str, str]

    @classmethod
    def make(cls) -> Secrets:
        # A ':' inside: HTTP basic splits at the first one only.
        return cls({user: f"pw:{secrets.token_urlsafe(12)}" for user in (USER, READER)})

    def forms(self) -> list[str]:
        out = []
        for user, password in self.passwords.items():
            out += [password, base64.b64encode(f"{user}:{password}".encode()).decode()]
        return out

    def assert_absent(self, *texts: str) -> None:
        for text in texts:
            for form in self.forms():
                assert form not in text, f"a credential in: {text[:400]}"

    def config_json(self, path: Path, registry: RegistryProcess, user: str) -> Path:
        """A Docker-style config.json, as ``docker login`` writes it."""
        pair = base64.b64encode(f"{user}:{self.passwords[user]}".encode()).decode()
        host = registry.base.split("://", 1)[1]
        auths = {"other.example:5000": {"auth": "eDp5"}, host: {"auth": pair}}
        return private(path, json.dumps({"auths": auths}, indent=1))

    def line(self, path: Path, user: str, password: str | None = None) -> Path:
        """A credentials file of one USER:PASSWORD line."""
        return private(path, f"{user}:{password or self.passwords[user]}\n")


def private(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


def htpasswd(path: Path, passwords: dict[str, str]) -> Path:
    """A bcrypt htpasswd file by Apache's htpasswd (cost 4: every request checks it)."""
    lines = []
    for user, password in passwords.items():
        made = subprocess.run(
            ["htpasswd", "-niB", "-C", "4", user],
            input=password,
            capture_output=True,
            text=True,
            check=False,
        )
        assert made.returncode == 0, f"htpasswd (apache2-utils; scripts/dev.sh): {made.stderr}"
        lines.append(made.stdout.strip())
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def https_registry(directory: Path, pki: Pki, auth: str) -> Iterator[RegistryProcess]:
    try:
        with RegistryProcess(directory, tls=pki.server, ca=pki.ca, auth=auth) as reg:
            yield reg
    except RuntimeError as exc:  # not installed, or would not start: a failure
        pytest.fail(str(exc))


# --- the token realm ---------------------------------------------------------------------


class TokenService:
    """A Docker token service over TLS: ``GET /token?service=..&scope=..`` with HTTP
    basic; each user may have the actions ``allowed`` gives it. Answers
    ``{"access_token": JWT}`` (the other spelling of the spec's ``token``)."""

    def __init__(self, pki: Pki, passwords: dict[str, str], allowed: dict[str, set[str]]):
        self.pki, self.passwords, self.allowed = pki, passwords, allowed
        self.asked: list[dict[str, Any]] = []  # each request: user, service, scopes
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = service.answer(self.path, self.headers.get("Authorization"))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*map(str, pki.server))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}/token"

    def answer(self, path: str, authorization: str | None) -> tuple[int, dict[str, Any]]:
        query = parse_qs(urlsplit(path).query)
        user = None
        if authorization and authorization.startswith("Basic "):
            name, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
            user = name if self.passwords.get(name) == password else None
        scopes = query.get("scope", [])
        self.asked.append({"user": user, "service": query.get("service"), "scopes": scopes})
        if user is None:
            return 401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]}
        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":")
            granted = [a for a in actions.split(",") if a in self.allowed[user]]
            access.append({"type": kind, "name": name, "actions": granted})
        return 200, {"access_token": self.jwt(user, access), "expires_in": 300}

    def jwt(self, user: str, access: list[dict[str, Any]]) -> str:
        now = int(time.time())
        header = {
            "typ": "JWT",
            "alg": "RS256",
            "x5c": [base64.b64encode(self.pki.token_cert).decode()],
        }
        claims = {
            "iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + 300, "nbf": now - 10,
            "iat": now, "jti": secrets.token_hex(8), "access": access,
        }  # fmt: skip
        signing_input = (
            f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
        )
        signature = self.pki.token_key.sign(
            signing_input.encode(), padding.PKCS1v15(), hashes.SHA256()
        )
        return f"{signing_input}.{b64url(signature)}"

    def __enter__(self) -> TokenService:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


# --- the tests ---------------------------------------------------------------------------


def test_push_and_pull_through_htpasswd_and_tls(node: Node, pki: Pki, tmp_path: Path) -> None:
    keys = Secrets.make()
    auth = f"auth:\n  htpasswd:\n    realm: k26-test\n    path: {htpasswd(tmp_path / 'htpasswd', keys.passwords)}\n"
    with https_registry(tmp_path / "registry", pki, auth) as reg:
        assert reg.url.startswith("https://127.0.0.1:")
        config_json = keys.config_json(tmp_path / "docker" / "config.json", reg, USER)
        line = keys.line(tmp_path / "registry-credentials", READER)
        ca = ["--registry-ca", str(pki.ca)]
        node.fill()
        pushed = k26("flashinfer", "bundle", "push", *node.args(), "--module", SMALL_MODULE,
                     "--registry", reg.url, "--registry-auth", str(config_json), *ca,
                     "--chunk-size", str(256 << 10), "--json")  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        digest = json.loads(pushed.stdout)["digest"]
        before = node.files()
        node.wipe()
        pull = ["flashinfer", "bundle", "pull", *node.args(), "--registry", reg.url]
        pulled = k26(*pull, "--registry-auth", str(line), *ca, "--json")
        assert pulled.returncode == 0, pulled.stderr
        assert json.loads(pulled.stdout)["digest"] == digest
        assert node.files() == before  # bytes, mtimes to the ns, modes

        # Each refusal: one line, its exit code, what to do; the caches untouched.
        node.build.restore()
        untouched = node.all_files()
        wrong = keys.line(tmp_path / "wrong", READER, "pw:not-the-password")
        said = [
            refused(k26(*pull, "--registry-auth", str(wrong), *ca), 77),
            refused(k26(*pull, *ca), 77),
            refused(k26(*pull, "--registry-auth", str(line)), 69),
        ]
        assert said[0].endswith(
            f"HTTP 401: it refused the credentials of user '{READER}' ({wrong}); check them"
        )
        assert said[1].endswith(
            "HTTP 401: it asks for credentials and none are configured; name a Docker "
            "config.json or a USER:PASSWORD file (mode 0600) in --registry-auth (docs/fleet.md)"
        )
        assert "CERTIFICATE_VERIFY_FAILED" in said[2]
        assert said[2].endswith("name the CA's PEM bundle in --registry-ca")
        line.chmod(0o640)
        said.append(refused(k26(*pull, "--registry-auth", str(line), *ca), 78))
        assert said[-1] == (
            f"k26-supervisor: error: --registry-auth {line}: mode 0640 lets others than its "
            f"owner read or change the registry credentials; refused: chmod 600 {line}"
        )
        assert node.all_files() == untouched
        keys.assert_absent(pushed.stdout, pushed.stderr, pulled.stdout, pulled.stderr, *said)


def warmup(node: Node, url: str, auth: Path, ca: Path) -> tuple[Warmup, StatusBoard]:
    cfg = FlashInferSection(
        python=node.build.python,
        arch=ARCH,
        workspace=node.workspace,
        modules=(SMALL_MODULE,),
        env_file=node.env_file,
        registry=url,
        registry_timeout_s=10.0,
        registry_auth=auth,
        registry_ca=ca,
    )
    board = StatusBoard(version="test", config_path="test")
    return Warmup(cfg, board, accepted_record=accepted.record_path(node.state)), board


async def test_push_and_pull_through_a_bearer_token_realm(
    node: Node, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Secrets.make()
    allowed = {USER: {"pull", "push"}, READER: {"pull"}}
    with TokenService(pki, keys.passwords, allowed) as tokens:
        auth = (
            f"auth:\n  token:\n    realm: {tokens.url}\n    service: {SERVICE}\n"
            f"    issuer: {ISSUER}\n    rootcertbundle: {pki.ca}\n"
        )
        with https_registry(tmp_path / "registry", pki, auth) as reg:
            writer = keys.config_json(tmp_path / "writer.json", reg, USER)
            reader = keys.line(tmp_path / "reader", READER)
            ca = ["--registry-ca", str(pki.ca)]
            node.fill()
            push = ["flashinfer", "bundle", "push", *node.args(), "--module", SMALL_MODULE,
                    "--registry", reg.url, *ca]  # fmt: skip
            pushed = k26(*push, "--registry-auth", str(writer), "--json")
            assert pushed.returncode == 0, pushed.stderr
            # A push asks for pull and push on the repository, with the writer's login.
            push_scope = f"repository:{REPOSITORY}:pull,push"
            assert any(
                a["user"] == USER and a["service"] == [SERVICE] and push_scope in a["scopes"]
                for a in tokens.asked
            ), tokens.asked

            # The reader's token grants pull only: its push is refused, nothing pushed.
            said = [refused(k26(*push, "--registry-auth", str(reader), "--tag", "refused"), 77)]
            assert said[0].endswith(
                f"HTTP 401 with a fresh token from {tokens.url}: it grants user '{READER}' "
                f"({reader}) no pull,push on {REPOSITORY}; grant it, or configure other "
                "credentials"
            )
            # The token service refuses a wrong password.
            wrong = keys.line(tmp_path / "wrong", USER, "pw:not-the-password")
            said.append(refused(k26(*push, "--registry-auth", str(wrong)), 77))
            assert f"token service {tokens.url}: HTTP 401: it refused the credentials" in said[1]
            assert f"of user '{USER}' ({wrong}); check them" in said[1]

            # The daemon pulls with the reader's login, from its config's fields.
            before = node.files()
            node.wipe()
            tokens.asked.clear()
            warm, board = warmup(node, reg.url, reader, pki.ca)
            outcome = await warm.ensure(recheck=False, patch_allowed=False)
            assert outcome.ok, outcome.error
            assert outcome.built == () and node.files() == before
            assert {tuple(a["scopes"]) for a in tokens.asked} == {
                (f"repository:{REPOSITORY}:pull",)
            }
            assert len(tokens.asked) == 1  # one token, kept for every request after

            # A wrong password in the daemon: a warning on /status and in the log, one
            # line naming the user and the file; then it warms here (FlashInfer's cache
            # as built, the others cold: the registry is asked for them).
            node.wipe()
            node.build.restore()
            warm, board = warmup(node, reg.url, wrong, pki.ca)
            with caplog.at_level(logging.DEBUG):
                outcome = await warm.ensure(recheck=False, patch_allowed=False)
            assert outcome.ok and outcome.built == (), outcome.error
            status = json.dumps(board.snapshot().to_json())
            shown = board.snapshot().warmup
            assert shown is not None and shown.error is not None
            assert shown.error.startswith(f"registry pull failed: registry {reg.url}: manifest")
            assert f"it refused the credentials of user '{USER}' ({wrong})" in shown.error
            logged = "\n".join(r.getMessage() for r in caplog.records)
            assert "it refused the credentials" in logged
            keys.assert_absent(pushed.stdout, pushed.stderr, *said, status, logged)
