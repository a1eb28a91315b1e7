"""The archives bundles travel in: tar safety, manifests' shared parts, validation.

Every archive of this package (a FlashInfer bundle, a cache layer) is a gzip'd tar
laid out the same way: its manifest first, then each file under ``cache/``. What
they share lives here, and no module of the package reaches into another's private
names:

- ``walk_files`` reads every member once, refusing what a manifest does not list
  exactly (size, sha256), links, non-regular files, names that are not plain
  relative paths, a second manifest, duplicates and missing members; it writes
  under a stage only what passed, each file owner-only until complete;
- ``check_gzip`` reads a gzip stream to its end (tar alone stops early);
- ``exchange``/``move_new``: ``renameat2`` swaps and no-replace renames;
- ``Strict`` and ``parse_json``: frozen pydantic models that refuse unknown fields,
  and one error message naming the first bad field;
- ``read_manifest_bytes``: an archive's first member, its manifest, read with the
  same checks and errors for every kind;
- ``shown``/``ABSENT``: identities compared field by field (``flashinfer.cache.leaves``).
"""

from __future__ import annotations

import ctypes
import gzip
import hashlib
import io
import os
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.core.errors import CacheError, InputError, SupervisorError
from supervisor.flashinfer.cache import leaves

M = TypeVar("M", bound=BaseModel)


MEMBER_PREFIX = "cache/"


MAX_MANIFEST_BYTES = 4 << 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(Strict):
    name: str = Field(min_length=1, max_length=4096)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    mtime_ns: int = Field(ge=0)
    mode: int = Field(ge=0, le=0o777)


