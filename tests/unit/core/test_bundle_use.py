"""The pulled bundle's verdict at READY (core/bundle_use.py)."""

from __future__ import annotations

from supervisor.core.bundle_use import BundleUse, judge

USE = BundleUse("sha256:" + "a" * 64, "http://r:5000/k26/b", "2026-12-04T00:00:00Z")
BEFORE = {
    "flashinfer": frozenset({"cached_ops/sampling/sampling.so"}),
    "triton": frozenset({"K1/_kernel.cubin", "K1/_kernel.json"}),
}


def test_nothing_gained_since_the_pull_is_effective() -> None:
    judged = judge(USE, "u.service", BEFORE, dict(BEFORE))
    assert judged.effective is True and judged.rebuilt == ()
    assert judged.checked_units == ("u.service",)
    assert judged.to_json()["effective"] is True


def test_a_cache_that_gained_files_is_named_with_its_kernels() -> None:
    after = {
        **BEFORE,
        "triton": BEFORE["triton"]
        | {"K2/get_num_kv_splits_triton.cubin", "K2/get_num_kv_splits_triton.json"},
        "flashinfer": BEFORE["flashinfer"] | {"cached_ops/norm/norm.so"},
        "inductor": frozenset({"ab/cabxyz.py"}),  # a cache the pull did not list at all
    }
    judged = judge(USE, "u.service", BEFORE, after)
    assert judged.effective is False
    shown = {r.cache: (r.files, r.kernels) for r in judged.rebuilt}
    assert shown == {
        "flashinfer": (1, ("norm",)),
        "inductor": (1, ("cabxyz",)),
        "triton": (2, ("get_num_kv_splits_triton",)),
    }
    assert "triton 2 file(s) (get_num_kv_splits_triton)" in judged.summary()


def test_a_verdict_never_turns_back_to_effective_and_each_unit_is_counted_once() -> None:
    after = {**BEFORE, "triton": BEFORE["triton"] | {"K3/k.cubin"}}
    first = judge(USE, "a.service", BEFORE, after)
    second = judge(first, "b.service", after, after)  # nothing new by b's READY
    assert second.effective is False and second.rebuilt == first.rebuilt
    third = judge(second, "a.service", BEFORE, after)
    assert third.checked_units == ("a.service", "b.service")
