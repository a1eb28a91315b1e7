"""Where a unit's JIT caches are, from its own environment, and which survive a restart."""

from __future__ import annotations

from pathlib import PurePosixPath as P

import pytest

from supervisor.core import jit_caches
from supervisor.core.jit_caches import (
    JitCache,
    artifact_kernel,
    assess,
    ignored_artifact,
    locate,
    unknown,
)


def by_cache(env: dict[str, str], **kw: str) -> dict[JitCache, P]:
    return {loc.cache: loc.path for loc in locate(env, home=kw.get("home", "/home/svc"),
                                                   user=kw.get("user", "svc"))}  # fmt: skip


def test_library_defaults_follow_the_units_home_and_user() -> None:
    assert by_cache({}) == {
        JitCache.FLASHINFER: P("/home/svc/.cache/flashinfer"),
        JitCache.TRITON: P("/home/svc/.triton/cache"),
        JitCache.INDUCTOR: P("/tmp/torchinductor_svc"),
        JitCache.TVM_FFI: P("/home/svc/.cache/tvm-ffi"),
        JitCache.DEEPGEMM: P("/home/svc/.cache/deep_gemm"),
        JitCache.SGLANG: P("/home/svc/.cache/sglang"),
        # sglang 0.5.17 kernels/ops/attention/flash_attn/cute/cache_utils.py (and
        # FlashInfer's cute_dsl/sparse): tempfile.gettempdir()/<user>/...
        JitCache.CUTE_DSL: P("/tmp/svc/flash_attention_cute_dsl_cache"),
        # CUTLASS's base_dsl/cache_helpers.py: $TMPDIR/<user>/cutlass_python_cache
        JitCache.CUTLASS_DSL: P("/tmp/svc/cutlass_python_cache"),
        JitCache.TILELANG: P("/home/svc/.tilelang/cache"),
        JitCache.CUDA: P("/home/svc/.nv/ComputeCache"),  # the CUDA driver's default
    }
    # HOME in the unit's Environment= wins over the passwd entry, as for the libraries.
    assert by_cache({"HOME": "/var/lib/x"})[JitCache.TRITON] == P("/var/lib/x/.triton/cache")
    # inductor's default honours TMPDIR, as tempfile.gettempdir() does.
    assert by_cache({"TMPDIR": "/scratch"})[JitCache.INDUCTOR] == P("/scratch/torchinductor_svc")


def test_pinned_variables_win_and_are_marked_pinned() -> None:
    env = {
        "FLASHINFER_WORKSPACE_BASE": "/var/cache/sglang-k26/flashinfer",
        "TRITON_CACHE_DIR": "/var/cache/sglang-k26/triton",
        "TORCHINDUCTOR_CACHE_DIR": "/var/cache/sglang-k26/inductor",
        "TVM_FFI_CACHE_DIR": "/var/cache/sglang-k26/tvm-ffi",
        "SGLANG_DG_CACHE_DIR": "/var/cache/sglang-k26/deep_gemm",
        "SGLANG_CACHE_DIR": "/var/cache/sglang-k26/sglang",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/var/cache/sglang-k26/cute-dsl",
        "CUTE_DSL_CACHE_DIR": "/var/cache/sglang-k26/cutlass-dsl",
        "TILELANG_CACHE_DIR": "/var/cache/sglang-k26/tilelang",
        "CUDA_CACHE_PATH": "/var/cache/sglang-k26/cuda",
    }
    locations = locate(env, home="/", user="sglang-k26")
    assert all(loc.pinned for loc in locations)
    paths = {loc.cache: loc.path for loc in locations}
    assert paths[JitCache.FLASHINFER] == P("/var/cache/sglang-k26/flashinfer/.cache/flashinfer")
    assert paths[JitCache.INDUCTOR] == P("/var/cache/sglang-k26/inductor")
    assessed = assess(locations, private_tmp=True, cache_directories=["sglang-k26"])
    assert [a.problem for a in assessed] == [None] * len(jit_caches.CACHE_ENV)
    assert all(a.kept for a in assessed)


def test_private_tmp_wipes_the_inductor_default_at_every_restart() -> None:
    """The shipped units' old state: PrivateTmp=yes, no TORCHINDUCTOR_CACHE_DIR."""
    env = {"FLASHINFER_WORKSPACE_BASE": "/var/cache/sglang-k26/flashinfer"}
    assessed = {
        a.location.cache: a
        for a in assess(
            locate(env, home="/", user="sglang-k26"),
            private_tmp=True,
            cache_directories=["sglang-k26"],
        )
    }
    inductor = assessed[JitCache.INDUCTOR]
    assert not inductor.kept
    assert inductor.problem is not None
    assert (
        "PrivateTmp=yes wipes" in inductor.problem and "TORCHINDUCTOR_CACHE_DIR" in inductor.problem
    )
    # Kept, but by a library default outside the unit's CacheDirectory=: a problem to fix.
    triton = assessed[JitCache.TRITON]
    assert triton.kept and triton.problem and "TRITON_CACHE_DIR" in triton.problem
    assert assessed[JitCache.FLASHINFER].problem is None


