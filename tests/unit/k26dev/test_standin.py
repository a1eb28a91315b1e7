"""The stand-in SGLang server as a real process, over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k26dev.ports import free_port
from k26dev.standin import model, traffic
from supervisor.core.classify import ExitCause, ExitSnapshot, classify

ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 10.0

GREEDY: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0.0}
SAMPLED: dict[str, Any] = {
    "max_new_tokens": 4,
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 20,
    "sampling_seed": 7,
}


class Standin:
    """One ``python -m k26dev.standin --port 0`` process and its output."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = asyncio.Event()
        self._readers = [
            asyncio.create_task(self._collect(proc.stdout, self.stdout)),
            asyncio.create_task(self._collect(proc.stderr, self.stderr)),
        ]
        self.url = ""

    async def _collect(self, stream: asyncio.StreamReader | None, sink: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            sink.append(line.decode().rstrip("\n"))
            self._changed.set()
        self._changed.set()

    async def wait_line(self, pattern: str, timeout_s: float = DEADLINE_S) -> str:
        """The first output line matching ``pattern``; fails at the deadline."""
        regex = re.compile(pattern)

        async def find() -> str:
            while True:
                for line in self.stdout + self.stderr:
                    if regex.search(line):
                        return line
                if all(r.done() for r in self._readers):
                    raise AssertionError(f"exited without printing {pattern!r}: {self.output}")
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(find(), timeout_s)

    async def wait_exit(self, timeout_s: float = DEADLINE_S) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        await asyncio.wait_for(asyncio.gather(*self._readers), timeout_s)
        return code

    @property
    def output(self) -> list[str]:
        return self.stdout + self.stderr


@contextlib.asynccontextmanager
async def standin(
    *args: str, module: str = "k26dev.standin", port: int = 0
) -> AsyncIterator[Standin]:
    """The stand-in, yielded once it listens (with ``port``: at once, its url known)."""
    command = [sys.executable, "-m", module, *(["standin"] if module == "k26dev" else [])]
    proc = await asyncio.create_subprocess_exec(
        *command,
        "--port",
        str(port),
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    server = Standin(proc)
    try:
        if port:
            server.url = f"http://127.0.0.1:{port}"
        else:
            line = await server.wait_line(r"listening on http://")
            server.url = line.split("listening on ", 1)[1].strip()
        yield server
    finally:
        if proc.returncode is None:
            proc.kill()
        await server.wait_exit()


async def post(client: httpx.AsyncClient, url: str, body: Any) -> httpx.Response:
    return await client.post(url + "/generate", json=body)


# --- shapes -------------------------------------------------------------------------


async def test_sglang_shapes() -> None:
    async with standin() as s, httpx.AsyncClient(timeout=DEADLINE_S) as client:
        await s.wait_line(r"^standin: loaded$")
        health = await client.get(s.url + "/health")
        assert (health.status_code, health.content) == (200, b"")
        assert (await client.get(s.url + "/health_generate")).status_code == 200

        info = (await client.get(s.url + "/get_model_info")).json()
        assert info["model_path"] == info["tokenizer_path"] == "k26/standin-tiny"
        assert info["is_generation"] is True
        assert (await client.get(s.url + "/model_info")).json() == info
        assert (await client.get(s.url + "/get_server_info")).json()["version"]

        response = await post(client, s.url, {"text": "the model is", "sampling_params": SAMPLED})
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        out = response.json()
        assert set(out) == {"text", "output_ids", "meta_info"}
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert meta["completion_tokens"] == len(out["output_ids"]) == 4
        assert meta["prompt_tokens"] == 3 and meta["cached_tokens"] == 0
        assert isinstance(meta["id"], str) and meta["id"]
        assert isinstance(meta["e2e_latency"], float)
        assert out["text"] == model.detokenize(out["output_ids"])


async def test_generation_is_deterministic_by_seed() -> None:
    async with standin() as s, httpx.AsyncClient(timeout=DEADLINE_S) as client:
        await s.wait_line(r"^standin: loaded$")
        body: dict[str, Any] = {
            "input_ids": [1, 2, 3],
            "sampling_params": {**SAMPLED, "max_new_tokens": 16},
        }
        first, again = [(await post(client, s.url, body)).json() for _ in range(2)]
        assert first["output_ids"] == again["output_ids"]
        other = {**body, "sampling_params": {**SAMPLED, "max_new_tokens": 16, "sampling_seed": 8}}
        assert (await post(client, s.url, other)).json()["output_ids"] != first["output_ids"]
        greedy = {"input_ids": [1, 2, 3], "sampling_params": GREEDY, "rid": "req-1"}
        g1, g2 = [(await post(client, s.url, greedy)).json() for _ in range(2)]
        assert g1["output_ids"] == g2["output_ids"] and g1["meta_info"]["id"] == "req-1"
        batch = await post(client, s.url, {"text": ["a b", "c"], "sampling_params": GREEDY})
        assert [o["meta_info"]["prompt_tokens"] for o in batch.json()] == [2, 1]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"sampling_params": GREEDY}, 400, "Either text, input_ids or input_embeds"),
        ({"text": "x", "sampling_params": {"top_p": 1.5}}, 400, "top_p must be in (0, 1]"),
        ({"text": "x", "sampling_params": {"top_k": 0}}, 400, "top_k must be -1 (disable)"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, 400, "temperature must be"),
        ({"text": "x", "sampling_params": {"min_p": 2}}, 400, "min_p must be in [0, 1]"),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
        ({"input_ids": "nope"}, 400, "input_ids must be"),
    ],
)
async def test_bad_requests_are_400_like_sglang(
    body: dict[str, Any], status: int, message: str
) -> None:
    async with standin() as s, httpx.AsyncClient(timeout=DEADLINE_S) as client:
        await s.wait_line(r"^standin: loaded$")
        response = await post(client, s.url, body)
        assert response.status_code == status
        assert message in response.json()["error"]["message"]


