"""adapters/coverage.py over real HTTP: the stand-in SGLang, and a server that
misbehaves in each of the ways a shape can fail."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.adapters import coverage as play_mod
from supervisor.core import coverage
from supervisor.core.coverage import ShapeContext, ShapeResult
from tests.unit.k26dev.test_standin import QUICK, standin

Reply = Callable[[str, dict[str, Any]], "tuple[int, bytes | AsyncIterator[bytes]] | None"]


class Server:
    """An HTTP/1.1 server on a free port whose answer to each POST is ``reply``'s
    (None: close the connection without answering); it counts requests."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            path = head.split(" ", 2)[1]
            length = next(
                int(line.split(":", 1)[1])
                for line in head.split("\r\n")
                if line.lower().startswith("content-length:")
            )
            body = json.loads(await reader.readexactly(length))
            self.requests.append((path, body))
            answer = self.reply(path, body)
            if answer is None:
                return
            status, data = answer
            if not isinstance(data, bytes):  # a stream: written as it comes, then closed
                writer.write(f"HTTP/1.1 {status} X\r\nConnection: close\r\n\r\n".encode())
                async for piece in data:
                    writer.write(piece)
                    await writer.drain()
                return
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        finally:
            writer.close()


Start = Callable[[Reply], Awaitable[Server]]


@pytest.fixture
async def server() -> AsyncIterator[Start]:
    """Factory: a Server listening on a free port; all closed after the test."""
    listening: list[asyncio.Server] = []

    async def start(reply: Reply) -> Server:
        srv = Server(reply)
        listening.append(await asyncio.start_server(srv.handle, "127.0.0.1", 0))
        srv.url = f"http://127.0.0.1:{listening[-1].sockets[0].getsockname()[1]}"
        return srv

    yield start
    for each in listening:
        each.close()
        await each.wait_closed()


