"""Cache bundles without a serving venv: the manifest, every refusal, the install.

The cache is laid out as FlashInfer 0.7 lays it out, with a real nvcc-built
``.so`` (tests/unit/flashinfer/data) and a fingerprint as warm writes it; the
host identity is given, not asked. The real venv, kills and the booted host
are in tests/integration/test_flashinfer_bundle.py.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.errors import CacheError, InputError
from supervisor.flashinfer import cache, learned
from supervisor.flashinfer.venv import ServingEnv
from supervisor.fleet import bundle
from supervisor.fleet.archive import Limits

DATA = Path(__file__).parents[1] / "flashinfer" / "data"
IDENTITY: dict[str, Any] = {
    "python": "/usr/bin/python3.11",
    "python_version": "3.11.2",
    "prefix": "/srv/venv",
    "flashinfer": {"name": "flashinfer-python", "version": "0.7.4", "record_sha256": "aa"},
    "flashinfer_dir": "/srv/venv/lib/python3.11/site-packages/flashinfer",
    "gate_files": {"jit/core.py": "bb"},
    "torch": {"name": "torch", "version": "2.8.0", "record_sha256": "cc", "cuda": "12.9"},
    "nvcc": {"cuda_home": "/usr/local/cuda", "path": "/usr/local/cuda/bin/nvcc",
             "release": "13.0", "version_sha256": "dd", "mtime_ns": 1},
    "env": {"FLASHINFER_CUDA_ARCH_LIST": "12.0", "CC": None},
}  # fmt: skip


class Cache:
    """``<ws>/.cache/flashinfer/0.7.4/120f``: sampling's .so, its ninja state, a fingerprint."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.dir = cache.cache_root(workspace) / "0.7.4" / "120f"
        self.build_dir = self.dir / "cached_ops" / "sampling"
        self.so = self.build_dir / "sampling.so"
        self.serving = ServingEnv(Path("/srv/venv/bin/python"), "12.0", workspace)

    def warm(self, identity: dict[str, Any] = IDENTITY) -> None:
        self.build_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / "k_sm_120f.so", self.so)
        (self.build_dir / "build.ninja").write_text("rule link\n")
        (self.build_dir / ".ninja_log").write_text("# ninja log v5\n")
        (self.build_dir / "csrc_sampling.cuda.o").write_bytes(b"\x7fELF object")
        os.utime(self.build_dir / "csrc_sampling.cuda.o", ns=(1_700_000_000_123_456_789,) * 2)
        (self.dir / "cached_ops" / "tmp").mkdir(exist_ok=True)
        (self.dir / "cached_ops" / "tmp" / "sampling.lock").touch()  # released, as FlashInfer
        (self.dir / "flashinfer_jit.log").write_text("Building JIT module sampling\n")
        data = self.so.read_bytes()
        cache.write_fingerprint(
            cache.Fingerprint(
                arch="12.0",
                arch_tag="120f",
                identity=identity,
                modules={
                    "sampling": {
                        "path": str(self.so),
                        "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "targets": ["sm_120f"],
                    }
                },
                built_at="2026-12-01T00:00:00Z",
                path=self.dir / cache.FINGERPRINT_NAME,
            )
        )


def tree(workspace: Path) -> dict[str, tuple[str, int]]:
    """Every path under the workspace: its content hash (or kind) and mtime."""
    out: dict[str, tuple[str, int]] = {}
    for path in sorted(workspace.rglob("*")) if workspace.exists() else []:
        stat = path.lstat()
        kind = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(workspace))] = (kind, stat.st_mtime_ns)
    return out


@pytest.fixture
def built(tmp_path: Path) -> tuple[Cache, Path]:
    """A warmed cache and its bundle, then the build workspace moved aside (a new host)."""
    source = Cache(tmp_path / "ws")
    source.warm()
    archive = tmp_path / "out" / "sampling.k26bundle.tar.gz"
    archive.parent.mkdir()
    bundle.export_sync(source.serving, IDENTITY, archive, ["sampling"])
    shutil.move(tmp_path / "ws", tmp_path / "built-ws")
    return Cache(tmp_path / "ws"), archive


def members(archive: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(archive) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar]  # type: ignore[union-attr]


def rewrite(archive: Path, items: list[tuple[tarfile.TarInfo, bytes]], target: Path) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        for info, data in items:
            info = copy.copy(info)
            if info.isreg():
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return target


