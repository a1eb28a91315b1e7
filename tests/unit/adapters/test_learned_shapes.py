"""The learned-shapes store and learner: real files, a real event loop, real output."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

from supervisor.adapters import learned_shapes as adapter
from supervisor.core import learned_shapes as core
from supervisor.core.jit_caches import JitCache

PREFILL = (
    "[2026-12-04 14:22:47] Prefill batch, #new-seq: 5, #new-token: 40, #cached-token: 0, "
    "token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False"
)
DECODE = "[2026-12-04 14:22:46] Decode batch, #running-req: 1, #token: 53, token usage: 0.00"


def test_the_state_dir_follows_config_then_systemd_then_the_bus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/k26-supervisor:/var/lib/other")
    assert adapter.state_dir(tmp_path, "system") == tmp_path
    assert adapter.state_dir(None, "system") == Path("/var/lib/k26-supervisor")
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert adapter.state_dir(None, "user") == tmp_path / "k26-supervisor"
    assert adapter.state_dir(None, "system") == Path("/var/lib/k26-supervisor")


def _shape(variant: str = "AB") -> core.LearnedShape:
    batch = core.parse_batch_line(PREFILL)
    assert batch is not None
    return core.LearnedShape("triton", "k", variant, "t0", "t0", batches=(batch,))


def test_the_store_writes_a_private_file_and_reads_it_back(tmp_path: Path) -> None:
    async def go() -> None:
        store = adapter.LearnedStore(tmp_path / "state")
        await store.load()
        await store.add("a.service", [_shape()])
        again = adapter.LearnedStore(tmp_path / "state")
        await again.load()
        assert again.for_unit("a.service") == [_shape()]
        mode = stat.S_IMODE(store.path.stat().st_mode)
        assert mode == 0o600, oct(mode)
        assert json.loads(store.path.read_text())["schema"] == core.SCHEMA
        assert await again.merge_units({"a.service": [_shape()], "b.service": [_shape()]}) == 1

    asyncio.run(go())


def test_a_corrupt_record_is_moved_aside_and_learning_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / core.LEARNED_SHAPES_NAME
    path.write_text('{"schema": 1, "units": {"a.service": [{"cache": 5}]}}')

    async def go() -> None:
        store = adapter.LearnedStore(tmp_path)
        await store.load()
        assert store.for_unit("a.service") == []
        await store.add("a.service", [_shape()])

    asyncio.run(go())
    aside = [p for p in tmp_path.iterdir() if ".bad-" in p.name]
    assert len(aside) == 1 and '"cache": 5' in aside[0].read_text()  # nothing lost
    assert str(path) in caplog.text and "moved it to" in caplog.text
    assert "units.a.service[0]" in caplog.text  # the field at fault


def test_the_learner_records_the_batches_around_a_compile(tmp_path: Path) -> None:
    """The compile's first file lands while the decode line is the last one; the
    prefill that compiled is printed after its forward. Both are kept; the TTIR
    gives the signature."""
    output = [DECODE]
    changes: list[list[core.LearnedShape]] = []
    root = tmp_path / "triton"
    entry = root / "HASH1"
    entry.mkdir(parents=True)
    ttir = entry / "kern.source"
    ttir.write_text("tt.func public @kern(%arg0: !tt.ptr<i64> {tt.divisibility = 16 : i32}) {")

    async def output_of(unit: str) -> list[str]:
        return list(output)

    async def go() -> None:
        settled = asyncio.Event()

        def on_learned(unit: str, record: list[core.LearnedShape]) -> None:
            changes.append(record)
            if len(record[0].batches) == 3 and record[0].signature:
                settled.set()

        store = adapter.LearnedStore(tmp_path / "state")
        learner = adapter.Learner(store, output_of, on_learned)
        learner.saw("a.service", JitCache.TRITON, root, ttir)
        await asyncio.sleep(0)  # the first read happens at once
        output.extend(
            [PREFILL, "INFO: 200 OK", DECODE.replace("#running-req: 1", "#running-req: 5")]
        )
        learner.saw("a.service", JitCache.TRITON, root, entry / "kern.json")
        await settled.wait()
        await learner.close()
        (record,) = store.for_unit("a.service")
        assert record.variant == "HASH1" and record.kernel == "kern" and record.seen == 1
        assert record.signature == "kern(*i64:16)"
        assert [b.kind for b in record.batches] == ["decode", "prefill", "decode"]
        assert [n for n, _ in core.replay_items(record)] == [
            "learned-prefill-5x40", "learned-decode-descent",
        ]  # fmt: skip

    asyncio.run(asyncio.wait_for(go(), 10))
    assert changes and changes[-1][0].signature == "kern(*i64:16)"


def test_variants_are_triton_entries_and_other_caches_directories(tmp_path: Path) -> None:
    root = tmp_path
    triton = adapter.variant_of(JitCache.TRITON, root, root / "ABC" / "__grp__kern.json")
    assert triton == ("ABC", "kern")
    # inductor's <2 chars>/ directories are shards of many kernels: each file is its own
    inductor = adapter.variant_of(JitCache.INDUCTOR, root, root / "ab" / "cabcd.py")
    assert inductor == ("ab/cabcd", "cabcd")
    assert adapter.variant_of(JitCache.CUDA, root, root / "index") == ("index", "index")


def test_doctor_shows_a_unit_s_learned_shapes_and_a_bad_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from supervisor.commands import flashinfer as command

    path = tmp_path / core.LEARNED_SHAPES_NAME
    path.write_text(json.dumps(core.document({"a.service": [_shape(), _shape("CD")]})))
    shown = command._learned_shapes("a.service", tmp_path)
    assert (shown["count"], shown["replayable"], shown["path"]) == (2, 2, str(path))
    command._print_learned("a.service", shown)
    out = capsys.readouterr().out
    assert f"a.service learned shapes: 2 (2 replayed by its coverage) in {path}" in out
    assert "triton k (seen 1x): learned-prefill-5x40" in out
    assert command._learned_shapes("b.service", tmp_path)["count"] == 0
    path.write_text("{")
    bad = command._learned_shapes("a.service", tmp_path)
    command._print_learned("a.service", bad)
    assert f"problem: {path}: not JSON" in capsys.readouterr().out


def test_a_failed_first_sighting_does_not_leave_the_variant_s_other_files_waiting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter, "SETTLE_S", 0.2)  # an idle server prints nothing more
    calls = 0

    async def output_of(unit: str) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("journal gone")
        return [PREFILL]

    root = tmp_path / "triton"
    (root / "H").mkdir(parents=True)

    async def go() -> list[core.LearnedShape]:
        store = adapter.LearnedStore(tmp_path / "state")
        learner = adapter.Learner(store, output_of, lambda unit, r: None)
        learner.saw("a.service", JitCache.TRITON, root, root / "H" / "k.source")
        learner.saw("a.service", JitCache.TRITON, root, root / "H" / "k.cubin")
        await asyncio.wait_for(asyncio.gather(*learner._tasks), 10)  # none hangs
        learner.saw("a.service", JitCache.TRITON, root, root / "H" / "k.json")  # tries again
        await asyncio.wait_for(asyncio.gather(*learner._tasks), 10)
        return store.for_unit("a.service")

    (record,) = asyncio.run(go())
    assert record.variant == "H" and record.batches
    assert "journal gone" in caplog.text


def test_an_unreadable_record_is_left_alone_and_learning_goes_on_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / core.LEARNED_SHAPES_NAME).mkdir()  # reading it fails: not corrupt

    async def go() -> adapter.LearnedStore:
        store = adapter.LearnedStore(tmp_path)
        await store.load()
        await store.add("a.service", [_shape()])
        return store

    store = asyncio.run(go())
    assert store.for_unit("a.service") == [_shape()] and not store.writable
    assert (tmp_path / core.LEARNED_SHAPES_NAME).is_dir()  # not moved aside
    assert not [p for p in tmp_path.iterdir() if ".bad-" in p.name]
    assert "learning goes on in memory only" in caplog.text


def test_the_daemon_keeps_records_merged_into_its_file_meanwhile(tmp_path: Path) -> None:
    """`bundle pull --learned-into` while the daemon runs: its next write keeps them."""

    async def go() -> adapter.LearnedStore:
        store = adapter.LearnedStore(tmp_path)
        await store.load()
        await store.add("a.service", [_shape("MINE")])
        pulled = core.document({"a.service": [_shape("PULLED")]})
        assert adapter.merge_learned_file(store.path, pulled) == 1
        await store.add("a.service", [_shape("MINE2")])
        return store

    store = asyncio.run(go())
    on_disk = adapter.read_records(store.path)["a.service"]
    assert {s.variant for s in on_disk} == {"MINE", "PULLED", "MINE2"}
    assert {s.variant for s in store.for_unit("a.service")} == {"MINE", "PULLED", "MINE2"}


def test_made_sees_complete_entries_inside_their_roots_only(tmp_path: Path) -> None:
    """What a coverage round checks: a Triton entry once its metadata is written, any
    other cache's variant by its file; an entry outside its root, a glob character or
    a kernel that is a path never count (a record may come from another node)."""
    triton, inductor, other = tmp_path / "triton", tmp_path / "inductor", tmp_path / "other"
    entry = triton / "ABC"
    entry.mkdir(parents=True)
    (entry / "kern.source").write_text("ttir")
    roots = {"triton": [triton], "inductor": [inductor], "other": [tmp_path / "o1", other]}
    t = ("triton", "ABC", "kern")
    assert not adapter.made(roots, [t])  # binaries still being written
    (entry / "kern.json").write_text("{}")
    assert adapter.made(roots, [t])
    (entry / "kern.json").unlink()
    (entry / "__grp__kern.json").write_text("{}")  # as Triton 3.6 ends an entry
    assert adapter.made(roots, [t])
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab" / "cabcd.py").write_text("")
    assert adapter.made(roots, [t, ("inductor", "ab/cabcd", "cabcd")])
    assert not adapter.made(roots, [t, ("inductor", "ab/cabc", "cabc")])
    other.mkdir()
    (other / "index").write_text("")
    assert adapter.made(roots, [("other", "index", "index")])  # the second OTHER root
    (tmp_path / "secret.json").write_text("{}")
    (triton / "x").mkdir()
    for bad in [
        ("triton", "..", "secret"), ("triton", "x", "../secret"), ("triton", "/etc", "kern"),
        ("triton", ".", "kern"), ("inductor", "a**b", "k"), ("inductor", "ab/*", "k"),
        ("inductor", "ab/cabc?", "k"), ("triton", "", "kern"), ("tilelang", "ABC", "kern"),
        ("inductor", "ab/c\x00", "k"), ("triton", "AB\x00C", "kern"),
    ]:  # fmt: skip
        assert not adapter.made(roots, [bad]), bad
    assert adapter.made(roots, [])  # nothing asked: nothing missing


def test_the_census_names_triton_variants_and_other_caches_files(tmp_path: Path) -> None:
    """What the coverage lists before and after each shape: a Triton variant from its
    first file on (its hash directory), elsewhere each file less its suffixes, in
    every root of a cache; a missing root adds nothing and a link is not followed."""
    triton, inductor, flashinfer = tmp_path / "t", tmp_path / "i", tmp_path / "f"
    (triton / "ABC").mkdir(parents=True)
    (triton / "ABC" / "kern.source").write_text("ttir")  # the compile's first file
    (triton / "stray.tmp").write_text("")  # a file at the top is no variant
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab" / "cabcd.py").write_text("")
    (inductor / "ab" / "cabcd.best_config").write_text("")  # the same variant
    (inductor / "top.lock").write_text("")
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "x.so").write_text("")
    flashinfer.mkdir()
    (flashinfer / "linked").symlink_to(outside, target_is_directory=True)
    (triton / "LINK").symlink_to(outside, target_is_directory=True)
    roots = {
        "triton": [triton, tmp_path / "missing"],
        "inductor": [inductor],
        "flashinfer": [flashinfer],
    }
    seen = adapter.census(roots)
    assert seen == {
        "triton": frozenset({f"{triton}/ABC"}),
        "inductor": frozenset({f"{inductor}/ab/cabcd", f"{inductor}/top"}),
        "flashinfer": frozenset(),
    }
    (triton / "DEF").mkdir()
    (inductor / "ab" / "cfff.py").write_text("")
    from supervisor.core.coverage import gained

    assert gained(seen, adapter.census(roots)) == (("inductor", 1), ("triton", 1))
