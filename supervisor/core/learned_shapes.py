"""Learned shapes: what compiled after READY, the batch the server ran then, and the
request mix the next start's coverage plays to compile it before READY (pure).

The JIT watch sees a file land in a cache; it cannot see the request that made it:
the daemon is not in the request path. What it can read is the server's own account
of its batches, SGLang's scheduler log lines, printed as each batch is formed::

    Prefill batch, #new-seq: 1, #new-token: 700, #cached-token: 0, token usage: 0.02,
        #running-req: 0, #queue-req: 0, ...
    Decode batch, #running-req: 3, #token: 0, token usage: 0.00, cuda graph: True, ...

(sglang 0.5.17, ``scheduler_components/metrics_reporter.py``; older releases wrote
``Prefill batch.``; ``SGLANG_LOG_FORWARD_ITERS`` adds `` [N]``). 0.5.17 prints a
prefill line when it processes the batch's result, after the forward that compiled;
the overlap scheduler processes batch k's result after it launched batch k+1. So the
batch that compiled is one of: the last line before the compile's first file (a
decode batch running on), or the first two printed after it. All of them are kept
and replayed: a compile holds the scheduler, so no batch runs meanwhile.

What this can know: how many sequences a prefill took in, how many new and cached
tokens, how many requests were already running; the size of the running decode
batch. What it cannot: the requests' sampling parameters (a compile that a
parameter, not a batch, selects is recorded and shown, but no batch replays it), how
the new tokens split among the sequences, and, for decode, the step: SGLang logs a
decode batch only every ``decode_log_interval`` (40) steps, so a compile during
decode is dated by the last prefill or decode line, which the batch may have
outgrown or shrunk from since. The replay is therefore a family of mixes around the
logged batch, not a copy of the traffic.

A Triton variant is named by its cache entry: the directory (a hash of source and
specialization), and the kernel's signature as Triton wrote it in ``<name>.source``
(the TTIR before optimisation): each argument's type, and ``tt.divisibility = 16``
where Triton specialised an integer or pointer on 16. Arguments equal to 1 and every
``tl.constexpr`` are folded into the body and not named there; Triton 3.6's metadata
JSON (``<name>.json``) names no constants either (checked against an H200 cache).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from supervisor.core.coverage import Shape, ShapeContext, builtin_shape, companion, valid_name

LEARNED_SHAPES_NAME = "k26-learned-shapes.json"  # apart from FlashInfer's learned modules
SCHEMA = 1
MAX_PER_UNIT = 256  # records kept per unit, the oldest dropped first
MAX_COUNT = 1 << 20  # a batch count past this is refused (a record from elsewhere)
MAX_SEQS = 256  # sequences a replayed prefill plays (fresh first ids: 100..355)
LEARNED_DESCENT = "learned-decode-descent"
REPLAY_NEW_TOKENS = 4  # each replayed sequence decodes a few steps at the batch's size
# Ids 100..355 exist in every vocabulary a served model has. Each learned shape is
# played on a flushed radix cache (Shape.flush_first), so its own prompts only need
# first ids that differ from each other.
_FIRST_ID = 100

_STAMP = r"\[(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?: [^\]]*)?\] "
_BATCH = re.compile(
    rf"(?:{_STAMP})?(?P<kind>Prefill|Decode) batch(?: \[\d+\])?[.,] (?P<fields>.*)$"
)
_FIELD = re.compile(r"#(?P<key>[a-z-]+): (?P<value>\d+)")


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One SGLang scheduler batch line."""

    kind: Literal["prefill", "decode"]
    running_req: int
    new_seq: int | None = None  # prefill only
    new_token: int | None = None
    cached_token: int | None = None
    queue_req: int | None = None
    stamp: str | None = None  # "YYYY-MM-DD HH:MM:SS", the server's clock
    line: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "running_req": self.running_req}
        if self.kind == "prefill":
            out |= {
                "new_seq": self.new_seq,
                "new_token": self.new_token,
                "cached_token": self.cached_token,
            }
        out |= {"queue_req": self.queue_req, "stamp": self.stamp, "line": self.line}
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> BatchLine:
        kind = data.get("kind")
        if kind not in ("prefill", "decode"):
            raise ValueError(f"batch kind {kind!r} is neither prefill nor decode")

        def count(key: str, required: bool = False) -> int | None:
            value = data.get(key)
            if value is None and not required:
                return None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"batch {key} {value!r} is not a count")
            if value > MAX_COUNT:
                raise ValueError(f"batch {key} {value} is past {MAX_COUNT}")
            return value

        running = count("running_req", True)
        assert running is not None
        stamp = data.get("stamp")
        line = data.get("line")
        line = line if isinstance(line, str) else ""
        if kind == "prefill":
            return BatchLine(
                "prefill",
                running,
                new_seq=count("new_seq", True),
                new_token=count("new_token", True),
                cached_token=count("cached_token") or 0,
                queue_req=count("queue_req"),
                stamp=stamp if isinstance(stamp, str) else None,
                line=line,
            )
        return BatchLine(
            "decode",
            running,
            queue_req=count("queue_req"),
            stamp=stamp if isinstance(stamp, str) else None,
            line=line,
        )


