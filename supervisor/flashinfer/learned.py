"""The modules a server really uses, learned from what its FlashInfer built.

The config's ``modules`` is what an operator asks for; real SGLang builds more
(0.5.17 JIT-builds ``norm`` at start-up as well as ``sampling`` on the first
sampled request). After a unit has been ready, every module directory under
the cache's ``cached_ops/`` holding its ``.so`` is recorded here, with what
FlashInfer wrote beside it, and every later warm-up covers the ones FlashInfer
can rebuild without arguments.

The record lives at ``<workspace>/k26-learned-modules.json``, beside the cache
root rather than inside it, so it outlives a FlashInfer upgrade (a new
``<version>/`` directory) and a wiped ``.cache/flashinfer``. One entry per
arch: a module learned for 12.0 says nothing about 9.0. Within it, one entry per
module name (what warm-ups cover), holding each build seen of it under ``builds``,
keyed ``<version>/<tag>`` (``build_key``): a cache that holds two FlashInfer
versions after an upgrade has two builds of a module, and a bundle carries the one
of the version it ships. The entry's own fields are its latest build's.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.core.errors import CacheError
from supervisor.flashinfer import cache

LEARNED_NAME = "k26-learned-modules.json"
LEARNED_SCHEMA = 1
_NOT_MODULES = frozenset({"tmp"})  # cached_ops/tmp holds FlashInfer's build locks


@dataclass(frozen=True)
class Built:
    """A module directory FlashInfer left in the cache: its library and its build file."""

    name: str
    flashinfer: str | None  # the cache's <version> level (None on 0.2.x's layout)
    arch_tag: str
    library: str
    size: int
    sha256: str
    ninja_sha256: str | None


def build_key(flashinfer: str | None, arch_tag: str) -> str:
    """A build's key in its module's ``builds``: ``<version>/<tag>``, or ``<tag>`` on
    FlashInfer 0.2.x's layout, which has no version level."""
    return f"{flashinfer}/{arch_tag}" if flashinfer else arch_tag


def build_of(record: Mapping[str, Any], flashinfer: str | None, arch_tag: str) -> dict[str, Any]:
    """The module's build for this version and tag, from ``builds`` (or from the
    entry's own fields, which a record written before ``builds`` holds alone); ``{}``
    when the record saw none there. ``record`` as ``read`` checked it."""
    build = (record.get("builds") or {}).get(build_key(flashinfer, arch_tag))
    if build is not None:
        return dict(build)
    if (record.get("flashinfer"), record.get("arch_tag")) == (flashinfer, arch_tag):
        return dict(record)
    return {}


def builds_seen(record: Mapping[str, Any]) -> list[str]:
    """The keys (``build_key``) of every build the record saw of the module."""
    builds = record.get("builds") or {}
    return sorted(builds) or [build_key(record.get("flashinfer"), str(record.get("arch_tag")))]


def learned_path(workspace: Path) -> Path:
    return Path(workspace) / LEARNED_NAME


def scan(workspace: Path) -> list[Built]:
    """Every module whose ``<name>/<name>.so`` is in the cache, any version and tag."""
    root = cache.cache_root(Path(workspace))
    found: list[Built] = []
    for ops in sorted([*root.glob("*/*/cached_ops"), *root.glob("*/cached_ops")]):
        tag_dir = ops.parent
        version = tag_dir.parent.name if tag_dir.parent != root else None
        for module_dir in sorted(p for p in ops.iterdir() if p.is_dir()):
            library = module_dir / f"{module_dir.name}.so"
            if module_dir.name in _NOT_MODULES or not library.is_file():
                continue
            data = library.read_bytes()
            ninja = module_dir / "build.ninja"
            found.append(
                Built(
                    name=module_dir.name,
                    flashinfer=version,
                    arch_tag=tag_dir.name,
                    library=str(library),
                    size=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                    ninja_sha256=(
                        hashlib.sha256(ninja.read_bytes()).hexdigest() if ninja.is_file() else None
                    ),
                )
            )
    return found


