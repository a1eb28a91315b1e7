"""Cache bundles: a warmed, vouched-for JIT cache as one archive, for other hosts.

An archive is a gzip'd tar: ``k26-bundle.json`` (the manifest) first, then
each file of the cache directory under ``cache/``. The manifest holds the
fingerprint's builder identity, arch and arch tag, the workspace it was built
in, each module (file, size, sha256, targets) and every file (relative path,
size, sha256, mtime in ns, mode). Only the fingerprinted modules travel (those
asked for, and the learned ones the fingerprint vouches for): each build dir, the
``.so`` and FlashInfer's ninja state (objects, ``build.ninja``, ``.ninja_log``,
``.ninja_deps``), and a templated module's rendered sources (``generated/<module>/``),
with their exact mtimes, because FlashInfer 0.6+ runs ninja on every load and ninja
decides from those whether to rebuild.

Export refuses a cache that no fingerprint matching the serving venv vouches
for. Import refuses a bundle whose builder differs from this host's serving
venv in any compared field, a wrong arch or workspace path, and any archive
that is not exactly what its manifest lists; it reads the whole archive once
before it touches the workspace. Then it stages the cache under
``<cache root>/k26-bundle-work/`` (same filesystem), fsyncs it and swaps it in
with one ``renameat2(RENAME_EXCHANGE)``: a kill at any point leaves the old
cache or the new one, and at worst a work dir the next import removes.

Run as root (a booted host's import or pull), it writes into the units' workspace,
where their user can plant a symlink at any moment; so nothing is followed
(``archive``'s "Symlinks"): the workspace is the one path trusted, everything below
it is reached by directory fd with ``O_NOFOLLOW``, and a symlink on the way (the
cache root, ``k26-bundle-work``, the cache dir or its parent) is refused, naming
it, before anything is written, swept or swapped. Each import stages in a fresh
``k26-bundle-work/<pid>-<ns>/cache`` made 0o700, so no other user can enter it
while it fills; the staged tree is handed to the workspace's owner (``lchown``,
``fchown``, ``fchmod``) only once it is complete and checked, right before the swap,
and the cache dir is checked again with ``lstat`` just before it.

``check_archive`` (everything before the workspace is touched) and
``install_locked`` (the caller holds the warm lock) are import's two halves, for a
registry pull (``distribute.py``) that installs other caches under the same lock.
An archive's bytes are reproducible (no time in the gzip header; with
``reproducible``, the fingerprint's time in the manifest): the same cache is the
same archive, and a registry stores it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gzip
import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from supervisor.atomic_write import write_atomic
from supervisor.core.errors import CacheError, InputError
from supervisor.flashinfer import cache, locks
from supervisor.flashinfer import learned as learned_record
from supervisor.flashinfer.doctor import unusable
from supervisor.flashinfer.venv import ServingEnv, ask
from supervisor.flashinfer.warm import warm_lock
from supervisor.fleet.archive import (
    ABSENT,
    DEFAULT_LIMITS,
    MEMBER_PREFIX,
    FileEntry,
    Limits,
    Stage,
    Strict,
    add_member,
    check_listing,
    check_no_links,
    exchange,
    existing_dir,
    fsync_dir,
    hand_over,
    move_new,
    open_below,
    parse_json,
    private_dir,
    read_manifest_bytes,
    real_dir,
    remove_tree,
    sha256_file,
    shown,
    utc_stamp,
    walk_files,
)

MANIFEST_NAME = "k26-bundle.json"
WORK_NAME = "k26-bundle-work"
IDENTITY_TIMEOUT_S = 60.0
# Host-local facts that change neither what nvcc builds nor FlashInfer's ninja
# state: a reinstall of the same toolkit gives another mtime, same bytes.
NOT_COMPARED = frozenset({"nvcc.mtime_ns"})
# Told each step of an import as it is reached (import_sync): a CLI's progress, or a
# test that stops the import there to kill it.
Step = Callable[[str], None]


def _no_step(name: str) -> None:
    """The default: nobody is told."""


class ModuleEntry(Strict):
    file: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    targets: tuple[str, ...] = ()


class Manifest(Strict):
    kind: Literal["k26-flashinfer-bundle"] = "k26-flashinfer-bundle"
    schema_version: Literal[1] = 1
    arch: str
    arch_tag: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    cache_dir: str  # relative to the cache root: "0.7.4/120f" (0.2.x: "100")
    workspace: str  # where it was built; ninja's state names it
    identity: dict[str, Any]
    built_at: str
    exported_at: str
    modules: dict[str, ModuleEntry]
    files: tuple[FileEntry, ...]


def parse_manifest(raw: bytes, archive: Path, limits: Limits = DEFAULT_LIMITS) -> Manifest:
    """Validate the manifest's shape and names, its files under ``limits``
    (``archive.check_listing``). Pure; InputError names the field or the file."""
    manifest = parse_json(Manifest, raw, f"{archive}: not a k26 cache bundle: manifest")
    for part in manifest.cache_dir.split("/"):
        if part in ("", ".", "..") or part.startswith(".") or part == cache.QUARANTINE_NAME:
            raise InputError(f"{archive}: manifest cache_dir {manifest.cache_dir!r} is not valid")
    if not os.path.isabs(manifest.workspace):
        raise InputError(f"{archive}: manifest workspace {manifest.workspace!r} is not absolute")
    check_listing(manifest.files, archive, limits)
    names = {entry.name: entry for entry in manifest.files}
    for module, spec in manifest.modules.items():
        listed = names.get(spec.file)
        if listed is None or (listed.size, listed.sha256) != (spec.size, spec.sha256):
            raise InputError(
                f"{archive}: manifest module {module}: {spec.file!r} is not among its files "
                "with the same size and sha256"
            )
    return manifest


# --- comparing a bundle with this host ------------------------------------------------


def fix_advice(field: str) -> str:
    """What to do about a builder identity field that differs from this host's."""
    if field.startswith("nvcc."):
        return "build the bundle with the CUDA toolkit the nodes have (same release, same path)"
    if field.startswith("env."):
        return "build the bundle with the nodes' unit environment (the same --env-file)"
    return "build the bundle with the same serving venv (same packages at the same path)"


