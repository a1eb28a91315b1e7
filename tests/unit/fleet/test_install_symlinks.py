"""Installs run as root into directories the units' user owns: symlinks planted there.

A booted host's ``bundle import`` and ``pull`` run as root and write into the
units' workspace (and beside their caches), where that user can plant a symlink
at any moment. Each test plants one (the work dir, a parent, the cache dir, a
staged entry, the cold dir a pull swapped out) pointing at a decoy, and checks
that the decoy is untouched (no file removed, moved, chowned or chmodded) and, where
the install cannot go on, that one clear error names the link. The workspace is
given to uid 65534, as the installer gives it to the units' user. Run as root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.errors import CacheError
from supervisor.flashinfer import cache
from supervisor.fleet import archive, bundle, cache_layers, distribute
from tests.unit.fleet.test_bundle import IDENTITY, Cache, built  # noqa: F401  (a fixture)
from tests.unit.fleet.test_registry_caches import IDS, triton_cache

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and the unit user need root")

UNIT = 65534  # the units' user (nobody), who owns the workspace


def decoy(path: Path) -> Path:
    """A dir of root's files, as /etc is: what a planted link points at."""
    (path / "sub").mkdir(parents=True)
    (path / "secret").write_text("root only")
    (path / "secret").chmod(0o600)
    (path / "sub" / "kern.cubin").write_bytes(b"not yours")
    return path


def snapshot(path: Path) -> dict[str, tuple[str, int, int, int]]:
    """Every entry: content hash (or kind), owner, group, mode."""
    out = {}
    for entry in sorted([path, *path.rglob("*")]):
        info = entry.lstat()
        kind = hashlib.sha256(entry.read_bytes()).hexdigest() if entry.is_file() else "dir"
        out[str(entry.relative_to(path))] = (kind, info.st_uid, info.st_gid, info.st_mode)
    return out


def for_the_unit(workspace: Path) -> None:
    workspace.mkdir(parents=True, exist_ok=True)
    os.chown(workspace, UNIT, UNIT)
    workspace.chmod(0o2770)


# --- bundle import ---------------------------------------------------------------------


@pytest.fixture
def unit_ws(built: tuple[Cache, Path], tmp_path: Path) -> tuple[Cache, Path, Path]:  # noqa: F811
    target, archive_path = built
    for_the_unit(target.workspace)
    return target, archive_path, decoy(tmp_path / "decoy")


def test_a_work_dir_link_is_refused_and_nothing_behind_it_is_removed(
    unit_ws: tuple[Cache, Path, Path],
) -> None:
    target, archive_path, bait = unit_ws
    root = cache.cache_root(target.workspace)
    root.mkdir(parents=True)
    (root / bundle.WORK_NAME).symlink_to(bait)
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{root / bundle.WORK_NAME} is a symlink or not a dir"):
        bundle.import_sync(target.serving, IDENTITY, archive_path)
    assert snapshot(bait) == before
    assert (root / bundle.WORK_NAME).is_symlink()


@pytest.mark.parametrize("link", [".cache", ".cache/flashinfer"])
def test_a_parent_link_is_refused_and_nothing_behind_it_changes(
    unit_ws: tuple[Cache, Path, Path], link: str
) -> None:
    target, archive_path, bait = unit_ws
    (bait / "flashinfer" / bundle.WORK_NAME / "123-4").mkdir(parents=True)
    (bait / "flashinfer" / bundle.WORK_NAME / "123-4" / "keep").write_text("x")
    planted = target.workspace / link
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(bait if link == ".cache" else bait / "flashinfer")
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{planted} is a symlink or not a directory; refusing"):
        bundle.import_sync(target.serving, IDENTITY, archive_path)
    assert snapshot(bait) == before


def test_a_link_to_the_cache_dirs_parent_is_refused(unit_ws: tuple[Cache, Path, Path]) -> None:
    target, archive_path, bait = unit_ws
    (bait / "120f").mkdir()
    (bait / "120f" / "victim").write_text("keep me")
    root = cache.cache_root(target.workspace)
    root.mkdir(parents=True)
    (root / "0.7.4").symlink_to(bait)
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{root / '0.7.4'} is a symlink or not a directory"):
        bundle.import_sync(target.serving, IDENTITY, archive_path)
    assert snapshot(bait) == before
    assert not (root / bundle.WORK_NAME).exists()  # the job discarded, the work dir too


def test_the_cache_dir_swapped_for_a_link_before_the_swap_is_refused(
    unit_ws: tuple[Cache, Path, Path],
) -> None:
    target, archive_path, bait = unit_ws
    target.warm()
    before = snapshot(bait)

    def swap_in_a_link(step: str) -> None:
        if step == "staged":  # after the first lstat, before the exchange
            shutil.rmtree(target.dir)
            target.dir.symlink_to(bait)

    with pytest.raises(CacheError, match=rf"{target.dir} is a symlink or not a directory"):
        bundle.import_sync(target.serving, IDENTITY, archive_path, on_step=swap_in_a_link)
    assert snapshot(bait) == before
    assert target.dir.is_symlink()
    assert not (cache.cache_root(target.workspace) / bundle.WORK_NAME).exists()