def ok_generate(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    item = {"text": " x", "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
    if path == "/v1/completions":
        return 200, json.dumps({"choices": [{"text": " x", "index": 0}]}).encode()
    texts = body.get("text")
    n = (body.get("sampling_params") or {}).get("n") or 1
    many = isinstance(texts, list) or n > 1
    count = (len(texts) if isinstance(texts, list) else 1) * n
    return 200, json.dumps([item] * count if many else item).encode()


CTX = ShapeContext(prompt="P", max_batch=8, long_prompt_tokens=40)


async def test_every_default_shape_passes_against_the_standin_and_grammar_is_refused() -> None:
    args = ("--grammar-backend", "none", "--load-seconds", "0", "--context-length", "600")
    compiles = ("--triton-compile-seconds", "0.05", "--inductor-compile-seconds", "0.1")
    async with standin(*args, *compiles, *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            shapes = coverage.expand((coverage.DEFAULT_SET,), (), ctx)
            report = await play_mod.play(s.url, shapes, timeout_s=30, client=client)
    results = {o.name: o.result for o in report.shapes}
    assert report.ok, report.summary()
    assert results.pop("json-schema") is ShapeResult.REFUSED
    assert set(results.values()) == {ShapeResult.OK}, results
    (refused,) = [o for o in report.shapes if o.result is ShapeResult.REFUSED]
    assert "--grammar-backend none" in (refused.detail or "")
    ramp = next(o for o in report.shapes if o.name == "batch-ramp")
    assert ramp.requests == len(coverage.ramp_sizes(ctx.max_batch))
    # The long prompt fits the server's context (the H200's server refused one that
    # did not), and is a chunked prefill where the chunk is smaller than the context.
    assert CTX.long_prompt_tokens < ctx.long_prompt_tokens <= 600 - CTX.max_new_tokens - 64


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (lambda p, b: (500, b"Internal Server Error"), "HTTP 500: Internal Server Error"),
        (lambda p, b: (200, b'{"unexpected": true}'), "not /generate's answer"),
        (lambda p, b: None, "during the"),  # the connection closed without an answer
        (lambda p, b: (400, b'{"error": {"message": "top_p must be in (0, 1], got 7."}}'),
         "top_p must be in (0, 1]"),
    ],
)  # fmt: skip
async def test_a_failing_shape_is_named_with_the_servers_answer_and_stops_the_rest(
    server: Start, reply: Reply, detail: str
) -> None:
    def answer(path: str, body: dict[str, Any]) -> tuple[int, bytes] | None:
        sp = body.get("sampling_params") or {}
        if sp.get("repetition_penalty"):
            return reply(path, body)
        return ok_generate(path, body)

    srv = await server(answer)
    shapes = coverage.expand(("greedy", "repetition-penalty", "top-k"), (), CTX)
    report = await play_mod.play(srv.url, shapes, timeout_s=5)
    assert not report.ok
    assert [(o.name, o.result) for o in report.shapes] == [
        ("greedy", ShapeResult.OK),
        ("repetition-penalty", ShapeResult.FAILED),
    ]  # top-k never went out: a failing server would only fail the rest
    assert report.failed is not None and detail in (report.failed.detail or ""), report.failed
    assert len(srv.requests) == 2
    assert "repetition-penalty" in report.summary()


async def test_an_answer_that_never_comes_fails_at_the_timeout() -> None:
    release = asyncio.Event()
    seen: list[bool] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(True)
        await release.wait()  # never answers within the shape's timeout
        writer.close()

    listening = await asyncio.start_server(slow, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    try:
        report = await play_mod.play(url, coverage.expand(("greedy",), (), CTX), timeout_s=0.5)
    finally:
        release.set()
        listening.close()
        await listening.wait_closed()
    assert report.failed is not None and "no answer within 0.5 s" in (report.failed.detail or "")
    assert seen == [True]


async def test_an_abort_in_a_200_is_the_servers_refusal(server: Start) -> None:
    def aborted(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        finish = {"type": "abort", "message": "Grammar is not supported when the server is "
                  "launched with --grammar-backend none"}  # fmt: skip
        return 200, json.dumps({"text": "", "meta_info": {"finish_reason": finish}}).encode()

    srv = await server(aborted)
    report = await play_mod.play(srv.url, coverage.expand(("json-schema",), (), CTX), timeout_s=5)
    (only,) = report.shapes
    assert only.result is ShapeResult.REFUSED and report.ok
    assert (only.detail or "").startswith("aborted: Grammar is not supported")


# --- the decode descent --------------------------------------------------------------


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*.json"))


def _kv_variants(root: Path) -> set[str]:
    """The stand-in's KV-store kernel variants in its Triton cache."""
    return {json.loads(p.read_text())["shape"] for p in root.rglob("set_kv_buffer_kernel.json")}


def _draft_variants(root: Path) -> set[str]:
    """The draft decode kernel's compiled variants in the stand-in's Triton cache."""
    found = set()
    for meta in root.rglob("generate_draft_decode_kv_indices.json"):
        found.add(json.loads(meta.read_text())["shape"])
    return found


async def test_the_descent_decodes_every_batch_size_so_clients_compile_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The H200's EAGLE-3 failure: batches of 3, 5, 6 and 12 compiled the draft decode
    kernel after READY, each number of sequences a variant of its own. The descent
    reads the server's limit (48, which SGLang sets for speculative decoding), decodes
    every batch size from it down to 1, and leaves nothing for clients to compile."""
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    args = ("--eagle3", "--load-seconds", "0", "--context-length", "1024")
    async with standin(*args, "--triton-compile-seconds", "0.01", *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            assert ctx.max_running == 48 and ctx.tokens_per_step == 4
            shapes = coverage.expand(("decode-descent",), (), ctx)
            report = await play_mod.play(s.url, shapes, timeout_s=30, client=client)
            (descent,) = report.shapes
            assert descent.result is ShapeResult.OK and descent.detail is None, descent
            assert _draft_variants(cache) == {f"ns{n}" for n in range(2, 49)}
            before = set(cache.rglob("*"))
            # What the client matrix sent the H200: n > 1 and concurrent mixed batches.
            sampled = {"max_new_tokens": 4, "temperature": 0.7}
            await client.post(
                f"{s.url}/generate",
                json={"text": "x", "sampling_params": {**sampled, "n": 6}},
                timeout=30,
            )
            bodies = [{"text": f"y{i}", "sampling_params": sampled} for i in range(12)]
            await asyncio.gather(
                *(client.post(f"{s.url}/generate", json=b, timeout=30) for b in bodies)
            )
    assert set(cache.rglob("*")) == before


def _assign_variants(root: Path) -> set[str]:
    """The EAGLE draft's assign_req_to_token_pool variants in the stand-in's cache."""
    return {json.loads(p.read_text())["shape"] for p in root.rglob("assign_req_to_token_pool.json")}


async def test_the_descent_runs_each_size_at_both_kv_slot_alignments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The H100's EAGLE-3 failure (2026-12-05): every decode step hands the draft's
    assign_req_to_token_pool its KV slots, a slice of the allocator's free list at
    the offset handed out since the last end, and Triton keys the pointer on 16-byte
    alignment. Each new size's step compiled (200 ms), so one abort landed per step,
    every step ran just after an end at offset 0, and only aligned variants were
    made; the client matrix then compiled an unaligned one after READY. Each size
    held two steps runs the second at the batch's own count of slots: an odd size
    makes the unaligned variant of its power of two. Slow compiles here (50 ms) put
    one abort in each step, as there."""
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    args = ("--eagle3", "--kv-alignment", "--load-seconds", "0", "--context-length", "1024",
            "--max-running-requests", "8", "--triton-compile-seconds", "0.05")  # fmt: skip
    async with standin(*args, *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            assert ctx.max_running == 8 and ctx.kv_reset_at_finish
            shapes = coverage.expand(("decode-descent",), (), ctx)
            report = await play_mod.play(s.url, shapes, timeout_s=30, client=client)
            (descent,) = report.shapes
            assert descent.result is ShapeResult.OK and descent.detail is None, descent
    # Sizes 2 to 8 (the stand-in's draft path starts at 2): 3 and 5 to 7 are
    # unaligned at their second step (the old descent made only the aligned ones).
    made = _assign_variants(cache)
    assert {"bs2-any", "bs4-any", "bs4-any-a8", "bs8-any", "bs8-any-a8"} <= made, made


@pytest.mark.parametrize(
    ("status", "answer", "result", "detail"),
    [
        # A server without the endpoint: the descent cannot be played, and that is news.
        (404, b'{"detail": "Not Found"}', ShapeResult.FAILED,
         "/abort_request: HTTP 404: Not Found"),
        # --admin-api-key guards /abort_request while /generate stays open (sglang
        # 0.5.17's AuthLevel.ADMIN_OPTIONAL): the server's configuration declines it.
        (401, b'{"error": "Unauthorized"}', ShapeResult.REFUSED,
         "/abort_request: HTTP 401: Unauthorized; decode batch sizes not played"),
    ],
)  # fmt: skip
async def test_a_server_that_will_not_abort_ends_the_descent_with_its_answer(
    server: Start, status: int, answer: bytes, result: ShapeResult, detail: str
) -> None:
    asked = asyncio.Event()

    async def steps(rids: list[str], budget: int) -> AsyncIterator[bytes]:
        # One output per request and step, a decode step a millisecond, until each
        # request's budget; the last output says so.
        for n in range(1, budget + 1):
            finish = {"type": "length", "length": n} if n == budget else None
            for i, rid in enumerate(rids):
                meta = {"id": rid, "completion_tokens": n, "finish_reason": finish}
                chunk = {"text": "a", "index": i, "meta_info": meta}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await asyncio.sleep(0.001)
        yield b"data: [DONE]\n\n"

    def reply(path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        if path == "/abort_request":
            asked.set()
            return status, answer
        if path == "/generate" and body.get("stream"):
            return 200, steps(body["rid"], 300)
        return ok_generate(path, body)

    srv = await server(reply)
    ctx = replace(CTX, max_running=4, context_length=4096)
    shapes = coverage.expand(("decode-descent",), (), ctx)
    async with httpx.AsyncClient(trust_env=False) as client:
        report = await play_mod.play(srv.url, shapes, timeout_s=5, client=client)
    assert asked.is_set()
    (outcome,) = report.shapes
    assert (outcome.result, outcome.detail) == (result, detail)
    assert report.ok is (result is ShapeResult.REFUSED)


class _Scheduler:
    """A decode loop as SGLang 0.5.17 runs one: a streamed batch decodes a step at a
    time; /abort_requests are taken in only once ``together`` of them are pending, or
    every request still running is (they land at once, however fast the client); a
    request that ended is in one more step's batch (overlap). It records every step's
    batch size."""

    def __init__(self, together: int, *, verify_ct: bool) -> None:
        self.together = together
        self.verify_ct = verify_ct
        self.pending: list[str] = []
        self.sizes: list[list[int]] = []  # each streamed batch's, step by step

    def reply(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        if path == "/abort_request":
            self.pending.append(body["rid"])
            return 200, b""
        if path == "/generate" and body.get("stream"):
            return 200, self.stream(body)
        return ok_generate(path, body)

    async def descend(self, server: Start, ctx: ShapeContext) -> coverage.ShapeOutcome:
        """The descent against this scheduler, as the coverage plays it."""
        srv = await server(self.reply)
        shapes = coverage.expand(("decode-descent",), (), ctx)
        async with httpx.AsyncClient(trust_env=False) as client:
            report = await play_mod.play(srv.url, shapes, timeout_s=10, client=client)
        (outcome,) = report.shapes
        assert report.ok is (outcome.result is not ShapeResult.FAILED)
        return outcome

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        rids, params = body["rid"], body["sampling_params"]
        tokens = [1] * len(rids)
        ended: list[dict[str, Any] | None] = [None] * len(rids)
        leaving: set[int] = set()
        sizes: list[int] = []
        self.sizes.append(sizes)

        def chunk(i: int) -> bytes:
            meta: dict[str, Any] = {"id": rids[i], "completion_tokens": tokens[i],
                                    "finish_reason": ended[i]}  # fmt: skip
            if ended[i] is not None and self.verify_ct and tokens[i] > 1:
                meta["spec_verify_ct"] = tokens[i] - 1
            return b"data: " + json.dumps({"index": i, "meta_info": meta}).encode() + b"\n\n"

        for i in range(len(rids)):
            yield chunk(i)
        step = 0
        while any(e is None for e in ended):
            step += 1
            # This step's batch: every request running, and those that ended at the
            # last step (the forward launched before their end was processed).
            running = sum(e is None for e in ended)
            sizes.append(running + len(leaving))
            leaving = set()
            aborted = set()
            if len(self.pending) >= min(self.together, running):
                for rid in self.pending:
                    for i, other in enumerate(rids):
                        if other.startswith(rid) and ended[i] is None:
                            ended[i] = {"type": "abort"}
                            aborted.add(i)  # in this step's batch, its output dropped
                self.pending = []
            for i in range(len(rids)):
                if i in aborted:
                    yield chunk(i)  # its end: the last step's token, processed now
                    continue
                if ended[i] is not None:
                    continue
                tokens[i] += 1
                if tokens[i] >= params[i]["max_new_tokens"]:
                    ended[i] = {"type": "length"}
                    leaving.add(i)
                if ended[i] is not None or params[i].get("stream_interval", 1) == 1:
                    yield chunk(i)
            await asyncio.sleep(0.005)
        if leaving:
            sizes.append(len(leaving))  # the last ends' forward, its output dropped
        yield b"data: [DONE]\n\n"


@pytest.mark.parametrize(("verify_ct", "context"), [(False, 4096), (True, 4096), (False, 80)])
async def test_aborts_that_land_late_and_together_cost_only_the_sizes_they_skipped(
    server: Start, verify_ct: bool, context: int
) -> None:
    """The descent paces its aborts on the clock's chunks, but the scheduler takes
    them in when it can: here only two at once. Which sizes ran is read
    from the requests' own step counts at their end (on a speculative server its
    verify steps), so the sizes skipped are played again, and every size from the top
    down to 1 ran. In a context of 80 tokens a set's clock lasts 10 steps: each set
    goes as far as its clock, and the next starts below."""
    sched = _Scheduler(2, verify_ct=verify_ct)
    ctx = replace(CTX, max_running=12, context_length=context, tokens_per_step=1 + 3 * verify_ct)
    outcome = await sched.descend(server, ctx)
    assert (outcome.result, outcome.detail) == (ShapeResult.OK, None)
    first = sched.sizes[0]
    assert not set(range(1, 13)) <= set(first)  # the first set skipped sizes
    # In a context of 80 the set's requests hold 12 tokens (the clock 10): the
    # first set is over within 12 steps, before aborts in pairs reach the bottom;
    # in 4096 it goes down to 2 (15 steps here).
    assert (len(first) <= 12) is (context == 80), first
    assert set(range(1, 13)) <= {size for sizes in sched.sizes for size in sizes}


async def test_prefills_at_both_kv_alignments_leave_nothing_for_clients_to_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K2 on the H200: a client's 700-token prompt, its KV slots starting at an odd
    offset, compiled set_mla_kv_buffer_kernel after READY. The stand-in's
    --kv-alignment model keys a prefill's KV store on Triton's class of its token
    count and the parity of its first slot. prefill-alignment alone compiles all six
    variants whatever the parity it starts from; with the default set, clients'
    prompts of every class then compile nothing."""

    async def run(shift: int, names: tuple[str, ...], cache: Path) -> tuple[set[str], set[Path]]:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
        args = ("--kv-alignment", "--load-seconds", "0", "--context-length", "2048")
        async with standin(*args, "--triton-compile-seconds", "0", *QUICK) as s:
            await s.wait_line(r"^standin: loaded$")
            async with httpx.AsyncClient(trust_env=False) as client:

                async def prefill(n: int, new: int = 1) -> None:
                    body = {"input_ids": [101 + i % 200 for i in range(n)],
                            "sampling_params": {"max_new_tokens": new}}  # fmt: skip
                    answer = await client.post(f"{s.url}/generate", json=body, timeout=30)
                    assert answer.status_code == 200

                if shift:
                    await prefill(shift)  # the slots start at this parity
                ctx = await play_mod.server_context(s.url, CTX, client=client)
                shapes = coverage.expand(names, (), replace(ctx, descent_cap=8))
                report = await play_mod.play(s.url, shapes, timeout_s=30, client=client)
                assert report.ok, report.summary()
                before = _files(cache)
                # Clients: prompts of every class, one after another, so the slot
                # offset before each moves by what the one before took.
                for n in (700, 1, 3, 32, 45, 64, 9, 1, 700, 2, 16):
                    await prefill(n, 1 + n % 3)
                return _kv_variants(cache), _files(cache) - before

    every = {f"{c}-{a}" for c in ("1", "d16", "any") for a in ("a16", "a8")}
    # From an empty cache and slot offset 0, then from odd and even offsets (the
    # prompt that moves the offset compiles its own variant at offset 0 first).
    for shift in (0, 3, 34):
        alone, _ = await run(shift, ("prefill-alignment",), tmp_path / f"alone{shift}")
        assert alone == every, shift
    _, late = await run(1, (coverage.DEFAULT_SET,), tmp_path / "default")
    assert late == set()


async def test_rounds_go_beside_each_companion_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Shape.beside``: round r goes beside the (r - 1)th companion, modulo their
    count, until what it is played for is made."""
    seen: list[int] = []

    async def beside(
        http: Any, url: str, shape: coverage.Shape, companion: Any, timeout_s: float
    ) -> Any:
        seen.append(len(companion["input_ids"]))
        return [(ShapeResult.OK, None)]

    monkeypatch.setattr(play_mod, "_beside", beside)
    companions = tuple(coverage.companion(CTX, 1 + n, slots=k) for n, k in enumerate((5, 6, 7)))
    shape = coverage.Shape("learned-align-1x2", "/generate", {"input_ids": [[1, 2]]},
                           beside=companions, rounds=5,
                           until=(("triton", "V", "k"),))  # fmt: skip
    calls = 0

    async def produced(entries: Any) -> bool:
        nonlocal calls
        calls += 1
        return calls > 5  # the first check (is it there?) and 4 rounds say no

    async with httpx.AsyncClient(trust_env=False) as client:
        report = await play_mod.play("http://127.0.0.1:9", [shape], timeout_s=5, client=client,
                                     produced=produced)  # fmt: skip
    assert seen == [5, 6, 7, 5, 6]
    assert report.shapes[0].detail == "made what it is played for in round 5 of 5"


async def test_a_variant_no_rounds_made_costs_later_shapes_one_round_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the H200 (2026-12-05) three learned replays named one variant and each spent
    its 12 rounds on it in vain. Once one shape's rounds are spent, a later shape
    played for nothing else goes once; one that names another entry too keeps its
    rounds."""
    played: list[str] = []

    async def beside(
        http: Any, url: str, shape: coverage.Shape, companion: Any, timeout_s: float
    ) -> Any:
        played.append(shape.name)
        return [(ShapeResult.OK, None)]

    monkeypatch.setattr(play_mod, "_beside", beside)
    companions = (coverage.companion(CTX, 1, slots=5),)
    same, other = ("triton", "V", "k"), ("triton", "W", "k")

    def shape(name: str, *until: tuple[str, str, str]) -> coverage.Shape:
        return coverage.Shape(name, "/generate", {"input_ids": [[1, 2]]}, beside=companions,
                              rounds=4, until=until)  # fmt: skip

    async def produced(entries: Any) -> bool:
        return False

    shapes = [shape("a", same), shape("b", same), shape("c", same, other), shape("d", same)]
    async with httpx.AsyncClient(trust_env=False) as client:
        report = await play_mod.play("http://127.0.0.1:9", shapes, timeout_s=5, client=client,
                                     produced=produced)  # fmt: skip
    assert played == ["a"] * 4 + ["b"] + ["c"] * 4 + ["d"]
    assert [o.detail for o in report.shapes] == [
        "what it is played for was not made in 4 rounds",
        "what it is played for was not made in 1 round",
        "what it is played for was not made in 4 rounds",
        "what it is played for was not made in 1 round",
    ]


async def test_what_a_later_shape_made_is_said_of_the_shape_that_did_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The H100 (2026-12-05): the learned descent, played first, named variants that
    the sweep after it made; /status said "not made" of it while nothing was left to
    compile. A shape's detail says when a later shape made its entries, and only
    then."""
    made: set[tuple[str, str, str]] = set()
    x, y = ("triton", "X", "k"), ("triton", "Y", "k")
    makes = {"b": {x}}

    async def beside(
        http: Any, url: str, shape: coverage.Shape, companion: Any, timeout_s: float
    ) -> Any:
        made.update(makes.get(shape.name, set()))
        return [(ShapeResult.OK, None)]

    monkeypatch.setattr(play_mod, "_beside", beside)
    companions = (coverage.companion(CTX, 1, slots=5),)

    def shape(name: str, *until: tuple[str, str, str]) -> coverage.Shape:
        return coverage.Shape(name, "/generate", {"input_ids": [[1, 2]]}, beside=companions,
                              until=until)  # fmt: skip

    async def produced(entries: Any) -> bool:
        return set(entries) <= made

    shapes = [shape("a", x), shape("c", y), shape("b", x)]
    async with httpx.AsyncClient(trust_env=False) as client:
        report = await play_mod.play("http://127.0.0.1:9", shapes, timeout_s=5, client=client,
                                     produced=produced)  # fmt: skip
    assert [o.detail for o in report.shapes] == [
        "what it is played for was not made in 1 round; a later shape made it",
        "what it is played for was not made in 1 round",  # Y: nothing made it
        None,
    ]


async def test_an_unaligned_variant_is_made_beside_a_companion_round_after_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sglang 0.5.17 with EAGLE-3: every request's end hands KV slots back, so prefills
    played one after another all start at offset 0, and the variant a client's
    prefill compiled beside a decoding request (its slots at an odd offset) is never
    made that way. The learned replay plays the batch beside a companion of an odd
    count of ids, sent on its first token, so that it is prefilled right after the
    companion's prompt, at an odd offset; round after round until the variant is in
    the unit's cache (a round misses where decode steps came between); played again,
    it costs nothing."""
    from supervisor.adapters.learned_shapes import made
    from supervisor.core import learned_shapes as ls

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    args = ("--eagle3", "--kv-alignment", "--load-seconds", "0", "--context-length", "1024",
            "--max-running-requests", "4", "--triton-compile-seconds", "0")  # fmt: skip
    kernel = "set_kv_buffer_kernel"
    variant = hashlib.sha256(f"triton:{kernel}@any-a8".encode()).hexdigest()[:32]
    line = "Prefill batch, #new-seq: 1, #new-token: 40, #cached-token: 0, #running-req: 1"
    batch = ls.parse_batch_line(line)
    assert batch is not None
    record = ls.LearnedShape("triton", kernel, variant, "t", "t", batches=(batch,),
                             signature=f"{kernel}(*i64, i32)")  # fmt: skip
    missing = replace(record, variant="0" * 32, signature=None)
    roots = {"triton": [cache]}

    async def produced(entries: Any) -> bool:
        return await asyncio.to_thread(made, roots, entries)

    async with standin(*args, *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            assert ctx.kv_reset_at_finish
            shapes = {x.name: x for x in ls.shapes([record], ctx)}
            align = shapes["learned-align-1x40"]
            assert align.beside and align.rounds == ls.ALIGN_ROUNDS
            # More rounds than the daemon's, so that chance cannot fail the test: the
            # stand-in's 2 ms decode steps come between in about 1 round of 6.
            align = replace(align, rounds=40)
            report = await play_mod.play(
                s.url, [align], timeout_s=30, client=client, produced=produced
            )
            (outcome,) = report.shapes
            assert outcome.result is ShapeResult.OK, outcome
            assert outcome.detail is not None
            assert re.fullmatch(r"made what it is played for in round \d+ of 40",
                                outcome.detail), outcome.detail  # fmt: skip
            assert made(roots, align.until)
            assert "any-a8" in _kv_variants(cache)
            # Nothing left running: the companion was aborted and its end awaited.
            flushed = await client.post(s.url + "/flush_cache")
            assert flushed.status_code == 200, flushed.text
            # Made: played again, it is not played at all.
            again = await play_mod.play(
                s.url, [align], timeout_s=30, client=client, produced=produced
            )
            assert (again.shapes[0].requests, again.shapes[0].detail) == (0, play_mod._IN_CACHE)
            # One that is always played (the learned descent) goes out all the same.
            always = await play_mod.play(
                s.url, [replace(align, always=True)], timeout_s=30, client=client,
                produced=produced,
            )  # fmt: skip
            (outcome,) = always.shapes
            assert outcome.requests > 0 and outcome.detail == play_mod._ALWAYS, outcome
            # A variant no replay makes: its rounds, then said.
            (prefill,) = [x for x in ls.shapes([missing], ctx) if x.name.startswith("learned-pre")]
            third = await play_mod.play(
                s.url, [prefill], timeout_s=30, client=client, produced=produced
            )
            # Beside a companion, round after round: each round's companion aborted and
            # its end awaited, so the next round's flush finds nothing running.
            (never,) = [x for x in ls.shapes([replace(missing, signature=record.signature)], ctx)
                        if x.name.startswith("learned-align")]  # fmt: skip
            fourth = await play_mod.play(
                s.url, [replace(never, rounds=3)], timeout_s=30, client=client, produced=produced
            )
            assert (fourth.shapes[0].detail, fourth.shapes[0].requests) == (
                "what it is played for was not made in 3 rounds", 3)  # fmt: skip
            want = "what it is played for was not made in 1 round"
            assert ls.REPLAY_ROUNDS == 1
            assert (third.shapes[0].result, third.shapes[0].detail) == (ShapeResult.OK, want)
            assert third.shapes[0].requests == ls.REPLAY_ROUNDS


async def test_prefill_alignment_beside_a_companion_reaches_odd_offsets_on_eagle3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With EAGLE-3 every end resets the stand-in's KV slot offset (sglang 0.5.17's
    allocator), so prefills one after another all land at offset 0 (the plain plays
    alone make no odd variant); beside a decoding companion they reach odd offsets
    (the first play lands at the companion's 4 slots, later ones where its steps
    left the offset; on the stand-in every variant in 30 runs of 30,
    bench/coverage_alignment.py)."""
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    args = ("--eagle3", "--kv-alignment", "--load-seconds", "0", "--context-length", "1024",
            "--triton-compile-seconds", "0")  # fmt: skip
    async with standin(*args, *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            shape = coverage.builtin_shape("prefill-alignment", ctx)
            alone = replace(shape, beside=())
            report = await play_mod.play(s.url, [alone], timeout_s=30, client=client)
            assert report.ok
            assert {v.rsplit("-", 1)[1] for v in _kv_variants(cache)} == {"a16"}
            report = await play_mod.play(s.url, [shape], timeout_s=30, client=client)
            assert report.ok and report.shapes[0].detail is None, report.summary()
            assert report.shapes[0].requests == len(shape.bodies())  # the companion not counted
            assert {v.rsplit("-", 1)[1] for v in _kv_variants(cache)} == {"a16", "a8"}
            flushed = await client.post(s.url + "/flush_cache")  # nothing left running
            assert flushed.status_code == 200, flushed.text


async def test_a_speculative_server_that_does_not_count_its_steps_is_told_apart(
    server: Start,
) -> None:
    """A speculative step yields one token or several, so only the server's count of
    verify steps (spec_verify_ct at a request's end) says which batches ran. Without
    it the descent says so and stops, rather than claim sizes or play one set per
    size."""
    sched = _Scheduler(1, verify_ct=False)
    ctx = replace(CTX, max_running=6, context_length=4096, tokens_per_step=4)
    outcome = await sched.descend(server, ctx)
    assert (outcome.result, outcome.detail) == (ShapeResult.REFUSED, play_mod.UNCOUNTED)
    assert len(sched.sizes) == 1


@pytest.mark.parametrize(
    ("makes", "played", "detail"),
    [
        # The descent's longer holds of round 2 make it: after the replay, not before.
        ("round-2", [2, "replay", 4], "made what it is played for in round 2 of 2"),
        # The replay made it: no later round.
        ("replay", [2, "replay"],
         "what it is played for was not made in 1 round; a later shape made it"),
        # Nothing makes it: every round, each holding longer.
        ("never", [2, "replay", 4], "what it is played for was not made in 2 rounds"),
    ],
)  # fmt: skip
async def test_the_learned_descent_s_later_rounds_go_last_and_hold_longer(
    monkeypatch: pytest.MonkeyPatch, makes: str, played: list[Any], detail: str
) -> None:
    """The learned descent names every variant logged beside a decode batch; later
    shapes make most of them, so its later rounds wait for every other shape and are
    played only for what none made. A trained draft moves a step's KV slot offset by
    the tokens it accepted, so which alignment a size meets is chance: each later
    round holds every size longer, more chances at it."""
    from supervisor.core import learned_shapes as ls

    calls: list[Any] = []
    wanted, other = ("triton", "V", "assign_req_to_token_pool"), ("triton", "W", "k")

    async def descend(url: str, shape: coverage.Shape, *, timeout_s: float) -> Any:
        assert shape.descent is not None
        calls.append(shape.descent.held_steps)
        return [(ShapeResult.OK, None)] * 3, []

    async def beside(
        http: Any, url: str, shape: coverage.Shape, companion: Any, timeout_s: float
    ) -> Any:
        calls.append("replay")
        return [(ShapeResult.OK, None)]

    async def produced(entries: Any) -> bool:
        if wanted in entries:
            return (makes == "round-2" and 4 in calls) or (makes == "replay" and "replay" in calls)
        return "replay" in calls

    monkeypatch.setattr(play_mod, "descend", descend)
    monkeypatch.setattr(play_mod, "_beside", beside)
    ctx = replace(CTX, max_running=8, context_length=1024)
    descent = coverage.builtin_shape("decode-descent", ctx)
    learned = replace(descent, name=ls.LEARNED_DESCENT, until=(wanted,), always=True,
                      rounds=ls.DESCENT_ROUNDS, defer=True)  # fmt: skip
    replay = coverage.Shape("learned-align-1x2", "/generate", {"input_ids": [[1, 2]]},
                            beside=(coverage.companion(CTX, 1, slots=5),), until=(other,))  # fmt: skip
    seen: list[str] = []

    async def census() -> Any:  # each round played compiles one variant
        return {"triton": frozenset(str(i) for i in range(len(calls)))}

    async with httpx.AsyncClient(trust_env=False) as client:
        report = await play_mod.play(
            "http://127.0.0.1:9", [learned, replay], timeout_s=5, client=client,
            produced=produced, progress=lambda o: seen.append(o.name), census=census,
        )  # fmt: skip
    assert calls == played
    assert report.ok and report.shapes[0].detail == detail
    rounds = sum(isinstance(c, int) for c in calls)
    assert report.shapes[0].requests == 3 * rounds
    # What its later rounds compiled adds to what its first did.
    assert report.shapes[0].compiled == (("triton", rounds),)
    assert report.shapes[1].compiled == ((("triton", 1),) if "replay" in calls else ())
    # The log hears of the descent again when its later rounds ran.
    assert seen == [ls.LEARNED_DESCENT, "learned-align-1x2"] + [ls.LEARNED_DESCENT] * (
        makes != "replay"
    )


async def test_with_a_trained_draft_the_later_descent_rounds_make_both_alignments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trained draft accepts a varying count of tokens a step, so a step's KV slots
    move the offset by chance, not by the batch size. Against the stand-in's seeded
    random acceptance (and compiles slow enough for one abort a step, as on the GPU),
    the learned descent, its later rounds played only for what is still missing,
    makes the unaligned variants of 2, 4 and 8; and the ends' speculative counts
    agree with the tokens the steps yielded."""
    from supervisor.adapters.learned_shapes import made
    from supervisor.core import learned_shapes as ls

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    kernel = "assign_req_to_token_pool"
    wanted = tuple(
        ("triton", hashlib.sha256(f"triton:{kernel}@{v}".encode()).hexdigest()[:32], kernel)
        for v in ("bs2-any-a8", "bs4-any-a8", "bs8-any-a8")
    )
    roots = {"triton": [cache]}

    async def produced(entries: Any) -> bool:
        return await asyncio.to_thread(made, roots, entries)

    args = ("--eagle3", "--kv-alignment", "--draft-accepts", "random", "--load-seconds", "0",
            "--context-length", "1024", "--max-running-requests", "8",
            "--speculative-num-draft-tokens", "3", "--triton-compile-seconds", "0.05")  # fmt: skip
    async with standin(*args, *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            descent = coverage.builtin_shape("decode-descent", ctx)
            learned = replace(descent, name=ls.LEARNED_DESCENT, until=wanted, always=True,
                              rounds=ls.DESCENT_ROUNDS, defer=True)  # fmt: skip
            report = await play_mod.play(
                s.url, [learned], timeout_s=30, client=client, produced=produced
            )
            (outcome,) = report.shapes
            assert outcome.result is ShapeResult.OK, outcome
            assert await produced(wanted), (outcome, _assign_variants(cache))
            # The ends say the draft accepted tokens: steps yielded more than one.
            answer = await client.post(
                f"{s.url}/generate",
                json={"input_ids": [1, 2, 3], "stream": True,
                      "sampling_params": {"max_new_tokens": 40, "temperature": 0.7}},
                timeout=30,
            )  # fmt: skip
    last = json.loads(answer.text.split("data: ")[-2])["meta_info"]
    assert last["spec_verify_ct"] < last["completion_tokens"] - 1
    assert last["spec_accepted_drafts"] == sum(
        n * k for n, k in enumerate(last["spec_correct_drafts_histogram"])
    )


async def test_what_a_deferred_round_made_is_said_of_the_shapes_played_for_it_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learned sweep is played for the unaligned variants the descent's first
    round did not make; where the descent's deferred round then makes them, the
    sweep's detail says a later shape made them, not that they were never made."""
    from supervisor.core import learned_shapes as ls

    calls: list[Any] = []
    wanted = ("triton", "V", "assign_req_to_token_pool")

    async def descend(url: str, shape: coverage.Shape, *, timeout_s: float) -> Any:
        assert shape.descent is not None
        calls.append(shape.descent.held_steps)
        return [(ShapeResult.OK, None)], []

    async def beside(
        http: Any, url: str, shape: coverage.Shape, companion: Any, timeout_s: float
    ) -> Any:
        calls.append(shape.name)
        return [(ShapeResult.OK, None)]

    async def produced(entries: Any) -> bool:
        return 4 in calls

    monkeypatch.setattr(play_mod, "descend", descend)
    monkeypatch.setattr(play_mod, "_beside", beside)
    descent = coverage.builtin_shape("decode-descent", replace(CTX, max_running=4))
    learned = replace(descent, name=ls.LEARNED_DESCENT, until=(wanted,), always=True,
                      rounds=ls.DESCENT_ROUNDS, defer=True)  # fmt: skip
    sweep = coverage.Shape("sweep", "/generate", {"input_ids": [[1, 2]]},
                           beside=(coverage.companion(CTX, 1, slots=5),), until=(wanted,))  # fmt: skip
    async with httpx.AsyncClient(trust_env=False) as client:
        report = await play_mod.play("http://127.0.0.1:9", [learned, sweep], timeout_s=5,
                                     client=client, produced=produced)  # fmt: skip
    assert calls == [2, "sweep", 4]
    assert [o.detail for o in report.shapes] == [
        "made what it is played for in round 2 of 2",
        "what it is played for was not made in 1 round; a later shape made it",
    ]


async def test_each_shape_says_what_the_caches_gained_while_it_played(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the stand-in with its compiles on: each shape's ``compiled`` counts the
    cache entries that appeared while it played, all of them between the shapes, and
    the same shapes played again compile nothing; the report sums them."""
    from supervisor.adapters import learned_shapes as store

    roots = {"triton": [tmp_path / "triton"], "inductor": [tmp_path / "inductor"]}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(roots["triton"][0]))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(roots["inductor"][0]))

    async def census() -> Any:
        return await asyncio.to_thread(store.census, roots)

    args = ("--eagle3", "--load-seconds", "0", "--context-length", "1024")
    compiles = ("--triton-compile-seconds", "0.01", "--inductor-compile-seconds", "0.01")
    names = ("greedy", "repetition-penalty", "mixed-batch", "decode-descent")
    async with standin(*args, *compiles, *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        async with httpx.AsyncClient(trust_env=False) as client:
            ctx = await play_mod.server_context(s.url, CTX, client=client)
            shapes = coverage.expand(names, (), ctx)
            first = await play_mod.play(s.url, shapes, timeout_s=30, client=client, census=census)
            made = await census()
            again = await play_mod.play(s.url, shapes, timeout_s=30, client=client, census=census)
    assert first.ok and again.ok, (first.summary(), again.summary())
    by_name = {o.name: dict(o.compiled or {}) for o in first.shapes}
    assert by_name["repetition-penalty"].get("inductor", 0) >= 1, by_name
    assert by_name["decode-descent"]["triton"] > 0, by_name  # the sizes no batch before met
    assert _draft_variants(roots["triton"][0]) == {f"ns{n}" for n in range(2, 49)}
    for cache in ("triton", "inductor"):
        assert sum(o.get(cache, 0) for o in by_name.values()) == len(made[cache]), cache
    assert [o.compiled for o in again.shapes] == [()] * len(again.shapes)
    assert f"compiled: inductor {len(made['inductor'])}, triton {len(made['triton'])}" in (
        first.summary()
    )
    assert "compiled: nothing" in again.summary()
    assert all(o.compiled is None for o in (await _played_without_census(shapes)).shapes)


async def _played_without_census(shapes: Any) -> Any:
    async with standin("--load-seconds", "0", *QUICK) as s:
        await s.wait_line(r"^standin: loaded$")
        return await play_mod.play(s.url, shapes[:1], timeout_s=30)
