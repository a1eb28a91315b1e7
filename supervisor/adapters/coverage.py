"""The coverage warm-up: every request shape of a unit's set, played once before READY.

``core.coverage`` says which shapes and what an answer means; this adapter asks the
server what the bodies need (its model name, its prefill chunk), sends each
shape's requests (a batch at once where the shape is a batch), times them and
judges each answer. Never raises for anything the server does: a failed shape
is a result, with the server's own words in ``detail``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx

from supervisor.adapters.probe import error_text
from supervisor.core.coverage import (
    CoverageReport,
    Descent,
    Shape,
    ShapeContext,
    ShapeOutcome,
    ShapeResult,
    add_compiled,
    descent_ids,
    gained,
    held_sizes,
    judge,
    with_server_facts,
)

MAX_BODY_BYTES = 4 << 20
FLUSH_WAIT_S = 2.0  # how long a flush refused for running requests is asked again
FLUSH_POLL_S = 0.05
_SNIPPET = 300


def _clean(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SNIPPET else text[: _SNIPPET - 3] + "..."


def _finish_reason(data: dict[str, Any]) -> str | None:
    meta = data.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("finish_reason"), dict):
        return str(meta["finish_reason"].get("message") or meta["finish_reason"])
    return None


def _message(body: bytes) -> str:
    return error_text(body, _clean, ("error.message", "error", "message", "detail"), _finish_reason)


def _shaped(endpoint: str, body: bytes) -> bool:
    """The endpoint's answer shape: /generate's text and meta_info (one, or a list for
    n > 1), OpenAI's choices."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if endpoint == "/generate":
        items = data if isinstance(data, list) else [data]
        return bool(items) and all(
            isinstance(i, dict)
            and isinstance(i.get("text"), str)
            and isinstance(i.get("meta_info"), dict)
            for i in items
        )
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("choices"), list)
        or not data["choices"]
    ):
        return False
    key = "message" if endpoint.endswith("/chat/completions") else "text"
    return all(isinstance(c, dict) and key in c for c in data["choices"])


