"""FlashInfer's arch gate, doctor and the SM120 patch against real releases.

Serving venvs come from scripts/serving-venv.sh (cached under .cache/ locally,
built from scratch in CI). A venv that cannot be made fails the test: the
claims here are about real FlashInfer, so there is nothing to skip to.

    serving-0.7  flashinfer-python 0.7.4 + torch 2.13.0: the gate accepts 12.0
    serving-0.2  flashinfer-python 0.2.14.post1 + torch 2.6.0: the gate rejects
                 12.0 ("Unknown CUDA arch (12.0)"), patch builds PTX forward
    serving-0.7.0-cu128
                 flashinfer-python 0.7.0 + torch 2.8.0 (CUDA 12.8), no toolkit: the
                 gate rejects 12.0 ("SM 12.x requires CUDA >= 12.9"), patch makes
                 it native sm_120a as FlashInfer PR #3633 did
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from supervisor.core.errors import InputError
from supervisor.flashinfer import doctor, patch, recipes, revert, warm

pytestmark = pytest.mark.flashinfer
ROOT = Path(__file__).resolve().parents[2]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def package_files(python: Path) -> dict[str, Path]:
    package = python.parent.parent / "lib" / "python3.11" / "site-packages" / "flashinfer"
    return {rel: package / rel for rel in recipes_files()}


def recipes_files() -> tuple[str, ...]:
    return ("jit/core.py", "jit/env.py", "jit/cpp_ext.py", "compilation_context.py")


def hashes(python: Path) -> dict[str, str]:
    return {rel: sha(path) for rel, path in package_files(python).items() if path.exists()}


def own_flashinfer(
    serving: tuple[Path, dict[str, str]], where: Path
) -> tuple[Path, dict[str, str]]:
    """The shared serving venv, but for a private copy of its FlashInfer package: a
    venv at ``where`` whose site-packages holds the copy and then defers to the shared
    one (its .pth files included). A test patches that copy in place, while other
    workers read the shared venv, and a killed test leaves the shared cache as it was."""
    python, env = serving
    shared = python.parent.parent / "lib" / "python3.11" / "site-packages"
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(where)], check=True)
    site = where / "lib" / "python3.11" / "site-packages"
    for entry in shared.iterdir():
        if entry.name == "flashinfer" or (
            entry.name.startswith("flashinfer_python-") and entry.name.endswith(".dist-info")
        ):
            shutil.copytree(entry, site / entry.name, symlinks=True)
    (site / "zz-k26-shared-serving.pth").write_text(
        f"import site; site.addsitedir({str(shared)!r})\n"
    )
    own = where / "bin" / "python"
    workspace = {"FLASHINFER_WORKSPACE_BASE": str(where / "import-workspace")}  # its JIT log
    found = subprocess.run(
        [str(own), "-c", "import flashinfer; print(flashinfer.__file__)"],
        capture_output=True, text=True, env={**os.environ, **env, **workspace}, check=False,
    )  # fmt: skip
    assert found.stdout.strip() == str(site / "flashinfer" / "__init__.py"), found
    return own, env


def test_07_gate_accepts_and_patch_changes_nothing(
    serving_07: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = serving_07
    report = asyncio.run(doctor(python, "12.0", tmp_path, env=env))
    assert report.gate.verdict == "accepts", report.gate
    assert report.arch_tag == "120f"
    assert report.gate.arch_flags == ("-gencode=arch=compute_120f,code=sm_120f",)
    assert report.versions["flashinfer"] == "0.7.4"
    assert report.versions["cuda"] == "13.0"
    assert report.cache_dir == str(tmp_path / ".cache/flashinfer/0.7.4/120f/cached_ops")
    assert report.status == "needs-warmup" and report.exit_code == 2
    # Without the arch list a GPU-less host detects nothing: a setting, not a patch.
    assert report.gate_without_arch_list is not None
    assert report.gate_without_arch_list.verdict == "rejects"
    assert any("a setting, not a patch" in h for h in report.hints)

    before = hashes(python)
    result = asyncio.run(patch(python, "12.0", tmp_path, env=env))
    assert not result.changed and result.strategy == "none"
    assert "already accepts" in result.message
    assert hashes(python) == before


def test_02_gate_rejects_patch_ptx_forward_and_revert(
    serving_02: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = own_flashinfer(serving_02, tmp_path / "venv")
    original = hashes(python)
    report = asyncio.run(doctor(python, "12.0", tmp_path, env=env))
    assert report.versions["flashinfer"] == "0.2.14.post1"
    assert report.versions["torch"] == "2.6.0"
    assert report.versions["torch_cuda"] == "12.4"
    assert report.gate.verdict == "rejects"
    assert "Unknown CUDA arch (12.0) or GPU not supported" in str(report.gate.error)
    assert report.status == "needs-warmup"
    try:
        dry = asyncio.run(patch(python, "12.0", tmp_path, dry_run=True, env=env))
        assert dry.dry_run and not dry.changed and dry.strategy == "ptx-forward"
        assert 'return ["-gencode=arch=compute_100,code=compute_100"]' in dry.diff
        assert hashes(python) == original

        done = asyncio.run(patch(python, "12.0", tmp_path, env=env))
        assert done.changed and done.strategy == "ptx-forward"
        assert done.gate_after is not None and done.gate_after.verdict == "accepts"
        assert done.gate_after.arch_flags == ("-gencode=arch=compute_100,code=compute_100",)
        assert done.manifest is not None and Path(done.manifest).exists()

        again = asyncio.run(patch(python, "12.0", tmp_path, env=env))
        assert not again.changed and "already patched" in again.message

        patched = asyncio.run(doctor(python, "12.0", tmp_path, env=env))
        assert patched.gate.verdict == "accepts" and patched.arch_tag == "100"

        back = asyncio.run(revert(python, "12.0", tmp_path, env=env))
        assert back.changed
        assert hashes(python) == original, "revert must restore the exact bytes"
        assert back.gate_after is not None and back.gate_after.verdict == "rejects"
        none = asyncio.run(revert(python, "12.0", tmp_path, env=env))
        assert not none.changed and "nothing to revert" in none.message
    finally:
        asyncio.run(revert(python, "12.0", tmp_path, env=env))


def test_070_cu128_gate_rejects_patch_native_and_revert(
    serving_070_cu128: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = own_flashinfer(serving_070_cu128, tmp_path / "venv")
    original = hashes(python)
    report = asyncio.run(doctor(python, "12.0", tmp_path, env=env))
    assert report.versions["flashinfer"] == "0.7.0"
    assert report.versions["torch_cuda"] == "12.8"
    assert report.gate.verdict == "rejects"
    assert "SM 12.x requires CUDA >= 12.9" in str(report.gate.error)
    try:
        done = asyncio.run(patch(python, "12.0", tmp_path, env=env))
        assert done.changed and done.strategy == "native"
        assert done.files == ("compilation_context.py",)
        assert done.gate_after is not None and done.gate_after.verdict == "accepts"
        assert done.gate_after.arch_flags == ("-gencode=arch=compute_120a,code=sm_120a",)
        patched = asyncio.run(doctor(python, "12.0", tmp_path, env=env))
        assert patched.arch_tag == "120a"
        assert patched.versions["cuda"] == "12.8"
        assert patched.cache_dir == str(tmp_path / ".cache/flashinfer/0.7.0/120a/cached_ops")
        back = asyncio.run(revert(python, "12.0", tmp_path, env=env))
        assert back.changed and hashes(python) == original
        assert back.gate_after is not None and back.gate_after.verdict == "rejects"
    finally:
        asyncio.run(revert(python, "12.0", tmp_path, env=env))


def test_02_patch_refuses_unexpected_files(
    serving_02: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = own_flashinfer(serving_02, tmp_path / "venv")
    env_py = package_files(python)["jit/env.py"]
    pristine = env_py.read_bytes()
    edited = pristine.replace(
        b"from torch.utils.cpp_extension import _get_cuda_arch_flags\n",
        b"from torch.utils.cpp_extension import _get_cuda_arch_flags  # site edit\n",
    )
    assert edited != pristine
    try:
        env_py.write_bytes(edited)
        before = hashes(python)
        with pytest.raises(InputError, match="not what the patch expects"):
            asyncio.run(patch(python, "12.0", tmp_path, env=env))
        assert hashes(python) == before
    finally:
        env_py.write_bytes(pristine)
    # A file edited after the patch: revert refuses rather than clobber it.
    try:
        asyncio.run(patch(python, "12.0", tmp_path, env=env))
        patched = env_py.read_bytes()
        env_py.write_bytes(patched + b"# edited after the patch\n")
        with pytest.raises(InputError, match="changed since the patch"):
            asyncio.run(revert(python, "12.0", tmp_path, env=env))
        env_py.write_bytes(patched)
    finally:
        asyncio.run(revert(python, "12.0", tmp_path, env=env))
    assert env_py.read_bytes() == pristine


RELEASE_CHECK = """
import importlib.util, sys, types
# FlashInfer's real _normalize_cuda_arch, with only the CUDA version seam set to 12.8.
stub = types.ModuleType("flashinfer.jit.cpp_ext")
stub.is_cuda_version_at_least = lambda v: tuple(map(int, v.split("."))) <= (12, 8)
for name in ("flashinfer", "flashinfer.jit"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["flashinfer.jit.cpp_ext"] = stub
spec = importlib.util.spec_from_file_location("cc", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
try:
    print(module.CompilationContext._normalize_cuda_arch(12, 0))
except RuntimeError as error:
    print("rejects:", error)
"""


@pytest.mark.parametrize("version", ["0.6.18.post1", "0.7.0"])
def test_cuda128_recipe_on_real_release_text(
    version: str, serving_07: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """Releases before PR #3633 reject 12.0 on CUDA 12.8; the recipe makes it sm_120a."""
    python, _ = serving_07
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(tmp_path),
         f"flashinfer-python=={version}"],
        check=True,
    )  # fmt: skip
    wheel = next(tmp_path.glob("flashinfer_python-*.whl"))
    text = zipfile.ZipFile(wheel).read("flashinfer/compilation_context.py").decode()
    original = tmp_path / "original.py"
    original.write_text(text)
    run = [str(python), "-c", RELEASE_CHECK]
    before = subprocess.run([*run, str(original)], capture_output=True, text=True, check=True)
    assert before.stdout.strip() == "rejects: SM 12.x requires CUDA >= 12.9"
    recipe = recipes.select(
        {"compilation_context.py": text},
        target="12.0",
        gate_error="RuntimeError: SM 12.x requires CUDA >= 12.9",
    )
    assert recipe.strategy == "native"
    patched = tmp_path / "patched.py"
    patched.write_text(recipes.apply(recipe, {"compilation_context.py": text})[recipe.files[0]])
    after = subprocess.run([*run, str(patched)], capture_output=True, text=True, check=True)
    assert after.stdout.strip() == "(12, '0a')"


