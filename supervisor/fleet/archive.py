"""The archives bundles travel in: tar safety, manifests' shared parts, validation.

Every archive of this package (a FlashInfer bundle, a cache layer) is a gzip'd tar
laid out the same way: its manifest first, then each file under ``cache/``. What
they share lives here, and no module of the package reaches into another's private
names:

- ``Limits`` and ``check_listing``: what one archive may hold (files, bytes per
  file, bytes in all), checked on its manifest before any file is read, with every
  name a plain relative path, no setuid, setgid or sticky bit, no file that is
  another's directory;
- ``walk_files`` reads every member once, refusing what a manifest does not list
  exactly (size, sha256), links, non-regular files, special bits, names that are
  not plain relative paths, a second manifest, duplicates and missing members; it
  writes under a stage only what passed, each file owner-only until complete. The
  stream is decompressed through a budget (the manifest's files and their tar
  headers): a decompression bomb stops there, as it streams, and the stream is
  read to its end (gzip's CRC and length; tar alone stops early);
- ``exchange``/``move_new``: ``renameat2`` swaps and no-replace renames, by path
  or relative to directory fds;
- ``Stage``, ``open_below``, ``private_dir``, ``real_dir``, ``remove_tree``,
  ``hand_over``: the file system ops of an install, none of which follows a symlink
  (see "Symlinks" below);
- ``Strict`` and ``parse_json``: frozen pydantic models that refuse unknown fields,
  and one error message naming the first bad field;
- ``read_manifest_bytes``: an archive's first member, its manifest, read with the
  same checks and errors for every kind;
- ``shown``/``ABSENT``: identities compared field by field (``flashinfer.cache.leaves``).

**Symlinks.** An install may run as root into directories the units' user owns
(the workspace is theirs, or their group's): that user can plant a symlink
wherever they can write, at any moment. So an install trusts a directory's path
only once, at its anchor (the workspace; the dir a cache lives in, as configured)
and reaches everything below it by directory fd, one component at a time with
``O_NOFOLLOW``: a component that is a symlink (or not a directory) is refused,
naming it (CacheError), never followed. Work and staging dirs are made fresh with
``os.mkdir(name, 0o700)`` and checked by ``fstat`` (a real dir of this euid), so
nobody else can enter them while they fill; every file is created
``O_CREAT|O_EXCL|O_NOFOLLOW`` and given its mode and mtime through its fd; only once
all is written and checked does ``hand_over`` give the tree to the cache's owner
(``lchown``, ``fchown``, ``fchmod``), immediately before the ``renameat2`` swap,
which is made between directory fds after the target was checked again with
``lstat``. ``shutil.rmtree`` is only ever handed a name relative to a directory fd
reached that way (its own fd walk never follows a link inside).
"""

from __future__ import annotations

import bz2
import contextlib
import ctypes
import errno
import gzip
import hashlib
import io
import lzma
import os
import posixpath
import shutil
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.core.errors import CacheError, InputError, SupervisorError
from supervisor.flashinfer.cache import leaves

M = TypeVar("M", bound=BaseModel)


MEMBER_PREFIX = "cache/"


# Room for a manifest: a fixed part, and each file's entry (name, size, sha256, mtime,
# mode: about 250 bytes with a Triton-length name).
MANIFEST_BASE_BYTES = 1 << 20
MANIFEST_BYTES_PER_FILE = 512
# A pax or GNU long-name header: tarfile reads one whole into memory, so it is
# bounded before it is read (a name is at most 4096 characters).
MAX_EXTENDED_HEADER_BYTES = 64 << 10
# The tar stream beyond the files' bytes: per member its header, a pax header and
# the padding of its data; and the end-of-archive blocks padded to a record.
TAR_BYTES_PER_MEMBER = 4096
TAR_END_BYTES = 2 * tarfile.RECORDSIZE
# The longest name part a Linux filesystem takes (NAME_MAX), in bytes, and the
# longest name: PATH_MAX (4096) less room for the cache's own path.
NAME_MAX = 255
MAX_NAME_BYTES = 3072
SPECIAL_BITS = 0o7000  # setuid, setgid, sticky


