"""Learned shapes: SGLang's batch lines, Triton's signatures, the record and its replay."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.core import coverage
from supervisor.core import learned_shapes as ls

REAL = Path(__file__).parents[1] / "samples" / "real-sglang-0.5.17"


def test_every_batch_line_of_a_real_k2_log_parses_with_its_counts() -> None:
    """The H200 (2026-12-04, K2 2-layer, graphs on): 0.5.17's own lines, unedited."""
    lines = (REAL / "k2-batch-lines-around-late-compile.log").read_text().splitlines()
    batches = [b for b in map(ls.parse_batch_line, lines) if b is not None]
    assert len(batches) == sum("batch, #" in ln for ln in lines) == 20
    long = next(b for b in batches if b.new_token == 700)
    assert long == ls.BatchLine(
        "prefill", 0, new_seq=1, new_token=700, cached_token=0, queue_req=0,
        stamp="2026-12-04 14:22:47", line=long.line,
    )  # fmt: skip
    mixed = next(b for b in batches if b.new_seq == 4)
    assert (mixed.new_token, mixed.cached_token, mixed.running_req) == (8, 132, 1)
    assert [b.running_req for b in batches if b.kind == "decode"][:2] == [2, 1]


def test_eagle3_decode_lines_with_accept_rates_parse() -> None:
    lines = (REAL / "eagle3-decode-batch-lines.log").read_text().splitlines()
    batches = [ls.parse_batch_line(ln) for ln in lines]
    assert lines and all(b is not None and b.kind == "decode" for b in batches)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # SGLANG_LOG_FORWARD_ITERS=1 adds the iteration (metrics_reporter.py, 0.5.17)
        ("[2026-12-04 14:22:47 TP0] Prefill batch [812], #new-seq: 3, #new-token: 48, "
         "#cached-token: 0, token usage: 0.00, #running-req: 2, #queue-req: 1",
         ("prefill", 3, 48, 2)),
        # releases before 0.5 wrote a full stop
        ("Decode batch. #running-req: 12, #token: 900, token usage: 0.01, #queue-req: 0",
         ("decode", None, None, 12)),
    ],
)  # fmt: skip
def test_batch_line_variants(line: str, expected: tuple[object, ...]) -> None:
    batch = ls.parse_batch_line(line)
    assert batch is not None
    assert (batch.kind, batch.new_seq, batch.new_token, batch.running_req) == expected


@pytest.mark.parametrize(
    "line",
    [
        "Prefill batch, nothing else",
        '[2026-12-04 14:22:47] INFO:     127.0.0.1:60414 - "POST /generate HTTP/1.1" 200 OK',
        "Decode batch, #token: 5",  # no running count: not a batch line
        "",
    ],
)
def test_lines_that_are_not_batches(line: str) -> None:
    assert ls.parse_batch_line(line) is None


def test_the_candidates_are_the_line_before_the_compile_and_two_after_it() -> None:
    lines = (REAL / "k2-batch-lines-around-late-compile.log").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if "#new-token: 700" in ln)
    # Read at the compile's first file (the prefill's line is printed after its forward),
    # then once it settled.
    found = ls.candidates(lines[:at], lines)
    assert [b.kind for b in found] == ["decode", "prefill", "prefill"]
    assert found[1].new_token == 700
    # Read a moment late, the prefill already printed: it is still among them.
    assert any(b.new_token == 700 for b in ls.candidates(lines[: at + 1], lines))


def test_new_lines_survive_a_rotated_or_repeated_output() -> None:
    assert ls.new_lines(["a", "b"], ["a", "b", "c"]) == ["c"]
    assert ls.new_lines(["x", "b"], ["b", "c"]) == ["c"]  # only the last line still there
    assert ls.new_lines(["gone"], ["c", "d"]) == ["c", "d"]
    assert ls.new_lines([], ["c"]) == ["c"]


def test_triton_signature_from_a_ttir() -> None:
    source = (
        "#loc = loc(\"/sglang/mem_cache/utils.py\":20:0)\nmodule {\n"
        "  tt.func public @set_mla_kv_buffer_kernel(%arg0: !tt.ptr<bf16> "
        "{tt.divisibility = 16 : i32} loc(\"/x\"(#loc)), %arg1: !tt.ptr<i64> loc(\"/y\"(#loc)), "
        "%arg2: i32 {tt.divisibility = 16 : i32} loc(\"/z\"(#loc)), %arg3: i32 loc(#loc)) "
        "attributes {noinline = false} {\n    tt.return\n  }\n}\n"
    )  # fmt: skip
    assert ls.triton_signature(source) == "set_mla_kv_buffer_kernel(*bf16:16, *i64, i32:16, i32)"
    assert ls.triton_signature("not a ttir") is None