def parse_batch_line(line: str) -> BatchLine | None:
    """The batch a scheduler line describes, or None for any other line. A line
    without the counts a batch needs is not one (a message that only mentions one)."""
    found = _BATCH.search(line)
    if found is None:
        return None
    fields = {m["key"]: int(m["value"]) for m in _FIELD.finditer(found["fields"])}
    if any(v > MAX_COUNT for v in fields.values()):
        return None  # no server runs such a batch: not a line to replay
    if "running-req" not in fields:
        return None
    if found["kind"] == "Prefill":
        if "new-seq" not in fields or "new-token" not in fields:
            return None
        return BatchLine(
            "prefill",
            fields["running-req"],
            new_seq=fields["new-seq"],
            new_token=fields["new-token"],
            cached_token=fields.get("cached-token", 0),
            queue_req=fields.get("queue-req"),
            stamp=found["stamp"],
            line=line.strip(),
        )
    return BatchLine(
        "decode",
        fields["running-req"],
        queue_req=fields.get("queue-req"),
        stamp=found["stamp"],
        line=line.strip(),
    )


def last_batch(lines: Sequence[str]) -> BatchLine | None:
    """The last batch line of ``lines`` (the newest last)."""
    for line in reversed(lines):
        batch = parse_batch_line(line)
        if batch is not None:
            return batch
    return None


def new_lines(before: Sequence[str], after: Sequence[str]) -> list[str]:
    """The lines of ``after`` (a later read of the same output's end) that ``before``
    did not end with: after the longest suffix of ``before`` found in ``after``."""
    if not before:
        return list(after)
    tail = list(before[-8:])
    for size in range(len(tail), 0, -1):
        want = tail[-size:]
        for start in range(len(after) - size, -1, -1):
            if list(after[start : start + size]) == want:
                return list(after[start + size :])
    return list(after)  # the end read first is gone (rotated): all of it is new


def candidates(
    before: Sequence[str], after: Sequence[str], *, following: int = 2
) -> list[BatchLine]:
    """The batches that may have compiled (see the module docstring): the last batch
    line of ``before`` (read at the compile's first file) and the first ``following``
    batch lines printed since (``after``: read once the compile is over)."""
    if not before:  # nothing read at the compile (a journal that timed out): the newest
        newest = [b for b in map(parse_batch_line, after) if b is not None]
        return newest[-following:]
    out: list[BatchLine] = []
    last = last_batch(before)
    if last is not None:
        out.append(last)
    for line in new_lines(before, after):
        batch = parse_batch_line(line)
        if batch is not None and len(out) < following + (last is not None):
            out.append(batch)
    return out


_FUNC = re.compile(
    r"tt\.func\s+(?:public\s+)?@(?P<name>[\w$.]+)\s*\((?P<args>.*?)\)\s*(?:->|attributes|\{|loc)",
    re.S,
)
_ARG = re.compile(r"%\w+\s*:\s*(?P<type>!tt\.ptr<[^>]*>|[\w.]+)(?P<attrs>\s*\{[^}]*\})?")


