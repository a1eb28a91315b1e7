"""The pulled bundle's verdict at READY (core/bundle_use.py)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.adapters.warmup import list_artifacts
from supervisor.core.bundle_use import BundleUse, judge

USE = BundleUse("sha256:" + "a" * 64, "http://r:5000/k26/b", "2026-12-04T00:00:00Z")
BEFORE = {
    "flashinfer": {"cached_ops/sampling/sampling.so": (900, 1)},
    "triton": {"K1/_kernel.cubin": (70, 1), "K1/_kernel.json": (20, 1)},
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
        | {
            "K2/get_num_kv_splits_triton.cubin": (70, 2),
            "K2/get_num_kv_splits_triton.json": (9, 2),
        },
        "flashinfer": BEFORE["flashinfer"] | {"cached_ops/norm/norm.so": (800, 2)},
        "inductor": {"ab/cabxyz.py": (5, 2)},  # a cache the pull did not list at all
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
    after = {**BEFORE, "triton": BEFORE["triton"] | {"K3/k.cubin": (1, 2)}}
    first = judge(USE, "a.service", BEFORE, after)
    second = judge(first, "b.service", after, after)  # nothing new by b's READY
    assert second.effective is False and second.rebuilt == first.rebuilt
    third = judge(second, "a.service", BEFORE, after)
    assert third.checked_units == ("a.service", "b.service")


def test_a_module_rebuilt_in_place_is_a_build() -> None:
    """FlashInfer runs ninja at each load: a pulled module whose input is newer than its
    objects is rebuilt under the same names (seen with FlashInfer 0.7.4, when a bundle
    lacked the module's generated source and the loader wrote it anew)."""
    after = {**BEFORE, "flashinfer": {"cached_ops/sampling/sampling.so": (900, 5)}}
    judged = judge(USE, "u.service", BEFORE, after)
    assert judged.effective is False
    assert [(r.cache, r.files, r.kernels) for r in judged.rebuilt] == [
        ("flashinfer", 1, ("sampling",))
    ]
    grown = {**BEFORE, "triton": {**BEFORE["triton"], "K1/_kernel.json": (21, 1)}}
    assert judge(USE, "u.service", BEFORE, grown).effective is False


def test_listed_caches_judge_a_rewritten_record_as_nothing_and_a_relinked_module_as_a_build(
    tmp_path: Path,
) -> None:
    """The listings as the warm-up makes them (``list_artifacts``), on FlashInfer's
    layout: a warm-up that rewrites the fingerprint (learned modules found
    unrebuildable), FlashInfer rendering a module's sources again and its log are no
    build; the module's library written again is one."""
    root = tmp_path / ".cache" / "flashinfer"
    tag = root / "0.7.4" / "120f"
    files = {
        "so": tag / "cached_ops" / "norm" / "norm.so",
        "fingerprint": tag / "k26-fingerprint.json",
        "source": tag / "generated" / "norm" / "norm.cu",
        "log": tag / "flashinfer_jit.log",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("v1")
        os.utime(path, ns=(10**18, 10**18))
    roots = {"flashinfer": root}
    before = list_artifacts(roots)
    assert set(before["flashinfer"]) == {"0.7.4/120f/cached_ops/norm/norm.so"}
    for name in ("fingerprint", "source", "log"):
        files[name].write_text("v2, later")
    assert judge(USE, "u.service", before, list_artifacts(roots)).effective is True
    files["so"].write_text("v2")  # same size, a new mtime: relinked in place
    judged = judge(USE, "u.service", before, list_artifacts(roots))
    assert judged.effective is False and judged.rebuilt[0].kernels == ("norm",)