def with_manifest(items: list[tuple[tarfile.TarInfo, bytes]], **changes: Any) -> list[Any]:
    manifest = json.loads(items[0][1])
    manifest.update(changes)
    return [(items[0][0], json.dumps(manifest).encode()), *items[1:]]


# --- export -----------------------------------------------------------------------


def test_export_writes_manifest_and_module_build_dir(tmp_path: Path) -> None:
    source = Cache(tmp_path / "ws")
    source.warm()
    out = tmp_path / "b.tar.gz"
    result = bundle.export_sync(source.serving, IDENTITY, out, ["sampling"])
    items = members(out)
    assert items[0][0].name == bundle.MANIFEST_NAME
    manifest = bundle.parse_manifest(items[0][1], out)
    names = sorted(m.name for m, _ in items[1:])
    # The .so and its ninja state; no lock, no fingerprint, no FlashInfer log.
    assert names == [
        "cache/cached_ops/sampling/.ninja_log",
        "cache/cached_ops/sampling/build.ninja",
        "cache/cached_ops/sampling/csrc_sampling.cuda.o",
        "cache/cached_ops/sampling/sampling.so",
    ]
    assert manifest.cache_dir == "0.7.4/120f" and manifest.arch_tag == "120f"
    assert manifest.identity == IDENTITY and manifest.workspace == str(source.workspace)
    module = manifest.modules["sampling"]
    assert module.file == "cached_ops/sampling/sampling.so"
    assert module.sha256 == hashlib.sha256(source.so.read_bytes()).hexdigest()
    obj = next(f for f in manifest.files if f.name.endswith(".o"))
    assert obj.mtime_ns == 1_700_000_000_123_456_789
    assert result["files"] == 4 and result["size_bytes"] == out.stat().st_size
    assert not list(tmp_path.glob(".b.tar.gz.*")), "temp file left"


def test_a_templated_module_travels_with_its_generated_sources_and_their_mtimes(
    tmp_path: Path,
) -> None:
    """FlashInfer renders a templated module's sources into ``generated/<module>/`` and
    writes them again only when they differ; it runs ninja at every load. Pulled
    without them, the loader writes them anew, newer than the objects, and ninja
    rebuilds (FlashInfer 0.7.4's locality_domain did, on this machine). So they go in
    the bundle and come out with their mtimes, older than the objects as built."""
    source = Cache(tmp_path / "ws")
    source.warm()
    generated = source.dir / "generated" / "sampling"
    (generated / "inc").mkdir(parents=True)
    (generated / "sampling_kernel.cu").write_text("// rendered\n")
    (generated / "inc" / "config.inc").write_text("#define X 1\n")
    for path in (generated / "sampling_kernel.cu", generated / "inc" / "config.inc"):
        os.utime(path, ns=(1_600_000_000_000_000_000,) * 2)
    (source.dir / "generated" / "norm").mkdir()  # another module's: not this bundle's
    (source.dir / "generated" / "norm" / "norm.cu").write_text("// norm\n")
    out = tmp_path / "b.tar.gz"
    result = bundle.export_sync(source.serving, IDENTITY, out, ["sampling"])
    names = sorted(m.name for m, _ in members(out)[1:])
    assert [n for n in names if "/generated/" in f"/{n}"] == [
        "cache/generated/sampling/inc/config.inc",
        "cache/generated/sampling/sampling_kernel.cu",
    ]
    assert result["files"] == 6
    shutil.move(tmp_path / "ws", tmp_path / "built-ws")
    target = Cache(tmp_path / "ws")
    bundle.import_sync(target.serving, IDENTITY, out)
    pulled = target.dir / "generated" / "sampling" / "sampling_kernel.cu"
    assert pulled.read_text() == "// rendered\n"
    assert pulled.stat().st_mtime_ns == 1_600_000_000_000_000_000
    assert not (target.dir / "generated" / "norm").exists()


def _add_module(source: Cache, name: str) -> Path:
    """Another module built beside sampling, vouched for by the same fingerprint."""
    build = source.dir / "cached_ops" / name
    build.mkdir(parents=True)
    so = build / f"{name}.so"
    shutil.copy(DATA / "k_sm_120f.so", so)
    fingerprint = cache.read_fingerprint(source.dir / cache.FINGERPRINT_NAME)
    assert fingerprint is not None
    data = so.read_bytes()
    entry = {"path": str(so), "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
             "targets": ["sm_120f"]}  # fmt: skip
    cache.write_fingerprint(
        dataclasses.replace(fingerprint, modules={**fingerprint.modules, name: entry})
    )
    return so


