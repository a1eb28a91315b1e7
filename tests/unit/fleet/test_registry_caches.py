"""The caches besides FlashInfer's as bundle layers, without a registry: where they are,
what the serving venv says built them, which may move, and the install into a cold
cache that loses nothing (checked, swapped in whole, rolled back whole).

Triton's cache is laid out as Triton 3.x lays it out (``<key>/<name>.cubin``, its
``.json`` and the group file ``__grp__<name>.json`` naming both by absolute path),
inductor's with the ``# kernel path:`` header its generated code carries.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.errors import CacheError, InputError
from supervisor.flashinfer.protocol import Identity
from supervisor.flashinfer.venv import ServingEnv
from supervisor.fleet import bundle, cache_layers, distribute, registry
from tests.unit.fleet.test_bundle import IDENTITY, Cache

IDS = {"arch": "12.0", "triton": {"name": "triton", "version": "3.4.0", "record_sha256": "e"}}


def triton_cache(root: Path, keys: int = 2) -> Path:
    for n in range(keys):
        key = root / f"K{n:02d}ABCDEF"
        key.mkdir(parents=True)
        (key / "kern.cubin").write_bytes(os.urandom(4096))
        (key / "kern.json").write_text(json.dumps({"name": "kern", "hash": key.name}))
        group = {"child_paths": {f: str(key / f) for f in ("kern.cubin", "kern.json")}}
        (key / "__grp__kern.json").write_text(json.dumps(group))
        os.utime(key / "kern.cubin", ns=(1_700_000_000_000_000_001 + n,) * 2)
    (root / "K00ABCDEF" / "lock").write_text("")  # Triton's lock: not carried
    return root


def inductor_cache(root: Path) -> Path:
    (root / "ab").mkdir(parents=True)
    (root / "ab" / "cabc.py").write_text(f"# kernel path: {root}/ab/cabc.py\nimport triton\n")
    (root / "fxgraph" / "xy").mkdir(parents=True)
    (root / "fxgraph" / "xy" / "entry").write_bytes(b"\x80\x04pickled graph")
    return root


def files(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: sha256, mtime (ns), mode."""
    return {
        str(p.relative_to(root)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
            p.stat().st_mode & 0o777,
        )
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- where and who ------------------------------------------------------------------------


def test_only_caches_the_environment_pins_travel() -> None:
    env = {"TRITON_CACHE_DIR": "/var/cache/u/triton", "TORCHINDUCTOR_CACHE_DIR": "rel/ind"}
    assert cache_layers.pinned_locations(env) == {
        "triton": Path("/var/cache/u/triton"),
        "inductor": Path("/rel/ind"),  # relative to systemd's working directory, /
    }
    both = cache_layers.pinned_locations(env, {"deepgemm": Path("/x/dg")})
    assert both["deepgemm"] == Path("/x/dg")
    with pytest.raises(InputError, match="--cache sglang=/x: unknown cache 'sglang'"):
        cache_layers.pinned_locations({}, {"sglang": Path("/x")})
    with pytest.raises(InputError, match="the path must be absolute"):
        cache_layers.pinned_locations({}, {"triton": Path("rel")})


async def test_the_venv_script_answers_with_any_python(tmp_path: Path) -> None:
    """k26_caches.py run for real (here with the project's interpreter): no torch here."""
    serving = ServingEnv(Path(sys.executable), "12.0", tmp_path / "ws")
    reply = await cache_layers.tools_identity(serving)
    assert reply.python_version == ".".join(map(str, sys.version_info[:3]))
    assert reply.distributions["torch"] is None and reply.ptxas is None
    ids = cache_layers.identities(reply, "12.0")
    assert ids["triton"]["triton"] is None and ids["inductor"]["arch"] == "12.0"


async def test_the_roots_scan_reads_the_installed_sources(tmp_path: Path) -> None:
    """k26_caches.py roots with the project's interpreter: no SGLang, FlashInfer or torch
    here, so nothing is scanned; the reply is well formed all the same."""
    serving = ServingEnv(Path(sys.executable), "12.0", tmp_path / "ws")
    reply = await cache_layers.cache_roots(serving)
    assert reply.scanned == [] and reply.variables == {}


def test_bundle_learned_shapes_that_are_not_a_record_are_dropped_with_a_note() -> None:
    from supervisor.fleet import distribute

    record = {"cache": "triton", "layer": "sha256:" + "0" * 64, "size": 1, "identity": {},
              "media_type": "x", "path": "/c", "relocatable": True, "files": 1, "bytes": 1}  # fmt: skip
    config = distribute.ArtifactConfig(
        arch="9.0", key="0" * 64, identity={}, created_at="t", caches=(record,),  # type: ignore[arg-type]
        learned_shapes={"schema": 2, "units": {}},
    )  # fmt: skip
    kept, note = distribute.usable_learned(config, "reg@sha256:x")
    assert kept.learned_shapes is None and note is not None
    assert "learned shapes not used" in note and "schema 1" in note


async def test_a_venv_that_cannot_run_is_unavailable(tmp_path: Path) -> None:
    serving = ServingEnv(tmp_path / "no-python", "12.0", tmp_path / "ws")
    with pytest.raises(cache_layers.UnavailableError, match="cannot run"):
        await cache_layers.tools_identity(serving)


# --- export: what may move -------------------------------------------------------------


def test_triton_moves_its_group_files_are_rewritten(tmp_path: Path) -> None:
    root = triton_cache(tmp_path / "triton")
    layer = cache_layers.export_layer("triton", root, IDS, tmp_path / "t.tar.gz")
    assert layer.relocatable and layer.pinned_because is None
    assert sorted(layer.rewrite) == ["K00ABCDEF/__grp__kern.json", "K01ABCDEF/__grp__kern.json"]
    assert "K00ABCDEF/lock" not in [e.name for e in layer.files]
    assert len(layer.files) == 6 and layer.path == str(root)


def test_a_cache_whose_files_name_its_path_is_pinned_with_the_reason(tmp_path: Path) -> None:
    root = inductor_cache(tmp_path / "inductor")
    layer = cache_layers.export_layer("inductor", root, IDS, tmp_path / "i.tar.gz")
    assert not layer.relocatable
    assert layer.pinned_because is not None
    assert "# kernel path: ..." in layer.pinned_because
    assert layer.pinned_because.endswith("e.g. ab/cabc.py")
    tri = triton_cache(tmp_path / "triton")
    (tri / "K00ABCDEF" / "kern.json").write_text(json.dumps({"src": str(tri / "x.py")}))
    pinned = cache_layers.export_layer("triton", tri, IDS, tmp_path / "t.tar.gz")
    assert not pinned.relocatable and "K00ABCDEF/kern.json" in str(pinned.pinned_because)


def test_layers_are_reproducible_and_refuse_links(tmp_path: Path) -> None:
    root = triton_cache(tmp_path / "triton")
    one = cache_layers.export_layer("triton", root, IDS, tmp_path / "1.tar.gz")
    two = cache_layers.export_layer("triton", root, IDS, tmp_path / "2.tar.gz")
    assert one == two
    assert (tmp_path / "1.tar.gz").read_bytes() == (tmp_path / "2.tar.gz").read_bytes()
    (root / "evil").symlink_to("/etc/passwd")
    with pytest.raises(CacheError, match="evil: not a regular file"):
        cache_layers.export_layer("triton", root, IDS, tmp_path / "3.tar.gz")


def test_flashinfer_bundles_are_reproducible_for_a_push(tmp_path: Path) -> None:
    source = Cache(tmp_path / "ws")
    source.warm()
    for name in ("a", "b"):
        bundle.export_sync(
            source.serving, IDENTITY, tmp_path / name, ["sampling"], reproducible=True
        )
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


# --- the layer, read back -------------------------------------------------------------------


def rewrite(archive: Path, target: Path, change: Any) -> Path:
    with tarfile.open(archive) as tar:
        items = [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar]  # type: ignore[union-attr]
    items = change(items)
    with tarfile.open(target, "w:gz") as tar:
        for info, data in items:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return target


def test_a_layer_is_checked_member_by_member(tmp_path: Path) -> None:
    root = triton_cache(tmp_path / "triton")
    archive = tmp_path / "t.tar.gz"
    cache_layers.export_layer("triton", root, IDS, archive)
    assert cache_layers.check_layer(archive).cache == "triton"

    def flip(items: list[Any]) -> list[Any]:
        info, data = items[1]
        return [items[0], (info, bytes([data[0] ^ 1]) + data[1:]), *items[2:]]

    with pytest.raises(InputError, match=r"member 'cache/.*': sha256 \w+ differs"):
        cache_layers.check_layer(rewrite(archive, tmp_path / "a.tar.gz", flip))
    with pytest.raises(InputError, match="is missing"):
        cache_layers.check_layer(rewrite(archive, tmp_path / "b.tar.gz", lambda i: i[:-1]))

    def escape(items: list[Any]) -> list[Any]:
        evil = tarfile.TarInfo("cache/../../etc/cron.d/x")
        return [*items, (evil, b"x")]

    with pytest.raises(InputError, match="not a plain relative path"):
        cache_layers.check_layer(rewrite(archive, tmp_path / "c.tar.gz", escape))

    def unlisted(items: list[Any]) -> list[Any]:
        return [*items, (tarfile.TarInfo("cache/K00ABCDEF/extra.cubin"), b"x")]

    with pytest.raises(InputError, match="not listed in the manifest"):
        cache_layers.check_layer(rewrite(archive, tmp_path / "d.tar.gz", unlisted))

    def manifest_says(**changes: Any) -> Any:
        def change(items: list[Any]) -> list[Any]:
            data = json.loads(items[0][1])
            data.update(changes)
            return [(items[0][0], json.dumps(data).encode()), *items[1:]]

        return change

    cases = [
        ({"cache": "sglang"}, "manifest field cache"),
        ({"path": "rel"}, "manifest path 'rel' is not absolute"),
        ({"rewrite": ["K00ABCDEF/kern.cubin"]}, "is not a listed group file"),
        ({"relocatable": False}, "relocatable and pinned_because disagree"),
    ]
    for changes, match in cases:
        with pytest.raises(InputError, match=match):
            cache_layers.check_layer(
                rewrite(archive, tmp_path / "m.tar.gz", manifest_says(**changes))
            )
    (tmp_path / "cut.tar.gz").write_bytes(archive.read_bytes()[:200])
    with pytest.raises(InputError, match=r"cut\.tar\.gz: truncated or corrupt"):
        cache_layers.check_layer(tmp_path / "cut.tar.gz")


# --- install into what is cold ------------------------------------------------------------


@pytest.fixture
def layer(tmp_path: Path) -> tuple[Path, cache_layers.CacheManifest, dict[str, Any]]:
    root = triton_cache(tmp_path / "built" / "triton")
    archive = tmp_path / "t.tar.gz"
    cache_layers.export_layer("triton", root, IDS, archive)
    return archive, cache_layers.check_layer(archive), files(root)


def test_install_restores_exact_files_at_the_same_path(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, before = layer
    root = Path(manifest.path)
    shutil.rmtree(root)
    done = cache_layers.install(archive, manifest, root)
    assert not done.exchanged and not done.moved
    assert done.commit() == []
    expected = {k: v for k, v in before.items() if not k.endswith("lock")}
    assert files(root) == expected  # bytes, mtimes to the ns, modes
    assert not list(root.parent.glob(".k26-pull-*"))


def test_install_elsewhere_rewrites_the_group_files_only(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, before = layer
    target = tmp_path / "node" / "triton"
    done = cache_layers.install(archive, manifest, target)
    done.commit()
    assert done.moved
    after = files(target)
    for name, (sha, mtime, mode) in after.items():
        if "__grp__" in name:
            group = json.loads((target / name).read_text())["child_paths"]
            key = name.split("/")[0]
            assert group == {f: str(target / key / f) for f in ("kern.cubin", "kern.json")}
            assert mtime == before[name][1]
        else:
            assert (sha, mtime, mode) == before[name], name


def test_install_into_an_empty_dir_swaps_it_and_keeps_a_racing_writer(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, _ = layer
    target = tmp_path / "node" / "triton"
    (target / "tmp.pid_1_x").mkdir(parents=True)  # Triton's temporary: still cold
    done = cache_layers.install(archive, manifest, target)
    assert done.exchanged
    # A server wrote into the cold dir between the check and the swap.
    raced = tmp_path / "node" / done.work.name / "cache" / "RACE" / "k.cubin"
    raced.parent.mkdir(parents=True)
    raced.write_bytes(b"kernel")
    assert done.commit() == [str(target / "RACE" / "k.cubin")]
    assert (target / "RACE" / "k.cubin").read_bytes() == b"kernel"


def test_install_never_touches_a_cache_that_holds_kernels(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, _ = layer
    target = triton_cache(tmp_path / "node" / "triton", keys=1)
    before = files(target)
    with pytest.raises(CacheError, match="is not cold"):
        cache_layers.install(archive, manifest, target)
    assert files(target) == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["triton"]


def test_rollback_puts_back_what_was_there(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, _ = layer
    absent = tmp_path / "a" / "triton"
    cache_layers.install(archive, manifest, absent).rollback()
    assert not absent.exists() and list(absent.parent.iterdir()) == []
    empty = tmp_path / "b" / "triton"
    empty.mkdir(parents=True)
    (empty / "x.lock").write_text("")
    cache_layers.install(archive, manifest, empty).rollback()
    assert [p.name for p in empty.iterdir()] == ["x.lock"]
    assert [p.name for p in empty.parent.iterdir()] == ["triton"]


def test_a_failed_swap_leaves_the_cache_as_it_was_and_no_work_dir(
    tmp_path: Path,
    layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive, manifest, _ = layer
    target = tmp_path / "node" / "triton"
    target.mkdir(parents=True)

    def full_disk(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(cache_layers, "exchange", full_disk)
    monkeypatch.setattr(cache_layers, "move_new", full_disk)
    with pytest.raises(CacheError, match=f"cannot install into {target}: No space left"):
        cache_layers.install(archive, manifest, target)
    assert [p.name for p in target.parent.iterdir()] == ["triton"]
    assert list(target.iterdir()) == []


def test_a_killed_pulls_work_dir_is_swept(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, _ = layer
    target = tmp_path / "node" / "triton"
    dead = tmp_path / "node" / ".k26-pull-triton-999999999-1"
    (dead / "cache").mkdir(parents=True)
    mine = tmp_path / "node" / f".k26-pull-other-{os.getpid()}-1"
    mine.mkdir()
    cache_layers.install(archive, manifest, target).commit()
    assert not dead.exists() and mine.exists()


# --- a whole pull's install: all or nothing --------------------------------------------------


def test_a_failed_flashinfer_install_rolls_the_other_caches_back(
    tmp_path: Path,
    layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive, manifest, _ = layer
    source = Cache(tmp_path / "ws")
    source.warm()
    fi_archive = tmp_path / "fi.tar.gz"
    bundle.export_sync(source.serving, IDENTITY, fi_archive, ["sampling"], reproducible=True)
    fi = bundle.read_manifest(fi_archive)
    shutil.rmtree(tmp_path / "ws")
    target = tmp_path / "node" / "triton"

    def record(name: str, media: str, identity: dict[str, Any], path: str) -> Any:
        return distribute.CacheRecord(
            cache=name,  # type: ignore[arg-type]
            media_type=media,
            layer="sha256:" + "0" * 64,
            size=1,
            identity=identity,
            path=path,
            relocatable=name == "triton",
            pinned_because=None if name == "triton" else "ninja",
            files=1,
            bytes=1,
        )

    plan = distribute.Plan(
        [
            distribute.Step(
                record("triton", registry.CACHE_LAYER, manifest.identity, manifest.path),
                target,
                archive,
            ),
            distribute.Step(
                record("flashinfer", registry.FLASHINFER_LAYER, dict(fi.identity), fi.workspace),
                source.workspace,
                fi_archive,
            ),
        ]
    )

    def broken(*args: Any) -> dict[str, Any]:
        raise CacheError("cannot install into the workspace: No space left on device")

    monkeypatch.setattr(bundle, "install_locked", broken)
    with pytest.raises(CacheError, match="No space left"):
        distribute.install_plan(source.serving, IDENTITY, plan, where="reg@x")
    assert not target.exists() and list(target.parent.iterdir()) == []
    monkeypatch.undo()
    result = distribute.install_plan(source.serving, IDENTITY, plan, where="reg@x")
    assert [c["cache"] for c in result["caches"]] == ["flashinfer", "triton"]
    assert (source.dir / "cached_ops" / "sampling" / "sampling.so").is_file()
    assert target.is_dir()


def test_a_layer_whose_manifest_is_not_its_configs_is_refused(
    tmp_path: Path, layer: tuple[Path, cache_layers.CacheManifest, dict[str, Any]]
) -> None:
    archive, manifest, _ = layer
    other = distribute.CacheRecord(
        cache="triton",
        media_type=registry.CACHE_LAYER,
        layer="sha256:" + "0" * 64,
        size=1,
        identity={**manifest.identity, "arch": "9.0"},
        path=manifest.path,
        relocatable=True,
        files=1,
        bytes=1,
    )
    plan = distribute.Plan([distribute.Step(other, tmp_path / "t", archive)])
    serving = ServingEnv(Path("/srv/venv/bin/python"), "12.0", tmp_path / "ws")
    with pytest.raises(InputError, match="reg@x: the triton layer's manifest is not its config's"):
        distribute.install_plan(serving, IDENTITY, plan, where="reg@x")
    assert not (tmp_path / "t").exists()


def test_the_daemon_keeps_a_flashinfer_cache_that_vouches_for_any_module(tmp_path: Path) -> None:
    """A node that built modules itself is not replaced by a pull (warm builds the rest)."""
    source = Cache(tmp_path / "ws")
    who = Identity.model_validate(IDENTITY)
    assert not distribute.vouches_for_any(source.serving, who)  # nothing there: cold
    source.warm()
    assert distribute.vouches_for_any(source.serving, who)
    other = Identity.model_validate({**IDENTITY, "prefix": "/other/venv"})
    assert not distribute.vouches_for_any(source.serving, other)
    source.so.write_bytes(source.so.read_bytes()[:-1])  # no longer what it vouched for
    assert not distribute.vouches_for_any(source.serving, who)