@dataclass(frozen=True)
class Limits:
    """What one archive (a bundle, a layer) may hold: checked on its manifest before
    a file is read, the stream then bounded by what the manifest lists. The defaults
    fit real caches (a Triton or FlashInfer cache holds tens of thousands of files and
    several GB); ``[flashinfer]`` ``bundle_max_*`` configures them."""

    max_entries: int = 200_000
    max_entry_bytes: int = 4 << 30
    max_total_bytes: int = 64 << 30

    @property
    def max_manifest_bytes(self) -> int:
        return MANIFEST_BASE_BYTES + MANIFEST_BYTES_PER_FILE * self.max_entries


DEFAULT_LIMITS = Limits()


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(Strict):
    name: str = Field(min_length=1, max_length=4096)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    mtime_ns: int = Field(ge=0)
    mode: int = Field(ge=0, le=0o7777)  # special bits are refused naming the file


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


def check_listing(files: Sequence[FileEntry], archive: Path, limits: Limits) -> None:
    """The files a manifest lists, against ``limits`` and each other, before a byte of
    them is read; InputError naming the archive and the file, in one line."""
    what = f"{archive}: manifest file"
    if len(files) > limits.max_entries:
        raise InputError(
            f"{what} {files[limits.max_entries].name!r}: the manifest lists {len(files)} "
            f"files, more than bundle_max_entries ({limits.max_entries})"
        )
    names: set[str] = set()
    total = 0
    for entry in files:
        name = entry.name
        safe_relative(name, what)
        try:
            encoded = os.fsencode(name)
        except UnicodeError:
            raise InputError(f"{what} {name!r}: not a valid file name") from None
        if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
            raise InputError(f"{what} {name!r}: a name part is longer than {NAME_MAX} bytes")
        if len(encoded) > MAX_NAME_BYTES:
            raise InputError(f"{what} {name!r}: longer than {MAX_NAME_BYTES} bytes")
        if name in names:
            raise InputError(f"{archive}: manifest lists {name!r} twice")
        names.add(name)
        if entry.mode & SPECIAL_BITS:
            raise InputError(
                f"{what} {name!r}: mode {entry.mode:#o} sets setuid, setgid or sticky bits"
            )
        if entry.size > limits.max_entry_bytes:
            raise InputError(
                f"{what} {name!r}: {entry.size} bytes, more than bundle_max_entry_bytes "
                f"({limits.max_entry_bytes})"
            )
        total += entry.size
        if total > limits.max_total_bytes:
            raise InputError(
                f"{what} {name!r}: the files up to it add up to {total} bytes, more than "
                f"bundle_max_total_bytes ({limits.max_total_bytes})"
            )
    directories = {str(parent) for name in names for parent in PurePosixPath(name).parents}
    for name in sorted(names & directories):
        raise InputError(f"{what} {name!r}: a file, and the directory of another file")


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


class Bomb(Exception):
    """The decompressed stream ran past its budget (raised through tarfile, which
    passes on what it does not know)."""


class _BigHeader(Bomb):
    """A pax or GNU long-name header too large to be read."""


class _Budget:
    """A decompressed stream that refuses to give more than ``budget`` bytes: it asks
    its decompressor for at most one byte past the budget, so a bomb costs neither
    memory nor disk nor time beyond it."""

    def __init__(self, source: _Reader, budget: int) -> None:
        self.source = source
        self.budget = budget
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        want = 1 << 20 if size < 0 else size
        data = self.source.read(max(0, min(want, self.budget - self.count + 1)))
        self.count += len(data)
        if self.count > self.budget:
            raise Bomb(
                f"decompresses past {self.budget} bytes, more than it can hold: "
                "a decompression bomb"
            )
        return data


class _Header(tarfile.TarInfo):
    """A member header whose pax or GNU long-name data (read whole by tarfile) is
    bounded before it is read."""

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> _Header:
        info = super().frombuf(buf, encoding, errors)
        extended = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
        longname = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
        if info.type in extended + longname and info.size > MAX_EXTENDED_HEADER_BYTES:
            raise _BigHeader(
                f"an extended header of {info.size} bytes, more than the "
                f"{MAX_EXTENDED_HEADER_BYTES} a name takes"
            )
        return info


