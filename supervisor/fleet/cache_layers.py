"""The JIT caches besides FlashInfer's, as bundle layers: Triton, inductor, TVM-FFI, DeepGEMM.

Where each lives is read from the unit's environment (``core/jit_caches.py``); only
a cache the environment pins (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``,
``TVM_FFI_CACHE_DIR``, ``SGLANG_DG_CACHE_DIR``) travels, since a library default
depends on the unit's user and home. A layer is a gzip'd tar laid out as a
FlashInfer bundle is: ``k26-cache.json`` first (``CacheManifest``), then every
file under ``cache/``, with its size, sha256, mode and exact mtime.

**Identity.** What makes a cache valid, read from the serving venv by
``venv_scripts/k26_caches.py`` (no torch or triton import), per cache
(``identities``): Triton: the triton distribution (version and RECORD hash), the
ptxas it runs (release and ``--version`` hash), Python's version (its launcher
stubs are compiled against Python's headers) and the arch; torch inductor: torch
(and the CUDA it was built for), triton, the GPU models (inductor's keys name the
device: ``CacheBase.get_system``), Python and the arch; TVM-FFI: tvm-ffi, nvcc, the
C/C++ compilers, Python and the arch; DeepGEMM: deep-gemm and sgl-kernel, nvcc,
Python and the arch.

**Paths.** A cache may be restored at another path only when nothing in it names
its own: every file is searched for the cache's absolute path at export. Triton
keys its entries by a hash of source and options, no path; only its group files
(``<key>/__grp__<name>.json``: ``{"child_paths": {file: absolute path}}``) name
paths, and Triton drops a child whose path does not exist, a silent miss. Those
are rewritten to the new path on pull (the layer's bytes are verified first).
Any other file that names the path pins the cache to it, the reason recorded:
inductor's generated code says ``# kernel path: <cache>/...``; TVM-FFI runs ninja
in each build dir on every load and its ``build.ninja`` names its sources by
absolute path (as FlashInfer's does; a moved one is rebuilt). A pinned cache is
refused at another path with that reason.

**Install.** Into a cold cache only (absent, or holding no file but locks and
temporaries): staged beside it (same filesystem), fsynced, then swapped in with one
``renameat2``. ``Installed.rollback`` puts the cold dir back; ``commit`` keeps any
file a server wrote into the cold dir meanwhile, then drops it. A cache that is
not cold is left as it is: nothing a node built is ever replaced by a pull.

**Symlinks.** Run as root, a pull writes beside caches the units' user owns, who
can plant a symlink there at any moment; nothing is followed (``archive``'s
"Symlinks"). The cache's parent dir is the one path trusted (opened once, as
configured); everything else is reached by fd: the work dir
``.k26-pull-<cache>-<pid>-<ns>`` and its ``cache/`` stage are made fresh 0o700, so
no other user can enter them while they fill; each file is created
``O_CREAT|O_EXCL|O_NOFOLLOW`` and given its mode and mtime through its fd; the
staged tree goes to the cache's owner (``lchown``, ``fchown``, ``fchmod``) only once
complete, right before the swap; the target is checked with ``lstat`` when the
install starts and again just before the ``renameat2`` (a symlink refused, naming
it, nothing changed). ``commit`` walks the swapped-out cold dir and the new cache
by fd with ``O_NOFOLLOW`` (``os.fwalk``), so a link in either is never walked into,
and moves each file with a no-replace rename between directory fds. A leftover work
dir is removed by ``shutil.rmtree`` relative to the parent's fd (a link unlinked).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import os
import signal
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from supervisor.core import jit_caches
from supervisor.core.errors import CacheError, InputError, UnavailableError
from supervisor.core.jit_caches import JitCache
from supervisor.flashinfer.venv import RESULT_PREFIX, ServingEnv, spawn_script
from supervisor.fleet.archive import (
    DEFAULT_LIMITS,
    MEMBER_PREFIX,
    FileEntry,
    Limits,
    Stage,
    Strict,
    add_member,
    check_listing,
    exchange,
    existing_dir,
    fsync_dir,
    hand_over,
    move_new,
    open_child,
    parse_json,
    pid_alive,
    private_dir,
    read_manifest_bytes,
    real_dir,
    remove_tree,
    syncfs,
    walk_files,
)

SCRIPT = Path(__file__).with_name("venv_scripts") / "k26_caches.py"
LAYER_MANIFEST = "k26-cache.json"
TOOLS_TIMEOUT_S = 60.0
# The caches a layer carries (FlashInfer's is bundle.py's), by their names in /status.
CacheName = Literal["triton", "inductor", "tvm-ffi", "deepgemm"]
CARRIED: tuple[JitCache, ...] = (
    JitCache.TRITON,
    JitCache.INDUCTOR,
    JitCache.TVM_FFI,
    JitCache.DEEPGEMM,
)
# Why a cache that names its own path cannot move, where the reason is known.
PINNED_WHY: Mapping[str, str] = {
    "inductor": "torch inductor's files name its cache path (its generated code records "
    "each kernel's file as '# kernel path: ...', and its FX graph entries hold that code)",
    "tvm-ffi": "TVM-FFI runs ninja in each build dir at every load and its build.ninja "
    "names the sources by absolute path, so a moved cache is rebuilt",
    "deepgemm": "DeepGEMM's files name its cache path",
    "triton": "Triton's files name its cache path outside the group files it can rewrite",
}


# --- identity ---------------------------------------------------------------------------


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Dist(_Reply):
    name: str
    version: str
    record_sha256: str


class Tool(_Reply):
    path: str
    release: str | None
    version_sha256: str | None
    error: str | None = None


class ToolsReply(_Reply):
    """``k26_caches.py identity``: who writes the caches besides FlashInfer."""

    python_version: str
    prefix: str
    distributions: dict[str, Dist | None]
    torch_cuda: str | None
    ptxas: Tool | None
    nvcc: Tool | None
    gpu_models: list[str]
    env: dict[str, str | None]


def _tool(tool: Tool | None) -> dict[str, Any] | None:
    """What of a tool decides its output: its release and the hash of its version text
    (not where it is installed)."""
    if tool is None:
        return None
    if tool.error:
        return {"error": tool.error}
    return {"release": tool.release, "version_sha256": tool.version_sha256}


def identities(tools: ToolsReply, arch: str) -> dict[str, dict[str, Any]]:
    """Each cache's identity on this host: the compilers and runtimes that make it valid."""
    dists = {key: None if d is None else d.model_dump() for key, d in tools.distributions.items()}
    base = {"arch": arch, "python_version": tools.python_version}
    return {
        "triton": {**base, "triton": dists.get("triton"), "ptxas": _tool(tools.ptxas)},
        "inductor": {
            **base,
            "torch": dists.get("torch"),
            "torch_cuda": tools.torch_cuda,
            "triton": dists.get("triton"),
            "gpu_models": list(tools.gpu_models),
        },
        "tvm-ffi": {
            **base,
            "tvm_ffi": dists.get("tvm_ffi"),
            "nvcc": _tool(tools.nvcc),
            "cc": tools.env.get("CC"),
            "cxx": tools.env.get("CXX"),
        },
        "deepgemm": {
            **base,
            "deep_gemm": dists.get("deep_gemm"),
            "sgl_kernel": dists.get("sgl_kernel"),
            "nvcc": _tool(tools.nvcc),
        },
    }


