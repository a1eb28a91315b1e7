"""The ELF/fatbin reader against real nvcc 13.0 output (data/k.cu, see data/README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.flashinfer.fatbin import CudaTarget, ElfError, check_elf, cuda_targets, parse_arch

DATA = Path(__file__).with_name("data")


@pytest.mark.parametrize(
    ("name", "expected", "runs_on_120"),
    [
        ("k_sm_120.so", "sm_120", True),
        ("k_sm_120a.so", "sm_120a", True),
        ("k_sm_120f.so", "sm_120f", True),
        ("k_compute_90.so", "compute_90", True),  # PTX: the driver JIT-compiles it forward
        ("k_sm_90a.so", "sm_90a", False),
    ],
)
def test_targets_of_real_binaries(name: str, expected: str, runs_on_120: bool) -> None:
    targets = cuda_targets((DATA / name).read_bytes())
    assert {t.name for t in targets} == {expected}
    assert all(t.runs_on(12, 0) is runs_on_120 for t in targets)


def test_truncated_file_is_detected_at_any_cut() -> None:
    data = (DATA / "k_sm_120f.so").read_bytes()
    check_elf(data)
    for cut in (len(data) - 1, len(data) // 2, 100, 10):
        with pytest.raises(ElfError):
            cuda_targets(data[:cut])


def test_not_a_shared_object() -> None:
    with pytest.raises(ElfError, match="no ELF header"):
        check_elf(b"#!/bin/sh\necho not a library\n" * 4)


@pytest.mark.parametrize(
    ("target", "device", "runs"),
    [
        (CudaTarget("sass", 120, ""), (12, 1), True),
        (CudaTarget("sass", 120, ""), (10, 0), False),
        (CudaTarget("sass", 120, "a"), (12, 1), False),
        (CudaTarget("sass", 120, "f"), (12, 1), True),
        (CudaTarget("sass", 121, "f"), (12, 0), False),
        (CudaTarget("ptx", 100, ""), (12, 0), True),
        (CudaTarget("ptx", 120, "a"), (12, 0), True),
        (CudaTarget("ptx", 90, "a"), (12, 0), False),
    ],
)
def test_runs_on(target: CudaTarget, device: tuple[int, int], runs: bool) -> None:
    assert target.runs_on(*device) is runs


@pytest.mark.parametrize("bad", ["12", "sm_120", "12.0f", "12.10", "", "a.b"])
def test_parse_arch_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="compute capability"):
        parse_arch(bad)


def test_parse_arch() -> None:
    assert parse_arch("12.0") == (12, 0)
