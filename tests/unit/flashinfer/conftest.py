"""A cache laid out as FlashInfer 0.7 lays it out, with a real nvcc-built .so."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest

from supervisor.flashinfer.protocol import Identity, Probe
from supervisor.flashinfer.venv import ServingEnv

DATA = Path(__file__).with_name("data")

IDENTITY: dict[str, Any] = {
    "python": "/usr/bin/python3.11",
    "python_version": "3.11.2",
    "prefix": "/srv/venv",
    "flashinfer": {"name": "flashinfer-python", "version": "0.7.4", "record_sha256": "aa"},
    "flashinfer_dir": "/srv/venv/lib/python3.11/site-packages/flashinfer",
    "gate_files": {"jit/core.py": "bb"},
    "torch": {"name": "torch", "version": "2.13.0+cpu", "record_sha256": "cc", "cuda": None},
    "nvcc": {"cuda_home": "/usr/local/cuda", "path": "/usr/local/cuda/bin/nvcc",
             "release": "13.0", "version_sha256": "dd"},
    "env": {"FLASHINFER_CUDA_ARCH_LIST": "12.0", "CC": None},
}  # fmt: skip
WHO = Identity.model_validate(IDENTITY)


class FakeCache:
    """``<workspace>/.cache/flashinfer/0.7.4/120f`` with a sampling module."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.dir = workspace / ".cache" / "flashinfer" / "0.7.4" / "120f"
        self.jit = self.dir / "cached_ops"
        self.so = self.jit / "sampling" / "sampling.so"
        self.lock = self.jit / "tmp" / "sampling.lock"
        self.serving = ServingEnv(Path("/srv/venv/bin/python"), "12.0", workspace)

    def build(self, fixture: str = "k_sm_120f.so") -> None:
        self.so.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / fixture, self.so)

    def probe(self, *, loads: bool = True, gate: str = "accepts") -> Probe:
        """The probe answer k26_serving.py would give for this cache."""
        return Probe.model_validate(self.raw(loads=loads, gate=gate))

    def raw(self, *, loads: bool = True, gate: str = "accepts") -> dict[str, Any]:
        """The same answer as JSON, to edit before validating."""
        probe: dict[str, Any] = {
            "identity": copy.deepcopy(IDENTITY),  # edited by tests: never the shared one
            "flashinfer_version": "0.7.4",
            "cuda_version": "13.0",
            "gate": {"verdict": gate, "error": None if gate == "accepts" else "RuntimeError: no",
                     "arch_flags": ["-gencode=arch=compute_120f,code=sm_120f"]},
            "workspace_dir": str(self.dir),
            "jit_dir": str(self.jit),
            "arch_tag": "120f",
            "modules": {},
            "loads": {},
        }  # fmt: skip
        if gate == "accepts":
            probe["modules"] = {
                "sampling": {
                    "path": str(self.so),
                    "build_dir": str(self.so.parent),
                    "compiled": self.so.exists(),
                    "aot": False,
                    "lock_path": str(self.lock),
                    "error": None,
                }
            }
        if loads and self.so.exists():
            probe["loads"] = {str(self.so): {"ok": True, "loader": "tvm_ffi.load_module"}}
        return probe


@pytest.fixture
def fake_cache(tmp_path: Path) -> FakeCache:
    return FakeCache(tmp_path / "ws")
