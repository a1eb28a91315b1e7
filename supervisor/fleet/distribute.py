"""Push and pull: every JIT cache of a unit as one OCI artifact in a registry, by digest.

An artifact is an OCI image manifest (``application/vnd.oci.image.manifest.v1+json``,
``artifactType`` ``application/vnd.k26.jit-caches.v1``) whose config
(``application/vnd.k26.jit-caches.config.v1+json``, ``ArtifactConfig``) indexes
its layers, one per cache: FlashInfer's is exactly the archive ``bundle export``
writes (``application/vnd.k26.flashinfer-bundle.v1.tar+gzip``), each other cache a
layer of ``cache_layers`` (``application/vnd.k26.jit-cache.v1.tar+gzip``). The
config records each cache's identity, the path it was built at and whether it may
move; the node identity all of them were read from; and, when the push was given
the build host's daemon, a coverage marker: that the unit's coverage warm-up passed
with exactly these caches (its report from ``/status``, the unit ready with no JIT
after READY, no carried file newer than the report).

**Lookup.** A node finds its bundle without being told a digest: the artifact is
tagged ``k26-<arch>-<key>``, the key a sha256 over the node identity (the arch,
FlashInfer's builder identity as a fingerprint compares it, and every other cache's
identity). A node computes its own key from its own serving venv; no tag, no
matching bundle: it builds. ``--digest`` pulls one artifact by digest instead.

**Signatures.** ``push --sign-key`` signs the manifest digest the way cosign does
(``signing``); a pull given public keys verifies that signature right after the
manifest, before the config is even read, and refuses (SignatureError, exit 65,
one line naming the digest) a bundle none of them signed. Without keys a pull
installs unverified and warns once.

**Pull.** The manifest is checked against its digest, the config and every layer
against theirs as they stream; then every identity is compared with this node's
and every path is placed (a cache pinned to its path is refused elsewhere, with
why), all before anything is downloaded past the config; then each layer is read
whole and checked file by file before the caches are touched. Installing takes
FlashInfer's ``k26-warm.lock``: the other caches first (only where cold), then
FlashInfer's (``bundle.install_locked``); a failure puts the other caches back as
they were. A refusal is an InputError (exit 65) naming every mismatch; nothing
changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

import httpx
from pydantic import Field

from supervisor.core import jit_caches
from supervisor.core.errors import CacheError, InputError, UnavailableError
from supervisor.core.learned_shapes import LearnedShape, parse_records
from supervisor.core.learned_shapes import document as learned_document
from supervisor.flashinfer import cache, locks
from supervisor.flashinfer.protocol import Identity
from supervisor.flashinfer.venv import ServingEnv
from supervisor.flashinfer.warm import fast_check, warm_lock
from supervisor.fleet import accepted, bundle, cache_layers, registry, signing
from supervisor.fleet.archive import (
    DEFAULT_LIMITS,
    FileEntry,
    Limits,
    Strict,
    check_no_links,
    differences,
    open_below,
    parse_json,
    pid_alive,
    private_dir,
    real_dir,
    remove_tree,
    shown,
    utc_stamp,
)

log = logging.getLogger("k26.fleet")

PULL_WORK = "k26-pull-work"
# A carried file may be this much newer than the coverage report's time and still
# count as covered (the report's time is taken as the warm-up ends).
COVERAGE_SLACK_S = 1.0


class CacheRecord(Strict):
    cache: Literal["flashinfer", "triton", "inductor", "tvm-ffi", "deepgemm"]
    media_type: str
    layer: str = Field(pattern=registry.DIGEST_RE.pattern)
    size: int = Field(ge=0)
    identity: dict[str, Any]
    path: str  # FlashInfer: the workspace; the others: the cache dir
    relocatable: bool
    pinned_because: str | None = None
    files: int = Field(ge=0)
    bytes: int = Field(ge=0)


class CoverageMarker(Strict):
    """The build host's coverage warm-up passed with exactly these caches."""

    unit: str
    status_url: str
    ok: Literal[True]
    at: str
    duration_s: float
    shapes: list[dict[str, Any]]
    state: Literal["ready"]
    jit_after_ready: int = Field(ge=0, le=0)
    newest_file: str | None
    newest_file_at: str | None
    checked_at: str


class ArtifactConfig(Strict):
    kind: Literal["k26-jit-caches"] = "k26-jit-caches"
    schema_version: Literal[1] = 1
    arch: str
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    identity: dict[str, Any]
    created_at: str
    caches: tuple[CacheRecord, ...] = Field(min_length=1)
    coverage: CoverageMarker | None = None
    # The build host's learned shapes (core/learned_shapes.py's document): a node
    # that pulls the bundle replays them in its coverage too.
    learned_shapes: dict[str, Any] | None = None

    def record(self, name: str) -> CacheRecord | None:
        return next((r for r in self.caches if r.cache == name), None)


