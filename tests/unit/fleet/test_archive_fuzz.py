"""The archive reader under random layers (hypothesis): it refuses, or it stays inside.

Each example is a layer of random tar members (names with ``..``, absolute, empty
or ``.`` parts, backslashes, unicode, long; files, directories, symbolic and hard
links, character and block devices, fifos; any mode bits, setuid, setgid and sticky
among them; any size) and a manifest that lists each exactly, wrongly or not at all,
plus files that are missing, under random limits, sometimes with bytes after the
tar. Read as a pull reads a layer (``check_layer``, then ``install`` into a cold
cache), each must either:

- be refused with one InputError line that starts with the layer and names an
  entry (a member or a manifest file), everything on disk as it was; or
- install exactly the manifest's files (bytes, mode, mtime), regular files only,
  every one inside the cache, nothing else on disk changed.

``K26_ARCHIVE_FUZZ_EXAMPLES`` sets how many examples (200 by default, for the
suite's time); a fuzz run: ``K26_ARCHIVE_FUZZ_EXAMPLES=2000 .venv/bin/pytest
tests/unit/fleet/test_archive_fuzz.py``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from supervisor.core.errors import InputError
from supervisor.fleet import cache_layers
from supervisor.fleet.archive import DEFAULT_LIMITS, MEMBER_PREFIX, Limits

from .hostile import BASE, Snapshot, snapshot

EXAMPLES = int(os.environ.get("K26_ARCHIVE_FUZZ_EXAMPLES", "200"))
MTIME_NS = 1_700_000_000_123_456_789
# Refusals of the whole archive, which no one entry caused.
WHOLE = (
    "truncated or corrupt archive",
    "not a k26 cache layer",
    "manifest field files.",  # a listed file that fails the schema: named by its index
)

# Most parts plain, so that layers often get past the names to their links, modes,
# sizes and bytes; the rest hostile or odd.
PLAIN = st.text("abcxyz_0123456789.-é", min_size=1, max_size=10).filter(
    lambda p: p not in (".", "..")
)
ODD = st.one_of(
    st.sampled_from(["..", ".", "", "\\", "a\\b", "cache", "ü\u0301", "\u2028", "x" * 300]),
    st.text(
        st.characters(codec="utf-8", exclude_characters="\x00/"),
        min_size=1,
        max_size=12,
    ),
)
PARTS = st.one_of(*[PLAIN] * 6, ODD)
RELATIVE = st.lists(PARTS, min_size=1, max_size=3).map("/".join)
UNDER_CACHE = RELATIVE.map(lambda r: MEMBER_PREFIX + r)
NAMES = st.one_of(
    UNDER_CACHE,
    UNDER_CACHE,
    UNDER_CACHE,
    UNDER_CACHE,
    RELATIVE.map(lambda r: "/" + r),
    RELATIVE,
    RELATIVE.map(lambda r: MEMBER_PREFIX + "../" + r),
)
TYPES = st.sampled_from(
    [tarfile.REGTYPE] * 6
    + [
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
        tarfile.CONTTYPE,
    ]
)
LINKS = st.one_of(
    st.sampled_from(["/etc/passwd", "../../../etc", "..", ".", "a", "cache/a", "cache/../x"]),
    NAMES,
)
PLAIN_MODES = st.sampled_from([0o644, 0o755, 0o600, 0o444])
MODES = st.one_of(PLAIN_MODES, PLAIN_MODES, PLAIN_MODES, st.integers(0, 0o7777))
LISTING = st.sampled_from(["exact"] * 4 + ["absent"] * 3 + ["size", "sha256", "mode"])
LIMITS = st.one_of(
    st.just(DEFAULT_LIMITS),
    st.just(DEFAULT_LIMITS),
    st.builds(Limits, st.integers(1, 6), st.integers(0, 48), st.integers(0, 96)),
)


@dataclass(frozen=True)
class Member:
    name: str
    kind: bytes
    mode: int
    data: bytes
    link: str
    listing: str  # how the manifest lists it
    listed_mode: int


PLAIN_NAMES = st.lists(PLAIN, min_size=1, max_size=3).map(lambda p: MEMBER_PREFIX + "/".join(p))
BENIGN = st.builds(
    Member,
    name=PLAIN_NAMES,
    kind=st.just(tarfile.REGTYPE),
    mode=PLAIN_MODES,
    data=st.binary(max_size=40),
    link=st.just(""),
    listing=st.just("exact"),
    listed_mode=PLAIN_MODES,
)
MEMBERS = st.builds(
    Member,
    name=st.one_of(PLAIN_NAMES, PLAIN_NAMES, NAMES),  # a plain name: its type and mode tell
    kind=TYPES,
    mode=MODES,
    data=st.binary(max_size=40),
    link=LINKS,
    listing=LISTING,
    listed_mode=MODES,
)


def NAME(member: Member) -> str:
    return member.name


def entry_name(name: str) -> str:
    return name[len(MEMBER_PREFIX) :] if name.startswith(MEMBER_PREFIX) else name


def build(
    members: list[Member], missing: list[str], trailing: bytes, plain: bool
) -> tuple[bytes, list[dict[str, Any]]]:
    """The layer's bytes and its manifest's files."""
    files: list[dict[str, Any]] = []
    for m in members:
        if m.listing == "absent":
            continue
        data = m.data if m.kind == tarfile.REGTYPE else b""
        files.append(
            {
                "name": entry_name(m.name),
                "size": len(data) + (m.listing == "size"),
                "sha256": hashlib.sha256(data + b"!" * (m.listing == "sha256")).hexdigest(),
                "mtime_ns": MTIME_NS,
                "mode": m.listed_mode if m.listing == "mode" else m.mode,
            }
        )
    files += [
        {"name": n, "size": 1, "sha256": "0" * 64, "mtime_ns": 0, "mode": 0o644} for n in missing
    ]
    manifest = json.dumps({"kind": "k26-jit-cache", "schema_version": 1, **BASE, "files": files})
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.PAX_FORMAT) as tar:
        head = tarfile.TarInfo(cache_layers.LAYER_MANIFEST)
        head.size = len(manifest.encode())
        tar.addfile(head, io.BytesIO(manifest.encode()))
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type = m.kind
            info.mode = m.mode
            info.mtime = MTIME_NS // 1_000_000_000
            info.linkname = m.link if m.kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            regular = m.kind in (tarfile.REGTYPE, tarfile.CONTTYPE)
            info.size = len(m.data) if regular else 0
            tar.addfile(info, io.BytesIO(m.data) if regular else None)
    raw = tar_bytes.getvalue() + trailing
    return (raw if plain else gzip.compress(raw, mtime=0)), files


def names_an_entry(said: str, names: set[str]) -> bool:
    return any(repr(name) in said for name in names) or any(w in said for w in WHOLE)


def outside(whole: Snapshot) -> Snapshot:
    """Everything but the cache, directories' mtimes left out (the work dir beside the
    cache is made and removed)."""
    return {
        k: (v[0], v[1], 0 if v[0] == "dir" else v[2], v[3])
        for k, v in whole.items()
        if not (k == "caches/triton" or k.startswith("caches/triton/"))
    }


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    members=st.one_of(
        st.lists(MEMBERS, max_size=4),  # anything
        st.tuples(st.lists(BENIGN, max_size=4, unique_by=NAME), MEMBERS, st.integers(0, 4)).map(
            lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]]  # honest files and one odd
        ),
        st.lists(BENIGN, max_size=5, unique_by=NAME),  # honest files alone
    ),
    missing=st.one_of(st.just([]), st.just([]), st.lists(RELATIVE, max_size=2)),
    limits=LIMITS,
    trailing=st.one_of(
        st.just(b""), st.just(b""), st.binary(max_size=64), st.integers(1, 200_000).map(bytes)
    ),
    plain=st.booleans(),
)
def test_a_random_layer_is_refused_naming_an_entry_or_installs_inside_the_cache(
    members: list[Member], missing: list[str], limits: Limits, trailing: bytes, plain: bool
) -> None:
    try:
        made, files = build(members, missing, trailing, plain)
    except (ValueError, UnicodeError, tarfile.TarError):
        assume(False)  # what tarfile cannot write is no layer at all
        raise
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        layer = root / "layers" / "sha256-fuzz.layer"
        layer.parent.mkdir()
        layer.write_bytes(made)
        cache = root / "caches" / "triton"
        cache.mkdir(parents=True)
        (cache / "lock").write_text("")
        (root / "etc").mkdir()
        (root / "etc" / "passwd").write_text("root:x:0:0\n")
        before = snapshot(root)
        with tarfile.open(fileobj=io.BytesIO(made)) as tar:
            written = {info.name for info in tar.getmembers()}
        named = written | {f["name"] for f in files} | {MEMBER_PREFIX + f["name"] for f in files}

        try:
            manifest = cache_layers.check_layer(layer, limits)
        except InputError as exc:
            said = str(exc)
            event("refused: " + re.sub(r"'.*?'|\d+", "_", said.removeprefix(f"{layer}: "))[:60])
            assert len(said.splitlines()) == 1 and said.startswith(f"{layer}: "), said
            assert names_an_entry(said, named), said
            assert snapshot(root) == before
            try:  # the install's own walk must refuse it too, whatever check said
                parsed = cache_layers.read_layer_manifest(layer, limits)
            except InputError:
                return
            with pytest.raises(InputError) as again:
                cache_layers.install(layer, parsed, cache)
            assert names_an_entry(str(again.value), named), str(again.value)
            assert snapshot(cache) == {
                k.removeprefix("caches/triton").lstrip("/") or ".": v
                for k, v in before.items()
                if k == "caches/triton" or k.startswith("caches/triton/")
            }
            assert outside(snapshot(root)) == outside(before)
            return

        cache_layers.install(layer, manifest, cache).commit()
        event(f"installed {min(len(manifest.files), 3)}+ files")
        found: dict[str, Path] = {}
        for path in cache.rglob("*"):
            assert not path.is_symlink(), path
            assert os.path.realpath(path).startswith(str(cache) + os.sep), path
            if not path.is_dir():
                assert path.is_file(), path  # no device, fifo or socket
                found[path.relative_to(cache).as_posix()] = path
        # The cold cache's lock is no kernel: dropped with the cold dir, or kept.
        assert set(found) - {"lock"} == {e.name for e in manifest.files} - {"lock"}
        for entry in manifest.files:
            path = found[entry.name]
            stat = path.stat()
            assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
            assert stat.st_mode & 0o7777 == entry.mode and not entry.mode & 0o7000
            assert stat.st_mtime_ns == entry.mtime_ns
        assert outside(snapshot(root)) == outside(before)
