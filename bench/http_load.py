"""Load the status server: a fixed request rate against /status and /metrics.

    .venv/bin/python bench/http_load.py [--rate 200] [--duration 10]

The server runs in its own process (a realistic board: two units, a warm-up,
some exits and probes) so that the client's work does not share its loop.
Requests are sent open-loop at --rate per second over keep-alive connections;
latency is measured from each request's scheduled start, so a stalled server
shows up as latency rather than as a lower rate. Also prints the cost of
rendering each body on the loop. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
import timeit
from multiprocessing.connection import Connection

import httpx
from prometheus_client import generate_latest

from supervisor.adapters.http import StatusServer
from supervisor.adapters.metrics import build_registry
from supervisor.core.status import ExitInfo, ProbeInfo, StatusBoard, utc_now


def realistic_board() -> StatusBoard:
    board = StatusBoard(version="0.1.0", config_path="/etc/k26/supervisor.toml")
    board.add_unit("sglang-k26.service", "autoregressive")
    board.add_unit("sglang-k26-fallback.service", "fallback", state="standby")
    board.record_warmup("12.0", "built", 184.0, ok=True)
    board.record_exit(
        "sglang-k26.service",
        ExitInfo(
            "gpu-oom", utc_now(), 4200, 1, None, ("torch.OutOfMemoryError: CUDA out of memory",)
        ),
    )
    board.record_restart("sglang-k26.service")
    board.set_state("sglang-k26.service", "ready")
    board.set_systemd("sglang-k26.service", active_state="active", main_pid=4242)
    for latency_ms in (11.0, 14.5, 9.8, 230.0, 12.2):
        board.record_probe("sglang-k26.service", ProbeInfo(True, utc_now(), latency_ms, None, 4))
    board.set_ready(True)
    return board


def _serve(conn: Connection) -> None:
    async def main() -> None:
        board = realistic_board()
        server = StatusServer(
            "127.0.0.1:0", lambda: board.snapshot().to_json(), build_registry(board)
        )
        await server.start()
        conn.send(server.port)
        await asyncio.Event().wait()

    asyncio.run(main())


class _RawPool:
    """Keep-alive HTTP/1.1 connections over bare asyncio streams: nearly free client side."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def get(self, path: str) -> int:
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self._port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        self._idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()


def _cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(
    port: int, server_pid: int, path: str, rate: float, duration_s: float, client: str
) -> None:
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    pool = _RawPool(port)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as http:

        async def get() -> int:
            if client == "raw":
                return await pool.get(path)
            return (await http.get(path)).status_code

        async def one(scheduled: float) -> None:
            nonlocal errors
            try:
                ok = await get() == 200
            except (httpx.HTTPError, OSError, asyncio.IncompleteReadError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - scheduled)
            else:
                errors += 1

        await get()  # open a connection before the clock starts
        cpu_before = _cpu_s(server_pid)
        start = time.perf_counter()
        tasks = []
        for i in range(int(rate * duration_s)):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        server_cpu_ms = (_cpu_s(server_pid) - cpu_before) * 1000
    pool.close()

    ms = sorted(x * 1000 for x in latencies) or [float("nan")]
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    print(
        f"{client:5} {path:9} {len(latencies) / elapsed:6.1f} req/s  n={len(latencies):5d}  "
        f"errors={errors}  p50={statistics.median(ms):.2f} ms  p99={p99:.2f} ms  "
        f"max={ms[-1]:.2f} ms  server CPU {server_cpu_ms / max(1, len(latencies)):.3f} ms/req"
    )


def _render_costs() -> None:
    board = realistic_board()
    registry = build_registry(board)
    n = 2000
    metrics_s = timeit.timeit(lambda: generate_latest(registry), number=n) / n
    status_s = timeit.timeit(lambda: json.dumps(board.snapshot().to_json()), number=n) / n
    size = len(generate_latest(registry))
    print(f"render on the loop: /metrics {metrics_s * 1e3:.3f} ms ({size} bytes), "
          f"/status {status_s * 1e3:.3f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per endpoint")
    parser.add_argument(
        "--client",
        choices=("raw", "httpx", "both"),
        default="both",
        help="raw asyncio streams (cheap, shows the server) or httpx (a typical client)",
    )
    args = parser.parse_args()

    _render_costs()
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(theirs,), daemon=True)
    server.start()
    try:
        if not ours.poll(30):
            raise SystemExit("the server did not start within 30 s")
        port = ours.recv()
        pid = server.pid
        assert pid is not None
        print(f"server pid {server.pid} on 127.0.0.1:{port}; {args.rate:g} req/s for "
              f"{args.duration:g} s per endpoint")  # fmt: skip
        clients = ("raw", "httpx") if args.client == "both" else (args.client,)
        for client in clients:
            for path in ("/status", "/metrics"):
                asyncio.run(_drive(port, pid, path, args.rate, args.duration, client))
    finally:
        server.terminate()
        server.join(10)


if __name__ == "__main__":
    main()
