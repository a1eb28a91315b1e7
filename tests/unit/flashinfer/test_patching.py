"""Backup, manifest and byte-exact restore, on a package laid out in a temp dir.

Against real FlashInfer releases: tests/integration/test_flashinfer_gate.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from supervisor.flashinfer import recipes
from supervisor.flashinfer.patching import _apply, _restore, _Venv
from supervisor.flashinfer.protocol import Identity
from supervisor.flashinfer.warm import _build_error

from .conftest import IDENTITY

CONTEXT = b"""\
class CompilationContext:
    def _normalize_cuda_arch(major, minor):
        if major == 12:
            if is_cuda_version_at_least("12.9"):
                return (major, "0f")
            else:
                raise RuntimeError("SM 12.x requires CUDA >= 12.9")
\r\n# odd bytes survive: \xc3\xa9\n"""


def venv(tmp_path: Path) -> _Venv:
    package = tmp_path / "site-packages" / "flashinfer"
    package.mkdir(parents=True)
    (package / "compilation_context.py").write_bytes(CONTEXT)
    (package / "compilation_context.py").chmod(0o640)
    flashinfer = {**IDENTITY["flashinfer"], "version": "0.7.0"}
    raw = {**IDENTITY, "flashinfer": flashinfer, "flashinfer_dir": str(package)}
    return _Venv(Identity.model_validate({**raw, "prefix": str(tmp_path)}))


def test_apply_then_restore_is_byte_exact(tmp_path: Path) -> None:
    v = venv(tmp_path)
    target = v.package / "compilation_context.py"
    recipe = recipes.cuda128_recipe()
    texts = v.texts()
    manifest = _apply(v, recipe, recipes.apply(recipe, texts))
    entry = manifest["files"][0]
    assert entry["sha256_before"] == hashlib.sha256(CONTEXT).hexdigest()
    assert entry["sha256_after"] == hashlib.sha256(target.read_bytes()).hexdigest()
    assert manifest["flashinfer_version"] == "0.7.0" and manifest["strategy"] == "native"
    assert v.state(manifest) == "patched"
    assert target.stat().st_mode & 0o777 == 0o640
    _restore(v, manifest)
    assert target.read_bytes() == CONTEXT
    assert v.state(manifest) == "original"


def test_someone_elses_edit_is_detected(tmp_path: Path) -> None:
    v = venv(tmp_path)
    recipe = recipes.cuda128_recipe()
    manifest = _apply(v, recipe, recipes.apply(recipe, v.texts()))
    target = v.package / "compilation_context.py"
    target.write_bytes(target.read_bytes() + b"# local\n")
    assert v.state(manifest) == "changed"


def test_build_error_names_a_full_disk() -> None:
    tail = "nvcc fatal   : Could not write to output file: No space left on device"
    assert "filled up" in _build_error(tail, 1)
    assert _build_error("ninja: build stopped\nerror: x", 1).startswith("the build failed (exit 1)")
    assert "4 KiB free" in _build_error("as: BFD assertion fail", 1, free_bytes=4096)