def mismatches(
    manifest: Manifest, host: Mapping[str, Any], arch: str, workspace: Path
) -> list[str]:
    """Every way this host differs from the bundle's builder, as one line each.

    Each names the field, the bundle's value and this host's, and what to do.
    """
    lines: list[str] = []
    if manifest.arch != arch:
        lines.append(
            f"arch: bundle {manifest.arch}, this host {arch}: export a bundle warmed for {arch}"
        )
    built, here = cache.leaves(manifest.identity), cache.leaves(host)
    for field in sorted(set(built) | set(here)):
        if field in NOT_COMPARED:
            continue
        old, new = built.get(field, ABSENT), here.get(field, ABSENT)
        if old != new:
            lines.append(
                f"{field}: bundle {shown(old)}, this host {shown(new)}: {fix_advice(field)}"
            )
    if os.path.abspath(manifest.workspace) != os.path.abspath(workspace):
        lines.append(
            f"workspace: bundle {manifest.workspace}, this host {workspace}: FlashInfer's "
            "ninja state names absolute paths, so its loader would rebuild every module "
            "on first load; build the bundle in the workspace path the nodes use"
        )
    return lines


async def host_identity(serving: ServingEnv) -> dict[str, Any]:
    """This host's serving venv, as the fingerprint records it: the one place it is read."""
    return dict(await ask(serving, ["identity"], timeout_s=IDENTITY_TIMEOUT_S))


# --- export -------------------------------------------------------------------------------


def _vouched(
    serving: ServingEnv, identity: Mapping[str, Any], modules: Sequence[str]
) -> cache.Fingerprint:
    """The fingerprint that vouches for this cache now (warm's own criterion)."""
    found = [f for f in cache.find_fingerprints(serving.workspace) if f.arch == serving.arch]
    if not found:
        raise CacheError(
            f"no fingerprint for arch {serving.arch} under {cache.cache_root(serving.workspace)}: "
            "nothing vouches for this cache; run `k26-supervisor flashinfer warm` first"
        )
    for fingerprint in found:
        if not cache.identity_differences(fingerprint.identity, identity):
            break
    else:
        changes = cache.identity_differences(found[0].identity, identity)
        raise CacheError(
            f"the fingerprint {found[0].path} no longer matches the serving venv "
            f"({'; '.join(changes[:3])}); run `k26-supervisor flashinfer warm` first"
        )
    for name in modules:
        entry = fingerprint.modules.get(name)
        if entry is None:
            raise CacheError(f"module {name} is not covered by the fingerprint {fingerprint.path}")
        library = cache.inspect_library(Path(str(entry.get("path"))), serving.target)
        if (library.size, library.sha256) != (entry.get("size"), entry.get("sha256")):
            raise CacheError(
                f"{library.path} no longer matches the fingerprint (size or sha256 differ); "
                "run `k26-supervisor flashinfer warm` first"
            )
        if not (library.complete and library.runs_on_target):
            raise CacheError(f"{library.path} is not usable for {serving.arch}: {library.error}")
    held = [
        info
        for path in locks.find_lock_files(fingerprint.path.parent / "cached_ops")
        if (info := locks.inspect_lock(path)).state == "held"
    ]
    if held:
        raise CacheError(f"a build is running: {held[0].path} {held[0].detail}")
    return fingerprint