def safe_relative(name: str, what: str) -> PurePosixPath:
    """``name`` as a plain relative path (no root, ``..``, empty or odd parts)."""
    path = PurePosixPath(name)
    if (
        not name
        or name.startswith("/")
        or "\x00" in name
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise InputError(f"{what}: {name!r} is not a plain relative path")
    return path


def shown(value: Any) -> str:
    return "absent" if value is ABSENT else ("none" if value is None else str(value))


ABSENT = object()


def utc_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int, mtime_ns: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = mtime_ns // 1_000_000_000  # the exact ns are in the manifest
    tar.addfile(info, io.BytesIO(data))


def read_manifest_bytes(archive: Path, name: str, kind: str) -> bytes:
    """The bytes of ``name``, which must be the archive's first member; InputError if
    the archive is not a k26 cache ``kind`` (bundle, layer) or cannot be read."""
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            first = tar.next()
            if first is None or first.name != name or not first.isreg():
                raise InputError(f"{archive}: not a k26 cache {kind} (no {name} first)")
            if first.size > MAX_MANIFEST_BYTES:
                raise InputError(f"{archive}: {name} is {first.size} bytes; too large")
            handle = tar.extractfile(first)
            assert handle is not None
            raw = handle.read()
    except FileNotFoundError:
        raise InputError(f"{archive}: no such file") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise InputError(f"{archive}: truncated or corrupt archive: {exc}") from None
    if len(raw) != first.size:
        raise InputError(f"{archive}: truncated or corrupt archive: {name} is cut short")
    return raw


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def syncfs(path: Path) -> None:
    """Flush the whole filesystem ``path`` is on (data and metadata): one call where a
    fsync per file would cost each a round trip to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(path))
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_gzip(archive: Path) -> None:
    """A gzip'd archive must end as gzip ends (CRC, length): tar alone stops early."""
    with archive.open("rb") as raw:
        if raw.read(2) != b"\x1f\x8b":
            return
    try:
        with gzip.open(archive, "rb") as stream:
            while stream.read(1 << 20):
                pass
    except (EOFError, OSError, zlib.error) as exc:
        raise InputError(f"{archive}: truncated or corrupt archive: {exc}") from None


def copy_hashed(source: IO[bytes], sink: IO[bytes] | None) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    for chunk in iter(lambda: source.read(1 << 20), b""):
        digest.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return size, digest.hexdigest()


def check_member(member: tarfile.TarInfo, archive: Path, seen: set[str], manifest_name: str) -> str:
    name = member.name
    what = f"{archive}: member {name!r}"
    if name == manifest_name:
        raise InputError(f"{what}: a second manifest")
    if not name.startswith(MEMBER_PREFIX):
        raise InputError(f"{what}: outside {MEMBER_PREFIX}")
    relative = name[len(MEMBER_PREFIX) :]
    safe_relative(relative, what)
    if member.issym() or member.islnk():
        raise InputError(f"{what}: a link ({member.linkname!r}); bundles hold regular files only")
    if not member.isreg() or member.issparse():
        raise InputError(f"{what}: not a regular file (tar type {member.type!r})")
    if relative in seen:
        raise InputError(f"{what}: appears twice")
    seen.add(relative)
    return relative


def walk_files(
    archive: Path,
    files: Sequence[FileEntry],
    stage: Path | None,
    make_dirs: Callable[[Path], None] | None = None,
    *,
    manifest_name: str,
    sync_each: bool = True,
    written: Callable[[], None] | None = None,
) -> None:
    """``walk`` for any archive laid out as a bundle is (``manifest_name`` first, then
    ``cache/`` members): every member checked against ``files``; written under
    ``stage`` if given, its directories made by ``make_dirs``. ``sync_each=False``
    leaves the fsync to the caller (one ``syncfs`` for thousands of small files)."""
    listed = {entry.name: entry for entry in files}
    seen: set[str] = set()
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            first = tar.next()  # the manifest, read already
            if first is None or first.name != manifest_name:
                raise InputError(f"{archive}: not a k26 cache bundle (no {manifest_name} first)")
            while (member := tar.next()) is not None:
                relative = check_member(member, archive, seen, manifest_name)
                entry = listed.get(relative)
                what = f"{archive}: member {member.name!r}"
                if entry is None:
                    raise InputError(f"{what}: not listed in the manifest")
                if member.size != entry.size:
                    raise InputError(f"{what}: {member.size} bytes, the manifest says {entry.size}")
                source = tar.extractfile(member)
                assert source is not None
                target = None
                if stage is None:
                    size, digest = copy_hashed(source, None)
                else:
                    target = stage / relative
                    if make_dirs is not None:
                        make_dirs(target.parent)
                    else:
                        target.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as sink:
                        size, digest = copy_hashed(source, sink)
                        sink.flush()
                        if sync_each:
                            os.fsync(sink.fileno())
                if size != entry.size:
                    raise InputError(f"{what}: truncated ({size} of {entry.size} bytes)")
                if digest != entry.sha256:
                    raise InputError(f"{what}: sha256 {digest} differs from the manifest's")
                if target is not None:
                    os.chmod(target, entry.mode)
                    os.utime(target, ns=(entry.mtime_ns, entry.mtime_ns))
                    if written is not None:
                        written()
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise InputError(f"{archive}: truncated or corrupt archive: {exc}") from None
    except OSError as exc:
        if stage is not None and exc.filename is not None:
            raise CacheError(f"cannot stage {exc.filename}: {exc.strerror or exc}") from exc
        raise InputError(f"{archive}: truncated or corrupt archive: {exc}") from None
    missing = sorted(set(listed) - seen)
    if missing:
        raise InputError(f"{archive}: truncated: member {MEMBER_PREFIX + missing[0]!r} is missing")


_AT_FDCWD = -100


_RENAME_NOREPLACE = 1


_RENAME_EXCHANGE = 2


def _renameat2(source: Path, target: Path, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def exchange(source: Path, target: Path) -> None:
    """Swap two paths atomically (both must exist, on one filesystem)."""
    _renameat2(source, target, _RENAME_EXCHANGE)


def move_new(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically, failing if ``target`` exists."""
    _renameat2(source, target, _RENAME_NOREPLACE)


def parse_json(
    model: type[M], raw: bytes | str, what: str, error: type[SupervisorError] = InputError
) -> M:
    """``raw`` validated as ``model``; otherwise ``error`` saying ``{what} field
    {dotted path}: {pydantic's message}`` for the first bad field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top)"
        raise error(f"{what} field {field}: {first['msg']}") from None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def differences(
    built: Mapping[str, Any], here: Mapping[str, Any], ignore: Iterable[str] = ()
) -> list[tuple[str, Any, Any]]:
    """Every leaf that differs: (dotted field, bundle's value, this host's)."""
    old, new = leaves(built), leaves(here)
    skip = set(ignore)
    return [
        (key, old.get(key, ABSENT), new.get(key, ABSENT))
        for key in sorted(set(old) | set(new))
        if key not in skip and old.get(key, ABSENT) != new.get(key, ABSENT)
    ]