def triton_signature(source: str) -> str | None:
    """The kernel's specialisation as Triton's TTIR states it: each argument's type,
    ``:16`` where it was specialised as divisible by 16. None when no ``tt.func``."""
    found = _FUNC.search(source)
    if found is None:
        return None
    parts = []
    for arg in _ARG.finditer(found["args"]):
        kind = arg["type"]
        if kind.startswith("!tt.ptr<"):
            kind = "*" + kind[len("!tt.ptr<") : -1]
        attrs = arg["attrs"] or ""
        parts.append(kind + (":16" if "tt.divisibility = 16" in attrs else ""))
    return f"{found['name']}({', '.join(parts)})"


# --- records -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LearnedShape:
    """One variant compiled after READY, and the batch the server ran then."""

    cache: str
    kernel: str
    variant: str  # the cache entry: Triton's hash directory, else the file
    first_seen: str
    last_seen: str
    seen: int = 1
    signature: str | None = None  # Triton's, from the entry's TTIR
    # The batches that may have compiled it (``candidates``), as the server logged them.
    batches: tuple[BatchLine, ...] = ()

    def key(self) -> tuple[str, str]:
        return (self.cache, self.variant)

    def unaligned(self) -> bool:
        """Its signature has a pointer without 16-byte alignment: the variant depends
        on where in the KV pool the batch's slots begin, not only on the batch."""
        return bool(self.signature and _UNALIGNED.search(self.signature.partition("(")[2]))

    def to_json(self) -> dict[str, Any]:
        return {
            "cache": self.cache,
            "kernel": self.kernel,
            "variant": self.variant,
            "signature": self.signature,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "seen": self.seen,
            "batches": [b.to_json() for b in self.batches],
            "replay": [name for name, _ in replay_items(self)],
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> LearnedShape:
        def text(key: str, required: bool = True) -> str | None:
            value = data.get(key)
            if value is None and not required:
                return None
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key} {value!r} is not a non-empty string")
            return value

        seen = data.get("seen", 1)
        if not isinstance(seen, int) or isinstance(seen, bool) or seen < 1:
            raise ValueError(f"seen {seen!r} is not a positive count")
        batches = data.get("batches", [])
        if not isinstance(batches, list) or not all(isinstance(b, Mapping) for b in batches):
            raise ValueError("batches is not a list of objects")
        return LearnedShape(
            cache=str(text("cache")),
            kernel=str(text("kernel")),
            variant=str(text("variant")),
            first_seen=str(text("first_seen")),
            last_seen=str(text("last_seen")),
            seen=seen,
            signature=text("signature", False),
            batches=tuple(BatchLine.from_json(b) for b in batches),
        )


MAX_BATCHES = 8  # candidate batches kept per variant


def union(
    old: Sequence[BatchLine], new: Sequence[BatchLine], *, limit: int = MAX_BATCHES
) -> tuple[BatchLine, ...]:
    """``old`` then what ``new`` adds (a batch of the same counts is the same), at most
    ``limit``: a variant that compiled again after its replay was missing one."""
    out = list(old)
    seen = {_counts(b) for b in out}
    for batch in new:
        if _counts(batch) not in seen and len(out) < limit:
            seen.add(_counts(batch))
            out.append(batch)
    return tuple(out)


def _counts(batch: BatchLine) -> tuple[object, ...]:
    return (batch.kind, batch.running_req, batch.new_seq, batch.new_token, batch.cached_token)


def merge(
    known: Sequence[LearnedShape], new: Iterable[LearnedShape], *, limit: int = MAX_PER_UNIT
) -> list[LearnedShape]:
    """``known`` with ``new`` folded in: a variant seen again keeps its first sighting
    and batch (a later one fills in what the first lacked), counts up and moves to
    the end; past ``limit`` the least recently seen go."""
    by_key = {s.key(): s for s in known}
    for shape in new:
        old = by_key.pop(shape.key(), None)
        if old is not None:
            shape = LearnedShape(
                cache=old.cache,
                kernel=old.kernel,
                variant=old.variant,
                first_seen=min(old.first_seen, shape.first_seen),
                last_seen=max(old.last_seen, shape.last_seen),
                seen=old.seen + shape.seen,
                signature=old.signature or shape.signature,
                batches=union(old.batches, shape.batches),
            )
        by_key[shape.key()] = shape
    return list(by_key.values())[-limit:]


