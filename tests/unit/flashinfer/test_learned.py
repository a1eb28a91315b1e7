"""Modules learned from a ready unit's cache: recorded per arch, kept across wipes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from supervisor.core.errors import CacheError
from supervisor.flashinfer import learned
from supervisor.flashinfer.doctor import assess
from supervisor.flashinfer.protocol import Probe

from .conftest import DATA, FakeCache


def built(cache_dir: Path, name: str, fixture: str = "k_sm_120f.so") -> Path:
    module = cache_dir / "cached_ops" / name
    module.mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / fixture, module / f"{name}.so")
    (module / "build.ninja").write_text(f"# {name}\n")
    return module / f"{name}.so"


def test_what_a_server_built_is_learned_for_its_arch_only(fake_cache: FakeCache) -> None:
    built(fake_cache.dir, "sampling")
    built(fake_cache.dir, "norm")
    (fake_cache.dir / "cached_ops" / "tmp").mkdir()  # FlashInfer's lock dir: not a module
    (fake_cache.dir / "cached_ops" / "half").mkdir()  # a build that never linked: not used
    other = fake_cache.workspace / ".cache/flashinfer/0.7.4/90a"
    built(other, "rope", "k_sm_90a.so")
    new = learned.learn_from_cache(
        fake_cache.workspace, "12.0", ["120f"], unit="sglang-k26.service"
    )
    assert new == ["norm", "sampling"]
    known = learned.learned(fake_cache.workspace, "12.0")
    assert sorted(known) == ["norm", "sampling"]
    assert known["norm"]["flashinfer"] == "0.7.4" and known["norm"]["arch_tag"] == "120f"
    assert known["norm"]["seen_after"] == "sglang-k26.service"
    assert known["norm"]["build_ninja_sha256"]
    assert learned.learned(fake_cache.workspace, "9.0") == {}
    # Seen again: nothing new, first_seen kept.
    first = known["norm"]["first_seen"]
    assert learned.learn_from_cache(fake_cache.workspace, "12.0", ["120f"]) == []
    assert learned.learned(fake_cache.workspace, "12.0")["norm"]["first_seen"] == first


def test_the_record_outlives_a_wiped_cache_and_an_upgrade(fake_cache: FakeCache) -> None:
    built(fake_cache.dir, "norm")
    learned.learn_from_cache(fake_cache.workspace, "12.0", ["120f"])
    shutil.rmtree(fake_cache.workspace / ".cache")  # rm -rf ~/.cache/flashinfer
    assert "norm" in learned.learned(fake_cache.workspace, "12.0")
    upgraded = fake_cache.workspace / ".cache/flashinfer/0.7.5/120f"
    built(upgraded, "topk")
    assert learned.learn_from_cache(fake_cache.workspace, "12.0", ["120f"]) == ["topk"]
    assert sorted(learned.learned(fake_cache.workspace, "12.0")) == ["norm", "topk"]


def test_two_flashinfer_versions_in_one_cache_keep_a_build_each(fake_cache: FakeCache) -> None:
    """After an upgrade the cache holds both versions' dirs: the record keeps each
    build of a module under its ``<version>/<tag>``, the entry's own fields are the
    newest version's (0.10.0 after 0.7.4, not by string order), and a record written
    before builds existed gains them without losing its build."""
    old = built(fake_cache.dir, "batch_prefill_x")  # 0.7.4/120f
    legacy = {"schema": 1, "archs": {"12.0": {"modules": {"batch_prefill_x": {
        "first_seen": "2026-11-01T00:00:00Z", "last_seen": "2026-11-01T00:00:00Z",
        "flashinfer": "0.7.4", "arch_tag": "120f", "library": str(old), "size": 1,
        "sha256": "a" * 64, "build_ninja_sha256": "b" * 64, "seen_after": "u.service"}}}}}  # fmt: skip
    learned.learned_path(fake_cache.workspace).write_text(json.dumps(legacy))
    newer = fake_cache.workspace / ".cache/flashinfer/0.10.0/120f"
    built(newer, "batch_prefill_x")
    (newer / "cached_ops/batch_prefill_x/build.ninja").write_text("# 0.10.0's\n")
    assert learned.learn_from_cache(fake_cache.workspace, "12.0", ["120f"]) == []
    entry = learned.learned(fake_cache.workspace, "12.0")["batch_prefill_x"]
    assert entry["flashinfer"] == "0.10.0" and entry["first_seen"] == "2026-11-01T00:00:00Z"
    assert sorted(entry["builds"]) == ["0.10.0/120f", "0.7.4/120f"]
    seven = learned.build_of(entry, "0.7.4", "120f")
    ten = learned.build_of(entry, "0.10.0", "120f")
    assert seven["library"] == str(old) and seven["sha256"] != "a" * 64  # scanned anew
    assert ten["library"].endswith("0.10.0/120f/cached_ops/batch_prefill_x/batch_prefill_x.so")
    assert seven["build_ninja_sha256"] != ten["build_ninja_sha256"]
    assert learned.build_of(entry, "0.7.5", "120f") == {}
    assert learned.build_of(entry, "0.10.0", "90a") == {}
    # A record from before builds answers for its one build, and only that one.
    first = legacy["archs"]["12.0"]["modules"]["batch_prefill_x"]
    assert learned.build_of(first, "0.7.4", "120f")["sha256"] == "a" * 64
    assert learned.build_of(first, "0.10.0", "120f") == {}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "Expecting property name"),
        ('{"schema": 2, "archs": {}}', "schema is not 1"),
        ('{"schema": 1, "archs": []}', "archs is not a mapping"),
        ('{"schema": 1, "archs": {"12.0": {"modules": 3}}}', "archs.12.0.modules"),
        (
            '{"schema": 1, "archs": {"12.0": {"modules": {"norm": 3}}}}',
            "archs.12.0.modules.norm is not a mapping",
        ),
        (
            '{"schema": 1, "archs": {"12.0": {"modules": {"norm": {"builds": "x"}}}}}',
            "archs.12.0.modules.norm.builds is not a mapping of builds",
        ),
        (
            '{"schema": 1, "archs": {"12.0": {"modules": {"norm": {"builds": {"a/b": 1}}}}}}',
            "archs.12.0.modules.norm.builds is not a mapping of builds",
        ),
    ],
)
def test_a_corrupt_record_is_named_and_left_alone(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / learned.LEARNED_NAME
    path.write_text(text)
    with pytest.raises(CacheError) as caught:
        learned.learned(tmp_path, "12.0")
    assert str(path) in str(caught.value) and why in str(caught.value)
    assert "remove it" in str(caught.value)
    with pytest.raises(CacheError):
        learned.record(tmp_path, "12.0", [])
    assert path.read_text() == text  # nothing overwritten


def test_a_learned_module_flashinfer_cannot_build_by_name_is_listed_not_failed(
    fake_cache: FakeCache,
) -> None:
    raw = fake_cache.raw()
    raw["modules"]["batch_prefill_with_kv_cache_dtype_q_bf16"] = {
        "error": "LookupError: this FlashInfer has no generator for module 'batch_prefill...'",
        "generator": False,
    }
    probe = Probe.model_validate(raw)
    name = "batch_prefill_with_kv_cache_dtype_q_bf16"
    report = assess(fake_cache.serving, ["sampling"], probe, learned=[name, "sampling"])
    assert [m.name for m in report.modules] == ["sampling"]
    assert report.learned == (name,)
    assert "server JIT-builds it on first use" in report.not_rebuildable[name]
    assert not any(name in p for p in report.problems)
    # Configured by the operator, the same module is a problem, not a note.
    configured = assess(fake_cache.serving, ["sampling", name], probe)
    assert any(p.startswith(f"{name}: FlashInfer: LookupError") for p in configured.problems)


def test_a_learned_module_flashinfer_can_build_is_warmed_like_a_configured_one(
    fake_cache: FakeCache,
) -> None:
    raw = fake_cache.raw()
    raw["modules"]["norm"] = {
        "path": str(fake_cache.jit / "norm" / "norm.so"),
        "build_dir": str(fake_cache.jit / "norm"),
        "compiled": False,
    }
    report = assess(fake_cache.serving, ["sampling"], Probe.model_validate(raw), learned=["norm"])
    assert [m.name for m in report.modules] == ["sampling", "norm"]
    assert "norm: not compiled" in report.problems
    assert json.loads(report.to_json())["learned"] == ["norm"]


def test_the_fast_check_covers_learned_modules_but_not_the_unrebuildable(
    fake_cache: FakeCache,
) -> None:
    from supervisor.flashinfer.warm import _write_fingerprint, fast_check

    from .conftest import WHO

    fake_cache.build()
    probe = fake_cache.probe()
    report = assess(fake_cache.serving, ["sampling"], probe)
    _write_fingerprint(report, probe, {"attention_variant": "needs arguments"})
    recorded = next(iter(learned.cache.find_fingerprints(fake_cache.workspace)))
    assert recorded.not_rebuildable == {"attention_variant": "needs arguments"}
    serving = fake_cache.serving
    assert fast_check(serving, ["sampling"], WHO, ["attention_variant"]) is not None
    # A learned module the fingerprint does not cover sends warm down the full path.
    assert fast_check(serving, ["sampling"], WHO, ["norm"]) is None
