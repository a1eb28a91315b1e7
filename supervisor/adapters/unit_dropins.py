"""The files ``units configure`` reads and writes: shipped units, drop-ins, daemon-reload.

A set of files is applied all or nothing: each is replaced atomically
(``write_atomic``), and when one fails the ones already written are put back as
they were, so a host never runs one SGLang unit with the new serving venv and the
other with the old one.
"""

from __future__ import annotations

import contextlib
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from supervisor.atomic_write import write_atomic
from supervisor.core.errors import OSLevelError, UnavailableError

# Where a package (and then a local install) puts unit files, in systemd's order.
SHIPPED_DIRS = ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system")
DROPIN_ROOT = "/etc/systemd/system"


def shipped_unit(root: Path, name: str) -> tuple[Path, str]:
    """The installed unit file ``name`` (its path on the host, its text), skipping
    the administrator's directory (drop-ins render the vendor's template)."""
    for directory in SHIPPED_DIRS[1:]:
        path = root / directory.lstrip("/") / name
        if path.is_file():
            try:
                return Path(directory) / name, path.read_text()
            except OSError as exc:
                raise OSLevelError(f"cannot read {path}: {exc.strerror or exc}") from exc
    raise UnavailableError(
        f"{name} is not installed (not in {' or '.join(SHIPPED_DIRS[1:])}): "
        "install the k26-supervisor package first"
    )


def dropin_path(unit: str, filename: str) -> str:
    return f"{DROPIN_ROOT}/{unit}.d/{filename}"


def read_text(root: Path, path: str) -> str | None:
    target = root / path.lstrip("/")
    try:
        return target.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OSLevelError(f"cannot read {target}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class Change:
    verb: str  # create, update, remove
    path: str


def plan(root: Path, wanted: dict[str, str | None]) -> list[Change]:
    """What applying ``wanted`` (path -> text, or None: absent) would change."""
    changes = []
    for path, text in wanted.items():
        current = read_text(root, path)
        if text is None:
            if current is not None:
                changes.append(Change("remove", path))
        elif current is None:
            changes.append(Change("create", path))
        elif current != text:
            changes.append(Change("update", path))
    return changes


@dataclass
class _Undo:
    target: Path
    old: bytes | None
    mode: int | None
    made_dir: Path | None


def apply(root: Path, wanted: dict[str, str | None], changes: list[Change]) -> None:
    """Make each changed path hold its text (0644) or be gone, all or nothing."""
    done: list[_Undo] = []
    try:
        for change in changes:
            target = root / change.path.lstrip("/")
            old = target.read_bytes() if target.exists() else None
            mode = stat.S_IMODE(target.stat().st_mode) if old is not None else None
            made_dir = None if target.parent.exists() else target.parent
            done.append(_Undo(target, old, mode, made_dir))
            text = wanted[change.path]
            if text is None:
                target.unlink()
                with contextlib.suppress(OSError):
                    target.parent.rmdir()  # only when empty: another drop-in keeps it
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(target, text, mode=0o644)
    except OSError as exc:
        for undo in reversed(done):
            _restore(undo)
        where = exc.filename or (done[-1].target if done else root)
        raise OSLevelError(
            f"cannot write {where}: {exc.strerror or exc}; nothing was changed"
            + (" (run it as root)" if isinstance(exc, PermissionError) else "")
        ) from exc


def _restore(undo: _Undo) -> None:
    with contextlib.suppress(OSError):
        if undo.old is None:
            undo.target.unlink(missing_ok=True)
            if undo.made_dir is not None:
                shutil.rmtree(undo.made_dir, ignore_errors=True)
        else:
            undo.target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(undo.target, undo.old, mode=undo.mode)


def systemd_running(root: Path) -> tuple[bool, str]:
    """Whether systemctl may act for this root, and if not, why (for the report)."""
    if root != Path("/"):
        return False, f"--root is {root}, not /"
    if not Path("/run/systemd/system").is_dir():  # sd_booted()
        return False, "systemd is not running here (no /run/systemd/system)"
    return True, ""


def daemon_reload() -> None:
    try:
        done = subprocess.run(
            ["systemctl", "daemon-reload"], capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise OSLevelError(f"cannot run systemctl: {exc.strerror or exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise OSLevelError(
            "the drop-ins are written, but systemctl daemon-reload failed"
            + (f": {detail[-1]}" if detail else "")
            + "; run it yourself"
        )