class RootsReply(_Reply):
    """``k26_caches.py roots``: the cache variables the installed code reads."""

    scanned: list[str]  # the distributions whose sources were read
    files: int
    variables: dict[str, list[str]]  # variable -> the files that read it


async def cache_roots(serving: ServingEnv, *, timeout_s: float = 120.0) -> RootsReply:
    """Ask the serving venv which cache roots its SGLang, FlashInfer and torch (and
    what they require) can write (``k26_caches.py roots``)."""
    found = await _ask(serving, "roots", timeout_s)
    return parse_json(RootsReply, found, f"{serving.python} k26_caches.py roots:", UnavailableError)


async def tools_identity(serving: ServingEnv, *, timeout_s: float = TOOLS_TIMEOUT_S) -> ToolsReply:
    """Ask the serving venv (``k26_caches.py identity``, its own session, ended on timeout)."""
    found = await _ask(serving, "identity", timeout_s)
    return parse_json(
        ToolsReply, found, f"{serving.python} k26_caches.py identity:", UnavailableError
    )


async def _ask(serving: ServingEnv, what: str, timeout_s: float) -> str:
    """The result line of ``k26_caches.py WHAT`` (its own session, ended on timeout)."""
    try:
        proc = await spawn_script(serving, SCRIPT, [what])
    except OSError as exc:
        raise UnavailableError(
            f"serving interpreter {serving.python} cannot run: {exc.strerror or exc}"
        ) from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.shield(proc.wait())
        raise
    lines = out.decode("utf-8", "replace").splitlines()
    found = [line[len(RESULT_PREFIX) :] for line in lines if line.startswith(RESULT_PREFIX)]
    if not found:
        tail = " | ".join(lines[-5:]) or "no output"
        raise UnavailableError(
            f"{serving.python} k26_caches.py {what} exited {proc.returncode} without an "
            f"answer: {tail}"
        )
    return found[-1]