Entry = Mapping[str, Any]  # a module as a fingerprint records it: path, size, sha256, ...


def vouched_learned(
    serving: ServingEnv,
    fingerprint: cache.Fingerprint,
    learned: Sequence[str],
    asked: Sequence[str],
) -> tuple[dict[str, Entry], list[str]]:
    """Of the modules ready units built (``learned``, less those ``asked`` for), those
    a bundle carries too, each with its entry; and a note for each one left out. A
    learned module is one the server needed: a node pulled without it builds it at
    first use.

    One the fingerprint vouches for goes as it vouches for it. One FlashInfer cannot
    rebuild here (no generator: attention variants, which a server builds with its own
    arguments; the fingerprint names them ``not_rebuildable``) goes when its library is
    byte for byte what the learned record took from the unit that built it, in this
    fingerprint's cache dir (its FlashInfer version and arch tag), beside the same
    ``build.ninja``: the fingerprint vouches for the builder, the record for the bytes."""
    carried: dict[str, Entry] = {}
    notes: list[str] = []
    records: dict[str, dict[str, Any]] | None = None
    base = fingerprint.path.parent
    for name in dict.fromkeys(learned):
        if name in asked:
            continue
        entry = fingerprint.modules.get(name)
        if entry is None and name in fingerprint.not_rebuildable:
            if records is None:
                records = learned_record.learned(serving.workspace, serving.arch)
            made, why = _built_by_a_unit(serving, base, fingerprint, name, records.get(name))
            if made is not None:
                carried[name] = made
            else:
                notes.append(
                    f"learned module {name} not carried: {why}; nodes build it at first use"
                )
            continue
        if entry is None:
            notes.append(
                f"learned module {name} not carried: the fingerprint does not vouch for it "
                "(run `k26-supervisor flashinfer warm`, which builds learned modules, first)"
            )
            continue
        if entry.get("source", "jit") != "jit":
            notes.append(f"learned module {name} not carried: an installed package serves it")
            continue
        library = cache.inspect_library(Path(str(entry.get("path"))), serving.target)
        if (library.size, library.sha256) != (entry.get("size"), entry.get("sha256")) or not (
            library.complete and library.runs_on_target
        ):
            notes.append(
                f"learned module {name} not carried: {library.path} is not what the "
                "fingerprint vouches for (run `k26-supervisor flashinfer warm` first)"
            )
            continue
        carried[name] = entry
    return carried, notes


def _built_by_a_unit(
    serving: ServingEnv,
    base: Path,
    fingerprint: cache.Fingerprint,
    name: str,
    record: Mapping[str, Any] | None,
) -> tuple[Entry | None, str]:
    """An unrebuildable module's entry, vouched for by the learned record; else why not."""
    if record is None:
        return None, "warm cannot build it here and no learned record names its library"
    # FlashInfer 0.2.x has no version level: its tag dirs sit in the cache root.
    version = None if base.parent == cache.cache_root(serving.workspace) else base.parent.name
    built = learned_record.build_of(record, version, base.name)
    if not built:
        seen = ", ".join(learned_record.builds_seen(record))
        here = base.relative_to(cache.cache_root(serving.workspace))
        return None, (
            f"the unit built it into {seen}, not {here}, where the fingerprint vouches for "
            "the builder"
        )
    build = base / "cached_ops" / name
    library = cache.inspect_library(build / f"{name}.so", serving.target)
    if (library.size, library.sha256) != (built.get("size"), built.get("sha256")):
        return None, f"{library.path} is not what the learned record took from the unit"
    units_cuda = (fingerprint.identity.get("torch") or {}).get("cuda")
    why = unusable(library, library.path.name, units_cuda)
    if why is not None:
        return None, why
    ninja = built.get("build_ninja_sha256")
    if ninja is None:  # ninja would find no state it wrote, and build it again
        return None, "the learned record took no build.ninja beside it"
    try:
        here_ninja = hashlib.sha256((build / "build.ninja").read_bytes()).hexdigest()
    except OSError:
        here_ninja = None
    if here_ninja != ninja:
        return None, f"{build / 'build.ninja'} is not what the learned record took from the unit"
    targets = list(dict.fromkeys(t.name for t in library.targets))
    return {"path": str(library.path), "size": library.size, "sha256": library.sha256,
            "targets": targets, "source": "jit", "build_ninja_sha256": ninja}, ""  # fmt: skip