def parse_config(raw: bytes, where: str) -> ArtifactConfig:
    config = parse_json(ArtifactConfig, raw, f"{where}: not a k26 cache bundle: config")
    names = [r.cache for r in config.caches]
    if len(set(names)) != len(names):
        raise InputError(f"{where}: config lists a cache twice ({', '.join(names)})")
    return config


def usable_learned(config: ArtifactConfig, where: str) -> tuple[ArtifactConfig, str | None]:
    """``config`` without learned shapes that are not a valid record (a newer schema, a
    fault), and the note that says so: they never cost a node its caches."""
    if config.learned_shapes is None:
        return config, None
    try:
        learned_records(config.learned_shapes, f"{where}: config learned_shapes")
    except InputError as exc:
        return config.model_copy(update={"learned_shapes": None}), f"learned shapes not used: {exc}"
    return config, None


def learned_records(document: Any, where: str) -> dict[str, list[LearnedShape]]:
    """A learned-shapes document's records, or InputError naming the fault."""
    try:
        return parse_records(document, where)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def read_learned(path: Path) -> dict[str, Any]:
    """The learned-shapes file ``push --learned`` carries, checked; InputError names it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read the learned shapes: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    return learned_document(learned_records(data, str(path)))


def check_layers(manifest: registry.Manifest, config: ArtifactConfig, where: str) -> None:
    """Every cache the config lists is a layer of the manifest, same digest, size, type."""
    layers = {(d.annotations or {}).get(registry.CACHE_ANNOTATION): d for d in manifest.layers}
    if set(layers) != {r.cache for r in config.caches}:
        raise InputError(
            f"{where}: the manifest's layers ({', '.join(sorted(map(str, layers)))}) are not "
            f"the caches its config lists ({', '.join(r.cache for r in config.caches)})"
        )
    for record in config.caches:
        layer = layers[record.cache]
        if (layer.digest, layer.size, layer.mediaType) != (
            record.layer,
            record.size,
            record.media_type,
        ):
            raise InputError(
                f"{where}: the {record.cache} layer is {layer.digest} ({layer.size} bytes, "
                f"{layer.mediaType}), its config says {record.layer} ({record.size} bytes, "
                f"{record.media_type})"
            )


# --- identity and key -------------------------------------------------------------------


def node_identity(
    flashinfer: Mapping[str, Any], tools: cache_layers.ToolsReply, arch: str
) -> dict[str, Any]:
    """What a node is, for its caches: the arch, FlashInfer's builder identity as a
    fingerprint compares it, and every other cache's identity."""
    compared = {
        key: value
        for key, value in cache.leaves(flashinfer).items()
        if key not in bundle.NOT_COMPARED
    }
    return {
        "arch": arch,
        "flashinfer": compared,
        "caches": cache_layers.identities(tools, arch),
    }