def test_cuda128_recipe_refuses_074(serving_07: tuple[Path, dict[str, str]]) -> None:
    """0.7.4 already has PR #3633: its text is not what the recipe expects."""
    python, _ = serving_07
    text = package_files(python)["compilation_context.py"].read_text()
    with pytest.raises(recipes.RecipeMismatch):
        recipes.select(
            {"compilation_context.py": text},
            target="12.0",
            gate_error="RuntimeError: SM 12.x requires CUDA >= 12.9",
        )


def test_full_workspace_is_a_clear_error(
    serving_07: tuple[Path, dict[str, str]], tiny_mount: Path
) -> None:
    python, env = serving_07
    result = asyncio.run(warm(python, "12.0", tiny_mount, env=env))
    assert not result.ok and result.exit_code == 74
    assert result.error is not None and "is full" in result.error
    assert not list(tiny_mount.rglob("*.so")) and not list(tiny_mount.rglob("*.lock"))


def test_read_only_workspace_is_a_clear_error(
    serving_07: tuple[Path, dict[str, str]], tiny_mount: Path
) -> None:
    python, env = serving_07
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_mount)], check=True)
    result = asyncio.run(warm(python, "12.0", tiny_mount, env=env))
    assert not result.ok and result.exit_code == 74
    assert result.error is not None and "not writable (Read-only file system)" in result.error
    report = asyncio.run(doctor(python, "12.0", tiny_mount, env=env))
    assert report.status == "unknown"
    assert "Read-only file system" in str(report.gate.error)