def test_learned_modules_the_fingerprint_vouches_for_travel_and_the_rest_are_named(
    tmp_path: Path,
) -> None:
    """What ready units built goes with what was asked for (a node pulled without it
    builds it at first use); a learned module nothing vouches for, or one changed since,
    is left out with a note saying to warm first, and the export goes on."""
    source = Cache(tmp_path / "ws")
    source.warm()
    _add_module(source, "norm")
    changed = _add_module(source, "batch_prefill_x")
    changed.write_bytes(changed.read_bytes() + b"\0")
    # A module an installed wheel serves, and one FlashInfer has no generator for.
    served = _add_module(source, "gemm_sm90")
    fingerprint = cache.read_fingerprint(source.dir / cache.FINGERPRINT_NAME)
    assert fingerprint is not None
    modules = {**fingerprint.modules}
    modules["gemm_sm90"] = {**modules["gemm_sm90"], "source": "provider", "path": str(served)}
    cache.write_fingerprint(
        dataclasses.replace(
            fingerprint, modules=modules, not_rebuildable={"batch_decode_y": "no generator"}
        )
    )
    out = tmp_path / "b.tar.gz"
    learned = ["norm", "sampling", "batch_prefill_x", "never_built", "gemm_sm90", "batch_decode_y"]
    result = bundle.export_sync(
        source.serving, IDENTITY, out, ["sampling", "sampling"], learned=learned
    )
    assert result["modules"] == ["norm", "sampling"]
    names = [m.name for m, _ in members(out)[1:]]
    assert len(names) == len(set(names))  # sampling asked twice: its files once
    assert "cache/cached_ops/norm/norm.so" in names
    assert not any(w in n for n in names for w in ("batch_prefill_x", "gemm_sm90"))
    notes = dict(n.split(" not carried: ", 1) for n in result["notes"])
    assert set(notes) == {f"learned module {m}" for m in learned[2:]}
    assert "is not what the fingerprint vouches for" in notes["learned module batch_prefill_x"]
    assert notes["learned module never_built"].startswith("the fingerprint does not vouch")
    assert notes["learned module gemm_sm90"] == "an installed package serves it"
    assert notes["learned module batch_decode_y"] == (
        "warm cannot build it here and no learned record names its library; "
        "nodes build it at first use"
    )


def _unit_built(source: Cache, name: str, ninja: str = "rule cuda_compile\n") -> Path:
    """A templated module a unit built (FlashInfer has no generator for it: warm names
    it not_rebuildable), with its rendered sources, as the learned record took it."""
    build = source.dir / "cached_ops" / name
    build.mkdir(parents=True)
    so = build / f"{name}.so"
    shutil.copy(DATA / "k_sm_120f.so", so)
    (build / "build.ninja").write_text(ninja)
    (build / f"{name}.cuda.o").write_bytes(b"\x7fELF object")
    (source.dir / "generated" / name).mkdir(parents=True)
    (source.dir / "generated" / name / "kernel.cu").write_text("// rendered\n")
    fingerprint = cache.read_fingerprint(source.dir / cache.FINGERPRINT_NAME)
    assert fingerprint is not None
    cache.write_fingerprint(
        dataclasses.replace(fingerprint, not_rebuildable={name: "no generator"})
    )
    data = so.read_bytes()
    learned.record(source.workspace, "12.0", [learned.Built(
        name, "0.7.4", "120f", str(so), len(data), hashlib.sha256(data).hexdigest(),
        hashlib.sha256(ninja.encode()).hexdigest(),
    )])  # fmt: skip
    return so