def _collect(fingerprint: cache.Fingerprint, entries: Mapping[str, Entry]) -> list[Path]:
    """Every file of each module's build dir (the .so and its ninja state) and of its
    generated sources (``generated/<module>/``, where FlashInfer renders a templated
    module's sources). Those go too, with their mtimes: the loader writes them only
    when they differ (``write_if_different``), and runs ninja at every load, so a
    module pulled without them gets them anew, newer than its objects, and is rebuilt."""
    base = fingerprint.path.parent
    for top in (base / "cached_ops", base / "generated"):
        if top.is_symlink():
            raise CacheError(f"{top}: a symlink; refusing to bundle it")
    files: list[Path] = []
    for name, entry in entries.items():
        build_dir = Path(str(entry["path"])).parent
        if build_dir.parent != base / "cached_ops":
            raise CacheError(f"module {name}'s file is outside {base / 'cached_ops'}: {build_dir}")
        for top in (build_dir, base / "generated" / name):
            if top.is_symlink():
                raise CacheError(f"{top}: a symlink; refusing to bundle it")
            if not top.is_dir():
                continue  # no generated/: a module built from the package's own sources
            for path in sorted(top.rglob("*")):
                if path.is_symlink() or not (path.is_file() or path.is_dir()):
                    raise CacheError(f"{path}: not a regular file; refusing to bundle it")
                if path.is_file():
                    files.append(path)
    return files