async def test_unknown_sampling_key_and_bad_json_and_paths() -> None:
    async with standin() as s, httpx.AsyncClient(timeout=DEADLINE_S) as client:
        await s.wait_line(r"^standin: loaded$")
        # SGLang's native key is sampling_seed; "seed" is a TypeError there: HTTP 500.
        seeded = await post(client, s.url, {"text": "x", "sampling_params": {"seed": 1}})
        assert (seeded.status_code, seeded.text) == (500, "Internal Server Error")
        bad = await client.post(s.url + "/generate", content=b"{nope")
        assert bad.status_code == 400 and bad.json()["object"] == "error"
        assert bad.json()["code"] == 400
        missing = await client.get(s.url + "/nowhere")
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
        assert (await client.get(s.url + "/generate")).status_code == 405


# --- loading ------------------------------------------------------------------------


async def test_refused_while_loading_then_warm_up_then_200() -> None:
    """SGLang 0.5.17 starts uvicorn only once its engine is up: a client is refused,
    not answered 503, while the model loads; the warm-up then prints the ready line."""
    args = ("--load-seconds", "3")
    async with standin(*args, port=free_port()) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loading model")
        with pytest.raises(httpx.ConnectError):
            await c.get(s.url + "/health")
        assert not any("listening on" in line for line in s.stdout)
        await s.wait_line(r"^The server is fired up and ready to roll!$")
        assert (await c.get(s.url + "/health")).status_code == 200
        assert (await post(c, s.url, {"text": "x", "sampling_params": GREEDY})).status_code == 200


# --- faults -------------------------------------------------------------------------


def _classify(server: Standin, code: int) -> ExitCause:
    """As systemd would report the stand-in's end: killed by a signal, or exited."""
    if code < 0:
        snapshot = ExitSnapshot("standin.service", "signal", 2, -code, server.proc.pid, "", None)
    else:
        result = "success" if code == 0 else "exit-code"
        snapshot = ExitSnapshot("standin.service", result, 1, code, server.proc.pid, "", None)
    return classify(snapshot, [], server.output).cause


# Short versions of SGLang's 5 s SIGTERM poll and crash-diagnostics pause.
QUICK = ("--sigterm-poll-seconds", "0.1", "--crash-diagnostics-seconds", "0.1")


