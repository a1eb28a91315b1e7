"""A node's record of the newest signed bundle it accepted from each tag (fleet/accepted.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from supervisor.adapters import learned_shapes
from supervisor.cli import main
from supervisor.core.errors import CacheError, InputError
from supervisor.flashinfer.venv import ServingEnv
from supervisor.fleet import accepted, cache_layers, distribute, registry, signing

from .test_registry import FLASHINFER_ID, tools
from .test_signing import URL, MemoryRegistry, pem_private, pem_public, write

TAG = accepted.tag_key("http://registry:5000/k26/bundles/", "sm90-abc")
OLD, NEW, OTHER = ("sha256:" + c * 64 for c in "abc")


def admit(path: Path, digest: str, created_at: str, key: str = "/keys/build.pub") -> None:
    accepted.admit(path, TAG, digest, created_at, key, f"registry@{digest}")


def test_a_tag_keeps_its_newest_bundle_and_refuses_an_older_one(tmp_path: Path) -> None:
    path = accepted.record_path(tmp_path / "ws")
    admit(path, OLD, "2026-12-01T10:00:00Z")  # the workspace is made, as a pull makes it
    admit(path, NEW, "2026-12-02T10:00:00Z")
    before = path.read_bytes()
    with pytest.raises(InputError) as caught:
        admit(path, OLD, "2026-12-01T10:00:00Z")
    said = str(caught.value)
    assert said.startswith(f"registry@{OLD}: refused, older than the bundle this node accepted")
    assert (
        f"from {TAG} ({NEW}, created 2026-12-02T10:00:00Z; this one 2026-12-01T10:00:00Z)" in said
    )
    assert "pull it by digest" in said and "\n" not in said
    assert path.read_bytes() == before  # nothing written
    # The newest again, another made in the same second, a later one: accepted.
    admit(path, NEW, "2026-12-02T10:00:00Z")
    assert path.read_bytes() == before
    admit(path, OTHER, "2026-12-02T10:00:00Z")
    admit(path, NEW, "2026-12-03T00:00:00+00:00")
    tags = json.loads(path.read_text())["tags"]
    assert tags[TAG]["digest"] == NEW and tags[TAG]["key"] == "/keys/build.pub"
    assert TAG == "http://registry:5000/k26/bundles:sm90-abc"


def test_tags_are_apart(tmp_path: Path) -> None:
    path = accepted.record_path(tmp_path)
    admit(path, NEW, "2026-12-02T10:00:00Z")
    accepted.admit(path, TAG + "-other", OLD, "2026-12-01T00:00:00Z", "/k.pub", "w")
    assert set(json.loads(path.read_text())["tags"]) == {TAG, TAG + "-other"}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "field (top): Invalid JSON"),
        ('{"version": 2, "tags": {}}', "field version: Input should be less than"),
        ('{"version": 1, "tags": {"t": {"digest": "sha256:1"}}}', "field tags.t.digest:"),
        ("[]", "field (top): Input should be"),
        (
            '{"version": 1, "tags": {"t": {"digest": "sha256:' + "a" * 64 + '", "created_at":'
            ' "soon", "key": "k", "accepted_at": "x"}}}',
            "field tags.t.created_at: Value error",
        ),
    ],
)
def test_a_record_it_cannot_read_refuses_and_is_kept(tmp_path: Path, text: str, named: str) -> None:
    path = accepted.record_path(tmp_path)
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        admit(path, NEW, "2026-12-02T10:00:00Z")
    said = str(caught.value)
    assert said.startswith(f"{path}: not a record of accepted bundles: field ") and named in said
    assert "Move it aside" in said
    assert path.read_text() == text


def test_a_created_at_that_is_no_time_is_named(tmp_path: Path) -> None:
    path = accepted.record_path(tmp_path)
    with pytest.raises(InputError, match=r"config created_at 'yesterday' is not an ISO 8601"):
        admit(path, NEW, "yesterday")
    assert not path.exists()


def test_a_record_it_cannot_write_installs_nothing(tmp_path: Path) -> None:
    path = accepted.record_path(tmp_path)
    (tmp_path / f".{path.name}.{os.getpid()}.tmp").mkdir()  # where its new bytes would go
    with pytest.raises(CacheError, match=r"cannot be written .*; nothing installed"):
        admit(path, NEW, "2026-12-02T10:00:00Z")
    assert not path.exists()
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CacheError, match=r"cannot be read \(Not a directory\)"):
        admit(accepted.record_path(tmp_path / "file"), NEW, "2026-12-02T10:00:00Z")


def test_a_state_dir_that_cannot_be_made_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "deeper")  # dangling: nothing to make
    state = tmp_path / "link" / "state"
    with pytest.raises(CacheError) as caught:
        admit(accepted.record_path(state), NEW, "2026-12-02T10:00:00Z")
    said = str(caught.value)
    assert said.startswith(f"{state}: the state directory for {accepted.ACCEPTED_NAME} cannot")
    assert "nothing installed" in said and "--state-dir" in said and "\n" not in said
    assert not (tmp_path / "gone").exists()


def test_the_record_is_private_to_the_daemon(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = accepted.record_path(state)
    assert path == state / "k26-accepted-bundles.json"
    admit(path, NEW, "2026-12-02T10:00:00Z")
    assert state.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="a root pull by hand: needs root")
def test_a_root_pull_hands_the_record_to_the_state_dirs_owner(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)  # the daemon's user owns its StateDirectory=
    path = accepted.record_path(state)
    admit(path, NEW, "2026-12-02T10:00:00Z")
    assert (path.stat().st_uid, path.stat().st_gid) == (65534, 65534)


# --- where the record lives: the daemon's state directory, not the units' workspace ------


class Node:
    """A node pulling through the CLI from an in-memory registry (test_signing's), its
    serving venv stood in for (``distribute._this_node``): the real pull, signature
    check and rollback check, with nothing to install (its one cache is not pinned)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.memory = MemoryRegistry()
        real, transport = registry.Registry, httpx.MockTransport(self.memory)

        class InMemory(real):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, transport=transport, **kwargs)

        monkeypatch.setattr(registry, "Registry", InMemory)
        identity = distribute.node_identity(FLASHINFER_ID, tools(), "12.0")

        async def this_node(python: Path, arch: str, workspace: Path, env: Any, caches: Any) -> Any:
            serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
            key = distribute.lookup_key(identity)
            return distribute._Node(serving, {}, FLASHINFER_ID, tools(), identity, key)

        monkeypatch.setattr(distribute, "_this_node", this_node)
        self.identity = identity
        self.workspace = tmp_path / "ws"
        self.workspace.mkdir(mode=0o2770)
        self.state = tmp_path / "state"
        key = ec.generate_private_key(ec.SECP256R1())
        self.private = write(tmp_path / "build.key", pem_private(key), 0o600)
        self.public = write(tmp_path / "build.pub", pem_public(key), 0o644)

    def push(self, created_at: str, tag: str = "t") -> str:
        """A bundle made at ``created_at``, signed by the build key, tagged ``tag``."""
        triton = cache_layers.identities(tools(), "12.0")["triton"]
        body = json.dumps({
            "arch": "12.0", "key": distribute.lookup_key(self.identity),
            "identity": self.identity, "created_at": created_at,
            "caches": [{"cache": "triton", "media_type": registry.CACHE_LAYER, "layer": OTHER,
                        "size": 30, "identity": triton, "path": "/var/cache/k26/triton",
                        "relocatable": True, "files": 3, "bytes": 60}],
        }).encode()  # fmt: skip
        config = registry.Descriptor(
            mediaType=registry.CONFIG_MEDIA_TYPE,
            digest=registry.sha256_digest(body),
            size=len(body),
        )
        layer = registry.Descriptor(
            mediaType=registry.CACHE_LAYER, digest=OTHER, size=30,
            annotations={registry.CACHE_ANNOTATION: "triton"},
        )  # fmt: skip
        manifest = registry.Manifest(config=config, layers=(layer,))

        async def push() -> str:
            async with registry.Registry(URL) as reg:
                await reg.push_blob(body, config.digest, len(body))
                made = await reg.put_manifest(manifest.body(), tag)
                await signing.sign_manifest(reg, signing.load_signing_key(self.private), made)
                return made

        return asyncio.run(push())

    def args(self, *extra: str) -> list[str]:
        return ["--python", sys.executable, "--arch", "12.0", "--workspace", str(self.workspace),
                *extra]  # fmt: skip

    def pull(self, *extra: str) -> int:
        return main(["flashinfer", "bundle", "pull", *self.args("--registry", URL, "--tag", "t",
                     "--verify-key", str(self.public), *extra)])  # fmt: skip


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return Node(tmp_path, monkeypatch)