def read(workspace: Path) -> dict[str, Any]:
    """The whole record; ``{}`` when there is none. CacheError naming the file if corrupt."""
    path = learned_path(workspace)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CacheError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
        if data.get("schema") != LEARNED_SCHEMA:
            raise ValueError(f"schema is not {LEARNED_SCHEMA}")
        if not isinstance(data.get("archs"), dict):
            raise ValueError("archs is not a mapping")
        for arch, entry in data["archs"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("modules"), dict):
                raise ValueError(f"archs.{arch}.modules is not a mapping")
            for name, module in entry["modules"].items():
                where = f"archs.{arch}.modules.{name}"
                if not isinstance(module, dict):
                    raise ValueError(f"{where} is not a mapping")
                builds = module.get("builds", {})
                if not isinstance(builds, dict) or not all(
                    isinstance(b, dict) for b in builds.values()
                ):
                    raise ValueError(f"{where}.builds is not a mapping of builds")
    except (ValueError, AttributeError) as exc:
        raise CacheError(
            f"{path} is not a learned-modules record ({exc}); remove it and the next "
            "ready unit records the modules again"
        ) from None
    return dict(data)


def learned(workspace: Path, arch: str) -> dict[str, dict[str, Any]]:
    """name -> what was recorded, for one arch."""
    entry = read(workspace).get("archs", {}).get(arch, {})
    return {str(k): dict(v) for k, v in entry.get("modules", {}).items()}


def record(
    workspace: Path, arch: str, built: Iterable[Built], *, unit: str | None = None
) -> list[str]:
    """Add what was built for ``arch``; return the names seen for the first time.

    Modules are never forgotten here: a module the server needed once it may need
    again after a wipe. Written atomically (temp file, fsync, rename).
    """
    data = read(workspace) or {"schema": LEARNED_SCHEMA, "archs": {}}
    modules: dict[str, Any] = data["archs"].setdefault(arch, {"modules": {}})["modules"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new: list[str] = []
    # The newest version last, so that the entry's own fields are its latest build's
    # (scan sorts by path, where "0.10.0" comes before "0.7.4").
    for item in sorted(built, key=lambda b: (_version_key(b.flashinfer), b.arch_tag)):
        previous = modules.get(item.name)
        if previous is None:
            new.append(item.name)
        build = {
            "flashinfer": item.flashinfer,
            "arch_tag": item.arch_tag,
            "library": item.library,
            "size": item.size,
            "sha256": item.sha256,
            "build_ninja_sha256": item.ninja_sha256,
            "last_seen": now,
        }
        builds = dict((previous or {}).get("builds") or {})
        if previous and not builds and previous.get("arch_tag"):  # a record from before builds
            old = {k: previous.get(k) for k in build}
            builds[build_key(previous.get("flashinfer"), str(previous["arch_tag"]))] = old
        builds[build_key(item.flashinfer, item.arch_tag)] = build
        modules[item.name] = {
            "first_seen": previous["first_seen"] if previous else now,
            **build,
            "seen_after": unit or (previous or {}).get("seen_after"),
            "builds": builds,
        }
    if new or built:
        cache._atomic_write(learned_path(workspace), json.dumps(data, indent=1, sort_keys=True))
    return sorted(new)


def _version_key(version: str | None) -> tuple[int, ...]:
    """A FlashInfer version's order ("0.10.0" after "0.7.4"); 0.2.x's None first."""
    if version is None:
        return ()
    leading = (re.match(r"\d{1,9}", part) for part in version.split("."))
    return tuple(int(m.group()) if m else 0 for m in leading)


def learn_from_cache(
    workspace: Path, arch: str, arch_tags: Iterable[str], *, unit: str | None = None
) -> list[str]:
    """After a unit was ready: record the modules its FlashInfer built for ``arch``.

    Only directories of the arch's own tags (``120f`` for 12.0 on 0.7) count, so
    a cache shared by two arches does not mix them. Blocking file I/O.
    """
    tags = set(arch_tags)
    return record(workspace, arch, [b for b in scan(workspace) if b.arch_tag in tags], unit=unit)