def test_a_module_only_a_unit_can_build_travels_when_its_bytes_are_what_the_record_took(
    tmp_path: Path,
) -> None:
    """FlashInfer's attention modules are built by the server with its own arguments;
    warm cannot rebuild them, so no fingerprint lists them. The fingerprint still
    vouches for the builder (this venv), and the learned record for the bytes the unit
    built: such a module goes, with its rendered sources, and a node installs it vouched
    for. Bytes or a build.ninja that differ from the record, or a library the units
    cannot load (another CUDA runtime than their torch's), are named and left out."""
    cu13 = copy.deepcopy(IDENTITY)
    cu13["torch"]["cuda"] = "13.0"  # the test library links libcudart.so.13
    source = Cache(tmp_path / "ws")
    source.warm(cu13)
    _unit_built(source, "batch_prefill_h128")
    out = tmp_path / "b.tar.gz"
    result = bundle.export_sync(
        source.serving, cu13, out, ["sampling"], learned=["batch_prefill_h128"]
    )
    assert result["modules"] == ["batch_prefill_h128", "sampling"] and result["notes"] == []
    names = {m.name for m, _ in members(out)[1:]}
    assert {"cache/cached_ops/batch_prefill_h128/batch_prefill_h128.so",
            "cache/generated/batch_prefill_h128/kernel.cu"} <= names  # fmt: skip
    shutil.move(tmp_path / "ws", tmp_path / "built-ws")
    target = Cache(tmp_path / "ws")
    bundle.import_sync(target.serving, cu13, out)
    installed = cache.read_fingerprint(target.dir / cache.FINGERPRINT_NAME)
    assert installed is not None and "batch_prefill_h128" in installed.modules
    assert installed.modules["batch_prefill_h128"]["targets"] == ["sm_120f"]

    def left_out(identity: dict[str, Any], change: Any) -> list[str]:
        other = Cache(tmp_path / f"ws-{len(list(tmp_path.iterdir()))}")
        other.warm(identity)
        _unit_built(other, "batch_prefill_h128")
        change(other.dir / "cached_ops" / "batch_prefill_h128")
        done = bundle.export_sync(other.serving, identity, tmp_path / "c.tar.gz", ["sampling"],
                                  learned=["batch_prefill_h128"])  # fmt: skip
        assert done["modules"] == ["sampling"]
        return [n.split(" not carried: ", 1)[1] for n in done["notes"]]

    def ninja(build: Path) -> None:
        (build / "build.ninja").write_text("changed\n")

    (why,) = left_out(cu13, ninja)
    assert why.endswith("/build.ninja is not what the learned record took from the unit; "
                        "nodes build it at first use")  # fmt: skip
    (why,) = left_out(IDENTITY, lambda build: None)  # the units' torch: CUDA 12.9
    assert "links the CUDA 13 runtime (libcudart.so.13) but the units' torch" in why


@pytest.mark.parametrize("link", ["generated", "generated/sampling"])
def test_export_refuses_generated_sources_behind_a_symlink(link: str, tmp_path: Path) -> None:
    """A link where the sources are would carry (and on a root push, read) whatever it
    points at: refused, naming it, and no archive is written."""
    source = Cache(tmp_path / "ws")
    source.warm()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sampling").mkdir(parents=True)
    (elsewhere / "sampling" / "secret.cu").write_text("// not the cache's\n")
    target = source.dir / link
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(elsewhere if link == "generated" else elsewhere / "sampling")
    out = tmp_path / "b.tar.gz"
    with pytest.raises(CacheError, match=rf"{link}: a symlink; refusing"):
        bundle.export_sync(source.serving, IDENTITY, out, ["sampling"])
    assert not out.exists()


def test_export_refuses_a_cache_without_fingerprint(tmp_path: Path) -> None:
    source = Cache(tmp_path / "ws")
    source.warm()
    (source.dir / cache.FINGERPRINT_NAME).unlink()
    with pytest.raises(CacheError, match="nothing vouches for this cache"):
        bundle.export_sync(source.serving, IDENTITY, tmp_path / "b.tar.gz", ["sampling"])
    assert not (tmp_path / "b.tar.gz").exists()


def test_export_refuses_a_fingerprint_the_venv_no_longer_matches(tmp_path: Path) -> None:
    source = Cache(tmp_path / "ws")
    source.warm()
    now = copy.deepcopy(IDENTITY)
    now["torch"]["version"] = "2.9.0"
    with pytest.raises(CacheError, match=r"torch\.version: '2\.8\.0' -> '2\.9\.0'"):
        bundle.export_sync(source.serving, now, tmp_path / "b.tar.gz", ["sampling"])


