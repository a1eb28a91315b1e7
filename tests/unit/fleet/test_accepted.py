"""A node's record of the newest signed bundle it accepted from each tag (fleet/accepted.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.core.errors import CacheError, InputError
from supervisor.fleet import accepted

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