def _read_file(path: Path) -> tuple[bytes, os.stat_result]:
    """``path``'s bytes and the stat of that very file (one fd, no link followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CacheError(f"{path} went away while being bundled; try again") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheError(f"{path}: a symlink; refusing to bundle it") from None
        raise CacheError(f"cannot read {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        return handle.read(), os.fstat(handle.fileno())


def export_sync(
    serving: ServingEnv,
    identity: Mapping[str, Any],
    out: Path,
    modules: Sequence[str],
    *,
    reproducible: bool = False,
    learned: Sequence[str] = (),
) -> dict[str, Any]:
    """Write the bundle to ``out`` atomically (temp file, fsync, rename). Blocking I/O.
    ``modules`` must be vouched for; of the ``learned`` ones, those vouched for go too
    (``vouched_learned``), and the result's ``notes`` say which did not.

    The archive's bytes depend only on the cache and the time in its manifest;
    ``reproducible`` takes the fingerprint's ``built_at`` for that time, so the same
    cache is the same archive, byte for byte (a registry then stores it once)."""
    fingerprint = _vouched(serving, identity, modules)
    extra, notes = vouched_learned(serving, fingerprint, learned, modules)
    entries = {name: fingerprint.modules[name] for name in modules} | extra
    base = fingerprint.path.parent
    root = cache.cache_root(serving.workspace)
    blobs: list[tuple[FileEntry, bytes]] = []
    for path in _collect(fingerprint, entries):
        data, stat = _read_file(path)  # hashed and archived from the same bytes
        name = path.relative_to(base).as_posix()
        entry = FileEntry(
            name=name,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            mtime_ns=stat.st_mtime_ns,
            mode=stat.st_mode & 0o777,
        )
        blobs.append((entry, data))
    by_name = {entry.name: entry for entry, _ in blobs}
    module_entries: dict[str, ModuleEntry] = {}
    for name, recorded in entries.items():
        file = Path(str(recorded["path"])).relative_to(base).as_posix()
        if (by_name[file].size, by_name[file].sha256) != (recorded["size"], recorded["sha256"]):
            raise CacheError(f"{base / file} changed while being bundled; try again")
        ninja = (Path(file).parent / "build.ninja").as_posix()
        ninja_sha256 = recorded.get("build_ninja_sha256")  # a unit-built module's
        archived = by_name.get(ninja)
        if ninja_sha256 is not None and (archived is None or archived.sha256 != ninja_sha256):
            raise CacheError(f"{base / ninja} changed while being bundled; try again")
        module_entries[name] = ModuleEntry(
            file=file,
            size=by_name[file].size,
            sha256=by_name[file].sha256,
            targets=tuple(recorded.get("targets") or ()),
        )
    manifest = Manifest(
        arch=fingerprint.arch,
        arch_tag=fingerprint.arch_tag,
        cache_dir=base.relative_to(root).as_posix(),
        workspace=str(serving.workspace),
        identity=dict(fingerprint.identity),
        built_at=fingerprint.built_at,
        exported_at=fingerprint.built_at if reproducible else utc_stamp(),
        modules=module_entries,
        files=tuple(entry for entry, _ in blobs),
    )
    out = Path(os.path.abspath(out))
    packed = io.BytesIO()
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0) as compressed,
        tarfile.open(fileobj=compressed, mode="w") as tar,
    ):
        add_member(tar, MANIFEST_NAME, manifest.model_dump_json(indent=1).encode(), 0o644, 0)
        for entry, data in blobs:
            add_member(tar, MEMBER_PREFIX + entry.name, data, entry.mode, entry.mtime_ns)
    try:
        write_atomic(out, packed.getvalue(), new_mode=0o666)  # as open() makes it
    except OSError as exc:
        raise CacheError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return {
        "archive": str(out),
        "size_bytes": out.stat().st_size,
        "sha256": sha256_file(out),
        "cache_dir": str(base),
        "modules": sorted(module_entries),
        "files": len(blobs),
        "notes": notes,
    }


# --- reading an archive ---------------------------------------------------------------


def read_manifest(archive: Path, limits: Limits = DEFAULT_LIMITS) -> Manifest:
    """The manifest: the archive's first member. InputError if it is not a bundle, or
    lists what ``limits`` refuse."""
    raw = read_manifest_bytes(archive, MANIFEST_NAME, "bundle", limits)
    return parse_manifest(raw, archive, limits)


def walk(
    archive: Path,
    manifest: Manifest,
    stage: Stage | None,
    on_step: Step = _no_step,
) -> None:
    """Read every member and check it against the manifest; write under ``stage`` if given.

    Each file is written (owner-only until complete, nothing followed: ``Stage``),
    fsynced, given its mode and exact mtime. InputError names the archive and the member.
    """
    walk_files(
        archive,
        manifest.files,
        stage,
        manifest_name=MANIFEST_NAME,
        written=lambda: on_step("staging"),
    )


# --- import -------------------------------------------------------------------------------

Owner = tuple[int, int] | None


def _like_workspace(workspace: Path) -> tuple[Owner, int]:
    """(owner, directory mode) for what an import gives the units: the workspace's (the
    units' FLASHINFER_WORKSPACE_BASE, made by the installer for their user), not the
    cache root's: a root-run warm or import may have made that. An owner only when
    run as root into a workspace that is not root's: the units' user must be able to
    create FlashInfer's locks in what we install."""
    info = os.stat(workspace)
    mine = os.geteuid() == 0 and (info.st_uid, info.st_gid) != (0, 0)
    return ((info.st_uid, info.st_gid) if mine else None), info.st_mode & 0o7777


def _give(fd: int, owner: Owner, mode: int) -> None:
    """A directory we made, through its fd, given as the workspace is."""
    if owner is not None:
        os.fchown(fd, *owner)
    os.fchmod(fd, mode)


def _sweep(work_fd: int, work: Path) -> list[str]:
    """Work dirs left by a killed import (we hold the workspace lock: no live importer),
    each removed through ``work_fd`` following no symlink (a link is unlinked)."""
    removed: list[str] = []
    for name in sorted(os.listdir(work_fd)):
        remove_tree(work_fd, name)
        removed.append(str(work / name))
    return removed


def _discard(root_fd: int, work_fd: int, job: str) -> None:
    remove_tree(work_fd, job)
    with contextlib.suppress(OSError):
        os.rmdir(WORK_NAME, dir_fd=root_fd)  # the work dir, once empty (never a link)