def test_a_verified_pull_by_tag_records_in_the_state_dir_never_the_workspace(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a unit could write (the workspace is its group's) is neither read nor written:
    the record is the daemon's, in its state directory, shared with ``bundle pull``."""
    planted = accepted.record_path(node.workspace)
    planted.write_text("{}")  # a compromised unit's record, as a rollback would want it
    new = node.push("2026-12-02T10:00:00Z")
    assert node.pull("--state-dir", str(node.state)) == 0, capsys.readouterr().err
    record = accepted.record_path(node.state)
    tags = json.loads(record.read_text())["tags"]
    assert tags[f"{URL}:t"]["digest"] == new and tags[f"{URL}:t"]["key"] == str(node.public)
    assert planted.read_text() == "{}"  # neither read nor written
    planted.unlink()
    assert not list(node.workspace.rglob("*"))  # nothing of the record in the workspace
    capsys.readouterr()

    old = node.push("2026-12-01T10:00:00Z")  # whoever can push: an older signed bundle
    assert node.pull("--state-dir", str(node.state)) == 65
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"k26-supervisor: error: {URL}@{old}: refused, older than the bundle")
    assert f"({new}, created 2026-12-02T10:00:00Z;" in said and "\n" not in said
    assert json.loads(record.read_text())["tags"] == tags

    # doctor reads it from the same place.
    main(["flashinfer", "doctor", *node.args("--state-dir", str(node.state), "--json")])
    bundles = json.loads(capsys.readouterr().out)["accepted_bundles"]
    assert bundles["path"] == str(record) and bundles["tags"][f"{URL}:t"]["digest"] == new


@pytest.mark.parametrize("bus", ["system", "user"])
def test_the_cli_finds_the_state_dir_as_the_daemon_does(
    node: Node, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bus: str
) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    new = node.push("2026-12-02T10:00:00Z")
    expected = learned_shapes.state_dir(None, bus)
    if bus == "system":  # the default: systemd's $STATE_DIRECTORY, else /var/lib/...
        assert expected == Path("/var/lib/k26-supervisor")
        monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "systemd"))
        expected = tmp_path / "systemd"
    else:
        assert expected == tmp_path / "xdg" / "k26-supervisor"
    assert node.pull("--bus", bus) == 0
    assert (
        json.loads(accepted.record_path(expected).read_text())["tags"][f"{URL}:t"]["digest"] == new
    )
    assert not accepted.record_path(node.workspace).exists()


def test_a_state_dir_the_cli_cannot_make_is_one_line(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node.push("2026-12-02T10:00:00Z")
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "deeper")
    state = tmp_path / "link" / "state"
    assert node.pull("--state-dir", str(state)) == 74
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"k26-supervisor: error: {state}: the state directory for ")
    assert "nothing installed" in line


async def test_keys_without_a_record_are_a_callers_bug_before_the_registry_is_asked(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="keys given without accepted_record"):
        await distribute.pull(
            Path(sys.executable), "12.0", tmp_path, URL, keys=[tmp_path / "k.pub"],
            accepted_record=None,
        )  # fmt: skip
