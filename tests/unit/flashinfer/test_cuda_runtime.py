"""A module's CUDA runtime against the units' (flashinfer #5145), from the ELF itself."""

from __future__ import annotations

import copy

from supervisor.flashinfer.doctor import assess
from supervisor.flashinfer.fatbin import cudart_major, needed_libraries
from supervisor.flashinfer.protocol import Probe
from supervisor.flashinfer.warm import _toolkit_mismatch

from .conftest import DATA, FakeCache


def test_dt_needed_is_read_from_the_dynamic_section() -> None:
    data = (DATA / "k_sm_120f.so").read_bytes()  # nvcc 13.0 built it here
    assert needed_libraries(data)[0] == "libcudart.so.13"
    assert cudart_major(data) == 13


def _probe_with_torch_cuda(fake_cache: FakeCache, cuda: str | None) -> Probe:
    raw = copy.deepcopy(fake_cache.raw())
    raw["identity"]["torch"]["cuda"] = cuda
    return Probe.model_validate(raw)


def test_a_cuda13_module_for_cuda12_units_is_flagged(fake_cache: FakeCache) -> None:
    fake_cache.build()
    report = assess(fake_cache.serving, ["sampling"], _probe_with_torch_cuda(fake_cache, "12.8"))
    flagged = [p for p in report.problems if "libcudart.so.13" in p]
    assert flagged and "torch is built for CUDA 12.8" in flagged[0] and "#5145" in flagged[0]
    same = assess(fake_cache.serving, ["sampling"], _probe_with_torch_cuda(fake_cache, "13.0"))
    cpu = assess(fake_cache.serving, ["sampling"], _probe_with_torch_cuda(fake_cache, None))
    assert not any("libcudart" in p for p in [*same.problems, *cpu.problems])


def test_warm_refuses_a_toolkit_whose_runtime_the_units_cannot_load(fake_cache: FakeCache) -> None:
    report = assess(fake_cache.serving, ["sampling"], _probe_with_torch_cuda(fake_cache, "12.8"))
    text = _toolkit_mismatch(report)
    assert text is not None and "CUDA 13.0" in text and "CUDA 12.8" in text
    assert "nothing was built" in text
    agreeing = assess(fake_cache.serving, ["sampling"], _probe_with_torch_cuda(fake_cache, "13.0"))
    assert _toolkit_mismatch(agreeing) is None