async def test_sampling_arch_crashes_only_on_sampled_requests() -> None:
    args = ("--fail", "sampling-arch", *QUICK)
    async with standin(*args) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        assert (await c.get(s.url + "/health_generate")).status_code == 200
        greedy = {"text": "x", "sampling_params": {"temperature": 0.7, "top_k": 1}}
        assert (await post(c, s.url, greedy)).status_code == 200  # top_k=1 is greedy too
        with pytest.raises(httpx.TransportError):
            await post(c, s.url, {"text": "x", "sampling_params": SAMPLED})
        code = await s.wait_exit()
    # SGLang's end after a scheduler failure: SIGQUIT, diagnostics, its own SIGKILL.
    assert code == -signal.SIGKILL
    assert any(
        "RuntimeError: FlashInfer requires GPUs with sm75 or higher" in ln for ln in s.stderr
    )
    assert any("SIGQUIT received. signum=None, frame=None." in ln for ln in s.stdout)
    assert any("Sleeping 5 seconds before crash diagnostics" in ln for ln in s.stdout)
    assert any("include_parent=True" in ln for ln in s.stdout)
    assert _classify(s, code) is ExitCause.FLASHINFER_ARCH


async def test_sampling_arch_after_requests_and_a_warm_cache(tmp_path: Path) -> None:
    cache = tmp_path / "ws"
    async with (
        standin(
            "--fail",
            "sampling-arch",
            "--fail-after-requests",
            "2",
            "--flashinfer-cache",
            str(cache),
            *QUICK,
        ) as s,
        httpx.AsyncClient(timeout=DEADLINE_S) as c,
    ):
        await s.wait_line(r"^standin: loaded$")
        sampled = {"text": "x", "sampling_params": SAMPLED}
        for _ in range(2):  # not armed yet
            assert (await post(c, s.url, sampled)).status_code == 200
        module = cache / ".cache/flashinfer/0.7.4/120f/cached_ops/sampling/sampling.so"
        module.parent.mkdir(parents=True)
        module.write_bytes(b"\x7fELF")
        assert (await post(c, s.url, sampled)).status_code == 200  # warm: "fixed"
        module.unlink()
        with pytest.raises(httpx.TransportError):
            await post(c, s.url, sampled)
        assert await s.wait_exit() == -signal.SIGKILL


async def test_sampling_arch_needs_the_module_the_flag_names(tmp_path: Path) -> None:
    """--sampling-module: sampling.so alone no longer spares the crash; the named one does."""
    cache = tmp_path / "ws"
    arch_dir = cache / ".cache/flashinfer/0.7.4/120f/cached_ops"
    (arch_dir / "sampling").mkdir(parents=True)
    (arch_dir / "sampling" / "sampling.so").write_bytes(b"\x7fELF")
    args = ("--fail", "sampling-arch", "--flashinfer-cache", str(cache))
    async with (
        standin(*args, "--sampling-module", "api_log_stats", *QUICK) as s,
        httpx.AsyncClient(timeout=DEADLINE_S) as c,
    ):
        await s.wait_line(r"^standin: loaded$")
        (arch_dir / "api_log_stats").mkdir()
        (arch_dir / "api_log_stats" / "api_log_stats.so").write_bytes(b"\x7fELF")
        sampled = {"text": "x", "sampling_params": SAMPLED}
        assert (await post(c, s.url, sampled)).status_code == 200
        (arch_dir / "api_log_stats" / "api_log_stats.so").unlink()
        with pytest.raises(httpx.TransportError):
            await post(c, s.url, sampled)  # sampling.so is there, but not the one it needs
        assert await s.wait_exit() == -signal.SIGKILL


async def test_sampled_hang_hangs_only_sampled_requests() -> None:
    args = ("--fail", "sampled-hang", *QUICK)
    async with standin(*args) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                s.url + "/generate",
                json={"text": "x", "sampling_params": SAMPLED},
                timeout=httpx.Timeout(DEADLINE_S, read=0.5),
            )
        assert (await post(c, s.url, {"text": "x", "sampling_params": GREEDY})).status_code == 200
        assert (await c.get(s.url + "/health_generate")).status_code == 200
        # As SGLang: the drain waits for the hanging request, polling, until killed
        # (systemd's TimeoutStopSec= would SIGKILL it).
        s.proc.send_signal(signal.SIGTERM)
        await s.wait_line(r"Remaining number of requests 1\.")
        response = await c.get(s.url + "/health")
        assert response.status_code == 503
        await s.wait_line(r"Health check request received during shutdown\. Returning 503\.")
        assert s.proc.returncode is None
        s.proc.kill()
        assert await s.wait_exit() == -signal.SIGKILL