def test_export_refuses_a_module_file_that_changed_naming_it(tmp_path: Path) -> None:
    source = Cache(tmp_path / "ws")
    source.warm()
    source.so.write_bytes(source.so.read_bytes() + b"\0")
    with pytest.raises(CacheError, match=f"{source.so} no longer matches the fingerprint"):
        bundle.export_sync(source.serving, IDENTITY, tmp_path / "b.tar.gz", ["sampling"])
    with pytest.raises(CacheError, match="module norm is not covered"):
        bundle.export_sync(source.serving, IDENTITY, tmp_path / "b.tar.gz", ["norm"])


def test_export_failure_keeps_the_previous_archive_and_leaves_no_temp(tmp_path: Path) -> None:
    source = Cache(tmp_path / "ws")
    source.warm()
    (source.build_dir / "evil").symlink_to("/etc/passwd")
    out = tmp_path / "b.tar.gz"
    out.write_bytes(b"previous")
    with pytest.raises(CacheError, match="evil: not a regular file"):
        bundle.export_sync(source.serving, IDENTITY, out, ["sampling"])
    (source.build_dir / "evil").unlink()
    with pytest.raises(CacheError, match="cannot write"):
        bundle.export_sync(source.serving, IDENTITY, tmp_path / "no" / "b.tar.gz", ["sampling"])
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz", "ws"]


# --- import: the happy path ------------------------------------------------------


def test_import_installs_exact_files_and_a_fingerprint_for_this_host(
    built: tuple[Cache, Path], tmp_path: Path
) -> None:
    target, archive = built
    here = copy.deepcopy(IDENTITY)
    here["nvcc"]["mtime_ns"] = 2  # the same toolkit installed at another time
    result = bundle.import_sync(target.serving, here, archive)
    assert result["replaced"] is False and result["modules"] == ["sampling"]
    original = tmp_path / "built-ws" / ".cache/flashinfer/0.7.4/120f/cached_ops/sampling"
    for path in original.iterdir():
        copied = target.build_dir / path.name
        assert copied.read_bytes() == path.read_bytes(), path.name
        assert copied.stat().st_mtime_ns == path.stat().st_mtime_ns, path.name  # ninja's view
        assert copied.stat().st_mode == path.stat().st_mode, path.name
    fingerprint = cache.read_fingerprint(target.dir / cache.FINGERPRINT_NAME)
    assert fingerprint is not None and dict(fingerprint.identity) == here
    assert fingerprint.modules["sampling"]["path"] == str(target.so)
    assert not cache.identity_differences(fingerprint.identity, here)
    assert not (cache.cache_root(target.workspace) / bundle.WORK_NAME).exists()
    assert not (target.dir / "cached_ops" / "tmp").exists()  # FlashInfer makes its own


def test_import_tells_each_step_in_order_and_the_cache_is_old_until_the_swap(
    built: tuple[Cache, Path],
) -> None:
    """The steps the kill tests stop at (tests/integration/test_flashinfer_bundle.py):
    each told once as reached (staging once per file), the target untouched until
    the swap."""
    target, archive = built
    seen: list[tuple[str, bool]] = []
    bundle.import_sync(
        target.serving, IDENTITY, archive, on_step=lambda s: seen.append((s, target.so.exists()))
    )
    steps = list(dict.fromkeys(name for name, _ in seen))
    assert steps == ["verified", "locked", "staging", "staged", "swapped", "cleaned"]
    assert all(not there for name, there in seen if name not in ("swapped", "cleaned"))
    assert all(there for name, there in seen if name in ("swapped", "cleaned"))


def test_import_replaces_an_old_cache_and_sweeps_a_killed_import(
    built: tuple[Cache, Path],
) -> None:
    target, archive = built
    target.warm()
    (target.build_dir / "stale.o").write_bytes(b"old")
    leftover = cache.cache_root(target.workspace) / bundle.WORK_NAME / "123-4" / "cache"
    leftover.mkdir(parents=True)
    result = bundle.import_sync(target.serving, IDENTITY, archive)
    assert result["replaced"] is True and result["swept"] == [str(leftover.parent)]
    assert not (target.build_dir / "stale.o").exists()
    assert not (target.dir / "flashinfer_jit.log").exists()  # the whole dir is the bundle's
    assert not (cache.cache_root(target.workspace) / bundle.WORK_NAME).exists()


