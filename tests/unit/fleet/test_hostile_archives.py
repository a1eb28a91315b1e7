"""Hostile layers (tests/unit/fleet/hostile.py), each refused before a byte is written.

Each kind is read as a pull reads a fetched layer (``cache_layers.check_layer``),
and, where its manifest parses, installed as a pull would install a checked one
(``cache_layers.install``: the install's own walk refuses it too). The refusal is
one line naming the layer and the entry; the cache, and everything beside it, is
left exactly as it was (every path's kind, mode, mtime and bytes or link target).
The same corpus through a real registry: tests/integration/test_hostile_layers.py.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from supervisor.cli import build_parser
from supervisor.core.config import FlashInferSection
from supervisor.core.errors import InputError, UsageError
from supervisor.fleet import archive, cache_layers
from supervisor.fleet.archive import DEFAULT_LIMITS, Limits

from .hostile import (
    BOMB_BYTES,
    GOOD,
    GOOD_DATA,
    KINDS,
    Snapshot,
    hostile,
    layer,
    listed,
    member,
    snapshot,
)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's caches: Triton's cold (a lock and a temporary, no kernel), a neighbour
    holding files, and a directory outside both that a link or a name could reach."""
    caches = tmp_path / "caches"
    (caches / "triton").mkdir(parents=True)
    (caches / "triton" / "lock").write_text("")
    (caches / "triton" / "tmp.pid_1").mkdir()
    (caches / "triton" / "tmp.pid_1" / "x.cubin").write_text("half")
    (caches / "inductor" / "ab").mkdir(parents=True)
    (caches / "inductor" / "ab" / "k.py").write_text("# kernel\n")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0\n")
    return tmp_path


def one_line(exc: InputError) -> str:
    said = str(exc)
    assert "\n" not in said, said
    return said


@pytest.mark.parametrize("kind", KINDS)
def test_each_hostile_layer_is_refused_naming_it_and_the_entry_with_nothing_changed(
    node: Path, kind: str
) -> None:
    case = hostile(kind)
    path = node / "layers" / "sha256-hostile.layer"
    path.parent.mkdir()
    path.write_bytes(case.layer)
    target = node / "caches" / "triton"
    before = snapshot(node)

    with pytest.raises(InputError) as caught:
        cache_layers.check_layer(path, case.limits)
    said = one_line(caught.value)
    assert said.startswith(f"{path}: "), said
    assert repr(case.entry) in said and case.said in said, said
    assert snapshot(node) == before

    try:
        manifest = cache_layers.read_layer_manifest(path, case.limits)
    except InputError:
        return  # refused at the manifest: there is nothing an install could be given
    with pytest.raises(InputError) as caught:
        cache_layers.install(path, manifest, target)
    said = one_line(caught.value)
    assert repr(case.entry) in said and case.said in said, said
    # The cache exactly as it was; beside it, only its parent's mtime (the work dir
    # made and removed) may differ.
    assert snapshot(target) == snapshot_of(before, "caches/triton")
    assert snapshot(node, dir_mtimes=False) == snapshot_without_dir_mtimes(before)


def snapshot_of(whole: Snapshot, under: str) -> Snapshot:
    """The part of ``whole`` under ``under``, keyed as ``snapshot(under)`` keys it."""
    out: Snapshot = {}
    for key, value in whole.items():
        if key == under:
            out["."] = value
        elif key.startswith(under + "/"):
            out[key[len(under) + 1 :]] = value
    return out


def snapshot_without_dir_mtimes(whole: Snapshot) -> Snapshot:
    return {k: (v[0], v[1], 0 if v[0] == "dir" else v[2], v[3]) for k, v in whole.items()}


def test_the_corpus_is_every_kind() -> None:
    from .hostile import corpus

    assert tuple(case.kind for case in corpus()) == KINDS


