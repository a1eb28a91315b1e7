"""Hand-made hostile cache layers: one per kind of archive a node must refuse.

Each is a gzip'd tar laid out as ``cache_layers.export_layer`` writes a layer (its
manifest first, then files under ``cache/``) around one honest file, with one
hostile part: a name, a link, a special file, a mode, a size, a count, a bomb.
``Hostile.entry`` is the entry its refusal must name, ``said`` a part of the reason,
``limits`` the limits it is read under. The unit tests read them from disk
(tests/unit/fleet/test_hostile_archives.py); the integration test pushes each
through a real registry (tests/integration/test_hostile_layers.py).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.fleet.archive import DEFAULT_LIMITS, MEMBER_PREFIX, Limits
from supervisor.fleet.cache_layers import LAYER_MANIFEST

GOOD = "ok/_kernel.cubin"
GOOD_DATA = b"\x7fELF honest cubin bytes"
BASE: dict[str, Any] = {
    "cache": "triton",
    "path": "/var/cache/k26/triton",
    "identity": {"arch": "x86_64"},
    "relocatable": True,
}
BOMB_BYTES = 64 << 20  # zeros: about 64 KiB once gzip'd
GIB = 1 << 30


Snapshot = dict[str, tuple[str, int, int, str]]


def snapshot(top: Path, *, dir_mtimes: bool = True) -> Snapshot:
    """Every path under ``top`` (itself included): kind, mode, mtime, bytes' sha256 or
    link target. ``dir_mtimes=False`` leaves out directories' mtimes."""
    out: Snapshot = {}
    paths = [top, *sorted(top.rglob("*"))] if top.exists() else []
    for path in paths:
        stat = path.lstat()
        if path.is_symlink():
            kind, what = "link", os.readlink(path)
        elif path.is_dir():
            kind, what = "dir", ""
        else:
            kind, what = "file", hashlib.sha256(path.read_bytes()).hexdigest()
        mtime = stat.st_mtime_ns if kind != "dir" or dir_mtimes else 0
        out[str(path.relative_to(top))] = (kind, stat.st_mode, mtime, what)
    return out


@dataclass(frozen=True)
class Hostile:
    kind: str
    entry: str  # the entry the refusal names (as repr() writes it)
    said: str  # part of the reason
    layer: bytes
    limits: Limits = DEFAULT_LIMITS


def listed(
    name: str, data: bytes = b"", mode: int = 0o644, size: int | None = None
) -> dict[str, Any]:
    """A manifest's entry for ``name``."""
    return {
        "name": name,
        "size": len(data) if size is None else size,
        "sha256": hashlib.sha256(data).hexdigest(),
        "mtime_ns": 1_700_000_000_000_000_000,
        "mode": mode,
    }