class _Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


@contextlib.contextmanager
def open_tar(archive: Path, budget: int) -> Iterator[tuple[tarfile.TarFile, _Budget]]:
    """``archive`` read as a stream of members, at most ``budget`` bytes decompressed:
    gzip (what k26 writes), bzip2 or xz as tarfile's ``r|*`` reads them, or a plain
    tar. Raises what the decompressors and tarfile raise, and ``Bomb``."""
    with archive.open("rb") as raw, contextlib.ExitStack() as stack:
        magic = raw.read(6)
        raw.seek(0)
        source: _Reader = raw
        if magic.startswith(b"\x1f\x8b"):
            source = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
        elif magic.startswith(b"BZh"):
            source = stack.enter_context(bz2.BZ2File(raw))
        elif magic.startswith(b"\xfd7zXZ\x00"):
            source = stack.enter_context(lzma.LZMAFile(raw))
        stream = _Budget(source, budget)
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_Header) as tar:  # type: ignore[call-overload]
            yield tar, stream


_CORRUPT = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)


def read_manifest_bytes(
    archive: Path, name: str, kind: str, limits: Limits = DEFAULT_LIMITS
) -> bytes:
    """The bytes of ``name``, which must be the archive's first member; InputError if
    the archive is not a k26 cache ``kind`` (bundle, layer) or cannot be read. At most
    the manifest's room under ``limits`` (and its headers) is decompressed."""
    most = limits.max_manifest_bytes
    try:
        with open_tar(archive, most + TAR_END_BYTES + 2 * MAX_EXTENDED_HEADER_BYTES) as (tar, _):
            first = tar.next()
            if first is None or first.name != name or not first.isreg():
                raise InputError(f"{archive}: not a k26 cache {kind} (no {name} first)")
            if first.size > most:
                raise InputError(
                    f"{archive}: member {name!r}: {first.size} bytes, more than a manifest of "
                    f"bundle_max_entries ({limits.max_entries}) files takes ({most})"
                )
            handle = tar.extractfile(first)
            assert handle is not None
            raw = handle.read()
    except FileNotFoundError:
        raise InputError(f"{archive}: no such file") from None
    except Bomb as exc:
        raise InputError(f"{archive}: member {name!r}: {exc}") from None
    except (*_CORRUPT, OSError) as exc:
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


def syncfs(path: Path | int) -> None:
    """Flush the whole filesystem ``path`` (or the directory fd) is on (data and
    metadata): one call where a fsync per file would cost each a round trip to the disk."""
    fd = path if isinstance(path, int) else os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(path))
    finally:
        if not isinstance(path, int):
            os.close(fd)


def fsync_dir(path: Path | int) -> None:
    """fsync a directory, by path or fd (an fd stays open)."""
    if isinstance(path, int):
        os.fsync(path)
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_hashed(source: IO[bytes], sink: IO[bytes] | None) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    for chunk in iter(lambda: source.read(1 << 20), b""):
        digest.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return size, digest.hexdigest()


_KINDS = {
    tarfile.DIRTYPE: "a directory",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}


def _inside(path: str) -> bool:
    """Whether a relative ``path`` stays under its root, read as written."""
    normal = posixpath.normpath(path)
    return not (normal == ".." or normal.startswith(("../", "/")))


def _link(member: tarfile.TarInfo, relative: str) -> str:
    """What a link member is and where it points: every link is refused, so none can
    point out of the cache, at another link or at itself."""
    target = member.linkname
    if member.issym():
        kind = "symbolic"
        base = posixpath.dirname(relative)
        inside = not target.startswith("/") and _inside(posixpath.join(base, target))
    else:
        kind = "hard"
        inside = target.startswith(MEMBER_PREFIX) and _inside(target[len(MEMBER_PREFIX) :])
    where = "inside the cache (links may chain or loop)" if inside else "out of the cache"
    return f"a link ({kind}, to {target!r}) pointing {where}; archives hold regular files only"