async def test_sigterm_drains_then_sigkills_itself_like_sglang() -> None:
    async with standin(*QUICK) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        assert (await post(c, s.url, {"text": "x", "sampling_params": SAMPLED})).status_code == 200
        s.proc.send_signal(signal.SIGTERM)
        code = await s.wait_exit()
    assert code == -signal.SIGKILL  # systemd: Result=signal, ExecMainStatus=9
    lines = s.stdout
    order = [
        "SIGTERM received. signum=None frame=None. Draining requests and shutting down...",
        "Gracefully exiting... Remaining number of requests 0. Remaining requests remaining_rids=[].",
        f"kill_process_tree called: parent_pid={s.proc.pid}, include_parent=True",
    ]
    found = [next(i for i, ln in enumerate(lines) if text in ln) for text in order]
    assert found == sorted(found), lines
    assert _classify(s, code) is ExitCause.STOPPED


async def test_stop_mode_clean_exits_0_after_the_drain() -> None:
    async with standin(*QUICK, "--stop-mode", "clean") as s:
        await s.wait_line(r"^standin: loaded$")
        s.proc.send_signal(signal.SIGTERM)
        assert await s.wait_exit() == 0
    assert "standin: stopped" in s.stdout


def _cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    for task in tasks.iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended meanwhile (its children go to another)
            continue
    return found


async def test_a_killed_scheduler_child_ends_the_server_as_in_sglang() -> None:
    async with standin(*QUICK) as s:
        line = await s.wait_line(r"^standin: scheduler \d+ \(sglang::scheduler\)$")
        await s.wait_line(r"^standin: loaded$")
        scheduler = int(line.split()[2])
        assert scheduler in _children(s.proc.pid)
        assert _cmdline(scheduler)[0] == b"sglang::scheduler"
        os.kill(scheduler, signal.SIGKILL)
        code = await s.wait_exit()
    assert code == -signal.SIGKILL
    text = "\n".join(s.stdout)
    assert f"Subprocess scheduler_0 (pid={scheduler}) crashed with exit code -9." in text
    assert "It usually means one child failed." in text
    assert _classify(s, code) is ExitCause.SIGKILL


async def test_cuda_oom_while_loading_ends_in_sglangs_sigkill_with_torch_text() -> None:
    args = ("--fail", "cuda-oom", "--load-seconds", "0.2", *QUICK)
    async with standin(*args, port=free_port()) as s:
        code = await s.wait_exit()
    assert code == -signal.SIGKILL
    assert "standin: loaded" not in s.stdout
    assert any(ln.startswith("torch.OutOfMemoryError: CUDA out of memory.") for ln in s.stderr)
    # Still starting: the launch-phase handler's words, and no diagnostics pause.
    assert any("Received sigquit from a child process." in ln for ln in s.stdout)
    assert not any("Sleeping 5 seconds" in ln for ln in s.stdout)
    assert _classify(s, code) is ExitCause.GPU_OOM


async def test_kv_cache_oom_at_load_is_sglang_0517s_value_error(tmp_path: Path) -> None:
    args = ("--fail", "kv-cache-oom", "--load-seconds", "0.1", *QUICK)
    async with standin(*args, port=free_port()) as s:
        code = await s.wait_exit()
    assert code == -signal.SIGKILL
    assert any(
        "ValueError: Loaded weights leave no GPU memory for the KV cache" in ln for ln in s.stderr
    )
    assert not any("listening on" in ln for ln in s.stdout)
    assert _classify(s, code) is ExitCause.GPU_OOM


async def test_norm_arch_crashes_the_warm_up_unless_norm_is_cached(tmp_path: Path) -> None:
    """FlashInfer's gate runs in the norm JIT of the first forward, SGLang's greedy
    warm-up; a warm norm module skips the JIT and so the gate."""
    cache = tmp_path / "ws"
    args = ("--fail", "norm-arch", "--flashinfer-cache", str(cache), *QUICK)
    async with standin(*args) as s:
        code = await s.wait_exit()
    assert code == -signal.SIGKILL
    assert any(
        "RuntimeError: FlashInfer requires GPUs with sm75 or higher" in ln for ln in s.stderr
    )
    assert any("flashinfer/jit/norm.py" in ln for ln in s.stderr)
    assert not any("fired up" in ln for ln in s.stdout)
    assert _classify(s, code) is ExitCause.FLASHINFER_ARCH

    module = cache / ".cache/flashinfer/0.6.15/90a/cached_ops/norm/norm.so"
    module.parent.mkdir(parents=True)
    module.write_bytes(b"\x7fELF")
    async with standin(*args) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^The server is fired up and ready to roll!$")
        assert (await c.get(s.url + "/health")).status_code == 200