def _shape(*lines: str, variant: str = "AB") -> ls.LearnedShape:
    batches = tuple(b for b in map(ls.parse_batch_line, lines) if b is not None)
    return ls.LearnedShape("triton", "k", variant, "t0", "t0", batches=batches)


PREFILL = "Prefill batch, #new-seq: 3, #new-token: 700, #cached-token: 99, #running-req: 2"


def test_the_replay_plays_the_prefill_its_cached_prefix_and_the_running_batch() -> None:
    shape = _shape(PREFILL, "Decode batch, #running-req: 7, #queue-req: 0")
    assert [n for n, _ in ls.replay_items(shape)] == [
        "learned-prefill-3x700-c99", "learned-decode-descent",
    ]  # fmt: skip
    ctx = coverage.ShapeContext(context_length=4096, max_running=48, kv_tokens=100_000)
    played = ls.shapes([shape], ctx)
    # The descent first: it makes many variants, and a replay whose entries are then
    # in the caches is not played.
    descent, prefill = played
    primer, batch = prefill.waves()
    assert [len(w) for w in prefill.waves()] == [1, 1]
    prefix = primer[0]["input_ids"][:-1]  # the primer: the prefix and one id past it
    assert len(prefix) == 33  # 99 cached tokens over 3 sequences
    prompts = batch[0]["input_ids"]
    assert [len(p) - len(prefix) for p in prompts] == [234, 233, 233]  # 700 new tokens
    assert all(p[: len(prefix)] == prefix for p in prompts)
    assert len({p[len(prefix)] for p in prompts} | {prefix[0]}) == 4  # nothing else shared
    # Decode batches: every size from the server's limit down to 1.
    assert descent.name == "learned-decode-descent" and descent.descent is not None
    assert descent.descent.top == 48
    assert prefill.flush_first and not descent.flush_first
    assert all(coverage.valid_name(s.name) for s in played)
    # Token ids every vocabulary has, as the built-in shapes use.
    ids = [i for b in prefill.bodies() for p in _prompts(b) for i in p]
    assert min(ids) >= 100 and max(ids) <= 356
    # A coverage that descends already (decode-descent) needs no second descent.
    assert [s.name for s in ls.shapes([shape], ctx, descends=True)] == [prefill.name]


def _prompts(body: object) -> list[list[int]]:
    ids = body["input_ids"]  # type: ignore[index]
    return ids if isinstance(ids[0], list) else [ids]


def test_a_prompt_longer_than_the_context_is_cut_to_fit() -> None:
    shape = _shape("Prefill batch, #new-seq: 1, #new-token: 9000, #running-req: 0")
    (played,) = ls.shapes([shape], coverage.ShapeContext(context_length=1024))
    (prompt,) = played.body["input_ids"]
    assert len(prompt) <= 1024 - ls.REPLAY_NEW_TOKENS


def test_a_variant_without_a_batch_line_is_kept_but_not_replayed() -> None:
    shape = _shape()
    assert ls.replay_items(shape) == [] and ls.shapes([shape], coverage.ShapeContext()) == []


def test_merge_counts_sightings_joins_batches_and_keeps_the_newest() -> None:
    first = _shape(PREFILL)
    again = _shape("Decode batch, #running-req: 7", PREFILL)
    merged = ls.merge([first], [again])
    assert len(merged) == 1 and merged[0].seen == 2
    assert [b.kind for b in merged[0].batches] == ["prefill", "decode"]
    many = ls.merge([], [_shape(PREFILL, variant=str(i)) for i in range(10)], limit=4)
    assert [s.variant for s in many] == ["6", "7", "8", "9"]


def test_the_record_round_trips_and_a_bad_one_names_the_field() -> None:
    shape = _shape(PREFILL)
    doc = ls.document({"u.service": [shape]})
    assert ls.parse_records(doc, "f") == {"u.service": [shape]}
    doc["units"]["u.service"][0]["seen"] = 0
    with pytest.raises(ValueError, match=r"f: units.u.service\[0\]: seen 0"):
        ls.parse_records(doc, "f")
    with pytest.raises(ValueError, match="not a learned-shapes record"):
        ls.parse_records({"schema": 9}, "f")


def _radix_slots(
    prompts: list[list[int]],
    seen: set[tuple[int, ...]],
    keeps_last: bool = True,
    bigrams: bool = False,
) -> int:
    """New KV slots a prefill takes under SGLang's radix cache (page size 1): each
    prompt's longest prefix served before, at most all but its last token, is cached.
    Then the prompt is cached whole, or (``keeps_last`` false) all but its last token.
    With ``bigrams`` (an EAGLE server: ``RadixKey.maybe_to_bigram_view``), the cache
    keys token pairs: a shared prefix of N ids is N - 1 cached tokens."""
    slots = 0
    for prompt in prompts:
        shared = max((n for n in range(len(prompt) + 1) if tuple(prompt[:n]) in seen), default=0)
        match = min(shared - 1 if bigrams else shared, len(prompt) - 1)
        slots += len(prompt) - max(0, match)
        kept = len(prompt) if keeps_last else len(prompt) - 1
        seen.update(tuple(prompt[:n]) for n in range(1, kept + 1))
    return slots