# --- where the caches are -------------------------------------------------------------


def pinned_locations(
    env: Mapping[str, str], overrides: Mapping[str, Path] | None = None
) -> dict[str, Path]:
    """The carried caches the environment pins, by name; ``overrides`` win."""
    out: dict[str, Path] = {}
    for location in jit_caches.locate(env, home="/", user="root"):
        if location.cache in CARRIED and location.pinned:
            out[str(location.cache)] = Path(str(location.path))
    for name, path in (overrides or {}).items():
        if name not in {str(c) for c in CARRIED}:
            raise InputError(
                f"--cache {name}={path}: unknown cache {name!r}; one of "
                + ", ".join(str(c) for c in CARRIED)
            )
        if not path.is_absolute():
            raise InputError(f"--cache {name}={path}: the path must be absolute")
        out[name] = Path(os.path.abspath(path))
    return out


# Lock files named just "lock" (TVM-FFI's FileLock in each build dir, Triton's
# lock_path): made again when needed, never a kernel.
LOCK_NAMES = frozenset({"lock"})


def artifacts(root: Path) -> list[Path]:
    """The files of a cache that are kernels or their records: not locks, logs or
    temporaries (``jit_caches.ignored_artifact``, ``LOCK_NAMES``). Sorted. Blocking I/O."""
    if not root.is_dir():
        return []
    found: list[Path] = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(directory) / name
            relative = PurePosixPath(path.relative_to(root).as_posix())
            if name not in LOCK_NAMES and not jit_caches.ignored_artifact(relative):
                found.append(path)
    return found


def is_cold(root: Path) -> bool:
    """Absent, or holding no artifact (locks and temporaries do not count)."""
    return not artifacts(root)


# --- the layer --------------------------------------------------------------------------


class CacheManifest(Strict):
    kind: Literal["k26-jit-cache"] = "k26-jit-cache"
    schema_version: Literal[1] = 1
    cache: CacheName
    path: str  # where it was built
    identity: dict[str, Any]
    relocatable: bool
    pinned_because: str | None = None  # why it must be restored at ``path``
    rewrite: tuple[str, ...] = ()  # files naming ``path`` that a move rewrites
    files: tuple[FileEntry, ...]


def parse_layer_manifest(
    raw: bytes, archive: Path, limits: Limits = DEFAULT_LIMITS
) -> CacheManifest:
    """Validate a layer's manifest: its shape, and its files under ``limits`` (each a
    plain relative path, no special bits: ``archive.check_listing``). Pure."""
    manifest = parse_json(CacheManifest, raw, f"{archive}: not a k26 cache layer: manifest")
    if not os.path.isabs(manifest.path):
        raise InputError(f"{archive}: manifest path {manifest.path!r} is not absolute")
    check_listing(manifest.files, archive, limits)
    names = {entry.name for entry in manifest.files}
    for name in manifest.rewrite:
        if name not in names or not _is_group(name):
            raise InputError(f"{archive}: manifest rewrite {name!r} is not a listed group file")
    if manifest.relocatable == bool(manifest.pinned_because):
        raise InputError(f"{archive}: manifest relocatable and pinned_because disagree")
    return manifest


def _is_group(name: str) -> bool:
    """Triton's group file: ``<key>/__grp__<name>.json``."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith("__grp__") and base.endswith(".json")


def _group_children(data: bytes, root: str) -> dict[str, str] | None:
    """A group file's children when every one lies under ``root``; None otherwise."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    children = parsed.get("child_paths") if isinstance(parsed, dict) else None
    if not isinstance(children, dict) or set(parsed) != {"child_paths"}:
        return None
    if not all(isinstance(v, str) and v.startswith(root + "/") for v in children.values()):
        return None
    return {str(k): str(v) for k, v in children.items()}