async def test_a_cold_jit_build_holds_the_scheduler_and_health_checks_fail(
    tmp_path: Path,
) -> None:
    """As on the H200: the warm-up's norm build holds the scheduler, /health gives up
    after its timeout with SGLang's words; the first sampled request builds sampling."""
    args = (
        "--flashinfer-cache",
        str(tmp_path / "ws"),
        "--cold-norm-seconds",
        "2",
        "--cold-sampling-seconds",
        "0.2",
        "--health-check-timeout-seconds",
        "0.2",
    )
    async with standin(*args) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"JIT-building FlashInfer's norm \(2 s, a cold cache\)")
        assert (await c.get(s.url + "/health")).status_code == 503
        await s.wait_line(
            r"Health check failed\. Server couldn't get a response from "
            r"detokenizer for last 0\.2 seconds\."
        )
        await s.wait_line(r"^The server is fired up and ready to roll!$")
        assert (await c.get(s.url + "/health")).status_code == 200
        assert not any("FlashInfer's sampling" in ln for ln in s.stdout)  # greedy so far
        for _ in range(2):
            sampled = await post(c, s.url, {"text": "x", "sampling_params": SAMPLED})
            assert sampled.status_code == 200
    builds = [ln for ln in s.stdout if "JIT-building FlashInfer's" in ln]
    assert len(builds) == 2 and "sampling" in builds[1]  # each module once


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_grow_memory_grows_rss_until_killed() -> None:
    args = ("--fail", "grow-memory", "--grow-interval", "0.01", "--grow-limit-mib", "256")
    async with standin(*args) as s:
        await s.wait_line(r"^standin: loaded$")
        baseline = _rss_kib(s.proc.pid)
        await s.wait_line(r"grow-memory: 128 MiB allocated")
        assert _rss_kib(s.proc.pid) - baseline >= 100 * 1024
        s.proc.kill()
        assert await s.wait_exit() == -signal.SIGKILL


# --- command lines ------------------------------------------------------------------


