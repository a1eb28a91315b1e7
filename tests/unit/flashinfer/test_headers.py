"""A missing header named with what provides it; prebuilt modules judged by their wheel."""

from __future__ import annotations

import hashlib

from supervisor.flashinfer import headers
from supervisor.flashinfer.doctor import assess
from supervisor.flashinfer.protocol import Probe
from supervisor.flashinfer.warm import _build_error, _prepare

from .conftest import FakeCache

# What nvcc 13.0 printed here for FlashInfer 0.7.4's norm (its toolkit lacks cuBLAS).
NVCC_LINE = (
    "/srv/venv/lib/python3.11/site-packages/flashinfer/data/include/flashinfer/trtllm/"
    "common/cudaUtils.h:25:10: fatal error: cublasLt.h: No such file or directory"
)


def test_the_compiler_line_names_the_header_and_where() -> None:
    found = headers.missing_in_build_output(f"ninja: build stopped\n{NVCC_LINE}\n{NVCC_LINE}\n")
    assert found == [("cublasLt.h", NVCC_LINE.split(":10:")[0])]


def test_what_provides_a_header_follows_the_cuda_release() -> None:
    for13 = headers.provides("cublasLt.h", "13.0")
    assert "libcublas-dev-13-0" in for13 and "pip nvidia-cublas " in for13
    for12 = headers.provides("curand.h", "12.9")
    assert "libcurand-dev-12-9" in for12 and "nvidia-curand-cu12" in for12
    unknown = headers.provides("mystery.h", "13.0")
    assert "mystery.h" in unknown and "CPATH" in unknown


def test_a_build_that_fails_on_a_header_says_which_and_what_to_install() -> None:
    text = _build_error(f"RuntimeError: Ninja build failed\n{NVCC_LINE}", 1, None, "13.0")
    assert text.startswith("the build needs cublasLt.h (included from ")
    assert "libcublas-dev-13-0" in text


def test_doctor_names_a_missing_header_for_a_module_not_yet_built(fake_cache: FakeCache) -> None:
    raw = fake_cache.raw()
    raw["modules"]["sampling"]["headers"] = {
        "checked": True,
        "missing": [{"header": "curand.h", "included_from": "sampling.cuh:21"}],
    }
    report = assess(fake_cache.serving, ["sampling"], Probe.model_validate(raw))
    assert report.status == "needs-warmup"
    assert any(
        p.startswith("sampling: the build needs curand.h (included from sampling.cuh:21)")
        for p in report.problems
    ), report.problems


def _provider_probe(fake_cache: FakeCache, record_sha256: str | None) -> Probe:
    raw = fake_cache.raw()
    module = raw["modules"]["sampling"]
    module["aot"] = True
    module["resolution"] = {
        "source": "provider",
        "artifacts": [
            {
                "provider": "sm120f",
                "path": str(fake_cache.so),
                "archs": ["sm120f"],
                "distribution": "flashinfer-jit-cache-sm120f",
                "version": "0.7.4+cu130",
                "record_sha256": record_sha256,
            }
        ],
    }
    return Probe.model_validate(raw)


def test_a_provider_module_is_vouched_for_by_its_wheel_record(fake_cache: FakeCache) -> None:
    fake_cache.build()  # stands where a provider wheel put it; no fingerprint at all
    sha = hashlib.sha256(fake_cache.so.read_bytes()).hexdigest()
    report = assess(fake_cache.serving, ["sampling"], _provider_probe(fake_cache, sha))
    assert report.status == "warm", report.problems
    module = report.modules[0]
    assert module.prebuilt and module.source == "provider"
    assert module.source_detail == (
        "provider sm120f (flashinfer-jit-cache-sm120f 0.7.4+cu130, sm120f)"
    )


def test_a_provider_module_that_differs_from_its_record_is_flagged(fake_cache: FakeCache) -> None:
    fake_cache.build()
    report = assess(fake_cache.serving, ["sampling"], _provider_probe(fake_cache, "0" * 64))
    assert report.status == "needs-warmup"
    assert any("sha256 is not the one in its RECORD" in p for p in report.problems)
    unrecorded = assess(fake_cache.serving, ["sampling"], _provider_probe(fake_cache, None))
    assert any("is not in the RECORD" in p for p in unrecorded.problems)


def test_warm_never_quarantines_a_wheels_files(fake_cache: FakeCache) -> None:
    fake_cache.build()
    report = assess(fake_cache.serving, ["sampling"], _provider_probe(fake_cache, "0" * 64))
    quarantined, _removed = _prepare(report, fake_cache.serving)
    assert quarantined == [] and fake_cache.so.exists()