def _aborted(body: bytes) -> str | None:
    """SGLang reports some refusals as a 200 whose finish_reason is an abort."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    for item in data if isinstance(data, list) else [data]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return _clean(str(finish.get("message") or "aborted"))
    return None


async def _one(
    http: httpx.AsyncClient, url: str, endpoint: str, body: Mapping[str, Any], timeout_s: float
) -> tuple[ShapeResult, str | None]:
    status: int | None = None
    data = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream(
                "POST", f"{url}{endpoint}", json=dict(body), timeout=timeout_s
            ) as response:
                status = response.status_code
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_BODY_BYTES:
                        return ShapeResult.FAILED, f"answer larger than {MAX_BODY_BYTES} bytes"
    except TimeoutError:
        return ShapeResult.FAILED, f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        where = "request" if status is None else "response"
        return ShapeResult.FAILED, f"{type(exc).__name__} during the {where}: {_clean(str(exc))}"
    raw = bytes(data)
    aborted = _aborted(raw) if status == 200 else None
    if aborted is not None:
        result = judge(400, aborted, shaped=False)
        return result, f"aborted: {aborted}"
    result = judge(status, _message(raw), shaped=status == 200 and _shaped(endpoint, raw))
    if result is ShapeResult.OK:
        return result, None
    detail = (
        f"HTTP {status}: {_message(raw)}"
        if status != 200
        else f"not {endpoint}'s answer: {_message(raw)}"
    )
    return result, detail


Produced = Callable[[Sequence[tuple[str, str, str]]], Awaitable[bool]]
# Every entry of the unit's JIT caches now, per cache; None where they cannot be read.
Census = Callable[[], Awaitable[Mapping[str, frozenset[str]] | None]]


class _Gains:
    """What the caches gained since it last looked (``ShapeOutcome.compiled``)."""

    def __init__(self, census: Census | None) -> None:
        self.census = census
        self.seen: Mapping[str, frozenset[str]] | None = None

    async def start(self) -> None:
        if self.census is not None:
            self.seen = await self.census()

    async def since(self) -> tuple[tuple[str, int], ...] | None:
        if self.census is None:
            return None
        now = await self.census()
        was, self.seen = self.seen, now
        return None if was is None or now is None else gained(was, now)


async def play(
    url: str,
    shapes: Sequence[Shape],
    *,
    timeout_s: float,
    client: httpx.AsyncClient | None = None,
    progress: Any = None,
    produced: Produced | None = None,
    census: Census | None = None,
) -> CoverageReport:
    """Each shape in order, its requests at once; stops at the first failed shape (the
    unit is not ready, and a dying server would only fail the rest). ``produced``
    says whether a shape's cache entries (``Shape.until``) are all in the unit's
    caches: such a shape is not played (unless it is ``always`` played), and one
    played goes again, up to its ``rounds``, until they are. Entries a shape's
    rounds did not make get one round from each later shape played for them alone:
    several learned replays name the same variant, and on the H200 (2026-12-05)
    three of them spent 12 rounds each on one that none made (3.5 s). A shape whose
    entries a later shape made says so in its ``detail``. A shape that ``defer``s
    plays its first round in its place and the rest after every other shape, only
    where none made its entries. ``census`` lists the unit's caches: each shape played
    says what they gained meanwhile (``ShapeOutcome.compiled``)."""
    http = client if client is not None else httpx.AsyncClient(trust_env=False)
    started = time.monotonic()
    gains = _Gains(census)
    outcomes: list[ShapeOutcome] = []
    unmade: set[tuple[str, str, str]] = set()  # entries a shape's rounds were spent on in vain
    missing: list[tuple[int, Sequence[tuple[str, str, str]]]] = []  # played, not made
    deferred: list[tuple[int, Shape]] = []  # their later rounds go last
    try:
        await gains.start()
        for shape in shapes:
            tic = time.perf_counter()
            watched = produced if shape.until else None
            there = watched is not None and await watched(shape.until)
            if not there and shape.rounds > 1 and unmade.issuperset(shape.until):
                shape = replace(shape, rounds=1)
            if there and not shape.always:
                outcome = ShapeOutcome(shape.name, ShapeResult.OK, 0.0, 0, _IN_CACHE)
            elif there:  # played once all the same, for what it meets beyond them
                outcome, _ = await _rounds(
                    http, url, replace(shape, rounds=1), None, timeout_s, tic
                )
                if outcome.result is ShapeResult.OK:
                    said = _ALWAYS if outcome.detail is None else f"{_ALWAYS}; {outcome.detail}"
                    outcome = replace(outcome, detail=said)
            else:
                defers = shape.defer and shape.rounds > 1 and watched is not None
                first = replace(shape, rounds=1) if defers else shape
                outcome, made = await _rounds(http, url, first, watched, timeout_s, tic)
                if watched is not None and not made and outcome.result is ShapeResult.OK:
                    missing.append((len(outcomes), shape.until))
                    if defers:
                        deferred.append((len(outcomes), shape))
                if watched is not None and not made and shape.rounds > 1 and not defers:
                    unmade.update(shape.until)
            if outcome.requests:
                outcome = replace(outcome, compiled=await gains.since())
            elif census is not None:  # not played: the server was idle
                outcome = replace(outcome, compiled=())
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
            if outcome.result is ShapeResult.FAILED:
                break
        # What a shape did not make, a later one may have: the learned descent goes
        # first and names the variants its batches were logged beside, which the sweep
        # or a replay then makes (on the H100, 2026-12-05, /status said the descent's
        # were "not made" while the client matrix after READY compiled nothing).
        # Deferred rounds first, each only while what it is played for is missing (a
        # later shape, or an earlier deferred round, may have made it); then what
        # every other shape did not make, a later one may have.
        for index, shape in deferred:  # only where ``produced`` watched them
            assert produced is not None
            if not _none_failed(outcomes):
                break
            was = outcomes[index]
            if await produced(shape.until):
                outcomes[index] = replace(was, detail=f"{was.detail}; {_LATER}")
                continue
            tic = time.perf_counter()
            more, _ = await _rounds(http, url, shape, produced, timeout_s, tic, first=2)
            more = replace(more, compiled=await gains.since())
            outcomes[index] = replace(
                more,
                duration_ms=was.duration_ms + more.duration_ms,
                requests=was.requests + more.requests,
                compiled=add_compiled(was.compiled, more.compiled),
            )
            if progress is not None:
                progress(more)  # the later rounds' own time: the log's lines add up
        if produced is not None and _none_failed(outcomes):
            later = {index for index, _ in deferred}
            for index, until in missing:
                if index not in later and await produced(until):
                    was = outcomes[index]
                    outcomes[index] = replace(was, detail=f"{was.detail}; {_LATER}")
    finally:
        if client is None:
            await http.aclose()
    ok = all(o.result is not ShapeResult.FAILED for o in outcomes)
    return CoverageReport(ok, datetime.now(UTC), time.monotonic() - started, tuple(outcomes))


def _none_failed(outcomes: Sequence[ShapeOutcome]) -> bool:
    return not any(o.result is ShapeResult.FAILED for o in outcomes)


_IN_CACHE = "what it is played for is in the unit's caches already: not played"
_LATER = "a later shape made it"
_ALWAYS = "played at every start; what it is played for was in the caches already"


async def _rounds(
    http: httpx.AsyncClient, url: str, shape: Shape, produced: Produced | None,
    timeout_s: float, tic: float, first: int = 1,
) -> tuple[ShapeOutcome, bool]:  # fmt: skip
    """``shape`` played once, or, while ``produced`` says its entries are missing, up
    to ``shape.rounds`` times (from round ``first``: a deferred shape's later rounds);
    and whether ``produced`` said they were made. A descent's round r holds each size
    r times its ``held_steps``."""
    answers: list[tuple[ShapeResult, str | None]] = []
    missed: list[int] = []
    unflushed: str | None = None
    rounds = max(1, shape.rounds) if produced is not None else 1
    made: int | None = None
    for round_no in range(first, rounds + 1):
        if shape.flush_first:
            unflushed = await _flush(http, url, timeout_s) or unflushed
        if shape.descent is not None:
            held = shape.descent.held_steps * round_no
            this_round = replace(shape, descent=replace(shape.descent, held_steps=held))
            got, missed = await descend(url, this_round, timeout_s=timeout_s)
        elif shape.beside:
            this = shape.beside[(round_no - 1) % len(shape.beside)]
            got = await _beside(http, url, shape, this, timeout_s)
        else:
            got = []
            for wave in shape.waves():
                got += await asyncio.gather(
                    *(_one(http, url, shape.endpoint, b, timeout_s) for b in wave)
                )
        answers += got
        if any(a[0] is not ShapeResult.OK for a in got):
            break
        if produced is not None and await produced(shape.until):
            made = round_no
            break
    took_ms = (time.perf_counter() - tic) * 1000.0
    worst = max(answers, key=lambda a: _RANK[a[0]])
    detail = worst[1]
    if detail is None and shape.descent is not None:
        detail = _descent_gaps(shape.descent, missed)
    if detail is None and produced is not None and worst[0] is ShapeResult.OK:
        if made is None:
            detail = f"what it is played for was not made in {rounds} round" + "s" * (rounds > 1)
        elif rounds > 1:
            detail = f"made what it is played for in round {made} of {rounds}"
    if unflushed is not None:
        detail = unflushed if detail is None else f"{detail}; {unflushed}"
    return ShapeOutcome(shape.name, worst[0], took_ms, len(answers), detail), made is not None


def _decoding(stream: _Stream) -> Callable[[], bool]:
    return lambda: stream.chunks > 0 or stream.ended is not None


async def _beside(
    http: httpx.AsyncClient, url: str, shape: Shape, beside: Mapping[str, Any],
    timeout_s: float,
) -> list[tuple[ShapeResult, str | None]]:  # fmt: skip
    """The shape's waves while a companion (``beside``, one of ``Shape.beside``)
    decodes: it starts first, each wave goes out once it is decoding (a companion that
    ran out of tokens is replaced), and it is aborted after the last wave, its end
    awaited (so that a flush after it finds nothing running). Its own answer does not
    count: an abort ends it."""
    answers: list[tuple[ShapeResult, str | None]] = []
    tag = uuid.uuid4().hex[:12]
    companion: tuple[_Stream, asyncio.Task[None]] | None = None
    try:
        for number, wave in enumerate(shape.waves()):
            if companion is None or companion[0].ended is not None:
                if companion is not None:
                    await _end(companion[1], timeout_s)
                stream = _Stream(f"k26cov-{tag}-{number:04d}-companion")
                # Only its first token and its end are streamed: a chunk per step
                # would be parsed on the event loop for nothing.
                params = {**(beside.get("sampling_params") or {}), "stream_interval": 1 << 30}
                body = {**beside, "sampling_params": params, "rid": stream.rid,
                        "stream": True}  # fmt: skip
                clock = _Clock()
                companion = (
                    stream,
                    asyncio.create_task(_stream(http, url, body, [stream], clock, timeout_s)),
                )
                if not await clock.until(_decoding(stream), time.monotonic() + timeout_s):
                    return [*answers, (ShapeResult.FAILED, "the companion sent no token within "
                                       "the timeout")]  # fmt: skip
                if stream.ended is not None and stream.ended[0] is not ShapeResult.OK:
                    return [*answers, (stream.ended[0], f"the companion: {stream.ended[1]}")]
            answers += await asyncio.gather(
                *(_one(http, url, shape.endpoint, b, timeout_s) for b in wave)
            )
            if any(a[0] is not ShapeResult.OK for a in answers):
                break
    finally:
        if companion is not None:
            stream, task = companion
            try:
                if stream.ended is None and not task.done():
                    refused = await _abort(http, url, stream)
                    if refused is not None:
                        task.cancel()  # not abortable: its connection goes, SGLang ends it
                await _end(task, timeout_s)
            finally:
                task.cancel()  # a no-op once it ended; else (a cancel meanwhile) it goes too
    return answers


async def _end(task: asyncio.Task[None], timeout_s: float) -> None:
    """Wait for a companion's stream to end; cancelled if it does not in time."""
    _, pending = await asyncio.wait([task], timeout=timeout_s)
    for left in pending:
        left.cancel()


_RANK = {ShapeResult.OK: 0, ShapeResult.REFUSED: 1, ShapeResult.FAILED: 2}


async def _flush(http: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """SGLang's ``/flush_cache`` (the radix cache and the KV allocator, when nothing
    runs). None when flushed; else why not, for the shape's detail: the shape is still
    played, its counts then only approximate (a server guarding it with
    --admin-api-key answers 401/403, one with requests running 400)."""
    deadline = time.monotonic() + FLUSH_WAIT_S
    while True:
        try:
            answer = await http.post(url + "/flush_cache", timeout=timeout_s)
        except httpx.HTTPError as exc:
            return f"radix cache not flushed first ({type(exc).__name__}): counts approximate"
        if answer.status_code == 200:
            return None
        # 400: a request still running, such as an aborted companion whose end the
        # scheduler has not processed yet: asked again, for a moment.
        if answer.status_code != 400 or time.monotonic() >= deadline:
            break
        await asyncio.sleep(FLUSH_POLL_S)
    said = _clean(answer.text)[:160]
    return f"radix cache not flushed first (HTTP {answer.status_code}: {said}): counts approximate"


def _descent_gaps(plan: Descent, missed: Sequence[int]) -> str | None:
    """What a descent that passed left unplayed, in words (None: nothing)."""
    gaps = []
    if plan.capped_from is not None:
        gaps.append(
            f"the server runs up to {plan.capped_from} requests at once; decode batches "
            f"above {plan.top} ({plan.cap_why}) were not played"
        )
    if missed:
        runs: list[list[int]] = []
        for size in sorted(missed):
            if runs and size == runs[-1][-1] + 1:
                runs[-1].append(size)
            else:
                runs.append([size])
        text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
        gaps.append(f"decode batches of {text} could not be held")
    return "; ".join(gaps) or None


class _Stream:
    """One streamed request of a descent: its chunks and tokens so far, how it ended."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.chunks = 0
        self.tokens = 0  # meta_info.completion_tokens of its last chunk
        self.aborted = False  # the descent asked for its abort
        self.ended: tuple[ShapeResult, str | None] | None = None
        self.verify_ct: int | None = None  # meta_info.spec_verify_ct of its end, if any

    @property
    def live(self) -> bool:
        return self.ended is None and not self.aborted


class _Clock:
    """Wakes the descent at every chunk of any stream, and at every end."""

    def __init__(self) -> None:
        self.tick = asyncio.Event()

    async def until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``done()``; False at the deadline (monotonic)."""
        while not done():
            self.tick.clear()
            if done():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await self.tick.wait()
            except TimeoutError:
                return done()
        return True


async def _stream(
    http: httpx.AsyncClient, url: str, body: Mapping[str, Any], streams: list[_Stream],
    clock: _Clock, timeout_s: float,
) -> None:  # fmt: skip
    """Read one streamed batch /generate: SGLang sends ``data: {json}`` lines, each an
    output of one prompt (its ``index``, its rid in ``meta_info.id``), then
    ``data: [DONE]``."""
    status: int | None = None
    by_rid = {s.rid: s for s in streams}

    def end_all(result: ShapeResult, detail: str) -> None:
        for s in streams:
            if s.ended is None:
                s.ended = result, detail

    try:
        async with http.stream("POST", f"{url}/generate", json=dict(body), timeout=timeout_s) as r:
            status = r.status_code
            if status != 200:
                raw = await r.aread()
                end_all(
                    judge(status, _message(raw), shaped=False), f"HTTP {status}: {_message(raw)}"
                )
                return
            async for line in r.aiter_lines():
                payload = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if not payload or payload == "[DONE]":
                    continue
                try:
                    data = json.loads(payload)
                except ValueError:
                    end_all(ShapeResult.FAILED, f"not a stream chunk: {_clean(payload)}")
                    return
                meta = data.get("meta_info") if isinstance(data, dict) else None
                index = data.get("index") if isinstance(data, dict) else None
                s = by_rid.get(str(meta.get("id"))) if isinstance(meta, dict) else None
                if s is None and isinstance(index, int) and 0 <= index < len(streams):
                    s = streams[index]
                if s is None or not isinstance(meta, dict) or "error" in data:
                    end_all(ShapeResult.FAILED, f"not a stream chunk: {_clean(payload)}")
                    return
                tokens = meta.get("completion_tokens")
                s.chunks += 1
                s.tokens = tokens if isinstance(tokens, int) else s.tokens + 1
                if meta.get("finish_reason") is not None and s.ended is None:
                    verify = meta.get("spec_verify_ct")
                    s.verify_ct = verify if isinstance(verify, int) else None
                    s.ended = ShapeResult.OK, None
                clock.tick.set()
        end_all(ShapeResult.FAILED, "the stream ended before this request's last output")
    except httpx.HTTPError as exc:
        where = "request" if status is None else "stream"
        end_all(ShapeResult.FAILED, f"{type(exc).__name__} during the {where}: {_clean(str(exc))}")
    finally:
        clock.tick.set()


MAX_DESCENT_ROUNDS = 8


async def descend(
    url: str, shape: Shape, *, timeout_s: float
) -> tuple[list[tuple[ShapeResult, str | None]], list[int]]:
    """Play ``shape.descent`` (see ``core.coverage.Descent``); the answers, and the
    batch sizes it could not hold (played again in a later round, up to
    MAX_DESCENT_ROUNDS rounds while each round holds a size not held before).

    A set of requests, one per size from the largest still missing, streams at once.
    When every one has a chunk, the first started of them (the nearest to its end) is
    aborted every ``held_steps`` chunks of the last (the clock), down to the lowest size
    missing, for as long as the clock lasts; the next set starts below where it
    stopped. Which sizes the batch ran at, and for how many steps each, is read from
    every request's own count of decode steps at its end
    (``core.coverage.held_sizes``): an abort that landed a step late or together with
    the next, or a request that ended by itself, costs only the sizes it did not hold
    for ``held_steps`` steps, and those are played again. Nothing is sized ahead: how
    many tokens a step yields, and so how far a clock goes, is the server's. Its own
    client: the requests stream at once, beyond a shared pool."""
    plan = shape.descent
    assert plan is not None
    tag = uuid.uuid4().hex[:12]
    answers: list[tuple[ShapeResult, str | None]] = []
    held: set[int] = set()
    limits = httpx.Limits(max_connections=plan.top + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(trust_env=False, limits=limits) as http:
        number = 0
        for _ in range(MAX_DESCENT_ROUNDS):
            before = len(held)
            missing = [size for size in range(plan.top, 0, -1) if size not in held]
            while missing:
                high, low = missing[0], missing[-1]
                clock = _Clock()
                # Fixed width: SGLang aborts every request whose rid starts with the one named.
                streams = [_Stream(f"k26cov-{tag}-{number:04d}-{i:05d}") for i in range(high)]
                number += 1
                body = _batch(shape.body, [s.rid for s in streams], plan)
                tasks = [asyncio.create_task(_stream(http, url, body, streams, clock, timeout_s))]
                try:
                    problem = await _step_down(
                        http, url, streams, low, clock, timeout_s, plan.held_steps
                    )
                finally:
                    for s in streams:
                        if s.live:
                            await _abort(http, url, s)
                    done = await asyncio.wait(tasks, timeout=timeout_s)
                    for task in done[1]:
                        task.cancel()
                if problem is not None:
                    answers.append(problem)  # first: the cause, before what followed it
                answers += [
                    s.ended or (ShapeResult.FAILED, "no end within the timeout") for s in streams
                ]
                if any(a[0] is not ShapeResult.OK for a in answers):
                    return answers, []
                steps = [_decode_steps(s, plan.per_step) for s in streams]
                if None in steps:
                    return [*answers, (ShapeResult.REFUSED, UNCOUNTED)], []
                ran = held_sizes(steps, steps=plan.held_steps)
                held |= ran
                # Below where this set stopped, the next set goes on; what it skipped
                # above that waits for the next round.
                reached = min(ran, default=high)
                missing = [size for size in missing if size < reached and size not in held]
            if len(held) == before or all(size in held for size in range(1, plan.top + 1)):
                break
    return answers, [size for size in range(plan.top, 0, -1) if size not in held]


UNCOUNTED = (
    "the server's ends do not say how many decode steps a speculative request made "
    "(meta_info.spec_verify_ct, sglang 0.5.17): decode batch sizes not played"
)


def _decode_steps(s: _Stream, per_step: int) -> int | None:
    """The decode steps a descent's request made, from its end: the verify steps of a
    speculative one (SGLang 0.5.17 puts ``spec_verify_ct`` in a finished request's
    meta_info once it made one); else one token a step, its first being the
    prefill's. None where that cannot be told (a speculative server that does not
    say)."""
    if s.ended is None:
        return None
    if s.verify_ct is not None:
        return s.verify_ct
    if per_step == 1 or s.tokens <= 1:
        return s.tokens - 1
    return None


def _batch(body: Mapping[str, Any], rids: list[str], plan: Descent) -> dict[str, Any]:
    """A descent's requests as one streamed batch /generate, so that the scheduler
    takes them in together and they start decoding at the same step; each under its
    own rid. Every request but the last streams only its first token and its end (a
    per-request ``stream_interval``, which sglang 0.5.17's SamplingParams has), so a
    descent reads about two chunks per request besides the clock's one per step. The
    clock carries a little fewer tokens than the rest (``Descent.clock_budget``)."""
    base = body.get("sampling_params") or {}
    clock = {**base, "max_new_tokens": plan.clock_budget(len(rids))}
    quiet = {**base, "max_new_tokens": plan.budget(len(rids)), "stream_interval": 1 << 30}
    return {
        **body,
        "input_ids": [descent_ids(i) for i in range(len(rids))],
        "sampling_params": [quiet] * (len(rids) - 1) + [clock],
        "rid": rids,
    }


async def _step_down(
    http: httpx.AsyncClient, url: str, streams: list[_Stream], low: int, clock: _Clock,
    timeout_s: float, hold: int,
) -> tuple[ShapeResult, str | None] | None:  # fmt: skip
    """Step the running batch from ``len(streams)`` down to ``low``, or as far as the
    clock lasts: an abort every ``hold`` of the clock's chunks; a server problem,
    or None. Which sizes it ran at is read from the ends (``descend``)."""
    if not await clock.until(
        lambda: all(s.chunks > 0 or s.ended for s in streams), time.monotonic() + timeout_s
    ):
        return ShapeResult.FAILED, "no decode progress within the timeout"
    keeper = streams[-1]  # the one streaming every step: the set's clock
    # Chunks may come in bursts (a chunk is a step or more): the clock's count, not
    # the time they are read, paces the aborts. The clock should end first
    # (``Descent.clock_budget``); the sizes it did not reach go to the next set.
    target = keeper.chunks + hold
    while True:
        failed = next(
            (s.ended for s in streams if s.ended and s.ended[0] is not ShapeResult.OK), None
        )
        if failed is not None:
            return failed
        if not await clock.until(_reached(keeper, target), time.monotonic() + timeout_s):
            return (
                ShapeResult.FAILED,
                f"no decode progress within the timeout at a batch of "
                f"{sum(s.live for s in streams)}",
            )
        live = [s for s in streams[:-1] if s.live]
        if keeper.ended is not None or len(live) + 1 <= low:
            return None
        refused = await _abort(http, url, live[0])
        if refused is not None:
            return refused
        # The lowest size a chunk longer: the step after it is the clock's own end,
        # which an overlap scheduler runs only as a forward whose output it drops.
        target = keeper.chunks + hold + (len(live) == low)


def _reached(clock: _Stream, chunks: int) -> Callable[[], bool]:
    return lambda: clock.chunks >= chunks or clock.ended is not None


async def _abort(
    http: httpx.AsyncClient, url: str, s: _Stream
) -> tuple[ShapeResult, str | None] | None:
    s.aborted = True
    try:
        r = await http.post(f"{url}/abort_request", json={"rid": s.rid}, timeout=10.0)
    except httpx.HTTPError as exc:
        return ShapeResult.FAILED, f"/abort_request: {type(exc).__name__}: {_clean(str(exc))}"
    if r.status_code in (401, 403):
        # SGLang guards /abort_request with --admin-api-key where one is set, while
        # /generate stays open: the server's own configuration declines the descent
        # (its requests run to their end), which is not a reason to stay unready.
        why = f"HTTP {r.status_code}: {_message(r.content)}"
        return ShapeResult.REFUSED, f"/abort_request: {why}; decode batch sizes not played"
    if r.status_code != 200:
        return ShapeResult.FAILED, f"/abort_request: HTTP {r.status_code}: {_message(r.content)}"
    return None


async def server_context(
    url: str, base: ShapeContext, *, client: httpx.AsyncClient, timeout_s: float = 10.0
) -> ShapeContext:
    """The bodies' facts from the server (``/server_info``, which SGLang 0.5.17 added
    and logs a deprecation for at every ``/get_server_info``; the older name is the
    fallback): its served model name, a long prompt just past its prefill chunk
    within its context, and what the decode descent needs."""
    info = await _get_json(client, f"{url}/server_info", timeout_s)
    if not isinstance(info, dict):
        info = await _get_json(client, f"{url}/get_server_info", timeout_s)
    ctx = with_server_facts(base, info) if isinstance(info, dict) else base
    return replace(ctx, model=await served_model(url, client=client, timeout_s=timeout_s))


async def served_model(url: str, *, client: httpx.AsyncClient, timeout_s: float = 10.0) -> str:
    """The model name the OpenAI endpoints answer to (``/v1/models``), else "default"."""
    models = await _get_json(client, f"{url}/v1/models", timeout_s)
    if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        first = models["data"][0]
        if isinstance(first, dict) and isinstance(first.get("id"), str):
            return str(first["id"])
    return "default"


async def _get_json(client: httpx.AsyncClient, url: str, timeout_s: float) -> Any:
    try:
        response = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None