@dataclass
class _Scan:
    entries: list[FileEntry] = field(default_factory=list)
    rewrite: list[str] = field(default_factory=list)
    naming: list[str] = field(default_factory=list)  # files that name the path


def _scan(cache: str, root: Path) -> _Scan:
    needles = {os.fsencode(str(root)), os.fsencode(os.path.realpath(root))}
    scan = _Scan()
    for path in artifacts(root):
        if path.is_symlink() or not path.is_file():
            raise CacheError(f"{path}: not a regular file; refusing to bundle it")
        data = path.read_bytes()
        stat = path.stat()
        name = path.relative_to(root).as_posix()
        scan.entries.append(
            FileEntry(
                name=name,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                mtime_ns=stat.st_mtime_ns,
                mode=stat.st_mode & 0o777,
            )
        )
        if not any(needle in data for needle in needles):
            continue
        if cache == "triton" and _is_group(name) and _group_children(data, str(root)):
            scan.rewrite.append(name)
        else:
            scan.naming.append(name)
    for directory, dirs, _ in os.walk(root):
        for name in dirs:
            if (Path(directory) / name).is_symlink():
                raise CacheError(f"{Path(directory) / name}: a link; refusing to bundle it")
    return scan


def export_layer(cache: str, root: Path, identity: Mapping[str, Any], out: Path) -> CacheManifest:
    """Write the layer of the cache at ``root`` to ``out`` (a scratch file). Blocking I/O.

    Every file is read twice, once to hash and search, once to archive; a file that
    changed in between is a CacheError (try again once the server is idle)."""
    root = Path(os.path.abspath(root))
    scan = _scan(cache, root)
    why = None
    if scan.naming:
        why = f"{PINNED_WHY.get(cache, 'its files name its cache path')}: e.g. {scan.naming[0]}"
    manifest = CacheManifest(
        cache=cache,  # type: ignore[arg-type]  # checked by the model
        path=str(root),
        identity=dict(identity),
        relocatable=why is None,
        pinned_because=why,
        rewrite=tuple(scan.rewrite),
        files=tuple(scan.entries),
    )
    # Reproducible: the same cache is the same bytes (no time in the gzip header, no
    # owner in the tar), so a registry stores a layer once and a push sends only news.
    with (
        out.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed,
        tarfile.open(fileobj=compressed, mode="w") as tar,
    ):
        add_member(tar, LAYER_MANIFEST, manifest.model_dump_json(indent=1).encode(), 0o644, 0)
        for entry in scan.entries:
            data = (root / entry.name).read_bytes()
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                raise CacheError(f"{root / entry.name} changed while being bundled; try again")
            add_member(tar, MEMBER_PREFIX + entry.name, data, entry.mode, entry.mtime_ns)
    return manifest


def read_layer_manifest(archive: Path, limits: Limits = DEFAULT_LIMITS) -> CacheManifest:
    """The layer's manifest: its first member. InputError if it is not a layer, or
    lists what ``limits`` refuse."""
    raw = read_manifest_bytes(archive, LAYER_MANIFEST, "layer", limits)
    return parse_layer_manifest(raw, archive, limits)


def check_layer(archive: Path, limits: Limits = DEFAULT_LIMITS) -> CacheManifest:
    """Read a whole layer and check every member against its manifest, nothing
    written: InputError naming the layer and the member for anything hostile (see
    ``archive.walk_files``). Blocking I/O."""
    manifest = read_layer_manifest(archive, limits)
    walk_files(archive, manifest.files, None, manifest_name=LAYER_MANIFEST)
    return manifest


# --- install ----------------------------------------------------------------------------

WORK_PREFIX = ".k26-pull-"


Owner = tuple[int, int] | None


def _owner_like(reference: os.stat_result) -> Owner:
    """Run by root into the units' cache: what we make becomes the cache owner's."""
    if os.geteuid() == 0 and (reference.st_uid, reference.st_gid) != (0, 0):
        return reference.st_uid, reference.st_gid
    return None


