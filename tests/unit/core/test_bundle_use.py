"""The pulled bundle's verdict at READY (core/bundle_use.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.adapters.warmup import list_artifacts
from supervisor.core.bundle_use import BundleUse, Served, judge

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


def test_the_verdict_keeps_when_the_bundle_was_made() -> None:
    made = BundleUse(USE.digest, USE.registry, USE.pulled_at, created_at="2026-12-01T00:00:00Z")
    judged = judge(made, "u.service", BEFORE, dict(BEFORE))
    assert judged.created_at == "2026-12-01T00:00:00Z"
    assert judged.to_json() == {
        "digest": USE.digest,
        "registry": "http://r:5000/k26/b",
        "pulled_at": "2026-12-04T00:00:00Z",
        "created_at": "2026-12-01T00:00:00Z",
        "effective": True,
        "rebuilt": [],
        "checked_units": ["u.service"],
    }
    assert USE.to_json()["created_at"] is None


@pytest.mark.parametrize(
    ("created_at", "seconds"),
    [
        ("2026-12-01T00:00:00Z", 1796083200.0),
        ("2026-12-01T00:00:00+00:00", 1796083200.0),
        ("2026-12-01T02:00:00+02:00", 1796083200.0),
        ("2026-12-01T00:00:00", 1796083200.0),  # no zone: UTC, as accepted.py reads it
        ("2026-12-01T00:00:00.5Z", 1796083200.5),
        ("yesterday", None),  # an unsigned bundle's is whatever its pusher wrote
        ("", None),
        (None, None),
    ],
)
def test_the_bundle_s_creation_in_unix_seconds(
    created_at: str | None, seconds: float | None
) -> None:
    assert Served("sha256:aa", created_at, 0.0).created_seconds() == seconds


def test_the_bundle_s_age_is_taken_at_the_pull_not_now() -> None:
    made = 1796083200.0  # 2026-12-01T00:00:00Z
    assert Served("sha256:aa", "2026-12-01T00:00:00Z", made + 8 * 86400).age_at_pull() == (
        8 * 86400
    )
    # A node's clock behind the build host's: fresh, not negative.
    assert Served("sha256:aa", "2026-12-01T00:00:00Z", made - 60).age_at_pull() == 0.0
    assert Served("sha256:aa", "last week", made).age_at_pull() is None


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