@pytest.mark.parametrize("bigrams", [False, True])
@pytest.mark.parametrize(("seqs", "new"), [(1, 1), (1, 700), (2, 6), (3, 16), (11, 35)])
def test_an_unaligned_variant_is_played_at_every_kv_offset_modulo_4(
    seqs: int, new: int, bigrams: bool
) -> None:
    """H200 (2026-12-04, tiny EAGLE-3): write_req_to_token_pool_triton's variant with an
    unaligned last pointer compiled after READY again on the start that replayed its
    batches: where the batch's KV slots begin decides it, and no batch mix sets that."""
    line = f"Prefill batch, #new-seq: {seqs}, #new-token: {new}, #cached-token: 0, #running-req: 0"
    batch = ls.parse_batch_line(line)
    assert batch is not None
    signature = "write_req_to_token_pool_triton(*i32:16, *i64:16, *i64)"
    shape = ls.LearnedShape("triton", "w", "V", "t", "t", signature=signature, batches=(batch,))
    assert shape.unaligned()
    ctx = coverage.ShapeContext(context_length=4096, radix_bigrams=bigrams)
    played = ls.shapes([shape], ctx)
    (sweep,) = [s for s in played if s.name == f"learned-align-{seqs}x{new}"]
    seen: set[tuple[int, ...]] = set()
    offset, starts = 0, []
    for wave in sweep.waves():
        (body,) = wave
        assert body["sampling_params"]["max_new_tokens"] == 1  # no decode slots
        ids = body["input_ids"]
        batch_play = isinstance(ids[0], list)  # else the anchor or a flipper
        taken = _radix_slots(ids if batch_play else [ids], seen, bigrams=bigrams)
        if batch_play:
            starts.append(offset % 4)
            assert taken == new  # exactly the logged new tokens
        offset += taken
    assert sorted(starts) == [0, 1, 2, 3], starts
    aligned = ls.LearnedShape("triton", "w", "V", "t", "t", signature="k(*i64:16, i32)",
                              batches=(batch,))  # fmt: skip
    assert not aligned.unaligned()
    assert not [n for n, _ in ls.replay_items(aligned) if n.startswith("learned-align")]


def test_a_record_with_counts_no_server_runs_is_refused_not_played() -> None:
    doc = ls.document({"u.service": [_shape(PREFILL)]})
    doc["units"]["u.service"][0]["batches"][0]["new_token"] = 10**10
    with pytest.raises(ValueError, match="new_token 10000000000 is past"):
        ls.parse_records(doc, "f")
    assert ls.parse_batch_line(f"Prefill batch, #new-seq: 1, #new-token: {10**10}, "
                               "#running-req: 0") is None  # fmt: skip


@pytest.mark.parametrize("bigrams", [False, True])
@pytest.mark.parametrize("keeps_last", [True, False])
@pytest.mark.parametrize(
    ("seqs", "new_tokens", "cached_tokens"), [(64, 128, 192), (1, 2, 32), (2, 6, 64), (3, 3, 99)]
)
def test_a_replayed_batch_has_the_logged_counts_on_a_flushed_cache(
    seqs: int, new_tokens: int, cached_tokens: int, keeps_last: bool, bigrams: bool
) -> None:
    """Played after /flush_cache, every prompt but the shared prefix is fresh: the
    server counts the logged new and cached tokens, whether the primer's last token
    stays cached or not, and on an EAGLE server, whose radix cache keys token pairs
    (on the H200 every replay there ran one cached token short per sequence:
    1x2-c32 as 1x3-c31, and its variant compiled after READY)."""
    line = (
        f"Prefill batch, #new-seq: {seqs}, #new-token: {new_tokens}, "
        f"#cached-token: {cached_tokens}, #running-req: 0"
    )
    ctx = coverage.ShapeContext(context_length=4096, radix_bigrams=bigrams)
    (shape,) = ls.shapes([_shape(line)], ctx)
    assert shape.flush_first
    seen: set[tuple[int, ...]] = set()
    primer, batch = (w[0]["input_ids"] for w in shape.waves())
    _radix_slots([primer], seen, keeps_last, bigrams)
    new = _radix_slots(batch, seen, bigrams=bigrams)
    cached = sum(len(p) for p in batch) - new
    assert (len(batch), new, cached) == (seqs, new_tokens, cached_tokens)