def parse_records(data: Any, where: str) -> dict[str, list[LearnedShape]]:
    """Unit -> records, from a learned-shapes document. ValueError names what is wrong."""
    if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
        raise ValueError(f"{where}: not a learned-shapes record (schema {SCHEMA})")
    units = data.get("units")
    if not isinstance(units, Mapping):
        raise ValueError(f"{where}: 'units' is not an object")
    out: dict[str, list[LearnedShape]] = {}
    for unit, records in units.items():
        if not isinstance(records, list):
            raise ValueError(f"{where}: units.{unit} is not a list")
        parsed = []
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise ValueError(f"{where}: units.{unit}[{i}] is not an object")
            try:
                parsed.append(LearnedShape.from_json(record))
            except ValueError as exc:
                raise ValueError(f"{where}: units.{unit}[{i}]: {exc}") from None
        out[str(unit)] = merge([], parsed)
    return out


def document(records: Mapping[str, Sequence[LearnedShape]]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "units": {unit: [s.to_json() for s in shapes] for unit, shapes in records.items()},
    }


# --- the replay ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Prefill:
    seqs: int
    new_tokens: int
    cached: int


@dataclass(frozen=True, slots=True)
class _Decode:
    running: int


@dataclass(frozen=True, slots=True)
class _Align:
    """A prefill of ``seqs`` sequences and ``new_tokens`` played at each of four
    consecutive offsets of the KV slots it writes (see ``shapes``)."""

    seqs: int
    new_tokens: int


_Item = _Prefill | _Decode | _Align
_UNALIGNED = re.compile(r"\*\w+(?=,|\)|$)")  # a pointer Triton did not find 16-byte aligned


def replay_items(shape: LearnedShape) -> list[tuple[str, _Item]]:
    """The mixes that reproduce each batch that may have compiled ``shape``: a prefill
    of the logged sequences, new and cached tokens (whose sequences then decode
    together), and a decode batch of the whole running batch when requests were
    running beside the prefill (the batch the next decode steps run). A decode line
    gives a decode batch of its size. Decode batches are played by one descent
    (``shapes``): its item carries the largest. None without a batch line."""
    out: dict[str, _Item] = {}
    top = 0
    for batch in shape.batches:
        if batch.kind == "prefill":
            seqs, new = max(1, batch.new_seq or 1), max(1, batch.new_token or 1)
            cached = batch.cached_token or 0
            item = _Prefill(seqs, max(new, seqs), cached)
            name = f"learned-prefill-{item.seqs}x{item.new_tokens}"
            out.setdefault(name + (f"-c{cached}" if cached else ""), item)
            if shape.unaligned():
                out.setdefault(
                    f"learned-align-{item.seqs}x{item.new_tokens}",
                    _Align(item.seqs, item.new_tokens),
                )
            if batch.running_req:
                top = max(top, batch.running_req + seqs)
        else:
            top = max(top, batch.running_req)
    if top:
        out[LEARNED_DESCENT] = _Decode(top)
    return list(out.items())


def _ids(index: int, count: int) -> list[int]:
    """``count`` ids that begin with an id no other prompt of the shape begins with
    (each learned shape is played after a radix-cache flush, and has at most 256
    prompts: ``MAX_SEQS``)."""
    head = [_FIRST_ID + index % 256]
    return (head + [352 + index % 3] * count)[: max(1, count)]