async def test_k26_dev_standin_command() -> None:
    async with (
        standin(*QUICK, module="k26dev") as s,
        httpx.AsyncClient(timeout=DEADLINE_S) as c,
    ):
        await s.wait_line(r"^standin: loaded$")
        assert (await c.get(s.url + "/health")).status_code == 200
        s.proc.send_signal(signal.SIGTERM)
        assert await s.wait_exit() == -signal.SIGKILL


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["-m", "k26dev.standin", "--help"], 0),
        (["-m", "k26dev.standin", "--load-seconds", "-1"], 2),
        (["-m", "k26dev", "standin", "--load-seconds", "-1"], 64),
        (["-m", "k26dev", "standin", "--fail", "nope"], 64),
        (["-m", "k26dev", "standin", "--sampling-module", "../x"], 64),
    ],
)
async def test_command_line_errors(command: list[str], code: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode == code, err.decode()
    if code == 0:
        assert b"--fail-after-requests" in out
    else:
        assert any(flag in err for flag in (b"load-seconds", b"nope", b"--sampling-module"))


def test_a_real_jit_module_needs_the_serving_python_and_the_cache() -> None:
    from k26dev.standin.options import build_parser, options_from_args

    parser = build_parser()
    with pytest.raises(ValueError, match="--jit-module needs --jit-python and --flashinfer-cache"):
        options_from_args(parser.parse_args(["--jit-module", "topk"]))
    options = options_from_args(
        parser.parse_args(
            ["--jit-module", "topk", "--jit-python", "/srv/venv/bin/python",
             "--flashinfer-cache", "/srv/ws", "--jit-module", "rope"]
        )
    )  # fmt: skip
    assert options.jit_modules == ("topk", "rope")
    assert options.jit_python == Path("/srv/venv/bin/python")


async def test_a_streamed_batch_decodes_together_and_aborts_by_rid_prefix() -> None:
    """SGLang 0.5.17's batch streaming: each output carries its index and its rid
    (meta_info.id); a per-request stream_interval keeps a request quiet between its
    first output and its end; /abort_request ends every request whose rid starts with
    the one named, with finish_reason abort."""
    rids = ["d-1", "d-10", "e-2"]
    quiet = {"max_new_tokens": 4000, "temperature": 0.7, "stream_interval": 1 << 30}
    loud = {**quiet, "stream_interval": 1}
    body = {"text": ["a", "b", "c"], "sampling_params": [quiet, quiet, loud], "rid": rids,
            "stream": True}  # fmt: skip
    seen: dict[str, list[dict[str, Any]]] = {r: [] for r in rids}
    async with standin(*QUICK) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        async with c.stream("POST", s.url + "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                out = json.loads(line[6:])
                meta = out["meta_info"]
                assert rids[out["index"]] == meta["id"]
                seen[meta["id"]].append(meta)
                if meta["id"] == "e-2" and len(seen["e-2"]) == 5:
                    # "d-1" is a prefix of both d- rids; "e" of the loud one, later.
                    aborted = await c.post(s.url + "/abort_request", json={"rid": "d-1"})
                    assert aborted.status_code == 200 and aborted.content == b""
                if meta["id"] == "e-2" and len(seen["e-2"]) == 40:
                    await c.post(s.url + "/abort_request", json={"rid": "e"})
    for rid in rids:
        assert seen[rid][-1]["finish_reason"]["type"] == "abort", rid
    # The quiet ones: their first token, then only their end.
    assert [len(seen[r]) for r in ("d-1", "d-10")] == [2, 2]
    assert seen["d-1"][0]["completion_tokens"] == 1
    assert len(seen["e-2"]) >= 40  # the loud one: every step
    assert seen["e-2"][-1]["completion_tokens"] > seen["d-1"][-1]["completion_tokens"]


async def test_an_ended_request_runs_one_step_more_and_says_its_verify_steps() -> None:
    """SGLang 0.5.17's overlap scheduler launches a batch before it processes the
    last, so a request that ended at a step is in the next step's batch (its output
    dropped): the decode log of that step counts it. On a speculative server a
    finished request's meta_info carries its verify steps (``spec_verify_ct``)."""
    short = {"max_new_tokens": 40, "temperature": 0.7, "stream_interval": 1 << 30}
    clock = {**short, "max_new_tokens": 60, "stream_interval": 1}
    body = {"input_ids": [[5, 6], [7, 8]], "sampling_params": [short, clock], "stream": True}
    ends: list[dict[str, Any]] = []
    async with standin("--eagle3", *QUICK) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        async with c.stream("POST", s.url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    meta = json.loads(line[6:])["meta_info"]
                    if meta["finish_reason"] is not None:
                        ends.append(meta)
        # Its 40th token came from decode step 39 (the first, from the prefill);
        # sglang logs the running batch every 40 steps.
        logged = await s.wait_line(r"Decode batch, #running-req: ")
    assert "#running-req: 2," in logged, logged
    assert [(m["completion_tokens"], m["spec_verify_ct"]) for m in ends] == [(40, 39), (60, 59)]
    assert ends[0]["spec_accept_length"] == 40 / 39 and ends[0]["spec_accept_rate"] == 0.0


async def test_server_info_has_the_real_server_s_fields_the_coverage_reads() -> None:
    """Checked against what real SGLang 0.5.17 answered on the H200 (kept by the GPU
    script): the same names, the same kinds of value."""
    real = json.loads(
        (ROOT / "bench/gpu/results/h200-2026-12-04-eagle3-graphs-decode-server-info.json")
        .read_text()
    )  # fmt: skip
    keys = ("chunked_prefill_size", "context_length", "max_running_requests",
            "max_total_num_tokens", "max_req_input_len", "speculative_algorithm",
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
            "page_size")  # fmt: skip
    async with standin("--eagle3", *QUICK) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        mine = (await c.get(s.url + "/server_info")).json()
    for key in keys:
        assert type(mine[key]) is type(real[key]), key
    assert mine["page_size"] == real["page_size"] == 1  # the long output's pages
    state = "effective_max_running_requests_per_dp"
    assert mine["internal_states"][0][state] == mine["max_running_requests"] == 48
    assert real["internal_states"][0][state] == real["max_running_requests"] == 48


@pytest.mark.parametrize(("eagle3", "cached"), [(False, 32), (True, 31)])
def test_the_radix_cache_keys_token_pairs_on_an_eagle_server(
    eagle3: bool, cached: int, tmp_path: Path
) -> None:
    """sglang 0.5.17's RadixKey.maybe_to_bigram_view(is_eagle): on the H200's EAGLE-3
    server a prompt sharing 32 ids with an earlier one had 31 cached."""
    compiles = traffic.TrafficCompiles(
        attention_backend="triton", eagle3=eagle3, kv_alignment=True, triton_s=0.0,
        inductor_s=0.0, wait=lambda _s: None, environ={"TRITON_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    prefix = [100] + [352] * 31
    assert compiles.cached_tokens([[*prefix, 356]]) == 0
    assert compiles.cached_tokens([[*prefix, 101, 352]]) == cached
    # Never the whole prompt: its last token is always computed.
    assert compiles.cached_tokens([prefix]) == 31


@pytest.mark.parametrize("eagle3", [False, True])
def test_the_kv_slot_offset_starts_over_where_an_end_hands_slots_back(
    eagle3: bool, tmp_path: Path
) -> None:
    """sglang 0.5.17's TokenToKVPoolAllocator: ``alloc`` slices its free list, ``free``
    rebuilds it (torch.cat), so a slice's offset is what was handed out since the last
    free. With EAGLE-3 every end frees (the draft over-allocation and the radix key's
    unkeyed last token); without, an end frees nothing. A request's first spec step
    takes the whole reserve, twice the draft tokens (even); later ones what the step
    before accepted."""
    compiles = traffic.TrafficCompiles(
        attention_backend="triton", eagle3=eagle3, kv_alignment=True, triton_s=0.0,
        inductor_s=0.0, wait=lambda _s: None, environ={"TRITON_CACHE_DIR": str(tmp_path)},
        draft_tokens=3,
    )  # fmt: skip

    def parity(tokens: int) -> str:
        ((_, kernel),) = compiles.prefill_kernels(tokens, 0)
        return kernel.rsplit("-", 1)[1]

    assert parity(3) == "a16"  # offset 0
    assert parity(5) == "a8"  # offset 3: nothing ended between
    compiles.finished()
    assert parity(2) == "a16"  # offset 0 (EAGLE-3), else 8
    compiles.finished()
    assert parity(4) == "a16"  # offset 0 (EAGLE-3), else 10
    compiles.take_slots(1)  # one decode step of one request: offset 5, or 15
    compiles.finished()
    assert parity(1) == ("a16" if eagle3 else "a8")  # offset 0; else 15
    # A step takes what the step before committed: this draft accepts none.
    steps = set()
    for _ in range(8):
        before = compiles.kv_slots
        compiles.take_slots(3)
        steps.add(compiles.kv_slots - before)
    assert steps == {3}
    before = compiles.kv_slots
    compiles.take_slots(2, first=True)
    assert compiles.kv_slots - before == (2 * 6 if eagle3 else 2)


def test_an_eagle3_decode_step_s_draft_kernel_is_keyed_on_its_slots_alignment(
    tmp_path: Path,
) -> None:
    """sglang 0.5.17's ``eagle_prepare_for_decode`` hands ``assign_req_to_token_pool``
    the step's slots, a slice of the allocator's free list (int64) at the offset
    handed out since the last end: on the H100 (2026-12-05) an odd one compiled a
    variant of its own, ``(*i64:16, *i32:16, *i32:16, *i32:16, *i64)``, after READY.
    The prefill's batch kernels are keyed as before."""
    compiles = traffic.TrafficCompiles(
        attention_backend="triton", eagle3=True, kv_alignment=True, triton_s=0.0,
        inductor_s=0.0, wait=lambda _s: None, environ={"TRITON_CACHE_DIR": str(tmp_path)},
        draft_tokens=3,
    )  # fmt: skip

    def assign(**kw: bool) -> str:
        return next(k for _, k in compiles.batch_kernels(3, **kw) if "assign" in k)

    assert assign(step=True) == "assign_req_to_token_pool@bs4-any"  # offset 0
    compiles.take_slots(3)
    assert assign(step=True) == "assign_req_to_token_pool@bs4-any-a8"  # offset 3
    assert assign() == "assign_req_to_token_pool@bs4-any"
    compiles.take_slots(3)
    assert assign(step=True) == "assign_req_to_token_pool@bs4-any"  # offset 6
    compiles.take_slots(3)
    compiles.finished()
    assert assign(step=True) == "assign_req_to_token_pool@bs4-any"  # offset 0 again
    assert "!tt.ptr<i64>, " in traffic.ttir("assign_req_to_token_pool", "bs4-any-a8")