def check_member(member: tarfile.TarInfo, archive: Path, seen: set[str], manifest_name: str) -> str:
    """A member's name as a plain path under ``cache/``, refused (InputError naming the
    archive and the member, one line) unless it is a regular file with plain mode bits
    that no earlier member had."""
    name = member.name
    what = f"{archive}: member {name!r}"
    if name == manifest_name:
        raise InputError(f"{what}: a second manifest")
    if not name.startswith(MEMBER_PREFIX):
        raise InputError(f"{what}: outside {MEMBER_PREFIX}")
    relative = name[len(MEMBER_PREFIX) :]
    safe_relative(relative, what)
    if member.issym() or member.islnk():
        raise InputError(f"{what}: {_link(member, relative)}")
    if not member.isreg() or member.issparse():
        kind = _KINDS.get(member.type, f"tar type {member.type!r}")
        raise InputError(f"{what}: {kind}, not a regular file (tar type {member.type!r})")
    if member.mode & SPECIAL_BITS:
        raise InputError(f"{what}: mode {member.mode:#o} sets setuid, setgid or sticky bits")
    if relative in seen:
        raise InputError(f"{what}: appears twice")
    seen.add(relative)
    return relative


def stream_budget(files: Sequence[FileEntry]) -> int:
    """The most bytes an archive listing ``files`` decompresses to, besides its
    manifest: their data in tar blocks, each member's headers, the end blocks."""
    data = sum(-(-entry.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE for entry in files)
    names = sum(2 * len(entry.name.encode("utf-8", "surrogateescape")) for entry in files)
    return data + names + (len(files) + 1) * TAR_BYTES_PER_MEMBER + TAR_END_BYTES


def walk_files(
    archive: Path,
    files: Sequence[FileEntry],
    stage: Stage | None,
    *,
    manifest_name: str,
    sync_each: bool = True,
    written: Callable[[], None] | None = None,
) -> None:
    """``walk`` for any archive laid out as a bundle is (``manifest_name`` first, then
    ``cache/`` members): every member checked against ``files``; written under
    ``stage`` if given (``Stage``: nothing followed, each file owner-only until
    complete, then its mode and mtime set through its fd). ``sync_each=False``
    leaves the fsync to the caller (one ``syncfs`` for thousands of small files).

    No more is decompressed than ``files`` and their headers take (``stream_budget``,
    plus the manifest): a bomb is refused as it streams, naming the member it was
    reached at. The stream is then read to its end (gzip's CRC and length)."""
    listed = {entry.name: entry for entry in files}
    seen: set[str] = set()
    last: str | None = None  # the member being read
    done = False  # every member read: what follows is the end of the stream
    try:
        with open_tar(archive, stream_budget(files)) as (tar, stream):
            first = tar.next()  # the manifest, read already
            if first is None or first.name != manifest_name:
                raise InputError(f"{archive}: not a k26 cache bundle (no {manifest_name} first)")
            stream.budget += -(-first.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            last = first.name
            while (member := tar.next()) is not None:
                last = member.name
                relative = check_member(member, archive, seen, manifest_name)
                entry = listed.get(relative)
                what = f"{archive}: member {member.name!r}"
                if entry is None:
                    raise InputError(f"{what}: not listed in the manifest")
                if member.size != entry.size:
                    raise InputError(f"{what}: {member.size} bytes, the manifest says {entry.size}")
                source = tar.extractfile(member)
                assert source is not None
                if stage is None:
                    _check_copy(what, entry, *copy_hashed(source, None))
                    continue
                with os.fdopen(stage.create(relative), "wb") as sink:
                    _check_copy(what, entry, *copy_hashed(source, sink))
                    sink.flush()
                    if sync_each:
                        os.fsync(sink.fileno())
                    os.fchmod(sink.fileno(), entry.mode)
                    os.utime(sink.fileno(), ns=(entry.mtime_ns, entry.mtime_ns))
                if written is not None:
                    written()
            done = True
            while stream.read(1 << 20):  # to the end: gzip checks its CRC and length there
                pass
    except Bomb as exc:
        if isinstance(exc, _BigHeader):
            where = f"the member after {last!r}"
        else:
            where = f"after its last member {last!r}" if done else f"member {last!r}"
        raise InputError(f"{archive}: {where}: {exc}") from None
    except _CORRUPT as exc:
        raise InputError(f"{archive}: truncated or corrupt archive: {exc}") from None
    except OSError as exc:
        if stage is not None and exc.filename is not None:
            raise CacheError(f"cannot stage {exc.filename}: {exc.strerror or exc}") from exc
        raise InputError(f"{archive}: truncated or corrupt archive: {exc}") from None
    missing = sorted(set(listed) - seen)
    if missing:
        raise InputError(f"{archive}: truncated: member {MEMBER_PREFIX + missing[0]!r} is missing")


def _check_copy(what: str, entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.size:
        raise InputError(f"{what}: truncated ({size} of {entry.size} bytes)")
    if digest != entry.sha256:
        raise InputError(f"{what}: sha256 {digest} differs from the manifest's")


# --- file system ops that follow no symlink (see "Symlinks" above) -------------------------

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_FOLLOWED = (errno.ELOOP, errno.ENOTDIR)


def refused_link(path: Path, doing: str) -> CacheError:
    """The one line that refuses a symlink (or non-directory) at ``path``."""
    return CacheError(
        f"{path} is a symlink or not a directory; refusing to {doing} through it "
        "(whoever can write beside it could point it anywhere)"
    )


def open_child(dir_fd: int, name: str, path: Path, doing: str) -> int:
    """An fd of the directory ``name`` in ``dir_fd`` (shown as ``path``), opened with
    ``O_NOFOLLOW``: CacheError naming ``path`` if it is a symlink or not a directory;
    FileNotFoundError if it is absent."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NOT_FOLLOWED:
            raise refused_link(path, doing) from None
        raise


def open_below(anchor: Path, path: Path, doing: str) -> int:
    """An fd of directory ``path``: ``anchor`` opened as named (it is trusted), then
    each component below it with ``O_NOFOLLOW``. CacheError naming the first component
    that is a symlink or not a directory; FileNotFoundError if one is absent."""
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = anchor
    try:
        for part in path.relative_to(anchor).parts:
            shown = shown / part
            child = open_child(fd, part, shown, doing)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_no_links(anchor: Path, path: Path, doing: str) -> None:
    """No symlink (nor file) from ``anchor`` down to ``path``, by ``lstat``; absent
    parts are fine. For a path about to be handed to code that follows links (a
    probe written by path): an early refusal, naming it; the fd walk stays the guard."""
    shown = anchor
    for part in path.relative_to(anchor).parts:
        shown = shown / part
        try:
            info = os.lstat(shown)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            raise refused_link(shown, doing)


def existing_dir(parent_fd: int, path: Path) -> os.stat_result | None:
    """``path`` (a child of ``parent_fd``) checked with ``lstat`` just before a swap:
    None if absent; a symlink or a file refused, naming it (CacheError)."""
    try:
        info = os.lstat(path.name, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{path} is a symlink or not a directory; refusing to replace it")
    return info


def real_dir(dir_fd: int, name: str, path: Path, doing: str, mode: int = 0o700) -> tuple[int, bool]:
    """(fd, made): the directory ``name`` in ``dir_fd``, made with ``mode`` if absent;
    an existing one only if it is a real directory (CacheError naming ``path`` if it
    is a symlink: ``os.mkdir`` never follows one, and it is opened ``O_NOFOLLOW``)."""
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
        made = True
    except FileExistsError:
        made = False
    return open_child(dir_fd, name, path, doing), made


def private_dir(dir_fd: int, name: str, path: Path) -> int:
    """An fd of the fresh directory ``name`` in ``dir_fd``: made 0o700 (OSError if the
    name exists, a symlink included), then checked through its fd to be a real
    directory of this euid that nobody else may enter (CacheError otherwise)."""
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = open_child(dir_fd, name, path, "stage")
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise CacheError(
            f"{path}: made just now, yet not a private directory of uid {os.geteuid()} "
            f"(owner {info.st_uid}, mode {info.st_mode & 0o7777:#o}); refusing to stage in it"
        )
    return fd


def remove_tree(dir_fd: int, name: str) -> bool:
    """Remove ``name`` in ``dir_fd`` and all below it, following no symlink: a link or
    file is unlinked (never its target), a directory removed by ``shutil.rmtree``'s own
    fd walk. Errors are ignored (a leftover is swept next time). Whether it is gone."""
    try:
        info = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return False


def hand_over(
    fd: int, owner: tuple[int, int] | None, dir_mode: int | None, *, sync: bool = True
) -> None:
    """Give the tree under directory ``fd`` (a stage this process made and filled) to
    ``owner`` (uid, gid) and its directories ``dir_mode``; ``sync``: fsync each directory.
    Through fds and ``lchown`` only, deepest first, ``fd`` itself last: nothing in it
    is followed. Run once all is written and checked, right before the swap."""
    for _top, _dirs, names, dir_fd in os.fwalk(".", topdown=False, dir_fd=fd):
        if owner is not None:
            for name in names:
                os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)
            os.fchown(dir_fd, *owner)
        if dir_mode is not None:
            os.fchmod(dir_fd, dir_mode)
        if sync:
            os.fsync(dir_fd)


class Stage:
    """A fresh private directory (``private_dir``) being filled, reached by its fd
    only: each subdirectory made 0o700 by ``os.mkdir`` and opened ``O_NOFOLLOW``, each
    file created ``O_CREAT|O_EXCL|O_NOFOLLOW``. ``path`` names it in messages; the
    caller owns ``fd``; ``close`` closes what the stage opened itself."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self._last: tuple[str, int] | None = None  # the directory used last, kept open

    def dir(self, relative: str) -> int:
        """An fd of the directory ``relative`` ("" is the stage), made if absent. The
        stage keeps it: valid until the next call for another directory, or ``close``."""
        if not relative:
            return self.fd
        if self._last is not None and self._last[0] == relative:
            return self._last[1]
        current = self.fd
        shown = self.path
        try:
            for part in relative.split("/"):
                shown = shown / part
                child, _ = real_dir(current, part, shown, "stage")
                if current != self.fd:
                    os.close(current)
                current = child
        except BaseException:
            if current != self.fd:
                os.close(current)
            raise
        self.close()
        self._last = (relative, current)
        return current

    def open(self, relative: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of the file ``relative`` with ``flags`` and ``O_NOFOLLOW``
        (OSError naming the staged path)."""
        parent, _, name = relative.rpartition("/")
        try:
            return os.open(
                name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.dir(parent)
            )
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path / relative)) from None

    def create(self, relative: str, mode: int = 0o600) -> int:
        """A new file ``relative`` (it must not exist), opened for writing."""
        return self.open(relative, NEW_FILE_FLAGS, mode)

    def close(self) -> None:
        if self._last is not None:
            os.close(self._last[1])
            self._last = None


_AT_FDCWD = -100


_RENAME_NOREPLACE = 1


_RENAME_EXCHANGE = 2


def _renameat2(
    source: Path | str, target: Path | str, flags: int, src_dir: int, dst_dir: int
) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(src_dir, os.fsencode(source), dst_dir, os.fsencode(target), flags):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def exchange(
    source: Path | str, target: Path | str, src_dir: int = _AT_FDCWD, dst_dir: int = _AT_FDCWD
) -> None:
    """Swap two paths atomically (both must exist, on one filesystem); each relative to
    its directory fd if given. Neither is followed if it is a symlink (rename's way)."""
    _renameat2(source, target, _RENAME_EXCHANGE, src_dir, dst_dir)


def move_new(
    source: Path | str, target: Path | str, src_dir: int = _AT_FDCWD, dst_dir: int = _AT_FDCWD
) -> None:
    """Rename ``source`` to ``target`` atomically, failing if ``target`` exists; each
    relative to its directory fd if given."""
    _renameat2(source, target, _RENAME_NOREPLACE, src_dir, dst_dir)


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