def sweep_work(parent_fd: int, parent: Path, name: str) -> list[str]:
    """Work dirs a killed pull of ``name`` left beside it (their process is gone),
    removed through ``parent_fd`` following no symlink (a link is unlinked)."""
    removed: list[str] = []
    prefix = f"{WORK_PREFIX}{name}-"
    for leftover in sorted(os.listdir(parent_fd)):
        if not leftover.startswith(prefix):
            continue
        pid = leftover[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and pid_alive(int(pid)) and int(pid) != os.getpid():
            continue
        remove_tree(parent_fd, leftover)
        removed.append(str(parent / leftover))
    return removed


def _relocate(staged: Stage, manifest: CacheManifest, target: Path) -> None:
    """Rewrite the group files that name the old path (verified bytes) to ``target``."""
    old = manifest.path
    entries = {e.name: e for e in manifest.files}
    for name in manifest.rewrite:
        with os.fdopen(staged.open(name, os.O_RDONLY), "rb") as handle:
            children = _group_children(handle.read(), old)
        if children is None:  # the bytes were verified: only a bad manifest gets here
            raise InputError(f"{name}: not a Triton group under {old}")
        moved = {k: str(target) + v[len(old) :] for k, v in children.items()}
        with os.fdopen(staged.open(name, os.O_WRONLY | os.O_TRUNC), "wb") as handle:
            handle.write(json.dumps({"child_paths": moved}).encode())
            handle.flush()
            os.utime(handle.fileno(), ns=(entries[name].mtime_ns, entries[name].mtime_ns))


@dataclass
class Installed:
    """A cache swapped in, not yet committed: ``commit`` or ``rollback`` (either closes
    the directory fds it holds)."""

    cache: str
    target: Path
    work: Path
    exchanged: bool  # the cold dir that was there is now at work/cache
    files: int
    moved: bool  # restored at another path than it was built at
    parent_fd: int = field(default=-1, repr=False)  # the target's parent
    work_fd: int = field(default=-1, repr=False)
    owner: Owner = field(default=None, repr=False)  # for dirs commit makes
    dir_mode: int = field(default=0o755, repr=False)

    @property
    def _aside(self) -> Path:
        return self.work / "cache"

    def commit(self) -> list[str]:
        """Drop the cold dir it replaced, keeping any file written there meanwhile."""
        try:
            kept = self._keep() if self.exchanged else []
            remove_tree(self.parent_fd, self.work.name)
        finally:
            self._close()
        return kept

    def rollback(self) -> None:
        """Put back what was there (the cold dir, or nothing)."""
        try:
            if self.exchanged:
                exchange("cache", self.target.name, self.work_fd, self.parent_fd)
            else:
                move_new(self.target.name, "cache", self.parent_fd, self.work_fd)
            remove_tree(self.parent_fd, self.work.name)
        finally:
            self._close()

    def _close(self) -> None:
        for fd in (self.work_fd, self.parent_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.work_fd = self.parent_fd = -1

    def _keep(self) -> list[str]:
        """Move each artifact written into the cold dir (now aside) meanwhile into the
        cache where it has none: both reached by fd, nothing followed (a link in either
        is skipped, never walked into), each file renamed without replacing."""
        kept: list[str] = []
        try:
            aside = open_child(self.work_fd, "cache", self._aside, "keep files from")
        except (CacheError, OSError):
            return kept  # not a real dir (swapped for a link at the last moment): nothing
        try:
            into = open_child(self.parent_fd, self.target.name, self.target, "keep files in")
        except (CacheError, OSError):
            os.close(aside)
            return kept
        try:
            for top, dirs, names, dir_fd in os.fwalk(".", dir_fd=aside):
                dirs.sort()
                for name in sorted(names):
                    relative = PurePosixPath(top) / name
                    if name in LOCK_NAMES or jit_caches.ignored_artifact(relative):
                        continue
                    if self._move(dir_fd, into, relative):
                        kept.append(str(self.target / relative))
        finally:
            os.close(aside)
            os.close(into)
        return kept

    def _move(self, source_fd: int, into: int, relative: PurePosixPath) -> bool:
        fd = os.dup(into)
        shown = self.target
        try:
            for part in relative.parent.parts:
                shown = shown / part
                child, made = real_dir(fd, part, shown, "keep files in")
                os.close(fd)
                fd = child
                if made:
                    if self.owner is not None:
                        os.fchown(fd, *self.owner)
                    os.fchmod(fd, self.dir_mode)
            move_new(relative.name, relative.name, source_fd, fd)
        except (CacheError, FileExistsError):
            return False  # a link on the way (never followed), or the cache has one
        finally:
            os.close(fd)
        return True


def install(
    archive: Path, manifest: CacheManifest, target: Path, anchor: Path | None = None
) -> Installed:
    """Stage a checked layer beside ``target`` and swap it in, if ``target`` is cold.

    CacheError when it is not (nothing changed), when it or what lies beside it is a
    symlink (refused, naming it), or when the disk says no (the staged copy removed).
    ``anchor`` (the workspace): for a target below it, the dirs from there down are
    reached (made if absent) with no symlink followed; otherwise the target's parent
    is trusted as configured. The caller commits or rolls back. Blocking I/O."""
    target = Path(os.path.abspath(target))
    parent = target.parent
    try:
        if anchor is not None and parent.is_relative_to(anchor) and anchor.is_dir():
            parent_fd = _reach(anchor, parent)
        else:
            parent.mkdir(parents=True, exist_ok=True)
            parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise CacheError(f"cannot make {parent}: {exc.strerror or exc}") from exc
    try:
        return _install(archive, manifest, target, parent_fd)
    except BaseException:
        os.close(parent_fd)
        raise


def _reach(anchor: Path, parent: Path) -> int:
    """An fd of ``parent``, each dir below ``anchor`` made if absent, none followed."""
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = anchor
    try:
        for part in parent.relative_to(anchor).parts:
            shown = shown / part
            child, _ = real_dir(fd, part, shown, "install into", 0o777)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _install(archive: Path, manifest: CacheManifest, target: Path, parent_fd: int) -> Installed:
    parent = target.parent
    there = existing_dir(parent_fd, target)
    if not is_cold(target):
        raise CacheError(f"{target} is not cold (it holds compiled kernels); left as it is")
    reference = there if there is not None else os.fstat(parent_fd)
    owner, mode = _owner_like(reference), reference.st_mode & 0o7777
    sweep_work(parent_fd, parent, target.name)
    name = f"{WORK_PREFIX}{target.name}-{os.getpid()}-{time.monotonic_ns()}"
    work = parent / name
    try:
        work_fd = private_dir(parent_fd, name, work)
    except OSError as exc:
        raise CacheError(f"cannot install into {target}: {exc.strerror or exc}") from exc
    try:
        stage_fd = private_dir(work_fd, "cache", work / "cache")
        try:
            staged = Stage(work / "cache", stage_fd)
            try:
                walk_files(
                    archive, manifest.files, staged, manifest_name=LAYER_MANIFEST, sync_each=False
                )
                moved = os.path.abspath(manifest.path) != str(target)
                if moved:
                    _relocate(staged, manifest, target)
            finally:
                staged.close()
            hand_over(stage_fd, owner, mode, sync=False)  # complete and checked: now theirs
            syncfs(stage_fd)  # every staged file and dir on disk before the swap
        finally:
            os.close(stage_fd)
        exchanged = existing_dir(parent_fd, target) is not None  # again, just before the swap
        if exchanged:
            exchange("cache", target.name, work_fd, parent_fd)
        else:
            move_new("cache", target.name, work_fd, parent_fd)
        fsync_dir(parent_fd)
    except OSError as exc:
        remove_tree(parent_fd, name)
        os.close(work_fd)
        raise CacheError(f"cannot install into {target}: {exc.strerror or exc}") from exc
    except BaseException:
        remove_tree(parent_fd, name)
        os.close(work_fd)
        raise
    return Installed(
        manifest.cache,
        target,
        work,
        exchanged,
        len(manifest.files),
        moved,
        parent_fd=parent_fd,
        work_fd=work_fd,
        owner=owner,
        dir_mode=mode,
    )


def sizes(manifest: CacheManifest) -> tuple[int, int]:
    """(files, bytes) of a layer's cache."""
    return len(manifest.files), sum(e.size for e in manifest.files)


def names(caches: Sequence[JitCache] = CARRIED) -> list[str]:
    return [str(c) for c in caches]