# Every prompt of an alignment sweep starts with this id (after an anchor prompt that
# puts it in the radix cache) and then a pair no other prompt has: each prompt of L ids
# then matches exactly one cached id and takes L - 1 new KV slots, so the sweep knows
# how far each play moves the allocator's offset. No built-in shape starts with it.
_ANCHOR = 355
_ANCHOR_HEAD = [_ANCHOR, 354]  # its first two ids: shared where the cache keys pairs
_PRIMER_END = 356  # ends a replay's primer, after the shared prefix (_prefill_bodies)
_ALIGN_RESIDUES = 4  # int32 slices are 16-byte aligned at every fourth slot
# KV slots the companion of an unaligned replay takes, round by round
# (``companion(slots=...)``, ``Shape.beside``): the replayed batch is prefilled right
# after it, at that offset. 5 and 7 (1 and 3 modulo 4) leave an int64 slice 8 bytes
# off 16 and an int32 one 4 or 12; 6 (2 modulo 4) leaves an int32 slice 8 bytes off
# while an int64 one is aligned, a variant of its own. A first decode step between
# takes an even reserve, which keeps an odd offset odd.
UNALIGNING_SLOTS = (5, 6, 7)
# Rounds of a learned shape, played again while its variant is not in the cache. An
# alignment replay's offset is set by its companion's prompt (above), so one round
# makes it unless the scheduler took the batch with another prefill, or decode steps
# past the companion's first came between (a fast server's, or the stand-in's 2 ms
# ones: there a round makes it about 1 time in 2 to 5 of 6, bench/coverage_alignment.py).
# Two turns of the three companions (6 rounds) cover that: on the stand-in every run
# made it within 5. On the GPU (2026-12-05) every replay that made its variant did in
# round 1, and none of three that ran 12 rounds made it after: a real server lands a
# companion's offset the same way each turn, so later turns cost 90 ms a round for
# nothing. (Until 2026-12-05 the companion had 4 ids, every replay landed at offset 4,
# aligned, and 36 rounds on the H200 never made the variant: rounds did not help, a
# parity did.) A replay without one plays the same batches at the same offsets: once.
ALIGN_ROUNDS = 2 * len(UNALIGNING_SLOTS)
REPLAY_ROUNDS = 1
# Rounds of the learned descent, the second after every other shape and only where
# none made what it names (``Shape.defer``), holding every size twice as long: with a
# trained draft a step's KV slots move the offset by the tokens it accepted, and which
# alignment a size meets is chance; longer holds are more chances at it. One round
# more, not several: where what is missing is no decode step's (a variant nothing
# makes), the round is spent in vain, about a descent's steps at twice the holds
# (on the H100's tiny EAGLE-3, 48 sizes at about 15 ms a step: some 3 s).
DESCENT_ROUNDS = 2


