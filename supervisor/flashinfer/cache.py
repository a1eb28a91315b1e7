"""The JIT cache on disk: module files, the fingerprint beside them, quarantine.

Layout (FlashInfer 0.7.x; 0.2.x has no version level)::

    <workspace>/.cache/flashinfer/<version>/<arch tag>/
        cached_ops/<module>/<module>.so     what FlashInfer loads
        cached_ops/tmp/<module>.lock        its build lock
        k26-fingerprint.json                written by warm, after verification
    <workspace>/.cache/flashinfer/k26-quarantine/<stamp>-<arch tag>-<module>/

FlashInfer trusts any ``<module>.so`` that exists. The fingerprint records who
built each file (flashinfer, torch, CUDA, nvcc, the gate's code) and each
file's size and sha256; a file that no fingerprint vouches for is not trusted.
(A module an imported bundle carried is vouched for by that bundle: built by warm
on the build host, or by one of its units, its bytes then taken by the learned
record; fleet/bundle.py.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.atomic_write import write_atomic
from supervisor.core.errors import CacheError
from supervisor.flashinfer.fatbin import CudaTarget, ElfError, check_elf, cuda_targets, cudart_major

FINGERPRINT_NAME = "k26-fingerprint.json"
FINGERPRINT_SCHEMA = 1
QUARANTINE_NAME = "k26-quarantine"
QUARANTINE_KEEP = 4
WARM_LOCK_NAME = "k26-warm.lock"
# A sampling build writes about 10 MB (objects and the .so); leave room for
# the other modules a config may list and for FlashInfer's generated sources.
MIN_FREE_BYTES = 256 * 1024 * 1024


def cache_root(workspace: Path) -> Path:
    return workspace / ".cache" / "flashinfer"


def adopt_for_owner(workspace: Path) -> int:
    """After root ran a warm-up, doctor or import on a workspace that belongs to the
    units' user: give that user what root made under it (FlashInfer's lock files and
    their ``tmp/`` dir, builds, fingerprints), with the group rights the units' umask
    (0007) would have given. Otherwise the units' user cannot take FlashInfer's lock
    on its own cache. Returns how many paths changed; nothing to do unless root."""
    if os.geteuid() != 0:
        return 0
    try:
        top = workspace.stat()
    except OSError:
        return 0
    if top.st_uid == 0:
        return 0  # root's own workspace
    changed = 0
    for directory, dirs, files in os.walk(cache_root(workspace)):
        for name in (*dirs, *files, None):
            path = Path(directory) if name is None else Path(directory) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if st.st_uid != 0 or path.is_symlink():
                continue
            with contextlib.suppress(OSError):
                os.chown(path, top.st_uid, top.st_gid)
                if path.is_dir():
                    os.chmod(path, top.st_mode & 0o7777)
                else:  # the group gets what the owner has, as UMask=0007 gives it
                    mode = st.st_mode & 0o7777
                    os.chmod(path, mode | ((mode & 0o700) >> 3))
                changed += 1
    return changed


@dataclass(frozen=True)
class LibraryCheck:
    """One module file as found on disk."""

    path: Path
    exists: bool
    size: int | None = None
    sha256: str | None = None
    complete: bool = False
    error: str | None = None
    targets: tuple[CudaTarget, ...] = ()
    runs_on_target: bool = False
    cudart_major: int | None = None  # from DT_NEEDED libcudart.so.N

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "exists": self.exists,
            "size": self.size,
            "sha256": self.sha256,
            "complete": self.complete,
            "error": self.error,
            "targets": [t.name for t in self.targets],
            "holds_target_arch": self.runs_on_target,
        }


def inspect_library(path: Path, target: tuple[int, int]) -> LibraryCheck:
    """Read a module file: complete ELF? which CUDA targets? one that runs on ``target``?"""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LibraryCheck(path, exists=False)
    except OSError as exc:
        return LibraryCheck(path, exists=True, error=f"unreadable: {exc.strerror}")
    digest = hashlib.sha256(data).hexdigest()
    try:
        check_elf(data)
        targets = tuple(cuda_targets(data))
        runtime = cudart_major(data)
    except ElfError as exc:
        return LibraryCheck(path, True, len(data), digest, complete=False, error=str(exc))
    runs = any(t.runs_on(*target) for t in targets)
    error = None
    if not runs:
        names = ", ".join(t.name for t in targets) or "no CUDA code"
        error = f"holds {names}, none of which runs on {target[0]}.{target[1]}"
    return LibraryCheck(path, True, len(data), digest, True, error, targets, runs, runtime)


@dataclass(frozen=True)
class Fingerprint:
    """What warm recorded after verifying a cache: the builder and each file."""

    arch: str
    arch_tag: str
    identity: Mapping[str, Any]
    modules: Mapping[str, Mapping[str, Any]]
    built_at: str
    path: Path
    # Learned modules FlashInfer cannot rebuild by name: known, deliberately not built.
    not_rebuildable: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema": FINGERPRINT_SCHEMA,
            "arch": self.arch,
            "arch_tag": self.arch_tag,
            "identity": dict(self.identity),
            "modules": {k: dict(v) for k, v in self.modules.items()},
            "built_at": self.built_at,
        }
        if self.not_rebuildable:
            out["not_rebuildable"] = dict(self.not_rebuildable)
        return out


def read_fingerprint(path: Path) -> Fingerprint | None:
    """The fingerprint at ``path``, or None when absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != FINGERPRINT_SCHEMA:
        return None
    try:
        return Fingerprint(
            arch=str(data["arch"]),
            arch_tag=str(data["arch_tag"]),
            identity=dict(data["identity"]),
            modules={str(k): dict(v) for k, v in dict(data["modules"]).items()},
            built_at=str(data["built_at"]),
            path=path,
            not_rebuildable={
                str(k): str(v) for k, v in dict(data.get("not_rebuildable") or {}).items()
            },
        )
    except (KeyError, TypeError, ValueError):
        return None