def _venv_without(base_python: Path, tmp_path: Path, hidden: str) -> Path:
    """A venv seeing every package of ``base_python``'s venv except ``hidden``: the
    shape of a serving venv that lost a dependency (the GPU host's first run: no
    ``filelock``, which flashinfer.jit.core imports)."""
    site = next((base_python.parent.parent / "lib").glob("python3.*/site-packages"))
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(hidden):
            (shadow / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    own_site = next((venv / "lib").glob("python3.*/site-packages"))
    (own_site / "k26-shadow.pth").write_text(f"{shadow}\n")
    return venv / "bin" / "python"


def test_a_venv_that_cannot_import_the_gate_is_not_an_arch_rejection(
    serving_07: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """An import error is a broken venv: doctor must not call it a rejection, and
    warm must not advise patching FlashInfer's arch check."""
    base, env = serving_07
    python = _venv_without(base, tmp_path, "filelock")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    report = asyncio.run(doctor(python, "12.0", workspace, env=env))
    assert report.gate.verdict == "unknown", report.gate
    assert "No module named 'filelock'" in (report.gate.error or "")
    assert "cannot import FlashInfer's JIT" in (report.gate.error or "")
    result = asyncio.run(warm(python, "12.0", workspace, ("sampling",), env=env))
    assert not result.ok
    assert re.search(
        r"could not be run for 12\.0: .*filelock.*fix the serving venv", result.error or ""
    )
    assert "patch" not in (result.error or "")