def test_a_bomb_is_stopped_as_it_streams_not_after(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 MiB of zeros after the tar: refused once the budget (a few KiB: the files
    and their headers) is passed, the rest never decompressed."""
    path = node / "bomb.layer"
    path.write_bytes(hostile("decompression bomb (after the tar)").layer)
    most = 0
    real = archive._Budget.read

    def counted(self: archive._Budget, size: int = -1) -> bytes:
        nonlocal most
        data = real(self, size)
        most = max(most, self.count)
        return data

    monkeypatch.setattr(archive._Budget, "read", counted)
    with pytest.raises(InputError, match="a decompression bomb"):
        cache_layers.check_layer(path)
    assert 0 < most < 256 << 10 < BOMB_BYTES


def test_limits_are_inclusive_and_a_layer_at_them_installs(node: Path) -> None:
    """A layer of exactly ``max_entries`` files, ``max_entry_bytes`` in its largest and
    ``max_total_bytes`` in all is taken; one byte or one file less in a limit refuses it."""
    files = {GOOD: GOOD_DATA, "ok/b": b"0123456789", "ok/c": b""}
    made = layer(
        [listed(name, data) for name, data in files.items()],
        [member("cache/" + name, data=data) for name, data in files.items()],
    )
    path = node / "fits.layer"
    path.write_bytes(made)
    total = sum(len(d) for d in files.values())
    exact = Limits(max_entries=3, max_entry_bytes=len(GOOD_DATA), max_total_bytes=total)
    manifest = cache_layers.check_layer(path, exact)
    done = cache_layers.install(path, manifest, node / "caches" / "triton")
    done.commit()
    for name, data in files.items():
        assert (node / "caches" / "triton" / name).read_bytes() == data
    for tighter, said in (
        (Limits(2, exact.max_entry_bytes, total), r"bundle_max_entries \(2\)"),
        (Limits(3, exact.max_entry_bytes - 1, total), "bundle_max_entry_bytes"),
        (Limits(3, exact.max_entry_bytes, total - 1), "bundle_max_total_bytes"),
    ):
        with pytest.raises(InputError, match=rf"manifest file '.+': .*{said}"):
            cache_layers.check_layer(path, tighter)


def test_a_manifest_larger_than_its_limit_is_refused_unread(node: Path) -> None:
    """The manifest's own room follows ``max_entries``: 1 MiB and 512 bytes a file."""
    files = [listed(f"ok/{n:05d}-{'n' * 200}") for n in range(4000)]
    path = node / "wide.layer"
    path.write_bytes(layer(files, []))
    with pytest.raises(
        InputError, match=r"member 'k26-cache.json': \d+ bytes, more than a manifest"
    ):
        cache_layers.read_layer_manifest(path, Limits(max_entries=100))
    assert len(cache_layers.read_layer_manifest(path).files) == 4000


def test_a_plain_or_gzip_layer_reads_the_same_and_a_cut_gzip_is_refused(node: Path) -> None:
    made = layer([listed(GOOD, GOOD_DATA)], [member("cache/" + GOOD, data=GOOD_DATA)])
    (node / "plain.layer").write_bytes(gzip.decompress(made))
    (node / "gz.layer").write_bytes(made)
    (node / "cut.layer").write_bytes(made[:-6])  # gzip's length, and part of its CRC
    assert cache_layers.check_layer(node / "plain.layer") == cache_layers.check_layer(
        node / "gz.layer"
    )
    with pytest.raises(InputError, match=r"cut\.layer: truncated or corrupt archive"):
        cache_layers.check_layer(node / "cut.layer")


def test_the_config_and_the_cli_default_to_the_archive_limits() -> None:
    section = FlashInferSection()
    assert (
        Limits(
            section.bundle_max_entries,
            section.bundle_max_entry_bytes,
            section.bundle_max_total_bytes,
        )
        == DEFAULT_LIMITS
    )
    parser = build_parser()
    base = ["flashinfer", "bundle", "import", "--python", "/p", "--arch", "12.0"]
    args = parser.parse_args([*base, "--workspace", "/w", "a.tar.gz"])
    assert (args.max_entries, args.max_entry_bytes, args.max_total_bytes) == (
        DEFAULT_LIMITS.max_entries,
        DEFAULT_LIMITS.max_entry_bytes,
        DEFAULT_LIMITS.max_total_bytes,
    )
    args = parser.parse_args([*base, "--workspace", "/w", "--max-entries", "7", "a.tar.gz"])
    assert args.max_entries == 7
    with pytest.raises(UsageError, match="--max-entries: must be a whole number of at least 1"):
        parser.parse_args([*base, "--workspace", "/w", "--max-entries", "0", "a.tar.gz"])
