"""One way to replace a file so that a reader, or a kill at any instant, sees the old
bytes or the new ones, never a mix: write a temporary file beside it, fsync it,
rename it over the old one, and fsync the directory so the rename survives a crash.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(
    path: Path,
    data: bytes | str,
    *,
    mode: int | None = None,
    new_mode: int = 0o644,
    durable: bool = True,
) -> None:
    """Replace ``path`` with ``data`` atomically (``mode``: the new file's permission
    bits, else the old file's, else ``new_mode`` less the umask: 0o666 gives what
    ``open()`` would, so a shared directory's group keeps write access under
    ``UMask=0007``). ``durable=False`` skips the fsyncs, for files that a reboot
    clears anyway. Raises OSError; on any error the old file is untouched and no
    temporary file is left."""
    payload = data.encode() if isinstance(data, str) else data
    if mode is None:
        with contextlib.suppress(FileNotFoundError):
            mode = path.stat().st_mode & 0o7777
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, new_mode if mode is None else 0o600
        )
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            if durable:
                os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    if durable:
        with contextlib.suppress(OSError):
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def give_to_directory_owner(path: Path) -> None:
    """Where root wrote ``path`` into a directory another user owns (a daemon's
    ``StateDirectory=``), hand the file to that user, who reads and rewrites it.
    Raises OSError."""
    owner = path.parent.stat()
    if os.geteuid() == 0 and (owner.st_uid, owner.st_gid) != (0, 0):
        os.chown(path, owner.st_uid, owner.st_gid)
