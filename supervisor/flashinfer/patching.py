"""patch and revert: the SM120 gate edit, with a byte-exact backup and a manifest.

The backup and the manifest live in the serving venv, beside its packages::

    <venv>/k26-flashinfer-patch/manifest.json
    <venv>/k26-flashinfer-patch/backup/<path inside the flashinfer package>

The manifest lists, per file, the sha256 before and after, the recipe and its
strategy, and the FlashInfer version. Backups and the manifest are written
before any file changes, and each file is replaced atomically, so a crash
leaves every file either original or patched and ``revert`` can always
restore the original bytes. After editing, ``patch`` re-runs FlashInfer's
gate; if it still rejects, the original bytes are put back.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hashlib
import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.atomic_write import write_atomic
from supervisor.core.errors import CacheError, InputError, UnavailableError
from supervisor.flashinfer import recipes
from supervisor.flashinfer.doctor import run_probe
from supervisor.flashinfer.models import Gate, PatchResult
from supervisor.flashinfer.protocol import Identity, Probe, TorchArches
from supervisor.flashinfer.venv import ServingEnv, answer, identity

PATCH_DIR = "k26-flashinfer-patch"
MANIFEST = "manifest.json"
GATE_FILES = ("jit/core.py", "jit/env.py", "jit/cpp_ext.py", "compilation_context.py")
# Compute capabilities to ask torch about, oldest first (torch-arches keeps order).
TORCH_CANDIDATES = (
    "7.0", "7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "10.3", "11.0", "12.0", "12.1",
)  # fmt: skip


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _diff(relpath: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"a/flashinfer/{relpath}",
            f"b/flashinfer/{relpath}",
        )
    )


def _replace_bytes(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` keeping its mode; drop its stale bytecode."""
    write_atomic(path, data, mode=path.stat().st_mode & 0o7777)
    # A .pyc keyed on (mtime, size) could survive a same-size edit in one second.
    for stale in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        with contextlib.suppress(OSError):
            stale.unlink()