def member(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    data: bytes = b"",
    *,
    mode: int = 0o644,
    link: str = "",
    pax: Mapping[str, str] | None = None,
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    info.mtime = 1_700_000_000
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    if pax:
        info.pax_headers = dict(pax)
    return info, data


def layer(
    files: Sequence[Mapping[str, Any]],
    members: Sequence[tuple[tarfile.TarInfo, bytes]],
    *,
    base: Mapping[str, Any] = BASE,
    trailing: int = 0,
) -> bytes:
    """A layer: its manifest listing ``files``, then ``members`` (names as given),
    then ``trailing`` zero bytes past the tar's end inside the same gzip stream."""
    manifest = {"kind": "k26-jit-cache", "schema_version": 1, **base, "files": list(files)}
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed:
        with tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tar:
            data = json.dumps(manifest).encode()
            head, _ = member(LAYER_MANIFEST, data=data)
            tar.addfile(head, io.BytesIO(data))
            for info, content in members:
                tar.addfile(info, io.BytesIO(content) if info.isreg() else None)
        for _ in range(trailing // (1 << 20)):
            compressed.write(bytes(1 << 20))
    return raw.getvalue()


def honest() -> tuple[dict[str, Any], tuple[tarfile.TarInfo, bytes]]:
    return listed(GOOD, GOOD_DATA), member(MEMBER_PREFIX + GOOD, data=GOOD_DATA)


KINDS = (
    "absolute path",
    "dot-dot member",
    "dot-dot in the manifest",
    "symlink out (absolute)",
    "symlink out (relative)",
    "hardlink out",
    "symlink loop",
    "link chain",
    "character device",
    "block device",
    "fifo",
    "directory entry",
    "setuid member",
    "sticky member",
    "setgid in the manifest",
    "one entry too large",
    "total too large",
    "too many entries",
    "a file that is another's directory",
    "a name part too long",
    "decompression bomb (after the tar)",
    "decompression bomb (a member larger than listed)",
    "decompression bomb (an extended header)",
)  # parametrize by these: building the corpus takes a second (its bombs)


@functools.cache
def hostile(kind: str) -> Hostile:
    """The hostile layer ``kind`` (the corpus is built once)."""
    return {case.kind: case for case in corpus()}[kind]


@functools.cache
def corpus() -> tuple[Hostile, ...]:
    """Every hostile kind (``KINDS``), around one honest file."""
    base = BASE
    entry, good = honest()
    cases: list[Hostile] = []

    def add(kind: str, named: str, said: str, *extra: tuple[tarfile.TarInfo, bytes]) -> None:
        cases.append(Hostile(kind, named, said, layer([entry], [good, *extra], base=base)))

    def add_listed(
        kind: str, named: str, said: str, files: Sequence[dict[str, Any]], **kw: Any
    ) -> None:
        made = layer([entry, *files], [good], base=base)
        cases.append(Hostile(kind, named, said, made, **kw))

    add("absolute path", "/etc/cron.d/k26", "outside cache/", member("/etc/cron.d/k26", data=b"x"))
    add(
        "dot-dot member",
        "cache/../../etc/cron.d/k26",
        "not a plain relative path",
        member("cache/../../etc/cron.d/k26", data=b"x"),
    )
    add_listed(
        "dot-dot in the manifest",
        "../../etc/cron.d/k26",
        "not a plain relative path",
        [listed("../../etc/cron.d/k26", b"x")],
    )
    add(
        "symlink out (absolute)",
        "cache/evil",
        "pointing out of the cache",
        member("cache/evil", tarfile.SYMTYPE, link="/etc/passwd"),
    )
    add(
        "symlink out (relative)",
        "cache/ok/evil",
        "pointing out of the cache",
        member("cache/ok/evil", tarfile.SYMTYPE, link="../../../etc"),
    )
    add(
        "hardlink out",
        "cache/evil",
        "pointing out of the cache",
        member("cache/evil", tarfile.LNKTYPE, link="etc/passwd"),
    )
    add(
        "symlink loop",
        "cache/loop-a",
        "links may chain or loop",
        member("cache/loop-a", tarfile.SYMTYPE, link="loop-b"),
        member("cache/loop-b", tarfile.SYMTYPE, link="loop-a"),
    )
    add(
        "link chain",
        "cache/chain-1",
        "links may chain or loop",
        member("cache/chain-1", tarfile.SYMTYPE, link="chain-2"),
        member("cache/chain-2", tarfile.LNKTYPE, link=MEMBER_PREFIX + GOOD),
    )
    add(
        "character device",
        "cache/null",
        "a character device",
        member("cache/null", tarfile.CHRTYPE),
    )
    add("block device", "cache/sda", "a block device", member("cache/sda", tarfile.BLKTYPE))
    add("fifo", "cache/pipe", "a fifo", member("cache/pipe", tarfile.FIFOTYPE))
    add("directory entry", "cache/dir", "a directory", member("cache/dir", tarfile.DIRTYPE))
    run = b"#!/bin/sh\nid\n"
    cases.append(
        Hostile(
            "setuid member",
            "cache/ok/run",
            "mode 0o4755 sets setuid",
            layer(
                [entry, listed("ok/run", run, 0o755)],
                [good, member("cache/ok/run", data=run, mode=0o4755)],
                base=base,
            ),
        )
    )
    cases.append(
        Hostile(
            "sticky member",
            "cache/ok/run",
            "mode 0o1644 sets setuid, setgid or sticky bits",
            layer(
                [entry, listed("ok/run", run)],
                [good, member("cache/ok/run", data=run, mode=0o1644)],
                base=base,
            ),
        )
    )
    add_listed(
        "setgid in the manifest",
        "ok/run",
        "mode 0o2755 sets setuid",
        [listed("ok/run", run, 0o2755)],
    )
    add_listed(
        "one entry too large",
        "ok/huge.cubin",
        "more than bundle_max_entry_bytes",
        [listed("ok/huge.cubin", size=5 * GIB)],
    )
    add_listed(
        "total too large",
        "ok/big-15",  # 16 of 4 GiB and the honest file: past 64 GiB
        "more than bundle_max_total_bytes",
        [listed(f"ok/big-{n:02d}", size=4 * GIB) for n in range(17)],
    )
    add_listed(
        "too many entries",
        "ok/n-0999",
        "more than bundle_max_entries (1000)",
        [listed(f"ok/n-{n:04d}") for n in range(1000)],
        limits=Limits(max_entries=1000),
    )
    add_listed(
        "a file that is another's directory",
        "ok/_kernel.cubin",
        "the directory of another file",
        [listed(f"{GOOD}/inner")],
    )
    add_listed(
        "a name part too long",
        "ok/" + "x" * 256,
        "longer than 255 bytes",
        [listed("ok/" + "x" * 256)],
    )
    cases.append(
        Hostile(
            "decompression bomb (after the tar)",
            MEMBER_PREFIX + GOOD,
            "a decompression bomb",
            layer([entry], [good], base=base, trailing=BOMB_BYTES),
        )
    )
    oversized, _ = member(MEMBER_PREFIX + GOOD, data=GOOD_DATA)
    oversized.size = BOMB_BYTES  # the header says 64 MiB; the manifest says 24 bytes
    cases.append(
        Hostile(
            "decompression bomb (a member larger than listed)",
            MEMBER_PREFIX + GOOD,
            f"{BOMB_BYTES} bytes, the manifest says {len(GOOD_DATA)}",
            layer([entry], [(oversized, bytes(BOMB_BYTES))], base=base),
        )
    )
    cases.append(
        Hostile(
            "decompression bomb (an extended header)",
            MEMBER_PREFIX + GOOD,
            "an extended header of",
            layer(
                [entry, listed("ok/next", b"n")],
                [good, member("cache/ok/next", data=b"n", pax={"comment": "z" * (1 << 20)})],
                base=base,
            ),
        )
    )
    return tuple(cases)