def _anchored(index: int, new: int, bigrams: bool = False) -> list[int]:
    """A prompt that takes exactly ``new`` slots after the anchor (see ``_ANCHOR``):
    ``new + 1`` ids that share one cached token with the anchor: its first id, or
    its first two where the radix cache keys token pairs (``bigrams``: two shared
    ids are one cached token)."""
    head = [*_ANCHOR_HEAD[: 1 + bigrams], 100 + index % 254, 100 + (index // 254) % 254]
    return (head + [353] * new)[: new + 1]


def _align_bodies(item: _Align, limit: int, bigrams: bool = False) -> list[dict[str, Any]]:
    """The anchor, then the prefill at four consecutive offsets modulo 4 (and so at
    both parities): between two plays, a one-prompt prefill of ``f`` slots with
    ``new_tokens + f`` one more than a multiple of 4. A pointer into the int64 slots
    the batch writes is 16-byte aligned at every other offset, an int32 one at every
    fourth. Played on a flushed radix cache and allocator (``Shape.flush_first``)."""
    once = {"max_new_tokens": 1, "temperature": 0.7}  # a prefill only: no decode slots
    anchor = [*_ANCHOR_HEAD[: 1 + bigrams], _PRIMER_END]
    bodies: list[dict[str, Any]] = [{"input_ids": anchor, "sampling_params": once}]
    index = 0
    flip = (1 - item.new_tokens) % _ALIGN_RESIDUES or _ALIGN_RESIDUES
    for play in range(_ALIGN_RESIDUES):
        shares = _split(item.new_tokens, item.seqs)
        prompts = [
            _anchored(index + i, min(max(1, n), limit), bigrams) for i, n in enumerate(shares)
        ]
        index += item.seqs
        bodies.append({"input_ids": prompts, "sampling_params": once})
        if play < _ALIGN_RESIDUES - 1:
            bodies.append({"input_ids": _anchored(index, flip, bigrams), "sampling_params": once})
            index += 1
    return bodies


def _prefill_bodies(item: _Prefill, limit: int, bigrams: bool = False) -> list[dict[str, Any]]:
    """The cached prefix served once (one new token), then the batch: ``seqs``
    prompts that share it and then differ from their first id on, ``new_tokens`` in
    all, each decoding a few steps together (``REPLAY_NEW_TOKENS``). Where the radix
    cache keys token pairs (``bigrams``: an EAGLE server), N shared ids are N - 1
    cached tokens and the Nth is computed again, so the prefix is one id longer and
    each prompt's own ids one fewer (on the H200, 2026-12-04, tiny
    EAGLE-3: every replay had run one cached token short per sequence, and the
    variant its batch compiles came after READY)."""
    seqs = min(item.seqs, MAX_SEQS)
    bodies: list[dict[str, Any]] = []
    prefix: list[int] = []
    if item.cached // seqs:
        prefix = _ids(0, min(item.cached // seqs + bigrams, limit // 2))
        primer = {"max_new_tokens": 1, "temperature": 0.7}
        # One id past the prefix, which no replayed prompt has there: the whole
        # prefix is in the radix cache whether it keeps a finished prompt's last
        # token or not, and nothing past it is shared.
        bodies.append({"input_ids": [*prefix, _PRIMER_END], "sampling_params": primer})
    room = max(1, limit - len(prefix))
    # The last shared id is computed again where pairs are keyed: one own id fewer.
    shift = 1 if bigrams and prefix else 0
    prompts = [
        prefix + (_ids(1 + i, min(count - shift, room)) if count > shift else [])
        for i, count in enumerate(_split(item.new_tokens, seqs))
    ]
    sampling = {"max_new_tokens": REPLAY_NEW_TOKENS, "temperature": 0.7, "top_k": 20}
    bodies.append({"input_ids": prompts, "sampling_params": sampling})
    return bodies


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shapes(
    records: Sequence[LearnedShape],
    ctx: ShapeContext,
    *,
    descends: bool = False,
    aligns: bool = False,
) -> list[Shape]:
    """When any record names a decode batch, one decode descent
    (``learned-decode-descent``) from the server's running limit down to 1; then one
    coverage shape per distinct prefill the records call for (each played on a
    flushed radix cache).
    Decode batches are not replayed one by one: which sizes concurrent traffic runs
    depends on when each request arrives, so a kernel keyed on the batch size that
    compiled at one size will meet others; the descent covers them all for a few
    steps each. None when the unit's own coverage already ``descends``. A prompt
    longer than the server's context allows is cut to fit (one learned on another
    node, through a bundle, may name a longer one).

    Each shape names the entries it is played for (``Shape.until``): where the player
    sees the unit's caches, one already there costs nothing (but the descent, which is
    there for sizes not yet met: ``Shape.always``), and a replay that did not make its
    variant goes again (``rounds``). An unaligned variant on a server
    whose request ends take KV slots back (``ShapeContext.kv_reset_at_finish``) is
    replayed beside companions (``Shape.beside``) of ``UNALIGNING_SLOTS`` ids, round
    by round: there every request's end starts the offset over, and
    the batch, sent on the companion's first token, is prefilled right after the
    companion's prompt, at the offset its length sets.

    A server that compiled an unaligned variant has kernels keyed on where a batch's
    KV slots begin, for every prefill size, not only the sizes learned: the built-in
    ``prefill-alignment`` (every size class at both alignments) is played too,
    unless the unit's own coverage ``aligns`` already, or the descent before it made
    every unaligned variant learned (its ``until``: a decode step's, not a prefill's).

    The descent and the sweep go first, as the unit's own batch shapes do (built-ins
    come before learned ones): they make many learned variants on the way, and a
    replay whose entries are then in the caches is not played. On the H100
    (2026-12-05), with them last, 14 of 16 prefill replays and 12 rounds of one
    alignment replay (4.4 s of a 24 s coverage) were played for variants they did
    not make; the client matrix after READY compiled nothing, so the shapes after
    them made those."""
    items: dict[str, _Prefill | _Align] = {}
    wanted: dict[str, list[tuple[str, str, str]]] = {}
    top = 0
    for record in records:
        entry = (record.cache, record.variant, record.kernel)
        for name, item in replay_items(record):
            if isinstance(item, _Decode):
                top = max(top, item.running)
                wanted.setdefault(LEARNED_DESCENT, []).append(entry)
            elif valid_name(name):
                items.setdefault(name, item)
                wanted.setdefault(name, []).append(entry)
    out: list[Shape] = []
    if top and not descends:
        # Up to the server's own limit, not the largest size learned: concurrent traffic
        # runs whatever sizes arrival times make (measured on the stand-in: a second
        # start's matrix met sizes above the first's largest).
        most = ctx.max_running or top
        descent = builtin_shape("decode-descent", replace(ctx, max_running=most))
        until = tuple(dict.fromkeys(wanted[LEARNED_DESCENT]))
        # Played at every start, made or not: it is there for the sizes no start has
        # met yet (with the learned ones pulled from a bundle and the descent skipped,
        # the CPU rehearsal's matrix compiled a batch size new to it after READY).
        out.append(
            replace(
                descent, name=LEARNED_DESCENT, why="learned: decode batches", until=until,
                always=True, rounds=DESCENT_ROUNDS, defer=True,
            )
        )  # fmt: skip
    unaligned = tuple(
        dict.fromkeys((r.cache, r.variant, r.kernel) for r in records if r.unaligned())
    )
    if not aligns and unaligned:
        # Played for the unaligned variants, and not where the descent before it made
        # them all: then they are a decode step's (the EAGLE draft's slots, keyed at
        # every size), which no prefill meets. On the H100 (2026-12-05) three of the
        # four unaligned variants learned were ``assign_req_to_token_pool``'s.
        sweep = builtin_shape("prefill-alignment", ctx)
        why = "learned: a variant keyed on the KV slot offset"
        out.append(replace(sweep, why=why, until=unaligned))
    limit = max(2, (ctx.context_length or 1 << 30) - REPLAY_NEW_TOKENS - 8)
    for name, item in items.items():
        until = tuple(dict.fromkeys(wanted[name]))
        if isinstance(item, _Align) and ctx.kv_reset_at_finish:
            as_prefill = _Prefill(item.seqs, item.new_tokens, 0)
            bodies = _prefill_bodies(as_prefill, limit, ctx.radix_bigrams)
            why = "learned: an unaligned variant, after companions of 5, 6 and 7 ids until made"
            # Their own heads (index 1..): no other companion's prompt is cached.
            beside: tuple[Mapping[str, Any], ...] = tuple(
                companion(ctx, 1 + n, slots=slots) for n, slots in enumerate(UNALIGNING_SLOTS)
            )
            rounds = ALIGN_ROUNDS
        elif isinstance(item, _Align):
            if _ALIGN_RESIDUES * item.seqs + _ALIGN_RESIDUES > 254:
                continue  # more prompts than fresh anchored ones (62 sequences)
            bodies = _align_bodies(item, limit, ctx.radix_bigrams)
            why = "learned: an unaligned variant, at each KV slot offset modulo 4"
            beside, rounds = (), REPLAY_ROUNDS
        else:
            bodies = _prefill_bodies(item, limit, ctx.radix_bigrams)
            why = "learned: compiled after READY on an earlier start"
            beside, rounds = (), REPLAY_ROUNDS
        steps = (1,) * len(bodies)
        shape = Shape(name, "/generate", bodies[-1], len(bodies), why, tuple(bodies), steps)
        out.append(replace(shape, flush_first=True, beside=beside, until=until, rounds=rounds))
    return out