def test_installed_dirs_take_the_workspaces_mode(built: tuple[Cache, Path]) -> None:
    target, archive = built
    root = cache.cache_root(target.workspace)
    root.mkdir(parents=True, mode=0o755)  # as a warm run by root leaves it
    target.workspace.chmod(0o2770)  # as the installer makes it for the units' user
    bundle.import_sync(target.serving, IDENTITY, archive)
    for directory in (root.parent, root, target.dir, target.dir / "cached_ops", target.build_dir):
        assert directory.stat().st_mode & 0o7777 == 0o2770, directory


# --- import: refusals, each changing nothing --------------------------------------


def refused(target: Cache, archive: Path, match: str, host: dict[str, Any] = IDENTITY) -> None:
    before = tree(target.workspace)
    with pytest.raises(InputError, match=match):
        bundle.import_sync(target.serving, host, archive)
    assert tree(target.workspace) == before, "the workspace changed"


def test_refuses_another_builder_naming_field_values_and_fix(built: tuple[Cache, Path]) -> None:
    target, archive = built
    host = copy.deepcopy(IDENTITY)
    host["torch"]["cuda"] = "12.8"
    host["flashinfer"]["version"] = "0.7.0"
    del host["gate_files"]["jit/core.py"]
    refused(
        target,
        archive,
        r"torch\.cuda: bundle 12\.9, this host 12\.8: build the bundle with the same serving venv",
        host,
    )
    with pytest.raises(InputError) as caught:
        bundle.import_sync(target.serving, host, archive)
    message = str(caught.value)
    assert "flashinfer.version: bundle 0.7.4, this host 0.7.0" in message
    assert "gate_files.jit/core.py: bundle bb, this host absent" in message


def test_refuses_a_wrong_arch_and_another_workspace_path(
    built: tuple[Cache, Path], tmp_path: Path
) -> None:
    target, archive = built
    other = Cache(target.workspace)
    other.serving = ServingEnv(other.serving.python, "10.0", target.workspace)
    refused(other, archive, r"arch: bundle 12\.0, this host 10\.0")
    elsewhere = Cache(tmp_path / "elsewhere")
    refused(elsewhere, archive, r"workspace: bundle .*/ws, this host .*/elsewhere: .*ninja")


def test_nvcc_mtime_alone_is_not_compared() -> None:
    manifest = bundle.Manifest(
        arch="12.0", arch_tag="120f", cache_dir="0.7.4/120f", workspace="/w", identity=IDENTITY,
        built_at="x", exported_at="y", modules={}, files=(),
    )  # fmt: skip
    host = copy.deepcopy(IDENTITY)
    host["nvcc"]["mtime_ns"] = 99
    assert bundle.mismatches(manifest, host, "12.0", Path("/w")) == []
    host["nvcc"]["size"] = 5
    assert bundle.mismatches(manifest, host, "12.0", Path("/w")) == [
        "nvcc.size: bundle absent, this host 5: build the bundle with the CUDA toolkit "
        "the nodes have (same release, same path)"
    ]


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


EVIL = [
    ("traversal", _member("cache/../../../etc/cron.d/x"), "not a plain relative path"),
    ("absolute", _member("/etc/passwd"), "outside cache/"),
    ("inner dotdot", _member("cache/cached_ops/../x"), "not a plain relative path"),
    ("symlink", _member("cache/x", tarfile.SYMTYPE, "/etc/passwd"), "a link"),
    ("hardlink", _member("cache/x", tarfile.LNKTYPE, "cache/y"), "a link"),
    ("device", _member("cache/x", tarfile.CHRTYPE), "not a regular file"),
    ("fifo", _member("cache/x", tarfile.FIFOTYPE), "not a regular file"),
    ("directory", _member("cache/x", tarfile.DIRTYPE), "not a regular file"),
    ("unlisted", _member("cache/cached_ops/sampling/extra.so"), "not listed in the manifest"),
    ("second manifest", _member(bundle.MANIFEST_NAME), "a second manifest"),
]


@pytest.mark.parametrize(("label", "member", "match"), EVIL, ids=[e[0] for e in EVIL])
def test_refuses_an_evil_member_naming_it(
    built: tuple[Cache, Path], tmp_path: Path, label: str, member: tarfile.TarInfo, match: str
) -> None:
    target, archive = built
    items = members(archive)
    bad = rewrite(archive, [*items[:2], (member, b"x"), *items[2:]], tmp_path / "bad.tar.gz")
    refused(target, bad, rf"bad\.tar\.gz: member {re.escape(repr(member.name))}: .*{match}")


