"""What a node accepted from each signed tag, so that a registry cannot roll it back.

A signature covers a manifest's digest, and through it the bundle's config and its
``created_at``; it does not say which bundle is the newest. Whoever can push to the
registry (but holds no signing key) can point a node's tag at an older bundle that
was genuinely signed for the same identity: a build with a since-fixed fault, or
without the kernels learned since. So for every tag it pulled a *verified* bundle
from, a node keeps the newest ``created_at`` it accepted, and refuses a verified
bundle under that tag that was made before it (docs/fleet.md, "Rollback").

A pull by digest names the exact bundle: an operator going back on purpose. It is
neither checked nor recorded. Unverified pulls (no keys configured) are neither:
without a signature ``created_at`` is whatever the pusher wrote.

The record is ``k26-accepted-bundles.json`` in the daemon's state directory
(``learned_shapes.state_dir``: ``/var/lib/k26-supervisor`` for the system bus, beside
``k26-learned-shapes.json``), which the daemon and ``bundle pull`` (its
``--state-dir`` and ``--bus``, resolved the same way) share. Not the FlashInfer
workspace: the units' group can write there, and a unit that could delete or rewrite
the record could let the registry roll the node back; the state directory is the
daemon's alone (``StateDirectory=``, mode 0700). Written atomically, mode 0600, and
by root handed to whoever owns the directory (the daemon's user), so that a pull by
hand and the daemon keep one record. A node whose record is removed accepts the
tag's current signed bundle again. A record that cannot be read refuses every
verified pull by tag, naming the file: it is never taken as empty; a state directory
that cannot be made refuses it too, naming the directory.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from supervisor.atomic_write import give_to_directory_owner, write_atomic
from supervisor.core.bundle_use import utc_time
from supervisor.core.errors import CacheError, InputError
from supervisor.fleet.archive import parse_json, utc_stamp

ACCEPTED_NAME: Final = "k26-accepted-bundles.json"


class Accepted(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    created_at: str
    key: str  # the public key that verified it (its path on this node)
    accepted_at: str

    @field_validator("created_at")
    @classmethod
    def _a_time(cls, value: str) -> str:
        utc_time(value)  # ValueError: what pydantic reports, naming the field
        return value

    @property
    def made(self) -> datetime:
        return utc_time(self.created_at)


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(default=1, ge=1, le=1)
    tags: dict[str, Accepted] = Field(default_factory=dict)


def record_path(state_dir: Path) -> Path:
    """The record in the daemon's state directory (never the units' workspace)."""
    return Path(state_dir) / ACCEPTED_NAME


def tag_key(url: str, tag: str) -> str:
    """One tag of one repository: ``<registry URL>:<tag>``."""
    return f"{url.rstrip('/')}:{tag}"


def created(stamp: str, where: str) -> datetime:
    """A bundle's ``created_at`` as a time; InputError naming it when it is none."""
    try:
        return utc_time(stamp)
    except (TypeError, ValueError):
        raise InputError(
            f"{where}: config created_at {stamp!r} is not an ISO 8601 time: its age cannot "
            "be told, so it cannot be checked against the bundles accepted here; push it again"
        ) from None


def read(path: Path) -> Record:
    """The record (empty where there is none); InputError naming the file otherwise.
    Blocking I/O."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Record()
    except OSError as exc:
        raise CacheError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        return parse_json(Record, raw, f"{path}: not a record of accepted bundles:")
    except InputError as exc:
        raise InputError(
            f"{exc}; a node that cannot tell which signed bundles it accepted refuses every "
            "signed pull by tag. Move it aside to accept the registry's current signed bundles"
        ) from None


def admit(path: Path, key: str, digest: str, created_at: str, verified_by: str, where: str) -> None:
    """Accept a verified bundle from the tag ``key``: refused (InputError, one line
    naming both digests) when it was made before the one accepted from that tag,
    else recorded as the tag's newest, before anything of it is written (a record
    that cannot be written is a CacheError, and nothing is installed). Blocking I/O."""
    made = created(created_at, where)
    record = read(path)
    before = record.tags.get(key)
    if before is not None and made < before.made:  # a digest is made once: another
        raise InputError(
            f"{where}: refused, older than the bundle this node accepted from {key} "
            f"({before.digest}, created {before.created_at}; this one {created_at}): a "
            "registry serving an older signed bundle under the tag rolls the node back; "
            "nothing written. To go back on purpose, pull it by digest"
        )
    if before is not None and (before.digest, before.key) == (digest, verified_by):
        return
    entry = Accepted(digest=digest, created_at=created_at, key=verified_by, accepted_at=utc_stamp())
    body = Record(tags={**record.tags, key: entry}).model_dump_json(indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise CacheError(
            f"{path.parent}: the state directory for {path.name} cannot be made "
            f"({exc.strerror}); nothing installed: a node must remember what it accepted "
            "to refuse a rollback (the daemon's state directory: [supervisor] state_dir, "
            "or --state-dir by hand)"
        ) from None
    try:
        write_atomic(path, body, new_mode=0o600)
        give_to_directory_owner(path)  # a root pull by hand: the daemon's user rewrites it
    except OSError as exc:
        raise CacheError(
            f"{path}: cannot be written ({exc.strerror}); nothing installed: a node must "
            "remember what it accepted to refuse a rollback"
        ) from None