def test_the_stage_is_private_until_complete_then_handed_over_without_following(
    unit_ws: tuple[Cache, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, archive_path, bait = unit_ws
    before = snapshot(bait)
    work = cache.cache_root(target.workspace) / bundle.WORK_NAME
    probed: list[int] = []

    def unit_user_tries(step: str) -> None:
        if step != "staging" or probed:
            return
        (job,) = os.listdir(work)
        info = os.lstat(work / job)
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700)
        assert os.lstat(work / job / "cache").st_uid == 0  # not handed over yet
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        pid = os.fork()
        if pid == 0:  # the units' user, through a dir it can enter
            code = 0
            try:
                os.setgid(UNIT)
                os.setuid(UNIT)
                os.symlink(str(bait), f"{job}/cache/cached_ops", dir_fd=fd)
                code = 1
            except PermissionError:
                code = 0
            except BaseException:
                code = 2
            os._exit(code)
        os.close(fd)
        probed.append(os.waitpid(pid, 0)[1])

    real_hand_over = archive.hand_over

    def plant_then_hand_over(fd: int, *args: Any, **kwargs: Any) -> None:
        # A staged file swapped for a link to a root file (as if the user got in):
        # lchown takes the link, never /etc/shadow behind it.
        os.unlink("cached_ops/sampling/build.ninja", dir_fd=fd)
        os.symlink(str(bait / "secret"), "cached_ops/sampling/build.ninja", dir_fd=fd)
        real_hand_over(fd, *args, **kwargs)

    monkeypatch.setattr(bundle, "hand_over", plant_then_hand_over)
    bundle.import_sync(target.serving, IDENTITY, archive_path, on_step=unit_user_tries)
    assert probed == [0], "the units' user could enter the stage while it filled"
    assert snapshot(bait) == before  # still root's, 0600
    assert os.lstat(target.build_dir / "build.ninja").st_uid == UNIT  # the link itself
    assert os.stat(target.so).st_uid == UNIT and os.stat(target.dir).st_uid == UNIT
    assert target.dir.stat().st_mode & 0o7777 == 0o2770


def test_a_leftover_link_in_the_work_dir_is_unlinked_not_followed(
    unit_ws: tuple[Cache, Path, Path],
) -> None:
    target, archive_path, bait = unit_ws
    work = cache.cache_root(target.workspace) / bundle.WORK_NAME
    work.mkdir(parents=True)
    (work / "123-4").symlink_to(bait)
    before = snapshot(bait)
    result = bundle.import_sync(target.serving, IDENTITY, archive_path)
    assert result["swept"] == [str(work / "123-4")]
    assert snapshot(bait) == before
    assert not work.exists()


# --- cache layers -------------------------------------------------------------------------


@pytest.fixture
def layer(tmp_path: Path) -> tuple[Path, cache_layers.CacheManifest, Path, Path]:
    root = triton_cache(tmp_path / "built" / "triton")
    path = tmp_path / "t.tar.gz"
    cache_layers.export_layer("triton", root, IDS, path)
    node = tmp_path / "node"
    for_the_unit(node)
    return path, cache_layers.check_layer(path), node / "triton", decoy(tmp_path / "decoy")


Layer = tuple[Path, cache_layers.CacheManifest, Path, Path]


def hooked(monkeypatch: pytest.MonkeyPatch, before_hand_over: Callable[[int], None]) -> None:
    real = archive.hand_over

    def hook(fd: int, *args: Any, **kwargs: Any) -> None:
        before_hand_over(fd)
        real(fd, *args, **kwargs)

    monkeypatch.setattr(cache_layers, "hand_over", hook)


def test_a_layer_target_that_is_a_link_is_refused(layer: Layer) -> None:
    path, manifest, target, bait = layer
    target.symlink_to(bait)
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{target} is a symlink or not a directory"):
        cache_layers.install(path, manifest, target)
    assert snapshot(bait) == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["triton"]


def test_a_target_swapped_for_a_link_before_the_swap_is_refused(
    layer: Layer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, manifest, target, bait = layer
    target.mkdir()  # cold: checked, then swapped for a link while the layer stages

    def swap(_fd: int) -> None:
        target.rmdir()
        target.symlink_to(bait)

    hooked(monkeypatch, swap)
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{target} is a symlink or not a directory; refusing"):
        cache_layers.install(path, manifest, target)
    assert snapshot(bait) == before  # commit never walked it, nothing os.replace'd out
    assert sorted(p.name for p in target.parent.iterdir()) == ["triton"]


def test_commit_follows_no_link_in_the_cold_dir_or_the_cache(layer: Layer) -> None:
    path, manifest, target, bait = layer
    target.mkdir()
    done = cache_layers.install(path, manifest, target)
    assert done.exchanged
    # The cold dir, now aside, holds a link to a dir of kernels; the new cache, already
    # the units', a link where a kept file would go.
    aside = done.work / "cache"
    (aside / "linked").symlink_to(bait / "sub")
    (aside / "RACE").mkdir()
    (aside / "RACE" / "k.cubin").write_bytes(b"kernel")
    (target / "RACE").symlink_to(bait)
    before = snapshot(bait)
    assert done.commit() == []
    assert snapshot(bait) == before
    assert not done.work.exists()


def test_commit_keeps_nothing_when_the_cold_dir_was_a_link(
    layer: Layer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, manifest, target, bait = layer
    target.mkdir()
    done = cache_layers.install(path, manifest, target)
    aside = done.work / "cache"
    shutil.rmtree(aside)
    aside.symlink_to(bait)  # as if the exchange had swapped in a link
    before = snapshot(bait)
    assert done.commit() == []
    assert snapshot(bait) == before and not done.work.exists()


def test_a_layer_is_staged_privately_and_handed_over_without_following(
    layer: Layer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, manifest, target, bait = layer
    name = manifest.files[0].name
    seen: list[tuple[int, int]] = []

    def plant(fd: int) -> None:
        info = os.fstat(fd)
        seen.append((info.st_uid, info.st_mode & 0o777))
        os.unlink(name, dir_fd=fd)
        os.symlink(str(bait / "secret"), name, dir_fd=fd)

    hooked(monkeypatch, plant)
    before = snapshot(bait)
    cache_layers.install(path, manifest, target).commit()
    assert seen == [(0, 0o700)]
    assert snapshot(bait) == before
    assert os.lstat(target / name).st_uid == UNIT
    assert all(p.lstat().st_uid == UNIT for p in [target, *target.rglob("*")])
    assert target.stat().st_mode & 0o7777 == 0o2770


def test_a_leftover_pull_link_is_unlinked_not_followed(layer: Layer) -> None:
    path, manifest, target, bait = layer
    planted = target.parent / f"{cache_layers.WORK_PREFIX}triton-999999999-1"
    planted.symlink_to(bait)
    before = snapshot(bait)
    cache_layers.install(path, manifest, target).commit()
    assert snapshot(bait) == before
    assert not planted.is_symlink()


# --- a pull's download dir ------------------------------------------------------------------


def test_a_download_dir_link_is_refused(unit_ws: tuple[Cache, Path, Path]) -> None:
    target, _, bait = unit_ws
    root = cache.cache_root(target.workspace)
    root.mkdir(parents=True)
    (root / distribute.PULL_WORK).symlink_to(bait)
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{root / distribute.PULL_WORK} is a symlink"):
        distribute._download_dir(target.serving, distribute.Plan())
    assert snapshot(bait) == before


def test_download_leftovers_are_swept_by_fd_and_the_dir_made_private(
    unit_ws: tuple[Cache, Path, Path],
) -> None:
    target, _, bait = unit_ws
    base = cache.cache_root(target.workspace) / distribute.PULL_WORK
    base.mkdir(parents=True, mode=0o2770)
    os.chown(base, UNIT, UNIT)  # made by the units' user
    (base / "999999999-1").symlink_to(bait)
    (base / "999999999-2").mkdir()
    (base / "999999999-2" / "x").symlink_to(bait / "secret")
    before = snapshot(bait)
    work = distribute._download_dir(target.serving, distribute.Plan())
    assert snapshot(bait) == before
    assert os.listdir(base) == [work.name]
    info = base.lstat()
    assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700)
    assert work.lstat().st_mode & 0o777 == 0o700
    # Removed after the pull; through a planted link never.
    moved = base.with_name("elsewhere")
    base.rename(moved)
    base.symlink_to(bait)
    (bait / work.name).mkdir()
    distribute._remove_download(target.workspace, work)
    assert (bait / work.name).is_dir()
    base.unlink()
    moved.rename(base)
    distribute._remove_download(target.workspace, work)
    assert os.listdir(base) == []


def test_remove_tree_unlinks_a_link_and_open_below_names_it(tmp_path: Path) -> None:
    bait = decoy(tmp_path / "decoy")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").symlink_to(bait)
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{tmp_path / 'a' / 'b'} is a symlink"):
        archive.open_below(tmp_path, tmp_path / "a" / "b" / "sub", "remove")
    fd = archive.open_below(tmp_path, tmp_path / "a", "remove")
    try:
        assert archive.remove_tree(fd, "b")
    finally:
        os.close(fd)
    assert snapshot(bait) == before and not (tmp_path / "a" / "b").is_symlink()


def test_below_the_workspace_a_layers_parent_link_is_refused(layer: Layer) -> None:
    path, manifest, target, bait = layer
    (target.parent / "caches").symlink_to(bait)
    (bait / "triton").mkdir()
    before = snapshot(bait)
    with pytest.raises(CacheError, match=rf"{target.parent / 'caches'} is a symlink or not a"):
        cache_layers.install(path, manifest, target.parent / "caches" / "triton", target.parent)
    assert snapshot(bait) == before
    done = cache_layers.install(path, manifest, target.parent / "new" / "triton", target.parent)
    done.commit()
    assert (target.parent / "new" / "triton" / manifest.files[0].name).is_file()