def test_refuses_past_its_limits_and_a_setuid_member(
    built: tuple[Cache, Path], tmp_path: Path
) -> None:
    """A bundle is read as a layer is (tests/unit/fleet/test_hostile_archives.py)."""
    target, archive = built
    before = tree(target.workspace)
    with pytest.raises(InputError, match=r"manifest file '.+': .* bundle_max_entries \(1\)"):
        bundle.import_sync(target.serving, IDENTITY, archive, limits=Limits(max_entries=1))
    assert tree(target.workspace) == before
    items = members(archive)
    info = copy.copy(items[1][0])
    info.mode = 0o4755
    bad = rewrite(archive, [items[0], (info, items[1][1]), *items[2:]], tmp_path / "suid.tar.gz")
    refused(target, bad, rf"member {re.escape(repr(info.name))}: mode 0o4755 sets setuid")


def test_refuses_a_duplicate_member(built: tuple[Cache, Path], tmp_path: Path) -> None:
    target, archive = built
    items = members(archive)
    bad = rewrite(archive, [*items, items[1]], tmp_path / "bad.tar.gz")
    refused(target, bad, f"member {re.escape(repr(items[1][0].name))}: appears twice")


def test_refuses_changed_bytes_and_sizes(built: tuple[Cache, Path], tmp_path: Path) -> None:
    target, archive = built
    items = members(archive)
    index = next(i for i, (m, _) in enumerate(items) if m.name.endswith(".so"))
    info, data = items[index]
    flipped = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    bad = rewrite(archive, [*items[:index], (info, flipped), *items[index + 1 :]], tmp_path / "a")
    refused(target, bad, r"member 'cache/cached_ops/sampling/sampling.so': sha256 \w+ differs")
    short = rewrite(
        archive, [*items[:index], (info, data[:-1]), *items[index + 1 :]], tmp_path / "b"
    )
    refused(target, short, r"sampling.so': \d+ bytes, the manifest says \d+")


def test_refuses_a_missing_member_and_a_truncated_or_corrupt_archive(
    built: tuple[Cache, Path], tmp_path: Path
) -> None:
    target, archive = built
    items = members(archive)
    missing = rewrite(archive, items[:-1], tmp_path / "missing.tar.gz")
    refused(target, missing, f"truncated: member {re.escape(repr(items[-1][0].name))} is missing")
    raw = archive.read_bytes()
    for cut in (len(raw) // 2, len(raw) - 20, 40):
        (tmp_path / "cut.tar.gz").write_bytes(raw[:cut])
        refused(target, tmp_path / "cut.tar.gz", "cut.tar.gz: truncated or corrupt archive")
    plain = gzip.decompress(raw)
    garbage = plain[:2048] + os.urandom(4096) + plain[2048 + 4096 :]
    (tmp_path / "garbage.tar").write_bytes(garbage)
    with pytest.raises(InputError, match=r"garbage\.tar: "):
        bundle.import_sync(target.serving, IDENTITY, tmp_path / "garbage.tar")
    (tmp_path / "zeros").write_bytes(b"\0" * 10)
    refused(target, tmp_path / "zeros", "zeros: (truncated or corrupt|not a k26 cache bundle)")
    refused(target, tmp_path / "nonexistent", "nonexistent: no such file")


def test_refuses_what_is_not_a_bundle(built: tuple[Cache, Path], tmp_path: Path) -> None:
    target, archive = built
    items = members(archive)
    no_manifest = rewrite(archive, items[1:], tmp_path / "a.tar.gz")
    refused(target, no_manifest, f"not a k26 cache bundle \\(no {bundle.MANIFEST_NAME} first\\)")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"schema_version": 2}, "manifest field schema_version"),
        ({"kind": "other"}, "manifest field kind"),
        ({"surprise": 1}, "manifest field surprise"),
        ({"cache_dir": "../../etc"}, "manifest cache_dir '../../etc' is not valid"),
        ({"cache_dir": "k26-quarantine"}, "is not valid"),
        ({"workspace": "relative"}, "manifest workspace 'relative' is not absolute"),
    ]
    for changes, match in cases:
        bad = rewrite(archive, with_manifest(items, **dict(changes)), tmp_path / "m.tar.gz")
        refused(target, bad, match)
    manifest = json.loads(items[0][1])
    manifest["files"].append(dict(manifest["files"][0]))
    dup = [(items[0][0], json.dumps(manifest).encode()), *items[1:]]
    refused(target, rewrite(archive, dup, tmp_path / "d.tar.gz"), "lists .* twice")
    manifest = json.loads(items[0][1])
    manifest["files"][0]["name"] = "../escape"
    esc = [(items[0][0], json.dumps(manifest).encode()), *items[1:]]
    refused(target, rewrite(archive, esc, tmp_path / "e.tar.gz"), "not a plain relative path")
    manifest = json.loads(items[0][1])
    manifest["modules"]["sampling"]["sha256"] = "0" * 64
    mod = [(items[0][0], json.dumps(manifest).encode()), *items[1:]]
    refused(target, rewrite(archive, mod, tmp_path / "f.tar.gz"), "module sampling: .* not among")


