"""A flashinfer-jit-cache provider wheel, built here, installed by pip into a real venv.

The registry this project can reach has no ``flashinfer-jit-cache`` (NVIDIA
publishes it on flashinfer.ai's own index, which is out of reach), so the
tests make the pair FlashInfer 0.7's loader looks for, to the interface its
``jit/env.py`` uses:

- a shim distribution ``flashinfer-jit-cache`` whose module has
  ``__version__`` and ``get_jit_cache_providers()``, the providers being found
  through the ``flashinfer.jit_cache.providers`` entry-point group;
- a provider distribution whose entry point returns the manifest (schema 1:
  distribution, version, jit_cache_dir, cuda_architectures, modules) and
  whose wheel carries ``jit_cache/<module>/<module>.so``.

Both are real wheels (zip, WHEEL, METADATA, entry_points.txt, RECORD with
sha256), installed with pip into a venv layered over the serving venv (a
``.pth`` adds its site-packages), so FlashInfer's own code decides what it
loads, and pip's RECORD is what the supervisor checks the file against.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

SHIM_CODE = textwrap.dedent(
    '''\
    """Test shim: the flashinfer-jit-cache interface FlashInfer 0.7 calls."""
    import importlib.metadata
    from pathlib import Path
    from types import SimpleNamespace

    __version__ = "{version}"
    GROUP = "flashinfer.jit_cache.providers"


    def get_jit_cache_providers():
        found = []
        for entry in importlib.metadata.entry_points(group=GROUP):
            manifest = entry.load()()
            found.append(SimpleNamespace(
                provider_id=entry.name,
                distribution=manifest["distribution"],
                version=manifest["version"],
                jit_cache_dir=Path(manifest["jit_cache_dir"]).resolve(),
                cuda_architectures=frozenset(manifest["cuda_architectures"]),
                modules=frozenset(manifest["modules"]),
            ))
        return tuple(sorted(found, key=lambda p: p.provider_id))
    '''
)

PROVIDER_CODE = textwrap.dedent(
    '''\
    """Test provider: prebuilt FlashInfer modules for {archs}."""
    from pathlib import Path


    def manifest():
        return {{
            "schema_version": 1,
            "distribution": "{distribution}",
            "version": "{version}",
            "jit_cache_dir": str(Path(__file__).parent / "jit_cache"),
            "cuda_architectures": {archs!r},
            "modules": {modules!r},
        }}
    '''
)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def build_wheel(
    out: Path, distribution: str, version: str, files: dict[str, bytes], entry_points: str = ""
) -> Path:
    """A pure-Python wheel holding ``files`` (paths relative to site-packages)."""
    stem = distribution.replace("-", "_")
    dist_info = f"{stem}-{version}.dist-info"
    meta = {
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: k26-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    if entry_points:
        meta[f"{dist_info}/entry_points.txt"] = entry_points.encode()
    everything = {**files, **meta}
    record = "".join(
        f"{name},{_record_hash(data)},{len(data)}\n" for name, data in everything.items()
    )
    record += f"{dist_info}/RECORD,,\n"
    wheel = out / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in everything.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", record)
    return wheel


def provider_wheels(
    out: Path, modules: dict[str, Path], *, version: str, archs: list[str]
) -> list[Path]:
    """The shim and one provider serving ``modules`` (name -> a real built .so)."""
    out.mkdir(parents=True, exist_ok=True)
    shim = build_wheel(
        out,
        "flashinfer-jit-cache",
        version,
        {"flashinfer_jit_cache/__init__.py": SHIM_CODE.format(version=version).encode()},
    )
    distribution = "flashinfer-jit-cache-k26test-" + "-".join(archs)
    package = "k26test_jit_cache_provider"
    files = {
        f"{package}/__init__.py": PROVIDER_CODE.format(
            archs=archs, distribution=distribution, version=version, modules=sorted(modules)
        ).encode()
    }
    for name, so in modules.items():
        files[f"{package}/jit_cache/{name}/{name}.so"] = so.read_bytes()
    provider = build_wheel(
        out,
        distribution,
        version,
        files,
        entry_points=f"[flashinfer.jit_cache.providers]\nk26test = {package}:manifest\n",
    )
    return [shim, provider]


def layered_venv(base_python: Path, serving_site: Path, where: Path) -> Path:
    """A venv of its own whose imports fall through to the serving venv's site-packages."""
    subprocess.run(
        [str(base_python), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    site = next((where / "lib").glob("python3*/site-packages"))
    (site / "k26-serving.pth").write_text(f"{serving_site}\n")
    return where / "bin" / "python"


def pip_install(python: Path, wheels: list[Path]) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", *map(str, wheels)],
        check=True, timeout=300,
    )  # fmt: skip
