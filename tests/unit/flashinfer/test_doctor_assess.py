"""doctor's verdict from a probe answer and the files on disk (no venv needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from supervisor.flashinfer import cache
from supervisor.flashinfer.doctor import assess
from supervisor.flashinfer.protocol import Identity, Probe
from supervisor.flashinfer.warm import _write_fingerprint, fast_check

from .conftest import DATA, IDENTITY, WHO, FakeCache


def warm_up(fc: FakeCache) -> None:
    """What a successful warm leaves: the module and a fingerprint vouching for it."""
    fc.build()
    report = assess(fc.serving, ["sampling"], fc.probe())
    _write_fingerprint(report, fc.probe())


def test_warm_and_valid(fake_cache: FakeCache) -> None:
    warm_up(fake_cache)
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert report.status == "warm", report.problems
    assert report.exit_code == 0
    module = report.modules[0]
    assert module.targets == ("sm_120f",) and module.holds_target_arch
    assert json.loads(report.to_json())["status"] == "warm"
    assert fast_check(fake_cache.serving, ["sampling"], WHO) is not None


def test_cold_cache_needs_warmup(fake_cache: FakeCache) -> None:
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert report.status == "needs-warmup"
    assert report.exit_code == 2
    assert "sampling: not compiled" in report.problems
    assert fast_check(fake_cache.serving, ["sampling"], WHO) is None


def test_unfingerprinted_module_is_not_trusted(fake_cache: FakeCache) -> None:
    fake_cache.build()
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert report.status == "needs-warmup"
    assert any("no fingerprint" in p for p in report.problems)


def test_truncated_module_is_detected(fake_cache: FakeCache) -> None:
    warm_up(fake_cache)
    data = fake_cache.so.read_bytes()
    fake_cache.so.write_bytes(data[: len(data) // 2])  # a kill mid-write
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe(loads=False))
    assert report.status == "needs-warmup"
    assert not report.modules[0].complete
    assert any("truncated" in p for p in report.problems)
    assert fast_check(fake_cache.serving, ["sampling"], WHO) is None


def test_module_for_another_arch(fake_cache: FakeCache) -> None:
    fake_cache.build("k_sm_90a.so")
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert report.status == "needs-warmup"
    assert any("none of which runs on 12.0" in p for p in report.problems)


def test_fingerprint_mismatch_after_version_change(fake_cache: FakeCache) -> None:
    warm_up(fake_cache)
    probe = fake_cache.raw()
    probe["identity"] = json.loads(json.dumps(IDENTITY))
    probe["identity"]["torch"]["version"] = "2.14.1+cpu"
    report = assess(fake_cache.serving, ["sampling"], Probe.model_validate(probe))
    assert report.status == "needs-warmup"
    assert report.fingerprint["state"] == "mismatch"
    assert "torch.version: '2.13.0+cpu' -> '2.14.1+cpu'" in report.fingerprint["differences"]
    who = Identity.model_validate(probe["identity"])
    assert fast_check(fake_cache.serving, ["sampling"], who) is None


def test_replaced_module_is_not_vouched_for(fake_cache: FakeCache) -> None:
    warm_up(fake_cache)
    fake_cache.build("k_sm_120.so")  # same arch, other bytes
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert report.status == "needs-warmup"
    assert any("changed since warm-up" in p for p in report.problems)


def test_module_that_does_not_load(fake_cache: FakeCache) -> None:
    warm_up(fake_cache)
    probe = fake_cache.raw()
    probe["loads"] = {str(fake_cache.so): {"ok": False, "error": "OSError: libcudart.so.13"}}
    report = assess(fake_cache.serving, ["sampling"], Probe.model_validate(probe))
    assert report.status == "needs-warmup"
    assert report.modules[0].loads is False


def test_stale_lock_from_sigkilled_builder(fake_cache: FakeCache) -> None:
    warm_up(fake_cache)
    fake_cache.lock.parent.mkdir(parents=True, exist_ok=True)
    builder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT);"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
         str(fake_cache.lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert builder.stdout is not None and builder.stdout.readline().strip() == "locked"
    held = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert held.status == "needs-warmup"
    assert held.locks[0].state == "held" and builder.pid in held.locks[0].holders
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()
    # Its lock file stays, unheld. The module it guarded is still the one the
    # fingerprint vouches for: FlashInfer 0.6 takes this lock on every load, so a
    # server that died after loading a warm module leaves exactly this (seen on the
    # H200). Not a reason to rebuild.
    released = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert released.status == "warm", released.problems
    assert released.locks[0].state == "stale"
    # A builder that died having changed the module: the same lock is now evidence.
    fake_cache.build("k_sm_120.so")
    stale = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert stale.status == "needs-warmup"
    assert any("stale lock left by a dead builder" in p for p in stale.problems)
    assert fast_check(fake_cache.serving, ["sampling"], WHO) is None


def test_gate_rejects(fake_cache: FakeCache) -> None:
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe(gate="rejects"))
    assert report.status == "needs-warmup"
    assert report.gate.verdict == "rejects"
    assert any("flashinfer patch" in h for h in report.hints)


def test_flashinfer_missing_is_unknown(fake_cache: FakeCache) -> None:
    probe = fake_cache.raw()
    probe["identity"] = {**IDENTITY, "flashinfer": None}
    report = assess(fake_cache.serving, ["sampling"], Probe.model_validate(probe))
    assert report.status == "unknown"
    assert report.exit_code == 3


def test_arch_list_hint(fake_cache: FakeCache) -> None:
    probe = fake_cache.raw()
    probe["gate_without_arch_list"] = {"verdict": "rejects", "error": "RuntimeError: sm75"}
    report = assess(fake_cache.serving, ["sampling"], Probe.model_validate(probe))
    assert any("only when the arch list is set" in h for h in report.hints)


def test_fingerprint_is_found_under_both_layouts(tmp_path: Path) -> None:
    for tag_dir in (tmp_path / ".cache/flashinfer/0.7.4/120f", tmp_path / ".cache/flashinfer/100"):
        cache.write_fingerprint(
            cache.Fingerprint(
                "12.0", tag_dir.name, IDENTITY, {}, "now", tag_dir / "k26-fingerprint.json"
            )
        )
    assert sorted(f.arch_tag for f in cache.find_fingerprints(tmp_path)) == ["100", "120f"]


def test_a_live_build_is_refused_before_the_fingerprint_is_touched(fake_cache: FakeCache) -> None:
    import pytest

    from supervisor.core.errors import UnavailableError
    from supervisor.flashinfer.warm import _prepare

    warm_up(fake_cache)
    fake_cache.lock.parent.mkdir(parents=True, exist_ok=True)
    builder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT);"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
         str(fake_cache.lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert builder.stdout is not None and builder.stdout.readline().strip() == "locked"
        fake_cache.build("k_sm_120.so")  # changed under the live build: needs a warm-up
        report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
        with pytest.raises(UnavailableError, match="a live build holds"):
            _prepare(report, fake_cache.serving)
        assert (fake_cache.dir / cache.FINGERPRINT_NAME).exists()
        assert fake_cache.so.exists()  # nothing quarantined either
    finally:
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait()


def test_every_other_module_in_the_cache_is_listed(fake_cache: FakeCache) -> None:
    """A norm.so the server built beside a warm sampling: not asked for, not learned
    yet (no ready unit taught it), still listed with what its file is."""
    warm_up(fake_cache)
    for name, fixture in (("norm", "k_sm_120f.so"), ("rope", "k_sm_90a.so")):
        target = fake_cache.jit / name / f"{name}.so"
        target.parent.mkdir(parents=True)
        target.write_bytes((DATA / fixture).read_bytes())
    (fake_cache.jit / "half").mkdir()  # a build dir without its module: nothing to list
    report = assess(fake_cache.serving, ["sampling"], fake_cache.probe())
    assert report.status == "warm", report.problems  # others do not change the verdict
    assert set(report.others) == {"norm", "rope"}
    assert "sm_120f, runs on the target" in report.others["norm"]
    assert "none of which runs on 12.0" in report.others["rope"]
    assert json.loads(report.to_json())["others"] == report.others