def test_tmp_without_private_tmp_is_kept_only_until_a_reboot() -> None:
    [inductor] = [
        a for a in assess(locate({}, home="/root", user="root"), private_tmp=False)
        if a.location.cache is JitCache.INDUCTOR
    ]  # fmt: skip
    assert not inductor.kept and inductor.problem and "reboot" in inductor.problem


@pytest.mark.parametrize(
    ("cache", "relative", "kernel"),
    [
        (JitCache.FLASHINFER, "0.7.4/120f/cached_ops/sampling/sampling.so", "sampling"),
        (JitCache.FLASHINFER, "0.7.4/120f/cached_ops/norm/csrc_norm.cuda.o", "norm"),
        (
            JitCache.TRITON,
            "XQ3ABC/write_req_to_token_pool_triton.cubin",
            "write_req_to_token_pool_triton",
        ),
        (JitCache.TRITON, "XQ3ABC/get_num_kv_splits_triton.json", "get_num_kv_splits_triton"),
        (JitCache.INDUCTOR, "aotautograd/ab/abcdef.py", "abcdef"),
        (JitCache.TVM_FFI, "moe_align/moe_align.so", "moe_align"),
    ],
)
def test_a_new_artifact_is_named_after_its_kernel(
    cache: JitCache, relative: str, kernel: str
) -> None:
    assert artifact_kernel(cache, P(relative)) == kernel


@pytest.mark.parametrize(
    ("relative", "ignored"),
    [
        ("0.7.4/120f/cached_ops/tmp/sampling.lock", True),
        ("XQ3ABC/tmp.pid_12_abcd/kernel.cubin", True),
        ("0.7.4/120f/flashinfer_jit.log", True),
        ("XQ3ABC/kernel.cubin", False),
        ("0.7.4/120f/cached_ops/sampling/.ninja_log", False),
        # Rendered at a module's first load in a process, built or not (FlashInfer 0.7.4
        # on a pulled cache: tests/integration/test_gpu_rehearsal.py's bundle act).
        ("0.7.4/120f/generated/locality_domain/locality_domain.cu", True),
        (".cache/flashinfer/0.7.4/120f/generated/batch_prefill_x/batch_prefill_config.inc", True),
        ("0.7.4/120f/cached_ops/locality_domain/locality_domain_locality_domain.cuda.o", False),
        ("0.7.4/120f/generated/locality_domain/locality_domain.so", False),
        # This supervisor's own records: a warm-up rewrites the fingerprint (learned
        # modules found unrebuildable) with nothing built.
        ("0.7.4/120f/k26-fingerprint.json", True),
        ("k26-quarantine/20261205-120f-norm/norm.so", True),
    ],
)
def test_locks_logs_temporaries_and_generated_sources_are_no_artifacts(
    relative: str, ignored: bool
) -> None:
    assert ignored_artifact(P(relative), JitCache.FLASHINFER) is ignored


def test_generated_sources_and_k26_records_are_ignored_in_flashinfer_s_cache_only() -> None:
    """In another cache a source is part of what it carries (and of its layer)."""
    for relative in (P("mod_abc/generated/kernel.cu"), P("k26-x/kernel.so")):
        assert ignored_artifact(relative, JitCache.FLASHINFER) is True
        assert ignored_artifact(relative, JitCache.TVM_FFI) is False
        assert ignored_artifact(relative) is False


def test_a_cache_variable_no_cache_here_is_located_by_is_named() -> None:
    """What a serving venv's sources read (k26_caches.py roots) against this table."""
    read = ["TRITON_CACHE_DIR", "DG_JIT_CACHE_DIR", "CUDA_CACHE_PATH", "VLLM_CACHE_ROOT",
            "QUACK_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"]  # fmt: skip
    assert unknown(read) == ["QUACK_CACHE_DIR", "VLLM_CACHE_ROOT"]


def test_a_pinned_root_no_known_cache_follows_is_an_other_location() -> None:
    """The roots the serving venv's code reads beyond the known caches: watched where
    the unit pins them (relative from /), never where it does not, and never a known
    cache's own variable twice."""
    env = {"FLASHINFER_AUTOTUNE_CACHE_DIR": "var/autotune", "TRITON_CACHE_DIR": "/c/triton"}
    read = ["FLASHINFER_AUTOTUNE_CACHE_DIR", "QUACK_CACHE_DIR", "TRITON_CACHE_DIR"]
    (other,) = jit_caches.pinned_unknown(env, read)
    assert other.cache is JitCache.OTHER and other.pinned
    assert (str(other.path), other.source) == ("/var/autotune", "FLASHINFER_AUTOTUNE_CACHE_DIR")
    located = jit_caches.locate(env, home="/root", user="root")
    assert JitCache.OTHER not in {loc.cache for loc in located}


def test_an_other_root_under_tmp_is_assessed_naming_its_own_variable() -> None:
    env = {"FLASHINFER_AUTOTUNE_CACHE_DIR": "/tmp/autotune"}
    (other,) = jit_caches.pinned_unknown(env, ["FLASHINFER_AUTOTUNE_CACHE_DIR"])
    (assessed,) = assess([other], private_tmp=True)
    assert not assessed.kept and assessed.problem is not None
    assert "set FLASHINFER_AUTOTUNE_CACHE_DIR to a directory under" in assessed.problem