def _cache_parent(root_fd: int, root: Path, final: Path, owner: Owner, mode: int) -> int:
    """An fd of the cache dir's parent, each dir below the root made as the workspace
    is if absent; a symlink on the way is refused, naming it."""
    fd = os.dup(root_fd)
    shown = root
    try:
        for part in final.parent.relative_to(root).parts:
            shown = shown / part
            child, made = real_dir(fd, part, shown, "install into")
            os.close(fd)
            fd = child
            if made:
                _give(fd, owner, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fingerprint_text(manifest: Manifest, host: Mapping[str, Any], final: Path, digest: str) -> str:
    modules = {
        name: {
            "path": str(final / spec.file),
            "size": spec.size,
            "sha256": spec.sha256,
            "targets": list(spec.targets),
        }
        for name, spec in manifest.modules.items()
    }
    fingerprint = cache.Fingerprint(
        arch=manifest.arch,
        arch_tag=manifest.arch_tag,
        identity=dict(host),  # equal to the builder's in every compared field
        modules=modules,
        built_at=manifest.built_at,
        path=final / cache.FINGERPRINT_NAME,
    )
    data = fingerprint.to_dict()
    data["bundle"] = {
        "sha256": digest,
        "exported_at": manifest.exported_at,
        "imported_at": utc_stamp(),
        "builder_nvcc_mtime_ns": (manifest.identity.get("nvcc") or {}).get("mtime_ns"),
    }
    return json.dumps(data, indent=1, sort_keys=True)


@dataclass(frozen=True)
class Checked:
    """An archive read whole and found to fit this host: what install needs."""

    archive: Path
    manifest: Manifest
    sha256: str


def check_archive(
    serving: ServingEnv, host: Mapping[str, Any], archive: Path, limits: Limits = DEFAULT_LIMITS
) -> Checked:
    """Everything import checks before it touches the workspace. Blocking I/O.

    InputError: the archive is not exactly what its manifest lists, holds what
    ``limits`` or ``archive.walk_files`` refuse (a link, a device, a bomb: the member
    named), or does not fit this host (each mismatch named)."""
    archive = Path(os.path.abspath(archive))
    manifest = read_manifest(archive, limits)
    problems = mismatches(manifest, host, serving.arch, serving.workspace)
    if problems:
        raise InputError(
            f"{archive} does not fit this host's serving venv {serving.python}: "
            + "; ".join(problems)
        )
    digest = sha256_file(archive)
    walk(archive, manifest, None)  # every member verified before the workspace is touched
    return Checked(archive, manifest, digest)


def prepare_workspace(serving: ServingEnv, checked: Checked, extra_bytes: int = 0) -> None:
    """Room for the staged copy (the old cache is freed only after the swap), and the
    cache root made as the workspace is. Before ``warm_lock``, whose file lives there."""
    files = checked.manifest.files
    root = cache.cache_root(serving.workspace)
    check_no_links(
        serving.workspace, root, "import into"
    )  # before check_workspace writes its probe there
    cache.check_workspace(serving.workspace, sum(f.size for f in files) + extra_bytes + (16 << 20))
    owner, mode = _like_workspace(serving.workspace)
    for made in (root.parent, root):  # perhaps made just now, by root, 0755
        fd = open_below(serving.workspace, made, "import into")
        try:
            _give(fd, owner, mode)
        finally:
            os.close(fd)


def import_sync(
    serving: ServingEnv,
    host: Mapping[str, Any],
    archive: Path,
    on_step: Step = _no_step,
    limits: Limits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Check, stage and swap in a bundle. Blocking I/O; see the module docstring.
    ``on_step`` is told each step as it is reached: verified, locked, staging (once
    per file written), staged, swapped, cleaned. ``limits``: what the archive may hold."""
    checked = check_archive(serving, host, archive, limits)
    on_step("verified")
    prepare_workspace(serving, checked)
    with warm_lock(serving.workspace):
        on_step("locked")
        return install_locked(serving, host, checked, on_step)


def install_locked(
    serving: ServingEnv, host: Mapping[str, Any], checked: Checked, on_step: Step = _no_step
) -> dict[str, Any]:
    """Stage a checked archive and swap it in; the caller holds ``warm_lock``."""
    archive, manifest, digest = checked.archive, checked.manifest, checked.sha256
    workspace = serving.workspace
    root = cache.cache_root(workspace)
    final = root / manifest.cache_dir
    work = root / WORK_NAME
    owner, mode = _like_workspace(workspace)
    job = f"{os.getpid()}-{time.monotonic_ns()}"
    stage = work / job / "cache"
    with contextlib.ExitStack() as fds:

        def held(fd: int) -> int:
            fds.callback(os.close, fd)
            return fd

        try:
            root_fd = held(open_below(workspace, root, "install into"))
            work_fd, made = real_dir(root_fd, WORK_NAME, work, "install into")
            held(work_fd)
            if made:
                _give(work_fd, owner, mode)
            swept = _sweep(work_fd, work)
            job_fd = held(private_dir(work_fd, job, work / job))
        except OSError as exc:
            raise CacheError(f"cannot install into {final}: {exc.strerror or exc}") from exc
        try:
            stage_fd = held(private_dir(job_fd, "cache", stage))
            staged = Stage(stage, stage_fd)
            fds.callback(staged.close)
            walk(archive, manifest, staged, on_step)
            text = _fingerprint_text(manifest, host, final, digest)
            # 0o666 less the umask, as warm writes it: the units' group may replace it.
            with os.fdopen(staged.create(cache.FINGERPRINT_NAME, 0o666), "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            staged.close()
            hand_over(stage_fd, owner, mode)  # complete and checked: now the units'
            fsync_dir(job_fd)
            fsync_dir(work_fd)
            on_step("staged")
            parent_fd = held(_cache_parent(root_fd, root, final, owner, mode))
            replaced = existing_dir(parent_fd, final) is not None
            (exchange if replaced else move_new)("cache", final.name, job_fd, parent_fd)
            fsync_dir(parent_fd)
            fsync_dir(job_fd)
            on_step("swapped")
        except OSError as exc:
            _discard(root_fd, work_fd, job)
            unsupported = exc.errno in (errno.EINVAL, errno.ENOSYS)
            hint = " (this filesystem cannot swap directories atomically)" if unsupported else ""
            raise CacheError(f"cannot install into {final}: {exc.strerror or exc}{hint}") from exc
        except BaseException:
            _discard(root_fd, work_fd, job)
            raise
        _discard(root_fd, work_fd, job)  # the old cache, now swapped out
    on_step("cleaned")
    installed = cache.read_fingerprint(final / cache.FINGERPRINT_NAME)
    for spec in manifest.modules.values():
        library = cache.inspect_library(final / spec.file, serving.target)
        if installed is None or (library.size, library.sha256) != (spec.size, spec.sha256):
            raise CacheError(f"{final / spec.file} does not match the bundle after install")
    return {
        "archive": str(archive),
        "sha256": digest,
        "cache_dir": str(final),
        "replaced": replaced,
        "modules": sorted(manifest.modules),
        "files": len(manifest.files),
        "built_at": manifest.built_at,
        "swept": swept,
    }


# --- the async API (what the CLI and a daemon await) ---------------------------------------


async def export_bundle(
    python: Path,
    arch: str,
    workspace: Path,
    out: Path,
    modules: Sequence[str] = ("sampling",),
    *,
    env: Mapping[str, str] | None = None,
    learned: Sequence[str] = (),
) -> dict[str, Any]:
    """Write a bundle of the vouched-for cache (``modules``, and the ``learned`` ones
    vouched for). Raises CacheError, UnavailableError."""
    started = time.monotonic()
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    identity = await host_identity(serving)
    result = await asyncio.to_thread(
        functools.partial(export_sync, learned=learned), serving, identity, Path(out), modules
    )
    return {**result, "duration_s": round(time.monotonic() - started, 3)}


async def import_bundle(
    python: Path,
    arch: str,
    workspace: Path,
    archive: Path,
    *,
    env: Mapping[str, str] | None = None,
    on_step: Step = _no_step,
    limits: Limits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Install a bundle atomically. Raises InputError (bundle), CacheError, UnavailableError.
    ``on_step``: as ``import_sync``'s, called in a worker thread. ``limits``: what the
    archive may hold (``[flashinfer]`` ``bundle_max_*``)."""
    started = time.monotonic()
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    identity = await host_identity(serving)
    result = await asyncio.to_thread(import_sync, serving, identity, Path(archive), on_step, limits)
    return {**result, "duration_s": round(time.monotonic() - started, 3)}