def test_each_replay_names_what_it_is_played_for_and_beside_a_companion_where_ends_free() -> None:
    """Where request ends hand KV slots back (speculative decoding: sglang 0.5.17's
    allocator rebuilds its free list at each, so one prefill after another starts at
    offset 0), an unaligned variant's batch is replayed beside a decoding companion,
    round after round until the variant is in the cache. Elsewhere the offset sweep
    sets it; every replay names its entries, so one already made is not played."""
    line = "Prefill batch, #new-seq: 2, #new-token: 40, #cached-token: 0, #running-req: 1"
    batch = ls.parse_batch_line(line)
    assert batch is not None
    odd = ls.LearnedShape("triton", "w", "V1", "t", "t", signature="w(*i32:16, *i64)",
                          batches=(batch,))  # fmt: skip
    even = ls.LearnedShape("triton", "k", "V2", "t", "t", signature="k(*i64:16)",
                           batches=(batch,))  # fmt: skip
    base = coverage.ShapeContext(context_length=1024, max_running=6, radix_bigrams=True)
    speculative = coverage.with_server_facts(
        base, {"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 3,
               "context_length": 1024, "max_running_requests": 6},
    )  # fmt: skip
    assert speculative.kv_reset_at_finish
    assert not coverage.with_server_facts(base, {"context_length": 1024}).kv_reset_at_finish
    for ctx, beside in (
        (speculative, True),
        (replace(speculative, kv_reset_at_finish=False), False),
    ):
        played = {s.name: s for s in ls.shapes([odd, even], ctx)}
        # An unaligned variant: every size class at both alignments too (the built-in).
        assert set(played) == {"learned-prefill-2x40", "learned-align-2x40",
                               "prefill-alignment", "learned-decode-descent"}  # fmt: skip
        assert played["prefill-alignment"].why.startswith("learned:")
        # Played for the unaligned variants only: where the descent before it made
        # them (a decode step's), no prefill sweep is played.
        assert played["prefill-alignment"].until == (("triton", "V1", "w"),)
        assert not played["prefill-alignment"].always
        assert list(played).index("prefill-alignment") == 1
        # The descent is there for sizes no start met: played even when what it names
        # is in the caches; a prefill replay is not.
        assert played["learned-decode-descent"].always
        # Its later rounds wait for every other shape (most of what it names, they make).
        assert played["learned-decode-descent"].defer
        assert played["learned-decode-descent"].rounds == ls.DESCENT_ROUNDS > 1
        assert not any(played[n].defer for n in played if n != "learned-decode-descent")
        assert not any(played[n].always for n in played if n != "learned-decode-descent")
        assert bool(played["prefill-alignment"].beside) is beside
        assert "prefill-alignment" not in {s.name for s in ls.shapes([odd], ctx, aligns=True)}
        assert "prefill-alignment" not in {s.name for s in ls.shapes([even], ctx)}
        prefill, align = played["learned-prefill-2x40"], played["learned-align-2x40"]
        # Both variants came from the same batch: its replay is played for both.
        assert prefill.until == (("triton", "V1", "w"), ("triton", "V2", "k"))
        assert align.until == (("triton", "V1", "w"),)
        assert played["learned-decode-descent"].until == prefill.until
        assert prefill.beside == () and prefill.rounds == ls.REPLAY_ROUNDS
        assert align.flush_first and prefill.flush_first
        if beside:
            assert align.rounds == ls.ALIGN_ROUNDS
            for companion in align.beside:
                assert companion["stream"] is True
                params = companion["sampling_params"]
                assert params["ignore_eos"] and params["temperature"] > 0
                assert len(companion["input_ids"]) + params["max_new_tokens"] <= 1024
            # Round by round the batch follows a companion of 5, 6 and 7 ids (offsets 1,
            # 2 and 3 modulo 4), each with its own head: none is the built-in
            # companion's prompt or a prefix of another, so none is ever cached.
            heads = [tuple(c["input_ids"][:2]) for c in align.beside]
            assert [len(c["input_ids"]) for c in align.beside] == list(ls.UNALIGNING_SLOTS)
            assert [n % 4 for n in ls.UNALIGNING_SLOTS] == [1, 2, 3]
            (sweep,) = played["prefill-alignment"].beside
            assert len(set(heads)) == 3 and tuple(sweep["input_ids"][:2]) not in heads
            (wave,) = align.waves()  # the batch itself, as logged, nothing cached
            prompts = wave[0]["input_ids"]
            assert [len(p) for p in prompts] == [20, 20]
        else:
            assert align.beside == ()
            assert len(align.waves()) == 2 * ls._ALIGN_RESIDUES  # the anchor, 4 plays, 3 flips
