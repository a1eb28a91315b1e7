"""Registry credentials and TLS without a registry: ``WWW-Authenticate`` parsing, the
credentials files and their refusals, the CA bundle, and the client's Bearer token
and basic flows against ``httpx.MockTransport`` (what it sends, what it keeps, what
it says). The real registry, with htpasswd, TLS and a token realm, is
tests/integration/test_registry_auth.py.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.core.config import InvalidConfig, parse_toml
from supervisor.core.errors import AuthRefused, ConfigError, UnavailableError
from supervisor.fleet import registry
from supervisor.fleet.registry import Access, Challenge, Registry, parse_challenges

HOST = "registry.test:5000"
URL = f"https://{HOST}/k26/bundles"
USER, PASSWORD = "ci-bot", "s3cr3t:with-colon"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
DIGEST = registry.sha256_digest(b"blob")


def secret_free(text: str) -> None:
    assert PASSWORD not in text and BASIC not in text, text


def private(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def docker_config(path: Path, auths: dict[str, Any], **extra: Any) -> Path:
    return private(path, json.dumps({"auths": auths, **extra}))


# --- WWW-Authenticate ------------------------------------------------------------------


def test_a_bearer_challenge_gives_realm_service_and_scope() -> None:
    header = (
        'Bearer realm="https://auth.test/token",service="registry.test",'
        'scope="repository:k26/bundles:pull,push"'
    )
    assert parse_challenges([header]) == [
        Challenge(
            "bearer",
            {
                "realm": "https://auth.test/token",
                "service": "registry.test",
                "scope": "repository:k26/bundles:pull,push",
            },
        )
    ]


def test_several_challenges_tokens_escapes_and_odd_spacing() -> None:
    found = parse_challenges(
        ['Basic realm="a \\"quoted\\" realm", charset=UTF-8 ,  BEARER realm=x', "Digest"]
    )
    assert [(c.scheme, c.params) for c in found] == [
        ("basic", {"realm": 'a "quoted" realm', "charset": "UTF-8"}),
        ("bearer", {"realm": "x"}),
        ("digest", {}),
    ]
    # A token68 credential ends that header's list; nothing raises.
    assert [c.scheme for c in parse_challenges(["Negotiate abc==, Basic realm=r"])] == ["negotiate"]
    assert parse_challenges(["", " , ", '="x"']) == []


# --- credentials files -----------------------------------------------------------------


def test_a_docker_config_json_by_auth_or_by_username_and_password(tmp_path: Path) -> None:
    by_auth = docker_config(tmp_path / "a.json", {f"https://{HOST}/v1/": {"auth": BASIC}})
    found = registry.load_credentials(by_auth, HOST, "--registry-auth")
    assert (found.username, found.password) == (USER, PASSWORD)
    assert found.source == f"{by_auth}, auths.https://{HOST}/v1/"
    by_fields = docker_config(
        tmp_path / "b.json",
        {"other:5000": {"auth": "eDp5"}, HOST.upper(): {"username": USER, "password": PASSWORD}},
    )
    found = registry.load_credentials(by_fields, HOST, "--registry-auth")
    assert (found.username, found.password) == (USER, PASSWORD)
    assert PASSWORD not in repr(found) and PASSWORD not in found.who
    assert found.header() == f"Basic {BASIC}"


def test_a_file_of_one_user_password_line(tmp_path: Path) -> None:
    path = private(tmp_path / "creds", f"# the build host's robot\n\n{USER}:{PASSWORD}\n")
    found = registry.load_credentials(path, HOST, "flashinfer.registry_auth")
    assert (found.username, found.password, found.source) == (USER, PASSWORD, str(path))
    for bad in ("no colon here\n", f"{USER}:\n", f":{PASSWORD}\n", "a:b\nc:d\n", ""):
        private(path, bad)
        with pytest.raises(ConfigError, match="nor one USER:PASSWORD line") as caught:
            registry.load_credentials(path, HOST, "flashinfer.registry_auth")
        assert str(caught.value).startswith(f"flashinfer.registry_auth {path}: ")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666])
def test_a_file_others_may_read_or_change_is_refused(tmp_path: Path, mode: int) -> None:
    path = private(tmp_path / "creds", f"{USER}:{PASSWORD}\n", mode)
    with pytest.raises(ConfigError) as caught:
        registry.load_credentials(path, HOST, "--registry-auth")
    said = str(caught.value)
    assert said == (
        f"--registry-auth {path}: mode {mode:04o} lets others than its owner read or change "
        f"the registry credentials; refused: chmod 600 {path}"
    )


def test_what_is_not_a_credentials_file_is_said(tmp_path: Path) -> None:
    def refused(path: Path) -> str:
        with pytest.raises(ConfigError) as caught:
            registry.load_credentials(path, HOST, "flashinfer.registry_auth")
        secret_free(str(caught.value))
        assert str(caught.value).startswith(f"flashinfer.registry_auth {path}: ")
        return str(caught.value)

    assert "no such file; write the registry's credentials there (mode 0600)" in refused(
        tmp_path / "missing"
    )
    assert "not a regular file" in refused(tmp_path)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" + PASSWORD.encode())
    binary.chmod(0o600)
    assert "not UTF-8 text" in refused(binary)


def test_a_malformed_config_json_names_where_never_what(tmp_path: Path) -> None:
    path = private(tmp_path / "config.json", f'{{"auths": {{"{HOST}": {{"auth": "{BASIC}"}}')
    with pytest.raises(ConfigError) as caught:
        registry.load_credentials(path, HOST, "flashinfer.registry_auth")
    said = str(caught.value)
    secret_free(said)
    assert said.startswith(f"flashinfer.registry_auth {path}: not valid JSON (line 1 column ")
    assert '{"auths": {"HOST:PORT": {"auth": "<base64 of USER:PASSWORD>"}}}' in said
    private(path, '{"credsStore": "desktop"}')
    with pytest.raises(ConfigError, match='no "auths" object'):
        registry.load_credentials(path, HOST, "flashinfer.registry_auth")


def test_an_unknown_host_lists_the_known_ones(tmp_path: Path) -> None:
    path = docker_config(
        tmp_path / "config.json",
        {"other.test:5000": {"auth": BASIC}, "https://index.docker.io/v1/": {"auth": BASIC}},
        credHelpers={"gcr.io": "gcloud"},
    )
    with pytest.raises(ConfigError) as caught:
        registry.load_credentials(path, HOST, "--registry-auth")
    said = str(caught.value)
    secret_free(said)
    assert said == (
        f'--registry-auth {path}: "auths" has no entry for {HOST} (it has: '
        "https://index.docker.io/v1/, other.test:5000) (credential helpers, credsStore and "
        f'credHelpers, are not used); add "{HOST}": {{"auth": "<base64 of USER:PASSWORD>"}}, '
        "or point --registry-auth at the file that has it"
    )


def test_bad_entries_are_named_by_their_key(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    cases: list[tuple[Any, str]] = [
        ({"auth": "not base64!"}, f"auths.{HOST}.auth: not the base64 of USER:PASSWORD"),
        ({"auth": base64.b64encode(b"nocolon").decode()}, "(no ':')"),
        ({"username": USER}, 'neither "auth" (base64 of USER:PASSWORD) nor "username"'),
        ("a string", f"auths.{HOST}: not a JSON object"),
        ({"identitytoken": "tok"}, "holds only an identitytoken (an OAuth token"),
    ]
    for entry, expected in cases:
        docker_config(path, {HOST: entry})
        with pytest.raises(ConfigError) as caught:
            registry.load_credentials(path, HOST, "--registry-auth")
        assert expected in str(caught.value)
        secret_free(str(caught.value))


def test_an_identitytoken_beside_a_password_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = docker_config(tmp_path / "ignored.json", {HOST: {"auth": BASIC, "identitytoken": "t"}})
    with caplog.at_level(logging.WARNING, logger="k26.registry"):
        found = registry.load_credentials(path, HOST, "--registry-auth")
        registry.load_credentials(path, HOST, "--registry-auth")
    assert found.username == USER
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        f"--registry-auth {path}: auths.{HOST}.identitytoken is ignored (k26-supervisor "
        "logs in with the username and password)"
    ]


def test_the_ca_bundle_must_be_pem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--registry-ca .*/none: no such file; it names"):
        registry.load_ca(tmp_path / "none", "--registry-ca")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"no certificate OpenSSL accepts .* PEM bundle"):
        registry.load_ca(junk, "--registry-ca")


def test_the_config_fields_are_absolute_paths() -> None:
    unit = '[[units]]\nname = "sglang-k26.service"\nrole = "autoregressive"\n'
    unit += 'url = "http://127.0.0.1:30000"\n'
    parsed = parse_toml(
        (
            '[flashinfer]\nregistry = "https://r.test/k26"\n'
            'registry_auth = "/etc/k26/auth.json"\nregistry_ca = "/etc/k26/ca.pem"\n' + unit
        ).encode()
    )
    assert parsed.flashinfer.registry_auth == Path("/etc/k26/auth.json")
    assert parsed.flashinfer.registry_ca == Path("/etc/k26/ca.pem")
    for field in ("registry_auth", "registry_ca"):
        with pytest.raises(InvalidConfig, match=f"flashinfer.{field}: must be an absolute path"):
            parse_toml(f'[flashinfer]\n{field} = "auth.json"\n{unit}'.encode())


def test_a_bad_credentials_file_is_said_before_anything_is_sent(tmp_path: Path) -> None:
    path = private(tmp_path / "creds", f"{USER}:{PASSWORD}\n", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Registry(URL, access=Access(auth=path))
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ConfigError, match=r"flashinfer\.registry_ca"):
        Registry(URL, access=Access(ca=ca))


# --- the flows, against a mock registry ------------------------------------------------


class FakeRegistry:
    """A registry that wants ``scheme`` (``bearer`` or ``basic``) and records each
    request; its token service grants what ``grants`` says to the right password."""

    def __init__(self, scheme: str, grants: Callable[[list[str]], list[str]] = lambda s: s):
        self.scheme = scheme
        self.grants = grants
        self.seen: list[httpx.Request] = []
        self.tokens_issued = 0
        self.valid: dict[str, list[str]] = {}  # token -> scopes

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if request.url.host == "auth.test":
            return self.token(request)
        given = request.headers.get("Authorization", "")
        needed = "pull" if request.method in ("GET", "HEAD") else "push"
        scope = f"repository:k26/bundles:{'pull,push' if needed == 'push' else 'pull'}"
        if self.scheme == "basic":
            if given != f"Basic {BASIC}":
                return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        else:
            scopes = self.valid.get(given.removeprefix("Bearer "), [])
            if not any(needed in s.rsplit(":", 1)[1].split(",") for s in scopes):
                challenge = (
                    'Bearer realm="https://auth.test/token",service="registry.test",'
                    f'scope="{scope}"'
                )
                return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        if request.method == "HEAD":
            return httpx.Response(404)
        if request.method == "POST":
            return httpx.Response(202, headers={"Location": "/v2/k26/bundles/blobs/uploads/1"})
        if request.method == "PUT":
            return httpx.Response(201, headers={"Docker-Content-Digest": DIGEST})
        return httpx.Response(200, content=b"blob")

    def token(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("Authorization") != f"Basic {BASIC}":
            return httpx.Response(401, json={"errors": [{"code": "UNAUTHORIZED"}]})
        self.tokens_issued += 1
        token = f"tok{self.tokens_issued}"
        self.valid[token] = self.grants(request.url.params.get_list("scope"))
        return httpx.Response(200, json={"token": token, "expires_in": 60})


def client(fake: FakeRegistry, auth: Path | None) -> Registry:
    return Registry(URL, transport=httpx.MockTransport(fake.handler), access=Access(auth=auth))


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    return docker_config(tmp_path / "config.json", {HOST: {"auth": BASIC}})


async def test_the_bearer_flow_asks_the_realm_once_per_scope(creds: Path) -> None:
    fake = FakeRegistry("bearer")
    async with client(fake, creds) as reg:
        assert await reg.fetch_bytes(DIGEST, 4) == b"blob"
        assert await reg.fetch_bytes(DIGEST, 4) == b"blob"  # the kept token
    token_requests = [r for r in fake.seen if r.url.host == "auth.test"]
    assert len(token_requests) == 1
    asked = token_requests[0]
    assert asked.url.params.get("service") == "registry.test"
    assert asked.url.params.get_list("scope") == ["repository:k26/bundles:pull"]
    assert asked.headers["Authorization"] == f"Basic {BASIC}"
    blob_gets = [r for r in fake.seen if r.url.host != "auth.test"]
    assert [r.headers.get("Authorization") for r in blob_gets] == [
        None,
        "Bearer tok1",
        "Bearer tok1",
    ]


async def test_a_push_asks_for_pull_and_push(creds: Path) -> None:
    fake = FakeRegistry("bearer")
    async with client(fake, creds) as reg:
        assert await reg.push_blob(b"blob", DIGEST, 4)
    token_requests = [r for r in fake.seen if r.url.host == "auth.test"]
    assert [r.url.params.get_list("scope") for r in token_requests] == [
        ["repository:k26/bundles:pull", "repository:k26/bundles:pull,push"]
    ]
    assert [r.method for r in fake.seen if r.url.host != "auth.test"] == [
        "HEAD", "HEAD", "POST", "PUT"
    ]  # fmt: skip


async def test_an_expired_token_is_fetched_once_more(creds: Path) -> None:
    fake = FakeRegistry("bearer")
    async with client(fake, creds) as reg:
        await reg.fetch_bytes(DIGEST, 4)
        fake.valid.clear()  # every token expired
        await reg.fetch_bytes(DIGEST, 4)
    assert fake.tokens_issued == 2


async def test_a_token_that_grants_too_little_is_one_clear_refusal(creds: Path) -> None:
    fake = FakeRegistry("bearer", grants=lambda scopes: ["repository:k26/bundles:pull"])
    async with client(fake, creds) as reg:
        with pytest.raises(AuthRefused) as caught:
            await reg.push_blob(b"blob", DIGEST, 4)
    said = str(caught.value)
    assert caught.value.exit_code == 77
    secret_free(said)
    assert said == (
        f"registry {URL}: upload of {DIGEST}: HTTP 401 with a fresh token from "
        f"https://auth.test/token: it grants user 'ci-bot' ({creds}, auths.{HOST}) no "
        "pull,push on k26/bundles; grant it, or configure other credentials"
    )


async def test_wrong_or_missing_credentials_are_one_line_without_the_secret(
    tmp_path: Path,
) -> None:
    wrong = docker_config(tmp_path / "wrong.json", {HOST: {"username": USER, "password": "not-it"}})
    for scheme in ("bearer", "basic"):
        async with client(FakeRegistry(scheme), wrong) as reg:
            with pytest.raises(AuthRefused) as caught:
                await reg.get_manifest("latest")
        said = str(caught.value)
        assert "\n" not in said and "not-it" not in said
        assert f"it refused the credentials of user 'ci-bot' ({wrong}, auths.{HOST})" in said
        async with client(FakeRegistry(scheme), None) as reg:
            with pytest.raises(AuthRefused) as caught:
                await reg.get_manifest("latest")
        assert "it asks for credentials" in str(caught.value)
        assert "flashinfer.registry_auth (docs/fleet.md)" in str(caught.value)


async def test_basic_is_sent_after_the_challenge_and_then_always(creds: Path) -> None:
    fake = FakeRegistry("basic")
    async with client(fake, creds) as reg:
        await reg.fetch_bytes(DIGEST, 4)
        await reg.fetch_bytes(DIGEST, 4)
    assert [r.headers.get("Authorization") for r in fake.seen] == [
        None,
        f"Basic {BASIC}",
        f"Basic {BASIC}",
    ]


async def test_what_the_registry_or_its_realm_should_not_say(creds: Path) -> None:
    def forbidden(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"errors": [{"code": "DENIED", "message": "no"}]})

    async with Registry(URL, transport=httpx.MockTransport(forbidden), access=Access(creds)) as r:
        with pytest.raises(AuthRefused, match=r"HTTP 403 \(DENIED: no\): denied to user 'ci-bot'"):
            await r.get_manifest("latest")

    def tokenless(request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.test":
            return httpx.Response(200, json={"nope": 1})
        return httpx.Response(
            401, headers={"WWW-Authenticate": 'Bearer realm="https://auth.test/t"'}
        )

    async with Registry(URL, transport=httpx.MockTransport(tokenless)) as r:
        with pytest.raises(UnavailableError, match=r'holds no token .*"access_token"'):
            await r.get_manifest("latest")

    def negotiate(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, headers={"WWW-Authenticate": "Negotiate"})

    async with Registry(URL, transport=httpx.MockTransport(negotiate)) as r:
        with pytest.raises(AuthRefused, match=r"HTTP 401 \(negotiate\): k26-supervisor speaks"):
            await r.get_manifest("latest")


def test_a_ca_bundle_becomes_the_clients_trust(tmp_path: Path) -> None:
    ca = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    if not ca.is_file():
        pytest.fail(f"no system CA bundle at {ca} to load as a stand-in")
    reg = Registry(URL, access=Access(ca=ca))
    assert isinstance(reg._verify, ssl.SSLContext)
    assert reg._verify.verify_mode == ssl.CERT_REQUIRED