class _Venv:
    """The flashinfer package and the patch directory of one serving venv."""

    def __init__(self, identity: Identity) -> None:
        if identity.flashinfer is None or not identity.flashinfer_dir:
            raise UnavailableError(f"flashinfer is not installed for {identity.python}")
        self.version = identity.flashinfer.version
        self.package = Path(identity.flashinfer_dir)
        self.patch_dir = Path(identity.prefix) / PATCH_DIR
        self.manifest_path = self.patch_dir / MANIFEST

    def read(self, relpath: str) -> bytes:
        return (self.package / relpath).read_bytes()

    def texts(self) -> dict[str, str]:
        out = {}
        for relpath in GATE_FILES:
            with contextlib.suppress(FileNotFoundError):
                out[relpath] = self.read(relpath).decode("utf-8")
        return out

    def manifest(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise CacheError(f"patch manifest {self.manifest_path} is unreadable: {exc}") from exc
        if not isinstance(data, dict):
            raise CacheError(f"patch manifest {self.manifest_path} is not an object")
        return data

    def state(self, manifest: Mapping[str, Any]) -> str:
        """'patched', 'original', 'partial' (a crash mid-patch: each file one or
        the other) or 'changed' (some file is neither: someone else edited it)."""
        states = set()
        for entry in manifest["files"]:
            try:
                current = _sha(self.read(entry["path"]))
            except FileNotFoundError:
                return "changed"
            if current == entry["sha256_after"]:
                states.add("patched")
            elif current == entry["sha256_before"]:
                states.add("original")
            else:
                return "changed"
        return states.pop() if len(states) == 1 else "partial"


async def _gate(serving: ServingEnv) -> tuple[Gate, Probe]:
    probe = await run_probe(serving, (), load=False)
    return Gate.from_answer(probe.gate), probe


async def _torch_known(serving: ServingEnv) -> tuple[str, ...]:
    args = ["torch-arches"]
    for candidate in TORCH_CANDIDATES:
        args += ["--candidate", candidate]
    reply = await answer(serving, TorchArches, args, timeout_s=300)
    return tuple(reply.known)


def _restore(venv: _Venv, manifest: Mapping[str, Any]) -> None:
    for entry in manifest["files"]:
        original = (venv.patch_dir / "backup" / entry["path"]).read_bytes()
        if _sha(original) != entry["sha256_before"]:
            raise CacheError(f"backup of {entry['path']} does not match its manifest sha256")
        target = venv.package / entry["path"]
        if _sha(target.read_bytes()) != entry["sha256_before"]:
            _replace_bytes(target, original)


def _apply(venv: _Venv, recipe: recipes.Recipe, new_texts: Mapping[str, str]) -> dict[str, Any]:
    files = []
    backup = venv.patch_dir / "backup"
    for relpath in recipe.files:
        before = venv.read(relpath)
        after = new_texts[relpath].encode("utf-8")
        saved = backup / relpath
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_bytes(before)
        files.append({"path": relpath, "sha256_before": _sha(before), "sha256_after": _sha(after)})
    manifest = {
        "recipe": recipe.name,
        "strategy": recipe.strategy,
        "summary": recipe.summary,
        "flashinfer_version": venv.version,
        "package": str(venv.package),
        "patched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    venv.manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    for relpath in recipe.files:
        _replace_bytes(venv.package / relpath, new_texts[relpath].encode("utf-8"))
    return manifest


def _forget(venv: _Venv) -> None:
    shutil.rmtree(venv.patch_dir, ignore_errors=True)


async def patch(
    python: Path,
    arch: str,
    workspace: Path,
    *,
    dry_run: bool = False,
    env: Mapping[str, str] | None = None,
) -> PatchResult:
    """Make the serving venv's FlashInfer accept ``arch``, or say why not.

    Raises InputError (exit 65) when the files are not what a recipe expects,
    CacheError when the edit did not make the gate accept (the original bytes
    are restored first), UnavailableError when the venv cannot answer.
    """
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    before, probe = await _gate(serving)
    venv = _Venv(probe.identity)
    manifest = venv.manifest()
    if manifest is not None and manifest.get("flashinfer_version") != venv.version:
        manifest = None  # left by an earlier install; its backups are of other bytes
    state = venv.state(manifest) if manifest is not None else "original"
    if before.verdict == "accepts":
        if manifest is not None and state == "patched":
            message = (
                f"already patched ({manifest['recipe']}); the gate accepts {arch}; nothing changed"
            )
            strategy = manifest["strategy"]
        else:
            message = f"the gate already accepts {arch}; nothing to change"
            strategy = "none"
        return PatchResult(
            False, strategy, message, venv.version, gate_before=before, gate_after=before
        )
    if before.verdict != "rejects":
        raise UnavailableError(f"FlashInfer's gate could not be run: {before.error}")
    if manifest is not None and state == "partial":
        await asyncio.to_thread(_restore, venv, manifest)  # finish an interrupted patch's undo
    if manifest is not None and state == "patched":
        raise CacheError(
            f"already patched ({manifest['recipe']}) but the gate still rejects {arch}: "
            f"{before.error}"
        )
    texts = venv.texts()
    torch_known: tuple[str, ...] = ()
    if "Unknown CUDA arch" in (before.error or ""):
        torch_known = await _torch_known(serving)
    try:
        recipe = recipes.select(
            texts, target=arch, gate_error=before.error or "", torch_known=torch_known
        )
        new_texts = recipes.apply(recipe, texts)
    except recipes.RecipeMismatch as exc:
        raise InputError(
            f"refusing to patch FlashInfer {venv.version} at {venv.package}: "
            f"its files are not what the patch expects ({exc}); nothing was changed"
        ) from exc
    diff = "".join(_diff(p, texts[p], new_texts[p]) for p in recipe.files)
    if dry_run:
        return PatchResult(
            False,
            recipe.strategy,
            f"would apply {recipe.name}: {recipe.summary}",
            venv.version,
            recipe.files,
            diff,
            dry_run=True,
            gate_before=before,
        )
    _forget(venv)
    try:
        applied = await asyncio.to_thread(_apply, venv, recipe, new_texts)
    except OSError as exc:
        raise CacheError(f"cannot write into {venv.package}: {exc.strerror or exc}") from exc
    after, _ = await _gate(serving)
    if after.verdict != "accepts":
        await asyncio.to_thread(_restore, venv, applied)
        _forget(venv)
        raise CacheError(
            f"{recipe.name} did not make the gate accept {arch} ({after.error}); "
            "the original bytes are restored"
        )
    return PatchResult(
        True,
        recipe.strategy,
        f"applied {recipe.name}: {recipe.summary}; the gate now accepts {arch} "
        f"with {' '.join(after.arch_flags)}",
        venv.version,
        recipe.files,
        diff,
        gate_before=before,
        gate_after=after,
        manifest=str(venv.manifest_path),
    )


async def revert(
    python: Path,
    arch: str,
    workspace: Path,
    *,
    dry_run: bool = False,
    env: Mapping[str, str] | None = None,
) -> PatchResult:
    """Restore the exact bytes the patch replaced. Refuses if a file changed since."""
    serving = ServingEnv(Path(python), arch, Path(workspace), dict(env or {}))
    venv = _Venv(await identity(serving, timeout_s=120))
    manifest = venv.manifest()
    if manifest is None:
        return PatchResult(False, "none", "not patched; nothing to revert", venv.version)
    if manifest.get("flashinfer_version") != venv.version:
        raise InputError(
            f"the patch manifest is for FlashInfer {manifest.get('flashinfer_version')}, "
            f"the venv has {venv.version} (reinstalled?); nothing was changed"
        )
    state = venv.state(manifest)
    paths = tuple(entry["path"] for entry in manifest["files"])
    if state == "changed":
        raise InputError(
            f"refusing to revert: {', '.join(paths)} changed since the patch "
            "(sha256 is neither the patched nor the original); nothing was changed"
        )
    diff = ""
    for relpath in paths:
        original = (venv.patch_dir / "backup" / relpath).read_text()
        diff += _diff(relpath, venv.read(relpath).decode("utf-8"), original)
    if dry_run:
        return PatchResult(
            False,
            manifest["strategy"],
            f"would restore the original bytes of {', '.join(paths)}",
            venv.version,
            paths,
            diff,
            dry_run=True,
        )
    await asyncio.to_thread(_restore, venv, manifest)
    _forget(venv)
    after, _ = await _gate(serving)
    return PatchResult(
        state != "original",
        manifest["strategy"],
        f"restored the original bytes of {', '.join(paths)}; the gate now {after.verdict} {arch}",
        venv.version,
        paths,
        diff,
        gate_after=after,
    )