def write_fingerprint(fingerprint: Fingerprint) -> None:
    """Write atomically (temp file, fsync, rename) so a kill leaves old or new."""
    _atomic_write(fingerprint.path, json.dumps(fingerprint.to_dict(), indent=1, sort_keys=True))


def remove_fingerprint(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def find_fingerprints(workspace: Path) -> Iterator[Fingerprint]:
    """Fingerprints under the cache root (``<version>/<tag>/`` or ``<tag>/``)."""
    root = cache_root(workspace)
    for pattern in (f"*/{FINGERPRINT_NAME}", f"*/*/{FINGERPRINT_NAME}"):
        for path in sorted(root.glob(pattern)):
            found = read_fingerprint(path)
            if found is not None:
                yield found


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested identity flattened: ``{"a.b": leaf}`` for every leaf, so that two
    identities compare field by field (here, and by the fleet's bundles)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def identity_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable ``key: old -> new`` lines for every leaf that differs."""
    old, new = leaves(recorded), leaves(current)
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


def check_workspace(workspace: Path, min_free_bytes: int = MIN_FREE_BYTES) -> int:
    """Create the cache root if needed and prove it writable; return free bytes.

    Raises CacheError naming the path and the reason (permissions, full disk).
    """
    root = cache_root(workspace)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".k26-write-test-{os.getpid()}"
        with probe.open("wb") as handle:
            handle.write(b"k26")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
        stat = os.statvfs(root)
    except OSError as exc:
        raise CacheError(
            f"workspace {workspace} is not writable ({exc.strerror or exc}); "
            "FlashInfer could not build or lock its cache there"
        ) from exc
    free = stat.f_bavail * stat.f_frsize
    if free < min_free_bytes:
        raise CacheError(
            f"workspace {workspace} is full: {free // (1024 * 1024)} MiB free, "
            f"a warm-up needs at least {min_free_bytes // (1024 * 1024)} MiB"
        )
    return free


def quarantine(workspace: Path, victim: Path, label: str) -> Path | None:
    """Move ``victim`` (a module's build dir or file) aside; never delete evidence.

    Returns the new location, or None when ``victim`` does not exist. Keeps the
    newest QUARANTINE_KEEP entries so a flapping cache cannot fill the disk.
    """
    if not victim.exists():
        return None
    base = cache_root(workspace) / QUARANTINE_NAME
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    destination = base / f"{stamp}-{label}"
    suffix = 1
    while destination.exists():
        suffix += 1
        destination = base / f"{stamp}-{label}-{suffix}"
    try:
        victim.rename(destination)
    except OSError:
        shutil.move(str(victim), str(destination))
    entries = sorted(base.iterdir(), key=lambda p: p.stat().st_mtime)
    for old in entries[:-QUARANTINE_KEEP]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return destination


def _atomic_write(path: Path, text: str) -> None:
    """``write_atomic`` (fsynced), a new file 0o666 less the umask as ``open()`` makes
    it (group-writable in the shared cache), an OSError as a CacheError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, new_mode=0o666)
    except OSError as exc:
        raise CacheError(f"cannot write {path}: {exc.strerror or exc}") from exc
