"""The GPU script rehearsed on CPU with the stand-in (bench/gpu/eagle3_real_sglang.py
--server standin): its sandbox, units, daemon and acts, as the lent GPU will run them,
so that a moved command or a broken act shows here first (one did, unseen, once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.coverage import builtin_names

from .builds import ARCH, ARCH_DIR, SMALL_MODULE, SessionBuild

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "eagle3_real_sglang.py"


# The built-in shapes less every batch-size one: the matrix then compiles after READY,
# and the learn act's second start shows what learning brings back.
UNBATCHED = [n for n in builtin_names()
             if n not in ("decode-descent", "batch-ramp", "mixed-batch", "prefill-alignment")]  # fmt: skip


def _rehearse(tmp_path: Path, acts: str, *flags: str) -> dict[str, Any]:
    """The script's ``acts`` on the stand-in with the coverage less its batch shapes
    (and ``flags``): each act's result, once the run and its cold start passed."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--server", "standin", "--out", str(out),
         "--work", str(tmp_path / "work"), "--state", str(tmp_path / "state"),
         "--acts", acts, "--coverage-shapes", ",".join(UNBATCHED), "--deadline-s", "420",
         *flags],
        capture_output=True, text=True, timeout=480, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((out / "eagle3_real_sglang.json").read_text())
    assert result["skipped"] == [] and "error" not in result, result.get("error")
    assert result["acts"]["cold"]["primary"]["state"] == "ready", result["acts"]["cold"]
    return dict(result["acts"])


# The device-assert act logs an Xid to /dev/kmsg (the stand-in's --xid-pci). No cold
# FlashInfer JIT at each stand-in start (--standin-cold-s 0): it cost 40 s of sleep a
# start, three starts a run, and what a cold build does to the start is the subject
# of tests/integration/test_booted_host.py and the stand-in's own tests, not of this
# rehearsal of the script's acts.
@pytest.mark.xdist_group("kmsg")
def test_the_eagle3_script_plays_cold_matrix_learn_and_device_assert_on_the_standin(
    tmp_path: Path,
) -> None:
    acts = _rehearse(
        tmp_path, "cold,matrix,learn,device-assert", "--no-warmup", "--standin-cold-s", "0"
    )
    assert acts["matrix"]["all_200"], acts["matrix"]["shapes"]
    assert acts["matrix"]["n_files_gained"] > 0  # batches the coverage left out
    learn = acts["learn"]
    assert "error" not in learn, learn.get("error")
    assert learn["learned"]["replayable"] > 0, learn["learned"]
    played = {s["name"]: s["result"] for s in learn["primary"]["coverage"]["shapes"]}
    assert played.get("learned-decode-descent") == "ok", played
    assert learn["matrix"]["all_200"], learn["matrix"]
    # Every variant start 1 learned was made before READY. What the same matrix may
    # still compile after it is a variant no start saw: only one keyed on the KV slot
    # offset, which concurrent requests set by chance (sglang 0.5.17's allocator; on
    # the stand-in the built-in sweep misses one with chance about 2 %, and learning
    # takes it for the next start: tests/integration/test_learned_shapes.py).
    learned = {r["variant"] for rs in learn["record"]["units"].values() for r in rs}
    late = learn["matrix"]["files_gained"]
    assert set(late) <= {"triton"}, late
    entries = {path.split("/")[0] for path in late.get("triton", [])}
    assert not entries & learned, (entries, late)
    assert all(p.split("/")[1].startswith("set_kv_buffer_kernel.") for p in late.get("triton", []))
    count = learn["matrix"]["jit_after_ready_count"]  # the watch's, read at once: may lag
    assert count[0] == 0 and 0 <= count[1] <= len(late.get("triton", [])), (count, late)
    crash = acts["device-assert"]
    assert "error" not in crash, crash.get("error")
    assert crash["verdict_cause"] == "cuda-error" and crash["xid_in_evidence"]
    assert crash["needs_person"] is False and crash["serving_again"]
    assert (tmp_path / "out" / "eagle3-logs.tar.gz").is_file()


@pytest.mark.flashinfer
def test_the_bundle_act_round_trips_every_cache_through_the_registry_on_the_standin(
    small_build: SessionBuild, tmp_path: Path
) -> None:
    """The bundle act after cold and matrix, on the EAGLE-3 pair, with the daemon's
    real FlashInfer warm-up over the session's small build, at the path it was built
    at (its ninja state names it), and Debian's docker-registry: the push carries the
    FlashInfer module the daemon warms and the caches the matrix filled, with what the
    daemon learned; after the wipe, the node's warm-up pulls it, the product judges it
    effective (nothing built up to READY), and the matrix builds nothing the bundle
    carried. The start's ratio to the warm one is reported (a number for the GPU, not
    asserted here)."""
    workspace = small_build.restore()
    try:
        _bundle_act(workspace, tmp_path)
    finally:  # the session's build as the next test of the group expects it
        (workspace / "k26-learned-modules.json").unlink(missing_ok=True)
        small_build.restore()


def _bundle_act(workspace: Path, tmp_path: Path) -> None:
    acts = _rehearse(
        tmp_path, "cold,matrix,bundle", "--flashinfer-modules", SMALL_MODULE,
        "--flashinfer-workspace", str(workspace), "--arch", ARCH, "--standin-cold-s", "0",
    )  # fmt: skip
    assert acts["matrix"]["n_files_gained"] > 0  # what the bundle's learned shapes carry
    bundle = acts["bundle"]
    assert "error" not in bundle and not bundle.get("stop_here"), bundle
    assert sum(bundle["push"]["learned_shapes"].values()) > 0, bundle["push"]
    pushed = bundle["pushed_layers"]
    assert pushed.get("flashinfer", 0) > 0 and pushed.get("triton", 0) > 0, pushed
    # The node's warm-up pulled it: the module, the learned shapes and the product's
    # verdict that nothing was built from the pull to READY.
    assert f"{ARCH_DIR[1]}/{SMALL_MODULE}" in bundle["pulled_flashinfer_modules"], bundle
    assert (bundle["learned_after_pull"] or {}).get("replayable", 0) > 0, bundle
    verdict = bundle["bundle"]
    assert verdict["digest"] == bundle["push"]["digest"], verdict
    assert verdict["effective"] is True and verdict["rebuilt"] == [], verdict
    assert bundle["built_through_ready_count"] == 0, bundle["built_through_ready"]
    # The matrix after READY, as in the learn act: the learned descent, played at every
    # start, walked every batch size; what may still compile is a variant keyed on the
    # KV slot offset that concurrent requests set by chance, and none the bundle carried.
    played = {s["name"]: s for s in bundle["primary"]["coverage"]["shapes"]}
    assert played["learned-decode-descent"]["requests"] > 0, played["learned-decode-descent"]
    matrix = bundle["matrix"]
    assert matrix["all_200"], matrix["shapes"]
    late = matrix["files_gained"]
    assert set(late) <= {"triton"}, late
    entries = {path.split("/")[0] for path in late.get("triton", [])}
    assert not entries & set(bundle["learned_variants"]), (entries, late)
    assert all(p.split("/")[1].startswith("set_kv_buffer_kernel.") for p in late.get("triton", []))
    assert bundle["warm_start_s"] > 0 and bundle["ratio_to_warm"] > 0, bundle