def lookup_key(identity: Mapping[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def default_tag(arch: str, key: str) -> str:
    return f"k26-{arch}-{key[:40]}"


# --- the coverage marker ----------------------------------------------------------------


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat().replace("+00:00", "Z")


def coverage_marker(
    status: Mapping[str, Any], status_url: str, unit: str, newest: tuple[str, int] | None
) -> CoverageMarker:
    """The marker from a daemon's ``/status``, or CacheError saying why these caches
    are not the ones its coverage warm-up passed with. Pure."""
    units = status.get("units")
    shown = status_url
    if not isinstance(units, Mapping) or unit not in units:
        raise InputError(f"{shown}: no unit {unit!r} in /status")
    entry = units[unit]
    coverage = entry.get("coverage")
    if not isinstance(coverage, Mapping):
        raise CacheError(f"{shown}: {unit} has run no coverage warm-up yet; start it first")
    if coverage.get("ok") is not True:
        raise CacheError(f"{shown}: {unit}'s last coverage warm-up failed; fix that first")
    if entry.get("state") != "ready":
        raise CacheError(f"{shown}: {unit} is {entry.get('state')}, not ready")
    jit = entry.get("jit_after_ready") or {}
    count = int(jit.get("count") or 0) if isinstance(jit, Mapping) else 0
    if count:
        learned = entry.get("learned_shapes")
        replayable = learned.get("replayable") if isinstance(learned, Mapping) else None
        fix = "add the shapes that made them to its coverage, restart it, then push"
        if isinstance(replayable, int) and replayable > 0:
            fix = (
                f"restart it (its coverage then replays the {replayable} shape(s) it has "
                f"learned from such builds), then push; or {fix}"
            )
        raise CacheError(
            f"{shown}: {unit} compiled {count} kernel(s) after READY: its caches are not "
            f"the ones the coverage warm-up passed with; {fix}"
        )
    try:
        at = datetime.fromisoformat(str(coverage["at"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        raise InputError(f"{shown}: {unit}'s coverage has no valid 'at'") from None
    if newest is not None and newest[1] / 1e9 > at.timestamp() + COVERAGE_SLACK_S:
        raise CacheError(
            f"{newest[0]} changed at {_iso(newest[1])}, after {unit}'s coverage warm-up "
            f"passed at {coverage['at']}: the caches are not exactly those it covered; "
            "restart the unit (a new coverage warm-up), then push"
        )
    return CoverageMarker(
        unit=unit,
        status_url=status_url,
        ok=True,
        at=str(coverage["at"]),
        duration_s=float(coverage.get("duration_s") or 0.0),
        shapes=list(coverage.get("shapes") or []),
        state="ready",
        jit_after_ready=0,
        newest_file=None if newest is None else newest[0],
        newest_file_at=None if newest is None else _iso(newest[1]),
        checked_at=utc_stamp(),
    )


async def read_status(status_url: str, timeout_s: float) -> dict[str, Any]:
    url = status_url.rstrip("/") + "/status"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise UnavailableError(f"--coverage-from {url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise UnavailableError(f"--coverage-from {url}: HTTP {response.status_code}")
    try:
        data = response.json()
    except ValueError:
        raise UnavailableError(f"--coverage-from {url}: not JSON") from None
    if not isinstance(data, dict):
        raise UnavailableError(f"--coverage-from {url}: not the daemon's /status")
    return data


# --- push -----------------------------------------------------------------------------


@dataclass
class _Layer:
    record: CacheRecord
    path: Path
    newest: tuple[str, int] | None


def _newest(files: Sequence[FileEntry], base: str) -> tuple[str, int] | None:
    if not files:
        return None
    entry = max(files, key=lambda e: e.mtime_ns)
    return f"{base}/{entry.name}", entry.mtime_ns


def _make_layers(
    serving: ServingEnv,
    flashinfer: Mapping[str, Any],
    tools: cache_layers.ToolsReply,
    modules: Sequence[str],
    locations: Mapping[str, Path],
    work: Path,
    learned_modules: Sequence[str] = (),
) -> tuple[list[_Layer], list[str]]:
    """Every cache's layer in ``work``. Blocking I/O."""
    out = work / "flashinfer.tar.gz"
    exported = bundle.export_sync(
        serving, flashinfer, out, modules, reproducible=True, learned=learned_modules
    )
    notes: list[str] = list(exported["notes"])
    manifest = bundle.read_manifest(out)
    digest, size = registry.file_digest(out)
    cache_dir = cache.cache_root(serving.workspace) / manifest.cache_dir
    layers = [
        _Layer(
            CacheRecord(
                cache="flashinfer",
                media_type=registry.FLASHINFER_LAYER,
                layer=digest,
                size=size,
                identity=dict(manifest.identity),
                path=manifest.workspace,
                relocatable=False,
                pinned_because=(
                    "FlashInfer runs ninja on every load and its ninja state names "
                    "absolute paths (the workspace's and the serving venv's)"
                ),
                files=exported["files"],
                bytes=sum(f.size for f in manifest.files),
            ),
            out,
            _newest(manifest.files, str(cache_dir)),
        )
    ]
    ids = cache_layers.identities(tools, serving.arch)
    for name, root in sorted(locations.items()):
        if cache_layers.is_cold(root):
            notes.append(f"{name}: {root} holds no kernels; not carried")
            continue
        out = work / f"{name}.tar.gz"
        layer = cache_layers.export_layer(name, root, ids[name], out)
        digest, size = registry.file_digest(out)
        files, total = cache_layers.sizes(layer)
        layers.append(
            _Layer(
                CacheRecord(
                    cache=layer.cache,
                    media_type=registry.CACHE_LAYER,
                    layer=digest,
                    size=size,
                    identity=layer.identity,
                    path=layer.path,
                    relocatable=layer.relocatable,
                    pinned_because=layer.pinned_because,
                    files=files,
                    bytes=total,
                ),
                out,
                _newest(layer.files, layer.path),
            )
        )
    return layers, notes


class _Node(NamedTuple):
    """This host as the registry knows it."""

    serving: ServingEnv
    locations: dict[str, Path]  # the carried caches, by name
    flashinfer: dict[str, Any]  # who built (would build) FlashInfer's cache
    tools: cache_layers.ToolsReply  # who builds the other caches
    identity: dict[str, Any]  # both, as a node's identity
    key: str  # its lookup key


async def _this_node(
    python: Path,
    arch: str,
    workspace: Path,
    env: Mapping[str, str] | None,
    caches: Mapping[str, Path] | None,
) -> _Node:
    """The serving venv, where its caches are, who builds them and the node's key: what
    push and pull both ask first."""
    env = dict(env or {})
    serving = ServingEnv(Path(python), arch, Path(workspace), env)
    locations = cache_layers.pinned_locations(env, caches)
    flashinfer = await bundle.host_identity(serving)
    tools = await cache_layers.tools_identity(serving)
    identity = node_identity(flashinfer, tools, arch)
    return _Node(serving, locations, flashinfer, tools, identity, lookup_key(identity))


async def push(
    python: Path,
    arch: str,
    workspace: Path,
    url: str,
    *,
    env: Mapping[str, str] | None = None,
    modules: Sequence[str] = ("sampling",),
    learned_modules: Sequence[str] = (),
    caches: Mapping[str, Path] | None = None,
    coverage_from: str | None = None,
    unit: str | None = None,
    learned: Path | None = None,
    tags: Sequence[str] = (),
    chunk_size: int | None = None,
    timeout_s: float = 30.0,
    access: registry.Access | None = None,
    sign_key: Path | None = None,
    sign_passphrase: Path | None = None,
) -> dict[str, Any]:
    """Bundle every cache and push it; the artifact's digest and tags. FlashInfer's
    layer holds ``modules`` and each of ``learned_modules`` (what ready units built)
    that its fingerprint vouches for; ``notes`` names those left out. With
    ``sign_key``, the manifest is signed (``signing``) before any tag names it: a node
    that verifies never sees the bundle's tag without its signature.

    Raises CacheError (a cache nothing vouches for, or not what the coverage covered),
    InputError (bad arguments), UnavailableError (the venv, the registry, the daemon)."""
    started = time.monotonic()
    registry.Registry(url, access=access)  # a bad address, bad credentials: said at once
    for tag in tags:
        registry.check_reference(tag)
    if (coverage_from is None) != (unit is None):
        raise InputError("--coverage-from and --unit go together: the daemon and its unit")
    if sign_passphrase is not None and sign_key is None:
        raise InputError("--sign-passphrase-file goes with --sign-key: the key it decrypts")
    signer = None  # a bad key is said before anything runs
    if sign_key is not None:
        signer = await asyncio.to_thread(signing.load_signing_key, sign_key, sign_passphrase)
    learned_doc = None if learned is None else await asyncio.to_thread(read_learned, learned)
    serving, locations, flashinfer, tools, identity, key = await _this_node(
        python, arch, workspace, env, caches
    )
    status = None if coverage_from is None else await read_status(coverage_from, timeout_s)
    work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="k26-push-"))
    try:
        layers, notes = await asyncio.to_thread(
            _make_layers, serving, flashinfer, tools, modules, locations, work, learned_modules
        )
        marker = None
        if status is not None and coverage_from is not None and unit is not None:
            stamps = [layer.newest for layer in layers if layer.newest is not None]
            newest = max(stamps, key=lambda s: s[1]) if stamps else None
            marker = coverage_marker(status, coverage_from, unit, newest)
        config = ArtifactConfig(
            arch=arch,
            key=key,
            identity=identity,
            created_at=utc_stamp(),
            caches=tuple(layer.record for layer in layers),
            coverage=marker,
            learned_shapes=learned_doc,
        )
        # A bundle without learned shapes is byte for byte what older nodes parse
        # (their config model forbids fields it does not know).
        unset = {"learned_shapes"} if learned_doc is None else set()
        config_bytes = config.model_dump_json(indent=1, exclude=unset).encode()
        config_digest = registry.sha256_digest(config_bytes)
        manifest = registry.Manifest(
            config=registry.Descriptor(
                mediaType=registry.CONFIG_MEDIA_TYPE, digest=config_digest, size=len(config_bytes)
            ),
            layers=tuple(
                registry.Descriptor(
                    mediaType=layer.record.media_type,
                    digest=layer.record.layer,
                    size=layer.record.size,
                    annotations={
                        registry.TITLE: f"{layer.record.cache}.tar.gz",
                        registry.CACHE_ANNOTATION: layer.record.cache,
                    },
                )
                for layer in layers
            ),
            annotations={registry.CREATED: config.created_at, "io.k26.arch": arch},
        )
        body = manifest.body()
        wanted = [default_tag(arch, key), *tags]
        uploaded = skipped = 0
        sent = 0
        async with registry.Registry(
            url, timeout_s=timeout_s, chunk_size=chunk_size, access=access
        ) as reg:
            for layer in layers:
                if await reg.push_blob(layer.path, layer.record.layer, layer.record.size):
                    uploaded += 1
                    sent += layer.record.size
                else:
                    skipped += 1
            if await reg.push_blob(config_bytes, config_digest, len(config_bytes)):
                sent += len(config_bytes)
            signed = None
            if signer is not None:
                signed = await signing.sign_manifest(reg, signer, registry.sha256_digest(body))
            digest = ""
            for tag in dict.fromkeys(wanted):
                digest = await reg.put_manifest(body, tag)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    return {
        "registry": url,
        "digest": digest,
        "reference": f"{url}@{digest}",
        "tags": list(dict.fromkeys(wanted)),
        "key": key,
        "caches": [
            {
                "cache": layer.record.cache,
                "layer": layer.record.layer,
                "size_bytes": layer.record.size,
                "files": layer.record.files,
                "bytes": layer.record.bytes,
                "path": layer.record.path,
                "relocatable": layer.record.relocatable,
            }
            for layer in layers
        ],
        "layers_uploaded": uploaded,
        "layers_already_there": skipped,
        "bytes_sent": sent,
        "coverage": None if marker is None else {"unit": marker.unit, "at": marker.at},
        "learned_shapes": _learned_count(learned_doc),
        "signature": signed,
        "notes": notes,
        "duration_s": round(time.monotonic() - started, 3),
    }


# --- pull -----------------------------------------------------------------------------


@dataclass
class Step:
    """One cache to install: its record, where, and (once fetched) its layer file."""

    record: CacheRecord
    target: Path
    layer: Path | None = None


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _fix(cache_name: str, field_name: str) -> str:
    if cache_name == "flashinfer":
        return bundle.fix_advice(field_name)
    return "build the bundle on a host with the nodes' serving venv, toolkit and GPU"


def plan_pull(
    config: ArtifactConfig,
    identity: Mapping[str, Any],
    flashinfer: Mapping[str, Any],
    serving: ServingEnv,
    locations: Mapping[str, Path],
    *,
    flashinfer_kept: str | None = None,
    cold: Callable[[Path], bool] = cache_layers.is_cold,
) -> Plan:
    """What to install where, or InputError naming every reason the bundle does not
    fit this node. ``flashinfer_kept``: why FlashInfer's cache here is not replaced
    (None: it is). Nothing is touched; ``cold`` reads the caches."""
    problems: list[str] = []
    plan = Plan()
    if config.arch != serving.arch:
        problems.append(f"arch: bundle {config.arch}, this node {serving.arch}")
    node_caches = identity.get("caches") or {}
    for record in config.caches:
        name = record.cache
        if name == "flashinfer":
            here: Mapping[str, Any] = flashinfer
            ignore: frozenset[str] = bundle.NOT_COMPARED
        else:
            here = node_caches.get(name) or {}
            ignore = frozenset()
        for leaf, old, new in differences(record.identity, here, ignore):
            problems.append(
                f"{name}.{leaf}: bundle {shown(old)}, this node {shown(new)}: {_fix(name, leaf)}"
            )
        if name == "flashinfer":
            if os.path.abspath(record.path) != str(serving.workspace):
                problems.append(
                    f"flashinfer.workspace: bundle {record.path}, this node {serving.workspace}: "
                    f"{record.pinned_because}; build the bundle in the workspace path the nodes use"
                )
            elif flashinfer_kept is not None:
                plan.notes.append(f"flashinfer: {flashinfer_kept}")
            else:
                plan.steps.append(Step(record, serving.workspace))
            continue
        target = locations.get(name)
        if target is None:
            variable = jit_caches.CACHE_ENV[jit_caches.JitCache(name)]
            plan.notes.append(
                f"{name}: this node's environment does not pin it ({variable}); not pulled"
            )
            continue
        if str(target) != os.path.abspath(record.path) and not record.relocatable:
            variable = jit_caches.CACHE_ENV[jit_caches.JitCache(name)]
            problems.append(
                f"{name}: bundle {record.path}, this node {target}: {record.pinned_because}; "
                f"set {variable}={record.path} in the units' environment, or build the "
                "bundle with the nodes' path"
            )
            continue
        if not cold(target):
            plan.notes.append(f"{name}: {target} holds kernels already; kept")
            continue
        plan.steps.append(Step(record, target))
    if problems:
        raise InputError("; ".join(problems))
    for absent in sorted(set(locations) - {r.cache for r in config.caches}):
        plan.notes.append(f"{absent}: the bundle carries none")
    return plan


def vouches_for_any(serving: ServingEnv, who: Identity) -> bool:
    """A fingerprint of this arch and this builder vouches for a JIT module whose file
    still matches it. Blocking I/O."""
    for found in cache.find_fingerprints(serving.workspace):
        if found.arch != serving.arch or dict(found.identity) != who.recorded():
            continue
        for name, entry in found.modules.items():
            if entry.get("source", "jit") != "jit":
                continue
            path = found.path.parent / "cached_ops" / name / f"{name}.so"
            library = cache.inspect_library(path, serving.target)
            if library.complete and (library.size, library.sha256) == (
                entry.get("size"),
                entry.get("sha256"),
            ):
                return True
    return False


def held_build_locks(workspace: Path) -> list[Path]:
    """FlashInfer build locks under ``workspace`` that a live process holds. Blocking I/O."""
    root = cache.cache_root(workspace)
    if not root.is_dir():
        return []
    held: list[Path] = []
    # <version>/<arch>/cached_ops from 0.4 on; <arch>/cached_ops before.
    for jit_dir in [*root.glob("*/cached_ops"), *root.glob("*/*/cached_ops")]:
        for path in locks.find_lock_files(jit_dir):
            if locks.inspect_lock(path).state == "held":
                held.append(path)
    return held


def _sweep_downloads(base_fd: int) -> None:
    """Download dirs of pulls that are gone, removed through ``base_fd`` following no
    symlink (a link planted there is unlinked, never its target)."""
    for leftover in sorted(os.listdir(base_fd)):
        pid = leftover.split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or pid_alive(int(pid))):
            continue
        remove_tree(base_fd, leftover)


def _download_dir(serving: ServingEnv, plan: Plan) -> Path:
    """A fresh dir for the layers, on the workspace's filesystem, with room. Blocking.

    ``k26-pull-work`` below the cache root is reached from the workspace with no
    symlink followed (one is refused, naming it), kept 0o700 by its owner (root takes
    over one the units' user made: nobody else may rename what root downloads into),
    swept by fd, and each pull's dir in it made fresh 0o700."""
    need = sum(step.record.size + step.record.bytes for step in plan.steps) + (16 << 20)
    root = cache.cache_root(serving.workspace)
    check_no_links(serving.workspace, root, "pull into")
    cache.check_workspace(serving.workspace, need)
    base = root / PULL_WORK
    name = f"{os.getpid()}-{time.monotonic_ns()}"
    try:
        root_fd = open_below(serving.workspace, root, "pull into")
        try:
            base_fd, _ = real_dir(root_fd, PULL_WORK, base, "pull into")
        finally:
            os.close(root_fd)
        try:
            owner = os.fstat(base_fd).st_uid
            if owner != os.geteuid() and os.geteuid() == 0:
                os.fchown(base_fd, 0, 0)
            if owner == os.geteuid() or os.geteuid() == 0:
                os.fchmod(base_fd, 0o700)
            _sweep_downloads(base_fd)
            os.close(private_dir(base_fd, name, base / name))
        finally:
            os.close(base_fd)
    except OSError as exc:
        raise CacheError(f"cannot make a download dir in {base}: {exc.strerror or exc}") from exc
    return base / name


def _remove_download(workspace: Path, work: Path) -> None:
    """Remove a pull's download dir, reached from the workspace with no symlink
    followed; a link on the way is left alone and said (the next pull sweeps it)."""
    try:
        fd = open_below(workspace, work.parent, "remove a download dir")
    except (CacheError, OSError) as exc:
        log.warning("k26: %s left behind: %s", work, exc)
        return
    try:
        remove_tree(fd, work.name)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _named_layer(record: CacheRecord, fetched: Path, where: str) -> Iterator[None]:
    """A layer refused while it is read whole is named by the artifact, the cache and
    its digest, not by the scratch file it was fetched to (gone once the pull ends)."""
    try:
        yield
    except InputError as exc:
        said = str(exc).replace(f"{fetched}: ", "").replace(str(fetched), "the layer")
        raise InputError(
            f"{where}: the {record.cache} layer ({record.layer}): {said}; nothing was "
            "installed: push the bundle again from the build host"
        ) from None


def install_plan(
    serving: ServingEnv,
    flashinfer: Mapping[str, Any],
    plan: Plan,
    *,
    where: str,
    limits: Limits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Check every fetched layer whole (hostile archives refused: ``limits``,
    ``archive.walk_files``), then install under the warm lock. Blocking I/O."""
    checked: bundle.Checked | None = None
    layers: list[tuple[Step, Path, cache_layers.CacheManifest]] = []
    for step in plan.steps:
        assert step.layer is not None, "install_plan takes fetched steps"
        record = step.record
        with _named_layer(record, step.layer, where):
            if record.cache == "flashinfer":
                checked = bundle.check_archive(serving, flashinfer, step.layer, limits)
            else:
                layer = cache_layers.check_layer(step.layer, limits)
        if record.cache == "flashinfer":
            assert checked is not None
            if dict(checked.manifest.identity) != record.identity:
                raise InputError(f"{where}: the flashinfer layer's builder is not its config's")
            continue
        if (layer.cache, layer.identity, layer.path, layer.relocatable) != (
            record.cache,
            record.identity,
            record.path,
            record.relocatable,
        ):
            raise InputError(f"{where}: the {record.cache} layer's manifest is not its config's")
        layers.append((step, step.layer, layer))
    if checked is not None:
        bundle.prepare_workspace(serving, checked)
    installed: list[cache_layers.Installed] = []
    result: dict[str, Any] = {"caches": []}
    with warm_lock(serving.workspace):
        try:
            for step, archive, layer in layers:
                installed.append(
                    cache_layers.install(archive, layer, step.target, serving.workspace)
                )
            if checked is not None:
                done = bundle.install_locked(serving, flashinfer, checked)
                result["caches"].append(
                    {
                        "cache": "flashinfer",
                        "path": done["cache_dir"],
                        "files": done["files"],
                        "modules": done["modules"],
                        "replaced": done["replaced"],
                    }
                )
        except BaseException:
            for done_cache in reversed(installed):
                with contextlib.suppress(OSError):
                    done_cache.rollback()
            raise
        for done_cache in installed:
            kept = done_cache.commit()
            result["caches"].append(
                {
                    "cache": done_cache.cache,
                    "path": str(done_cache.target),
                    "files": done_cache.files,
                    "moved": done_cache.moved,
                    "kept_from_cold_dir": kept,
                }
            )
    return result


async def pull(
    python: Path,
    arch: str,
    workspace: Path,
    url: str,
    *,
    env: Mapping[str, str] | None = None,
    reference: str | None = None,
    caches: Mapping[str, Path] | None = None,
    flashinfer: Literal["install", "if-cold"] = "install",
    modules: Sequence[str] = ("sampling",),
    learned: Sequence[str] = (),
    timeout_s: float = 30.0,
    access: registry.Access | None = None,
    say: Callable[[str], None] = lambda _line: None,
    keys: Sequence[Path] = (),
    accepted_record: Path | None,
    limits: Limits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Find this node's bundle (or ``reference``), check it, install it.

    ``limits``: what each layer may hold (``[flashinfer]`` ``bundle_max_*``).

    ``keys``: public keys (PEM files); the manifest must carry a cosign signature by
    one of them, checked before anything past the manifest is read (``signing``).
    None: the bundle is installed unverified, with a warning.

    ``accepted_record``: the record of what this node accepted from each signed tag
    (``accepted.record_path`` of the daemon's state directory, never the units'
    workspace), which a verified pull by tag checks and updates. Every caller names
    it (the daemon and the CLI always give one); None is only for a caller that
    gives no ``keys``, and with keys it is a ValueError before the registry is asked.

    ``flashinfer="if-cold"`` (the daemon): FlashInfer's cache is left alone when it
    is warm and valid for ``modules`` and ``learned`` (warm's own fast path).
    Raises NotInRegistry (no bundle for this node), InputError (refused: nothing
    changed), UnavailableError (the registry, the venv), CacheError (the disk)."""
    started = time.monotonic()
    registry.Registry(url, access=access)  # a bad address, bad credentials: said at once
    if reference is not None:
        registry.check_reference(reference)
    if keys and accepted_record is None:  # a caller's bug: never a pull unprotected
        raise ValueError("pull: keys given without accepted_record: a rollback goes unseen")
    trusted = await asyncio.to_thread(signing.load_public_keys, list(keys))
    serving, locations, host, _, identity, key = await _this_node(
        python, arch, workspace, env, caches
    )
    ref = registry.check_reference(reference or default_tag(arch, key))
    phases = {"identity": time.monotonic() - started}
    kept: str | None = None
    if flashinfer == "if-cold":
        who = Identity.model_validate(host)
        found = await asyncio.to_thread(fast_check, serving, modules, who, learned)
        # Warm, or holding modules its fingerprint vouches for (warm builds the rest
        # beside them): either way not replaced, so nothing built here is lost. Nor
        # while a process builds in it (a unit started alongside its warm-up, whose
        # FlashInfer JIT got there first): its cache is not swapped from under it.
        if found is not None or await asyncio.to_thread(vouches_for_any, serving, who):
            kept = "its fingerprint vouches for what it holds; kept"
        elif held := await asyncio.to_thread(held_build_locks, serving.workspace):
            kept = f"a process is building in it ({held[0]}); kept, not swapped from under it"
        cold = await asyncio.to_thread(
            lambda: [name for name, path in locations.items() if cache_layers.is_cold(path)]
        )
        if kept is not None and not cold:  # nothing to pull: the registry is not even asked
            return {
                "registry": url,
                "reference": ref,
                "digest": None,
                "installed": [],
                "notes": ["every cache is warm here; the registry was not asked"],
                "bytes_fetched": 0,
                "coverage": None,
                "learned_shapes": None,
                "verified_by": None,
                "created_at": None,
                "duration_s": round(time.monotonic() - started, 3),
                "phases_s": {k: round(v, 3) for k, v in phases.items()},
            }
    work: Path | None = None
    try:
        async with registry.Registry(url, timeout_s=timeout_s, access=access) as reg:
            try:
                raw, digest = await reg.get_manifest(ref)
            except registry.NotInRegistry:
                if reference is not None:
                    raise registry.NotInRegistry(
                        f"registry {url}: manifest {ref}: not found (check the digest or "
                        "tag: `bundle push` prints both)"
                    ) from None
                raise registry.NotInRegistry(
                    f"registry {url} holds no bundle for this node (tag {ref}, its identity's "
                    "key): push one from a build host with this serving venv, or warm here"
                ) from None
            where = f"{url}@{digest}"
            verified_by = None
            if trusted:  # before anything else is read, let alone written
                signer = await signing.verify_manifest(reg, digest, trusted, where)
                verified_by = str(signer.path)
            manifest = registry.parse_manifest(raw, where)
            try:
                config_bytes = await reg.fetch_bytes(manifest.config.digest, manifest.config.size)
            except registry.NotInRegistry as exc:
                raise InputError(
                    f"{where}: names a config the registry does not hold: {exc}"
                ) from None
            config = parse_config(config_bytes, where)
            config, learned_note = usable_learned(config, where)
            check_layers(manifest, config, where)
            plan = await asyncio.to_thread(
                plan_pull, config, identity, host, serving, locations, flashinfer_kept=kept
            )
            if learned_note is not None:
                plan.notes.append(learned_note)
            if verified_by is not None and not registry.DIGEST_RE.fullmatch(ref):
                # A signed tag may not go back in time (fleet/accepted.py); by digest,
                # the operator names the very bundle. After the plan: a bundle this
                # node would refuse anyway (another identity) is not remembered.
                assert accepted_record is not None  # checked above: keys were given
                await asyncio.to_thread(
                    accepted.admit,
                    accepted_record,
                    accepted.tag_key(url, ref),
                    digest,
                    config.created_at,
                    verified_by,
                    where,
                )
            mark = time.monotonic()
            phases["manifest"] = mark - started - phases["identity"]
            if not plan.steps:
                _unverified(url, digest, verified_by)
                return _pulled(
                    url, digest, ref, config, plan, {"caches": []}, 0, started, phases, verified_by
                )
            work = await asyncio.to_thread(_download_dir, serving, plan)
            fetched = 0
            for step in plan.steps:
                say(f"k26: pulling {step.record.cache} ({step.record.size} bytes) from {url}")
                step.layer = work / f"{step.record.cache}.layer"
                try:
                    await reg.fetch_blob(step.record.layer, step.record.size, step.layer)
                except registry.NotInRegistry as exc:
                    raise InputError(
                        f"{where}: names a layer the registry does not hold: {exc}"
                    ) from None
                fetched += step.record.size
        phases["fetch"] = time.monotonic() - mark
        mark = time.monotonic()
        result = await asyncio.to_thread(
            install_plan, serving, host, plan, where=where, limits=limits
        )
        phases["install"] = time.monotonic() - mark
    finally:
        if work is not None:
            await asyncio.to_thread(_remove_download, serving.workspace, work)
    _unverified(url, digest, verified_by)
    return _pulled(url, digest, ref, config, plan, result, fetched, started, phases, verified_by)


def _unverified(url: str, digest: str, verified_by: str | None) -> None:
    """The one warning of a pull that verified no signature (no keys configured)."""
    if verified_by is None:
        log.warning(
            "registry %s: %s pulled without verifying a signature: no public key is "
            "configured (flashinfer.registry_keys, --verify-key); anyone who can push "
            "there chooses the native code this node loads",
            url,
            digest,
        )


def _learned_count(document: Mapping[str, Any] | None) -> dict[str, int]:
    """Per unit, how many learned shapes a document carries."""
    if document is None:
        return {}
    return {unit: len(records) for unit, records in document["units"].items()}


def _pulled(
    url: str,
    digest: str,
    reference: str,
    config: ArtifactConfig,
    plan: Plan,
    result: Mapping[str, Any],
    fetched: int,
    started: float,
    phases: Mapping[str, float],
    verified_by: str | None = None,
) -> dict[str, Any]:
    """The pull's account: what went where, what was kept and why, and where the time
    went (identity: asking the serving venv; manifest: the manifest, config and plan;
    fetch: the layers; install: checking them whole and swapping them in)."""
    coverage = config.coverage
    return {
        "registry": url,
        "reference": reference,
        "digest": digest,
        "installed": list(result.get("caches", [])),
        "notes": plan.notes,
        "bytes_fetched": fetched,
        "coverage": None
        if coverage is None
        else {"unit": coverage.unit, "at": coverage.at, "shapes": len(coverage.shapes)},
        "learned_shapes": config.learned_shapes,
        "verified_by": verified_by,
        # When the build host made it: a node shows its age (a tag the registry froze).
        "created_at": config.created_at,
        "duration_s": round(time.monotonic() - started, 3),
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
    }
