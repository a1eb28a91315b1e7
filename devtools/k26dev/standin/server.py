"""The stand-in's HTTP server: SGLang's native endpoints over the toy model.

A ``ThreadingHTTPServer`` (standard library only; it runs as its own process, a
unit's main process in the tests). Like SGLang 0.5.17 it listens only once the
"model" has loaded (a connection is refused until then), then runs one greedy
warm-up generation, which builds a cold FlashInfer norm module.
Shapes follow SGLang 0.5.x; docs/sglang-shapes.md says which source each comes
from. It lives and dies as SGLang 0.5.17 does (``lifecycle``): a scheduler
child, SIGTERM drained and then ended by its own SIGKILL, a failed child ending
in the same SIGKILL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, cast

from k26dev.standin import faults, model, openai_api, startup, traffic
from k26dev.standin.lifecycle import Lifecycle, stamp
from k26dev.standin.options import StandinOptions
from supervisor.core.jit_caches import JitCache

SGLANG_VERSION = "0.5.17-standin"
CHUNKED_PREFILL_SIZE = 2048
STREAM_STEP_S = 0.002  # one decode step of a streamed request
DECODE_LOG_INTERVAL = 40  # sglang 0.5.17's --decode-log-interval default
# sglang 0.5.17, srt/managers/scheduler_components/grammar_manager.py
GRAMMAR_DISABLED = (
    "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported "
    "when the server is launched with --grammar-backend none"
)
# Reentrant: SGLang's SIGTERM handler prints, and Python runs it in the main thread,
# which may be inside ``say`` already (a plain Lock deadlocked the stop there).
_print_lock = threading.RLock()


def say(line: str, stream: Any = None) -> None:
    """One line to stdout (or ``stream``), flushed: unit output files carry it."""
    with _print_lock:
        out = stream if stream is not None else sys.stdout
        out.write(line + "\n")
        out.flush()


class _State:
    def __init__(self, options: StandinOptions) -> None:
        self.options = options
        self.loaded = threading.Event()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.generate_requests = 0
        self.decode_steps = 0
        # rids being served (for the SIGTERM drain), each with its sequences in the batch
        self.in_flight: dict[str, int] = {}
        self._paused_s = 0.0  # time compiles held the scheduler (step_time)
        self.aborts: dict[str, threading.Event] = {}  # set when an /abort_request names it
        self.ended: set[str] = set()  # in flight, their end processed: in the batch a step more
        # --enable-metrics: SGLang 0.5.17's scheduler counters (realtime tokens by mode,
        # after each prefill and decode step) and the tokenizer's (at a request's end).
        self.realtime_tokens = {"prefill_compute": 0, "prefill_cache": 0, "decode": 0}
        self.prompt_tokens = self.generation_tokens = self.requests_total = 0
        self.scheduler_pid: int | None = None
        self.hung = threading.Event()  # --fail chaos, "hang": no /generate answers again
        self.lifecycle = Lifecycle(
            say,
            in_flight=lambda: list(self.in_flight),
            on_stop=self.stopping.set,
            sigterm_poll_s=options.sigterm_poll_s,
            crash_diagnostics_s=options.crash_diagnostics_s,
            stop_mode=options.stop_mode,
        )
        # The one scheduler: generations (health checks included) run one at a time,
        # and a JIT build (a cold FlashInfer module) holds it for its whole length.
        self.scheduler = threading.Lock()
        self.jitted: set[str] = set()
        self.last_heartbeat = time.strftime("%H:%M:%S")
        self._accepts = random.Random(0)  # --draft-accepts random: seeded
        self.compiles = traffic.TrafficCompiles(
            attention_backend=options.attention_backend,
            eagle3=options.eagle3,
            cuda_graphs=options.cuda_graphs,
            kv_alignment=options.kv_alignment,
            draft_tokens=options.num_draft_tokens,
            triton_s=options.triton_compile_s,
            inductor_s=options.inductor_compile_s,
            wait=self.stopping.wait,
        )
        self.grower = faults.MemoryGrower(
            options.grow_step_bytes,
            options.grow_interval_s,
            options.grow_limit_bytes,
            self.stopping,
            say,
        )

    def count_generate(self) -> bool:
        """Count one /generate request; True when the fault is armed for it."""
        with self._lock:
            self.generate_requests += 1
            return self.generate_requests > self.options.fail_after_requests

    def forward(self, *, sampled: bool) -> None:
        """One forward pass in the scheduler (hold ``self.scheduler``): the first one
        JIT-builds FlashInfer's norm, the first sampled one its sampling module, when
        the cache lacks them, as sglang 0.5.17 does; or crashes as the fault says."""
        o = self.options
        cold = [("norm", o.cold_norm_s)] + ([("sampling", o.cold_sampling_s)] if sampled else [])
        for name, seconds in cold:
            if name in self.jitted:
                continue
            self.jitted.add(name)
            if faults.module_cached(o.flashinfer_cache, name) is not None:
                continue
            if name == "norm" and o.fail == "norm-arch":
                say("standin: fault norm-arch: FlashInfer's gate rejects the arch in the norm JIT")
                self.crash(faults.NORM_ARCH_FRAMES)
            if seconds > 0:
                say(f"standin: JIT-building FlashInfer's {name} ({seconds:g} s, a cold cache)")
                self.stopping.wait(seconds)
        for name in o.jit_modules:
            if name in self.jitted:
                continue
            self.jitted.add(name)
            if faults.module_cached(o.flashinfer_cache, name) is None:
                self.jit_build(name)
        self.last_heartbeat = time.strftime("%H:%M:%S")

    def jit_build(self, name: str) -> None:
        """A real FlashInfer JIT build of ``name``, in this process's environment."""
        assert self.options.jit_python is not None
        say(f"standin: JIT-building FlashInfer's {name} (a real build, {self.options.jit_python})")
        # The product's own serving script, found without importing the product here.
        spec = importlib.util.find_spec("supervisor")
        assert spec is not None and spec.submodule_search_locations
        script = Path(spec.submodule_search_locations[0]) / "flashinfer" / "venv_scripts"
        try:
            done = subprocess.run(
                [str(self.options.jit_python), str(script / "k26_serving.py"), "build",
                 "--module", name],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
            )  # fmt: skip
        except OSError as exc:
            self.crash(f"RuntimeError: cannot run {self.options.jit_python}: {exc}\n")
            return
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
            self.crash(f"RuntimeError: Ninja build failed for {name}:\n{tail}\n")
            return
        say(f"standin: built FlashInfer's {name}")

    def log_xid(self, xid: int) -> None:
        """What the NVIDIA driver logs for the faulting scheduler (--xid-pci)."""
        if self.options.xid_pci is None:
            return
        pid = self.scheduler_pid or os.getpid()
        try:
            say(f"standin: kernel log: {faults.log_xid(self.options.xid_pci, xid, pid)}")
        except OSError as exc:
            say(f"standin: cannot write the Xid to /dev/kmsg: {exc}", sys.stderr)

    def admit(self, rid: object, weight: int) -> str:
        """Put a request in flight, under its own rid when it has a free one."""
        with self._lock:
            key = rid if isinstance(rid, str) and rid and rid not in self.in_flight else None
            key = key or uuid.uuid4().hex
            self.in_flight[key] = weight
            self.aborts[key] = threading.Event()
            return key

    def end(self, key: str) -> None:
        """A request's end, processed: its KV slots go back now, while it stays in
        the running batch until ``retire`` (the overlap scheduler's next step)."""
        with self._lock:
            first = key in self.in_flight and key not in self.ended
            self.ended.add(key)
        if first:
            self.compiles.finished()

    def retire(self, key: str) -> None:
        with self._lock:
            ended = self.in_flight.pop(key, None) is not None
            self.aborts.pop(key, None)
            freed = key in self.ended
            self.ended.discard(key)
        if ended and not freed:
            self.compiles.finished()

    def step_time(self) -> float:
        """The decode clock: wall time less the time compiles held the scheduler."""
        with self._lock:
            return time.monotonic() - self._paused_s

    def paused(self, seconds: float) -> None:
        with self._lock:
            self._paused_s += seconds

    def abort_event(self, key: str) -> threading.Event:
        with self._lock:
            return self.aborts.setdefault(key, threading.Event())

    def abort(self, rid: str, abort_all: bool) -> None:
        """SGLang 0.5.17's scheduler: every request whose rid starts with ``rid``
        (``req.rid.startswith(recv_req.rid)``), or all of them."""
        with self._lock:
            for key, event in self.aborts.items():
                if abort_all or key.startswith(rid):
                    event.set()

    def commits(self) -> int:
        """Tokens a verify step commits for one request: the drafts it accepted (none,
        or 0 to num_draft_tokens - 1 with ``--draft-accepts random``) and the target's
        own. One without speculative decoding."""
        o = self.options
        if not o.eagle3 or o.draft_accepts != "random":
            return 1
        with self._lock:
            return 1 + self._accepts.randint(0, max(0, o.num_draft_tokens - 1))

    def batch(self) -> int:
        """The running batch: every sequence in flight, up to max_running_requests
        (the scheduler queues the rest)."""
        o = self.options
        with self._lock:
            running = sum(self.in_flight.values())
        return max(1, min(running, startup.running_requests(o.eagle3, o.max_running_requests)))

    def log_decode(self) -> None:
        """One decode step of a streamed request. sglang 0.5.17 logs the running batch
        every decode_log_interval (40) steps of the scheduler."""
        with self._lock:
            self.decode_steps += 1
            due = self.decode_steps % DECODE_LOG_INTERVAL == 0
        if due:
            running = self.batch()
            graph = self.options.cuda_graphs and running <= traffic.CAPTURED_MAX_BS
            say(
                f"{stamp()} Decode batch, #running-req: {running}, #token: 0, token usage: "
                f"0.00, cuda graph: {graph}, gen throughput (token/s): 0.00, #queue-req: 0"
            )

    def count_decode(self, tokens: int) -> None:
        with self._lock:
            self.realtime_tokens["decode"] += tokens

    def count_tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            self.realtime_tokens["prefill_compute"] += prompt
            self.realtime_tokens["decode"] += generated
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.requests_total += 1

    def metrics_text(self) -> str:
        labels = (
            f'model_name="{self.options.model_path}",engine_type="unified",tp_rank="0",'
            'pp_rank="0",moe_ep_rank="0"'
        )
        front = f'model_name="{self.options.model_path}",engine_type="unified"'
        with self._lock:
            running = sum(self.in_flight.values())
            lines = [
                "# HELP sglang:num_running_reqs The number of running requests.",
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{{{labels}}} {running}.0",
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{{{labels}}} 0.0",
                "# HELP sglang:realtime_tokens_total Total number of tokens processed "
                "(updated on each log interval).",
                "# TYPE sglang:realtime_tokens_total counter",
                *(
                    f'sglang:realtime_tokens_total{{{labels},mode="{mode}"}} {n}.0'
                    for mode, n in self.realtime_tokens.items()
                ),
                "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE sglang:prompt_tokens_total counter",
                f'sglang:prompt_tokens_total{{{front},is_streaming="false"}} '
                f"{self.prompt_tokens}.0",
                "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
                "# TYPE sglang:generation_tokens_total counter",
                f'sglang:generation_tokens_total{{{front},is_streaming="false"}} '
                f"{self.generation_tokens}.0",
                "# HELP sglang:num_requests_total The number of requests processed.",
                "# TYPE sglang:num_requests_total counter",
                f'sglang:num_requests_total{{{front},is_streaming="false"}} '
                f"{self.requests_total}.0",
            ]
        return "\n".join(lines) + "\n"

    def crash(self, frames: str) -> None:
        """A fault in the "scheduler": its exception, then SGLang's SIGQUIT path."""
        faults.print_scheduler_exception(frames)
        self.lifecycle.child_failed()

    def start_growing(self) -> None:
        if self.grower.allocated == 0:
            say(
                f"standin: fault grow-memory: allocating {self.options.grow_step_bytes >> 20} MiB "
                f"every {self.options.grow_interval_s:g} s"
            )
        self.grower.start()


class StandinHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 2048  # uvicorn's default backlog: many clients connect at once

    def __init__(self, state: _State) -> None:
        self.state = state
        super().__init__((state.options.host, state.options.port), _Handler)


def _validation_error(message: str) -> dict[str, Any]:
    """FastAPI's RequestValidationError, as SGLang's handler reshapes it (400)."""
    return {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


def _error(message: str) -> dict[str, Any]:
    """SGLang's ``_create_error_response``: a ValueError from the request (400)."""
    return {"error": {"message": message}}


def _copies(sampling: dict[str, Any]) -> int:
    """``n``: how many samples of each prompt (1 unless a larger integer is given)."""
    n = sampling.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the request was a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise model.RequestError("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None:
        if isinstance(input_ids, list) and input_ids and all(isinstance(i, int) for i in input_ids):
            return [list(input_ids)], False
        if (
            isinstance(input_ids, list)
            and input_ids
            and all(isinstance(r, list) and all(isinstance(i, int) for i in r) for r in input_ids)
        ):
            return [list(r) for r in input_ids], True
        raise model.RequestError("input_ids must be a list of token ids or a list of such lists.")
    if isinstance(text, str):
        return [model.tokenize(text)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [model.tokenize(t) for t in text], True
    raise model.RequestError("text must be a string or a list of strings.")


def _sampling_list(raw: object, count: int) -> list[dict[str, Any]]:
    """``sampling_params`` for each prompt: one object for all, or a list of them (a
    batch's own, as SGLang takes them)."""
    if isinstance(raw, list):
        if len(raw) != count:
            raise model.RequestError(
                f"sampling_params has {len(raw)} entries for a batch of {count} prompts."
            )
        return [r if isinstance(r, dict) else {} for r in raw]
    return [raw if isinstance(raw, dict) else {}] * count


@dataclasses.dataclass
class _Decoding:
    """One prompt of a streamed request, as it decodes."""

    key: str
    prompt: list[int]
    budget: int
    interval: int
    abort: threading.Event
    ids: list[int] = dataclasses.field(default_factory=list)
    finish: dict[str, Any] | None = None
    committed: int = 1  # tokens its last step yielded
    histogram: list[int] = dataclasses.field(default_factory=list)  # steps by drafts accepted
    sent: int = 0  # tokens already streamed out

    def step(self, commits: int = 1) -> None:
        """A step that yields ``commits`` tokens (the prefill's, or a verify step's:
        its accepted drafts and one more), within the budget."""
        commits = max(1, min(commits, self.budget - len(self.ids)))
        if self.ids:  # a verify step
            self.histogram += [0] * (commits - len(self.histogram))
            self.histogram[commits - 1] += 1
        for _ in range(commits):
            previous = self.ids[-1] if self.ids else sum(self.prompt) + len(self.prompt)
            self.ids.append((previous * 31 + 7) % model.VOCAB_SIZE)
        self.committed = commits
        if self.abort.is_set():
            self.finish = {"type": "abort", "message": "Abort before prefill", "status_code": 200}
        elif len(self.ids) >= self.budget:
            self.finish = {"type": "length", "length": len(self.ids)}

    def due(self) -> bool:
        n = len(self.ids)
        return self.finish is not None or n % self.interval == (1 if self.interval > 1 else 0)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    @property
    def state(self) -> _State:
        return cast(StandinHTTPServer, self.server).state

    # --- plumbing -----------------------------------------------------------------

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.state.options.access_log:
            try:
                phrase = HTTPStatus(int(code)).phrase
            except ValueError:
                phrase = ""
            host, port = self.client_address[:2]
            say(f'INFO:     {host}:{port} - "{self.requestline}" {code} {phrase}')

    def log_message(self, format: str, *args: Any) -> None:
        say("standin: " + (format % args), sys.stderr)

    def _send(self, status: int, body: bytes, content_type: str | None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        self._send(status, body, "application/json")

    def _json_object(self) -> dict[str, Any] | None:
        """The request body as a JSON object; None once a 400 has answered otherwise
        (FastAPI's validation errors, as SGLang answers them)."""
        try:
            body = json.loads(self._body or b"null")
        except ValueError as exc:
            self._json(400, _validation_error(f"JSON decode error: {exc}"))
            return None
        if not isinstance(body, dict):
            self._json(400, _validation_error("Input should be a valid dictionary or object"))
            return None
        return body

    def _read_body(self) -> bytes:
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        routes: dict[str, tuple[set[str], Callable[[], None]]] = {
            "/health": ({"GET"}, self._health),
            "/health_generate": ({"GET"}, self._health),
            "/get_model_info": ({"GET"}, self._model_info),
            "/model_info": ({"GET"}, self._model_info),
            "/get_server_info": ({"GET"}, self._server_info),
            "/server_info": ({"GET"}, self._server_info),
            "/v1/models": ({"GET"}, self._models),
            "/ping": ({"GET"}, lambda: self._send(200, b"", None)),
            "/generate": ({"POST", "PUT"}, self._generate),
            "/metrics": ({"GET"}, self._metrics),
            "/abort_request": ({"POST"}, self._abort_request),
            "/flush_cache": ({"GET", "POST"}, self._flush_cache),
            "/v1/completions": ({"POST"}, self._completions),
        }
        body = self._read_body() if method in ("POST", "PUT") else b""
        self._body = body
        if path not in routes:
            self._json(404, {"detail": "Not Found"})
            return
        methods, handler = routes[path]
        if method not in methods:
            self._json(405, {"detail": "Method Not Allowed"})
            return
        handler()

    # --- endpoints ----------------------------------------------------------------

    def _health(self) -> None:
        """``/health`` and ``/health_generate`` (one handler in SGLang 0.5.x): 503 while
        starting, else a greedy one-token generation (``input_ids=[0]``,
        ``temperature=0``), which never touches the sampling kernels."""
        state = self.state
        if state.lifecycle.gracefully_exit.is_set():
            say(f"{stamp()} Health check request received during shutdown. Returning 503.")
            self._send(503, b"", None)
            return
        if state.stopping.is_set() or not state.loaded.is_set():
            self._send(503, b"", None)
            return
        tic = time.strftime("%H:%M:%S")
        wait_s = state.options.health_check_timeout_s
        if not state.scheduler.acquire(timeout=wait_s):
            # The scheduler is busy (a JIT build): SGLang gives up on it after 20 s.
            say(
                f"{stamp()} Health check failed. Server couldn't get a response from detokenizer "
                f"for last {wait_s:g} seconds. tic start time: {tic}. "
                f"last_heartbeat time: {state.last_heartbeat}"
            )
            self._send(503, b"", None)
            return
        try:
            state.forward(sampled=False)
            params = model.parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0})
            model.generate([0], params)
        finally:
            state.scheduler.release()
        self._send(200, b"", None)

    def _metrics(self) -> None:
        if not self.state.options.enable_metrics:  # SGLang mounts it only with the flag
            self._json(404, {"detail": "Not Found"})
            return
        body = self.state.metrics_text().encode()
        self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")

    def _model_info(self) -> None:
        path = self.state.options.model_path
        self._json(
            200,
            {
                "model_path": path,
                "tokenizer_path": path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            },
        )

    def _server_info(self) -> None:
        o = self.state.options
        self._json(
            200,
            {
                "model_path": o.model_path,
                "tokenizer_path": o.model_path,
                "host": o.host,
                "port": cast(StandinHTTPServer, self.server).server_port,
                "sampling_backend": o.sampling_backend,
                "attention_backend": o.attention_backend,
                "grammar_backend": o.grammar_backend,
                "speculative_algorithm": "EAGLE3" if o.eagle3 else None,
                "speculative_num_steps": o.num_steps if o.eagle3 else None,
                "speculative_eagle_topk": o.eagle_topk if o.eagle3 else None,
                "speculative_num_draft_tokens": o.num_draft_tokens if o.eagle3 else None,
                "chunked_prefill_size": CHUNKED_PREFILL_SIZE,
                "page_size": 1,  # the server argument's default (the real H100's said 1)
                # Resolved, as sglang 0.5.17 answers it (48 for speculative decoding,
                # measured on the H200); the scheduler's own is in internal_states too.
                "max_running_requests": startup.running_requests(o.eagle3, o.max_running_requests),
                "context_length": o.context_length,
                # The scheduler's handshake (get_init_info), merged in as sglang does.
                "max_total_num_tokens": startup.StartupPlan.max_total_tokens,
                "max_req_input_len": o.context_length - 1,
                "internal_states": [
                    {
                        "generate_requests": self.state.generate_requests,
                        "effective_max_running_requests_per_dp": startup.running_requests(
                            o.eagle3, o.max_running_requests
                        ),
                    }
                ],
                "version": SGLANG_VERSION,
                "standin": {
                    "loaded": self.state.loaded.is_set(),
                    "fail": o.fail,
                    "fail_after_requests": o.fail_after_requests,
                },
            },
        )

    def _models(self) -> None:
        name = self.state.options.model_path
        card = {"id": name, "object": "model", "owned_by": "sglang", "root": name}
        self._json(200, {"object": "list", "data": [{**card, "max_model_len": model.CONTEXT_LEN}]})

    def _generate(self) -> None:
        state = self.state
        if state.stopping.is_set() or not state.loaded.is_set():
            self._json(503, _error("The server is not ready: the model is still loading."))
            return
        body = self._json_object()
        if body is None:
            return
        try:
            prompts, is_batch = _prompts(body)
            raws = _sampling_list(body.get("sampling_params"), len(prompts))
            every = [model.parse_sampling_params(r) for r in raws]
            if body.get("stream") and _copies(raws[0]) > 1:
                raise model.RequestError(
                    "stream=True with n > 1 is not supported by the stand-in server."
                )
        except model.RequestError as exc:
            self._json(400, _error(str(exc)))
            return
        except model.InternalServerError as exc:
            say(f"standin: TypeError in SamplingParams: {exc}", sys.stderr)
            self._send(500, b"Internal Server Error", "text/plain; charset=utf-8")
            return

        raw = raws[0]
        if state.options.grammar_backend == "none" and any(
            raw.get(k) is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")
        ):
            # sglang 0.5.17: set_finish_with_abort(...), FINISH_ABORT(BAD_REQUEST): a 400.
            say(f"{stamp()} {GRAMMAR_DISABLED}, self.rid='{uuid.uuid4().hex}'", sys.stderr)
            self._json(400, _error(GRAMMAR_DISABLED))
            return
        # In SGLang's rid_to_state until answered: a SIGTERM drain waits for it.
        # A streamed batch runs as its own requests, each under its rid (SGLang's
        # batch streaming: every output carries its "index").
        if body.get("stream"):
            rids = body.get("rid")
            keys = [
                state.admit(rids[i] if isinstance(rids, list) and i < len(rids) else rids, 1)
                for i in range(len(prompts))
            ]
        else:
            keys = [state.admit(None, _copies(raw) * len(prompts))]
        try:
            self._serve_generate(body, prompts, is_batch, raws, every, keys)
        finally:
            for key in keys:
                state.retire(key)

    def _serve_generate(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        is_batch: bool,
        raws: list[dict[str, Any]],
        every: list[model.SamplingParams],
        keys: list[str],
    ) -> None:
        state, options = self.state, self.state.options
        params = every[0]
        armed = state.count_generate()
        if armed and options.fail == "cuda-oom" and options.fail_after_requests:
            say("standin: fault cuda-oom: the KV cache does not fit in GPU memory")
            state.crash(faults.CUDA_OOM_FRAMES)
        if armed and options.fail == "grow-memory" and options.fail_after_requests:
            state.start_growing()
        sampling_arch = options.fail == "sampling-arch" and options.sampling_backend == "flashinfer"
        cold_sampling = (
            faults.module_cached(options.flashinfer_cache, options.sampling_module) is None
        )
        if armed and not params.is_greedy and sampling_arch and cold_sampling:
            say("standin: fault sampling-arch: FlashInfer sampling JIT rejected the GPU")
            state.crash(faults.SAMPLING_ARCH_FRAMES)
        # The request shape that took real SGLang 0.5.17 down on an H200: a prompt of
        # about 900 tokens under --context-length 1024 (field facts). Any prompt of at
        # least three quarters of the context plays it; the probe's never does.
        long_prompt = max(map(len, prompts), default=0) >= options.context_length * 3 // 4
        fault, xid = options.fail, options.xid
        # A stall logs an Xid when one is asked for (a GPU that fell off the bus hangs
        # the scheduler before anything dies): --xid-pci, or a number in a chaos prompt.
        stall_xid = options.xid_pci is not None
        text = body.get("text")
        if fault == "chaos" and isinstance(text, str) and text.startswith(faults.CHAOS_PREFIX):
            # bench/chaos.py names the fault in the prompt: "k26-chaos:KIND[:XID]".
            fault, _, number = text[len(faults.CHAOS_PREFIX) :].partition(":")
            xid, long_prompt, armed = int(number or xid), True, True
            stall_xid = bool(number)
            if fault == "hang":  # from now on no /generate answers; /health still does
                state.hung.set()
            if fault == "grow-memory":
                state.start_growing()
            if fault == "compile":  # a kernel variant never compiled before, e.g. a new shape
                with state.scheduler:
                    state.compiles.compile([(JitCache.TRITON, f"chaos_variant@{number}")])
        if fault == "chaos" and state.hung.is_set():
            fault, long_prompt, armed = "hang", True, True
        if armed and long_prompt and fault == "device-assert":
            say("standin: fault device-assert: a device-side assert in the scheduler's forward")
            state.log_xid(xid)
            state.crash(faults.DEVICE_ASSERT_FRAMES)
        if armed and long_prompt and fault == "crash-exit-0":
            say("standin: fault crash-exit-0: a fatal engine error, then exit status 0")
            state.log_xid(xid)
            faults.print_scheduler_exception(faults.ENGINE_ERROR_FRAMES)
            state.lifecycle.exit_quietly(0)
        if armed and long_prompt and fault in ("stall", "hang"):
            # stall: the scheduler itself hangs in this request's forward, so no other
            # request gets a token either (its health checks wait, then 503); hang: this
            # and every later /generate hang while /health still answers 200. Either way
            # in flight (running), with no token, until a stop drains it.
            say(f"standin: fault {fault}: no token comes for this request")
            if fault == "stall" and stall_xid:
                state.log_xid(xid)
            with state.scheduler if fault == "stall" else contextlib.nullcontext():
                while not state.lifecycle.gracefully_exit.wait(0.1) and not state.stopping.is_set():
                    pass
            self.close_connection = True
            return
        if armed and not params.is_greedy and options.fail == "sampled-hang":
            say("standin: fault sampled-hang: a sampled request will never be answered")
            state.stopping.wait()
            self.close_connection = True
            return
        sampled_kernels = not params.is_greedy and options.sampling_backend == "flashinfer"
        raw = raws[0]
        text = body.get("text")
        later = 0 if body.get("stream") else sum(max(0, p.max_new_tokens - 1) for p in every)
        seqs = len(prompts) * _copies(raw)
        new_tokens = sum(map(len, prompts)) * _copies(raw)
        with state.scheduler:  # the one scheduler: it forms the batch as it runs it
            batch = state.batch()
            kernels = state.compiles.kernels_for(
                raw, batch, text if isinstance(text, str) else json.dumps(prompts)
            )
            cached = state.compiles.cached_tokens(prompts) if options.kv_alignment else 0
            kernels += state.compiles.prefill_kernels(new_tokens - cached, later)
            tic = time.monotonic()
            state.forward(sampled=sampled_kernels)
            state.compiles.compile(kernels)  # the server stalls while it compiles
            state.paused(time.monotonic() - tic)
            if not cached and (JitCache.TRITON, "write_req_to_token_pool_triton") in kernels:
                cached = new_tokens - seqs  # the whole prompt again: all but its last token
            # sglang 0.5.17 logs a prefill batch as it processes the result, after the
            # forward (metrics_reporter.report_prefill_stats), before the next batch.
            say(
                f"{stamp()} Prefill batch, #new-seq: {seqs}, "
                f"#new-token: {new_tokens - cached}, "
                f"#cached-token: {cached}, token usage: 0.00, "
                f"#running-req: {max(0, batch - seqs)}, #queue-req: 0, #pending-token: 0, "
                "cuda graph: False, input throughput (token/s): 0.00"
            )
        if body.get("stream"):
            self._stream(prompts, raws, every, keys, is_batch)
        else:
            self._answer(body, prompts, is_batch, raws, every)

    def _stream(
        self,
        prompts: list[list[int]],
        raws: list[dict[str, Any]],
        every: list[model.SamplingParams],
        keys: list[str],
        is_batch: bool,
    ) -> None:
        """A streamed /generate as SGLang sends it: ``data: {json}`` lines, then
        ``data: [DONE]``. The first token comes from the prefill and goes out at
        once; then the request's prompts decode together, a verify step's tokens a
        step (one where the draft accepts none, and without speculative decoding) at
        the batch in flight then, compiling what that batch size needs first. Each
        outputs when its length modulo its ``stream_interval`` is 1 (0 for an interval
        of 1: sglang 0.5.17's output streamer) and at its end; a batch's outputs carry
        their ``index``. An /abort_request ends one with finish_reason abort at the
        next step's output, as the real scheduler does; and, as its overlap scheduler
        does (launching a batch before it processes the last), a request that ended
        at a step is still in the next step's batch, its output dropped. A finished
        speculative request's meta_info carries the verify steps it made
        (``spec_verify_ct``) and the drafts they accepted (``--draft-accepts``)."""
        state = self.state
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        started = time.monotonic()
        intervals = [r.get("stream_interval") for r in raws]
        streams = [
            _Decoding(
                key=key,
                prompt=prompt,
                budget=min(p.max_new_tokens, model.CONTEXT_LEN - len(prompt)),
                interval=every_n if isinstance(every_n, int) and every_n > 0 else 1,
                abort=state.abort_event(key),
            )
            for key, prompt, p, every_n in zip(keys, prompts, every, intervals, strict=True)
        ]
        try:
            # The first token comes from the prefill itself (sampled from its logits)
            # and goes out at once, before any decode step: no step's KV slots are
            # taken for it (seen on the H200: a wave sent on a streamed request's first
            # token was prefilled right after it, at the offset its prompt left).
            prefilled = True
            ending: list[str] = []  # ended at the last step: in this step's batch still
            while any(d.finish is None for d in streams) and not state.stopping.is_set():
                if not prefilled:
                    self._decode_step(ending)
                    ending = []
                # The step: every running request's KV slots, taken before its forward,
                # then its tokens; the ends it made hand slots back once it is done
                # (processing its result), so the next step's slices start at 0.
                stepped = [(i, d) for i, d in enumerate(streams) if d.finish is None]
                for _, d in stepped:
                    first_step = len(d.ids) == 1
                    before = d.committed  # what its last step committed: this one's slots
                    d.step(1 if prefilled else state.commits())
                    state.count_decode(d.committed)
                    if not prefilled:
                        state.compiles.take_slots(1, first=first_step, each=before)
                    if d.finish is not None:
                        ending.append(d.key)
                for _, d in stepped:
                    if d.finish is not None:
                        state.end(d.key)
                for index, d in stepped:
                    if not d.due():
                        continue
                    meta = {
                        "id": d.key,
                        "finish_reason": d.finish,
                        "prompt_tokens": len(d.prompt),
                        "completion_tokens": len(d.ids),
                        "cached_tokens": 0,
                        "e2e_latency": time.monotonic() - started,
                    }
                    if d.finish is not None:
                        meta.update(self._spec_metrics(len(d.ids), d.histogram))
                    # The tokens since its last output only (as
                    # --incremental-streaming-output): the whole text at every step
                    # would cost the stand-in quadratic time.
                    fresh, d.sent = d.ids[d.sent :], len(d.ids)
                    chunk: dict[str, Any] = {
                        "text": model.detokenize(fresh),
                        "output_ids": fresh,
                        "meta_info": meta,
                    }
                    if is_batch:
                        chunk["index"] = index
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                prefilled = False
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            if ending and not state.stopping.is_set():
                self._decode_step(ending)  # the last ends' forward, its output dropped
        except OSError:
            return  # the client went away: SGLang aborts the request
        finally:
            for d in streams:
                state.count_tokens(len(d.prompt), 0)

    def _decode_step(self, ending: list[str]) -> None:
        """One decode step of the running batch, on the clock every request shares,
        compiling what its size needs first; then the requests that ended at the step
        before (``ending``) leave the batch."""
        state = self.state
        kernels = state.compiles.batch_kernels(state.batch(), step=True)
        if kernels:
            with state.scheduler:
                tic = time.monotonic()
                state.compiles.compile(kernels)
                state.paused(time.monotonic() - tic)
        time.sleep(STREAM_STEP_S - time.monotonic() % STREAM_STEP_S)
        state.log_decode()
        for key in ending:
            state.retire(key)  # out of the running batch from the next step

    def _spec_metrics(
        self, completion_tokens: int, histogram: list[int] | None = None
    ) -> dict[str, Any]:
        """What sglang 0.5.17 adds to a finished request's meta_info on a speculative
        server (``TokenizerManager._calculate_spec_decoding_metrics``), once it made a
        verify step: the prefill yields the first token, each verify step its accepted
        drafts and one more (``histogram``: the steps by drafts accepted). A request
        answered whole (not streamed) accepts none."""
        if histogram is None:
            histogram = [completion_tokens - 1]
        verify = sum(histogram)
        if not self.state.options.eagle3 or verify <= 0:
            return {}
        accepted = sum(n * steps for n, steps in enumerate(histogram))
        proposed = verify * (self.state.options.num_draft_tokens - 1)
        return {
            "spec_accept_rate": accepted / proposed if proposed else 0.0,
            "spec_accept_length": completion_tokens / verify,
            "spec_num_correct_drafts": accepted,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify,
            "spec_accepted_drafts": accepted,
            "spec_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": histogram,
            "spec_accept_histogram": histogram,
        }

    def _flush_cache(self) -> None:
        """SGLang 0.5.17's /flush_cache: the radix cache and the KV allocator emptied
        when nothing runs (200 "Cache flushed..."), else a 400 that says why."""
        state = self.state
        with state.scheduler:
            if state.in_flight:
                self._send(400, b"Cache not flushed: there are running or waiting requests.\n",
                           "text/plain; charset=utf-8")  # fmt: skip
                return
            state.compiles.flush()
        say(f"{stamp()} Cache flushed successfully!")
        body = (
            b"Cache flushed.\nPlease check backend logs for more details. (When there are "
            b"running or waiting requests, the operation will not be performed.)\n"
        )
        self._send(200, body, "text/plain; charset=utf-8")

    def _abort_request(self) -> None:
        """SGLang 0.5.17's /abort_request: ``{"rid": ..., "abort_all": false}``; a 200
        with an empty body, whether or not a request matched."""
        body = self._json_object()
        if body is None:
            return
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        if not isinstance(rid, str):
            self._json(400, _validation_error("rid: Input should be a valid string"))
            return
        if rid or abort_all:  # an empty rid would match everything: SGLang ignores it
            self.state.abort(rid, abort_all)
        self._send(200, b"", None)

    def _answer(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        is_batch: bool,
        raws: list[dict[str, Any]],
        every: list[model.SamplingParams],
    ) -> None:
        started = time.monotonic()
        rids = body.get("rid")
        n = _copies(raws[0])
        outputs: list[dict[str, Any]] = []
        for index, prompt in enumerate(prompts):
            params = every[index]
            for copy in range(n):
                seeded = params
                if n > 1 and params.sampling_seed is not None:
                    seeded = dataclasses.replace(params, sampling_seed=params.sampling_seed + copy)
                try:
                    ids = model.generate(prompt, seeded)
                except model.RequestError as exc:
                    self._json(400, _error(str(exc)))
                    return
                rid = rids[index] if isinstance(rids, list) and index < len(rids) else rids
                meta: dict[str, Any] = {
                    "id": rid if isinstance(rid, str) else uuid.uuid4().hex,
                    "finish_reason": {"type": "length", "length": len(ids)},
                    "prompt_tokens": len(prompt),
                    "weight_version": "default",
                    "completion_tokens": len(ids),
                    "cached_tokens": 0,
                    "e2e_latency": time.monotonic() - started,
                    **self._spec_metrics(len(ids)),
                }
                if body.get("return_logprob"):
                    meta.update(openai_api.logprobs(ids, body.get("top_logprobs_num")))
                outputs.append(
                    {"text": model.detokenize(ids), "output_ids": ids, "meta_info": meta}
                )
                self.state.count_tokens(len(prompt), len(ids))
        # SGLang answers a list for a batch, or for one prompt sampled n > 1 times.
        self._json(200, outputs if is_batch or n > 1 else outputs[0])

    def _completions(self) -> None:
        """OpenAI's ``/v1/completions``, as SGLang serves it: the same engine."""
        state = self.state
        if state.stopping.is_set() or not state.loaded.is_set():
            self._json(503, _error("The server is not ready: the model is still loading."))
            return
        try:
            request = openai_api.parse_completion(json.loads(self._body or b"null"))
            params = model.parse_sampling_params(request.sampling_params)
        except (ValueError, model.RequestError) as exc:
            self._json(400, _validation_error(str(exc)))
            return
        except model.InternalServerError as exc:
            self._json(400, _validation_error(str(exc)))
            return
        key = state.admit(None, 1)
        try:
            kernels = state.compiles.kernels_for(
                request.sampling_params, state.batch(), request.prompt
            )
            with state.scheduler:
                state.forward(sampled=not params.is_greedy)
                state.compiles.compile(kernels)
            ids = model.generate(model.tokenize(request.prompt), params)
        finally:
            state.retire(key)
        model_name = state.options.model_path
        self._json(200, openai_api.completion_response(model_name, request, ids))


def _load(state: _State) -> bool:
    """The model load, before anything listens (SGLang starts uvicorn only after its
    engine is up: until then a client's connection is refused). False when stopped."""
    options = state.options
    say(f"standin: loading model {options.model_path} ({options.load_seconds:g} s)")
    plan = startup.StartupPlan(
        load_s=options.load_seconds,
        eagle3=options.eagle3,
        cuda_graphs=options.cuda_graphs,
        num_steps=options.num_steps,
        num_draft_tokens=options.num_draft_tokens,
        topk=options.eagle_topk,
        context_len=options.context_length,
        chunked_prefill_size=CHUNKED_PREFILL_SIZE,
        max_running_requests=options.max_running_requests,
    )
    if not startup.play(plan, say, state.stopping):
        return False
    if options.fail == "cuda-oom" and not options.fail_after_requests:
        say("standin: fault cuda-oom: the KV cache does not fit in GPU memory")
        state.crash(faults.CUDA_OOM_FRAMES)
    if options.fail == "kv-cache-oom":
        say("standin: fault kv-cache-oom: the loaded weights leave no GPU memory for the KV cache")
        state.crash(faults.KV_CACHE_OOM_FRAMES)
    return True


def _warm_up(state: _State) -> None:
    """SGLang's ``_wait_and_warmup``: one greedy generation once uvicorn listens (the
    first forward, so a cold norm module is built here), then the ready line."""
    with state.scheduler:
        if state.stopping.is_set():
            return
        state.forward(sampled=False)
    if not state.stopping.is_set():
        say("The server is fired up and ready to roll!")


def _bind_error(host: str, port: int, exc: OSError) -> None:
    """uvicorn's words for a port another process holds (then SGLang exits 1)."""
    say(
        f"{stamp()} ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
        f"({host!r}, {port}): {exc.strerror and exc.strerror.lower()}",
        sys.stderr,
    )


def serve(options: StandinOptions) -> int:
    """Serve until a fault or a stop ends the process: as SGLang, by its own SIGKILL
    (``--stop-mode clean``: exit 0 after the drain)."""
    state = _State(options)
    lifecycle = state.lifecycle
    if options.scheduler:
        pid = state.scheduler_pid = lifecycle.start_scheduler()
        say(f"standin: scheduler {pid} ({lifecycle.scheduler_title})")
    server: StandinHTTPServer | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        lifecycle.on_sigterm(signum)

    def stop_serving() -> None:
        state.stopping.set()
        if server is not None:
            threading.Thread(target=server.shutdown, name="shutdown", daemon=True).start()

    lifecycle.on_stop = stop_serving
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=lifecycle.sigterm_watchdog, name="sigterm", daemon=True).start()
    if not _load(state):
        say("standin: stopped")
        return 0
    try:
        server = StandinHTTPServer(state)
    except OSError as exc:
        _bind_error(options.host, options.port, exc)
        return 1
    host, port = server.server_address[:2]
    say(f"standin: listening on http://{host!s}:{port}")
    state.loaded.set()
    lifecycle.running = True
    say("standin: loaded")
    if options.skip_server_warmup:
        say("The server is fired up and ready to roll!")  # SGLang prints it all the same
    else:
        threading.Thread(target=_warm_up, args=(state,), name="warmup", daemon=True).start()
    if options.fail == "grow-memory" and not options.fail_after_requests:
        state.start_growing()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        state.stopping.set()
        server.server_close()
    say("standin: stopped")
    return 0