def test_a_failed_stage_leaves_the_old_cache_and_no_work_dir(
    built: tuple[Cache, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, archive = built
    target.warm()
    before = tree(target.workspace)

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device", str(target.dir))

    monkeypatch.setattr(bundle, "exchange", full_disk)
    monkeypatch.setattr(bundle, "move_new", full_disk)
    with pytest.raises(CacheError, match="No space left on device"):
        bundle.import_sync(target.serving, IDENTITY, archive)
    after = tree(target.workspace)
    after.pop(".cache/flashinfer/k26-warm.lock", None)
    before.pop(".cache/flashinfer/k26-warm.lock", None)
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}


def test_on_flashinfer_0_2_s_layout_a_record_without_a_version_matches(tmp_path: Path) -> None:
    """FlashInfer 0.2.x keeps its tag dirs in the cache root (no version level): the
    learned record says ``flashinfer: null`` there, and that is this cache dir."""
    workspace = tmp_path / "ws"
    base = cache.cache_root(workspace) / "120f"
    build = base / "cached_ops" / "batch_decode_x"
    build.mkdir(parents=True)
    shutil.copy(DATA / "k_sm_120f.so", build / "batch_decode_x.so")
    (build / "build.ninja").write_text("rule link\n")
    data = (build / "batch_decode_x.so").read_bytes()
    record = {"flashinfer": None, "arch_tag": "120f", "size": len(data),
              "sha256": hashlib.sha256(data).hexdigest(),
              "build_ninja_sha256": hashlib.sha256(b"rule link\n").hexdigest()}  # fmt: skip
    identity = copy.deepcopy(IDENTITY)
    identity["torch"]["cuda"] = "13.0"
    fingerprint = cache.Fingerprint(arch="12.0", arch_tag="120f", identity=identity, modules={},
                                    built_at="2026-12-01T00:00:00Z",
                                    path=base / cache.FINGERPRINT_NAME)  # fmt: skip
    serving = ServingEnv(Path("/srv/venv/bin/python"), "12.0", workspace)
    entry, why = bundle._built_by_a_unit(serving, base, fingerprint, "batch_decode_x", record)
    assert entry is not None and entry["sha256"] == record["sha256"], why
    elsewhere = {**record, "flashinfer": "0.7.4"}
    entry, why = bundle._built_by_a_unit(serving, base, fingerprint, "batch_decode_x", elsewhere)
    assert entry is None
    assert (
        why
        == "the unit built it into 0.7.4/120f, not 120f, where the fingerprint vouches for the builder"
    )
    # After an upgrade the record's latest build is another version's; the build of
    # this dir is still vouched for, from ``builds``.
    upgraded = {**elsewhere, "sha256": "c" * 64,
                "builds": {"0.7.4/120f": {**elsewhere, "sha256": "c" * 64}, "120f": record}}  # fmt: skip
    entry, why = bundle._built_by_a_unit(serving, base, fingerprint, "batch_decode_x", upgraded)
    assert entry is not None and entry["sha256"] == record["sha256"], why
    del upgraded["builds"]["120f"]
    entry, why = bundle._built_by_a_unit(serving, base, fingerprint, "batch_decode_x", upgraded)
    assert entry is None and why.startswith("the unit built it into 0.7.4/120f, not 120f")
    no_ninja = {**record, "build_ninja_sha256": None}
    entry, why = bundle._built_by_a_unit(serving, base, fingerprint, "batch_decode_x", no_ninja)
    assert (entry, why) == (None, "the learned record took no build.ninja beside it")
