"""The running daemon: restart latency, probe->ready, idle cost, /status and /metrics load.

    .venv/bin/python bench/daemon_bench.py [--kills 30] [--idle-seconds 60]

Needs root: it brings up the project's confined systemd sandbox
(``k26dev.sandbox.running``, torn down on any exit) and, in it, one stand-in
SGLang unit (``python -m k26dev.standin --port N``, ``Type=simple``,
``Restart=no``) and the real daemon, ``python -m supervisor run --config FILE``,
with a user-bus config, a real ``NOTIFY_SOCKET`` (drained by this script) and
``WATCHDOG_USEC`` as the shipped unit's ``WatchdogSec=30s`` would set it. The
config turns FlashInfer warm-up off (``[flashinfer] enabled = false``: its
warm-cache verification, paid before every start in production, is measured
separately by bench/flashinfer_warm.py), uses the smallest restart backoff the
config allows (``backoff_initial_s`` must be > 0; default here 0.001 s, factor 1,
capped at the same value), enough ``max_failures`` never to end ``failed``, the
default probe interval (30 s) and ``log_level = "debug"`` for the probe lines.

The daemon logs, with CLOCK_MONOTONIC seconds comparable to this process's
``time.monotonic()``: ``exit seen`` (when it read the D-Bus signal), ``start
issued ... restart=True``, ``state: unit=X ready`` and (debug) ``probe: ... ok=``.

Phases, in one run:

1. ``--kills`` rounds: wait until the unit is ready, a random 0.2-0.6 s more,
   ``t0 = time.monotonic()``, SIGKILL its MainPID, then read the daemon's log
   for: kill -> ``exit seen``, kill -> restart ``start issued``, ``exit seen`` ->
   ``start issued``, last ``probe: ok=True`` -> ``state: ready`` and kill -> ready.
2. ``--ready-rounds`` more kills while a thread polls ``GET /status`` over one
   keep-alive connection as fast as it can: the first answer saying the unit is
   ``ready`` (response received) minus the daemon's ``probe: ok=True`` line.
   (A separate phase, so that the busy poller does not load phase 1.)
3. Idle: the unit ready, nothing polling, for ``--idle-seconds``: the daemon's
   utime+stime (/proc/PID/stat) and VmRSS (/proc/PID/status) at start and end.
4. ``GET /status`` then ``GET /metrics`` at ``--rate`` req/s for ``--duration`` s
   each, from an asyncio client (bench/http_load.py's keep-alive pool) in a
   separate process, on a fixed schedule; latency from each request's
   scheduled start.

Percentiles are nearest-rank: with fewer than 100 samples p99 is the maximum.
Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
from common import Systemctl, free_port, nearest_rank, write_standin_unit  # bench/common.py
from http_load import _cpu_s, _RawPool  # bench/http_load.py, next to this file

from k26dev import sandbox
from supervisor.adapters.config_file import load_config

UNIT = "k26-bench-daemon.service"
WATCHDOG_USEC = 30_000_000  # units/k26-supervisor.service: WatchdogSec=30s
READY_DEADLINE_S = 60.0
LOG_DEADLINE_S = 10.0
SETTLE_S = (0.2, 0.6)

TARGET_RESTART_P99_MS = 100.0
TARGET_CPU_PCT = 0.5
TARGET_RSS_MB = 80.0
TARGET_HTTP_P99_MS = 5.0

_LINE = re.compile(
    r"(?P<kind>start issued|state|exit seen|probe): unit=(?P<unit>\S+)"
    r"(?: restart=(?P<restart>\w+)| ok=(?P<ok>\w+)| (?P<state>[a-z]+))?"
    r" monotonic=(?P<mono>\d+\.\d+)"
)


def write_unit(info: sandbox.SandboxInfo, port: int, output: Path) -> None:
    write_standin_unit(
        info,
        UNIT,
        port,
        output,
        description="k26 daemon benchmark stand-in",
        # The bench restarts it about once a second: far above systemd's default
        # start limit (5 in 10 s) and the shipped units' backstop (8 in 10 min).
        unit_lines="StartLimitIntervalSec=0\n",
    )


def write_config(path: Path, listen_port: int, standin_port: int, backoff_s: float) -> None:
    path.write_text(
        textwrap.dedent(
            f"""\
            [supervisor]
            bus = "user"
            listen = "127.0.0.1:{listen_port}"
            log_level = "debug"

            [flashinfer]
            enabled = false

            [restart]
            backoff_initial_s = {backoff_s!r}
            backoff_factor = 1
            backoff_max_s = {backoff_s!r}
            max_failures = 1000000

            [[units]]
            name = "{UNIT}"
            role = "autoregressive"
            url = "http://127.0.0.1:{standin_port}"
            """
        )
    )


# --- the daemon and its log ------------------------------------------------------------


@dataclass(frozen=True)
class LogEvent:
    kind: str  # "start issued", "state", "exit seen", "probe"
    mono: float
    value: str  # restart=..., ok=..., or the state


class NotifySink:
    """A real sd_notify socket, drained so the daemon's sends never fail."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []
        threading.Thread(target=self._recv, daemon=True).start()

    def _recv(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            self.messages.append(data.decode(errors="replace"))

    def close(self) -> None:
        self.sock.close()


class Daemon:
    """``python -m supervisor run`` with its log lines parsed as they come."""

    def __init__(self, info: sandbox.SandboxInfo, config: Path, notify: Path, log: Path) -> None:
        env = dict(
            os.environ,
            **info.env,
            NOTIFY_SOCKET=str(notify),
            WATCHDOG_USEC=str(WATCHDOG_USEC),
            PYTHONUNBUFFERED="1",
        )
        env.pop("WATCHDOG_PID", None)
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.pid = self.proc.pid
        self.events: list[LogEvent] = []
        self.lines = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._log.write(raw)
            self._log.flush()
            m = _LINE.search(raw)
            with self._cond:
                self.lines += 1
                if m is not None and m["unit"] == UNIT:
                    value = m["restart"] or m["ok"] or m["state"] or ""
                    self.events.append(LogEvent(m["kind"], float(m["mono"]), value))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait(
        self, kind: str, after: float, timeout_s: float, value: str | None = None
    ) -> LogEvent | None:
        """The first ``kind`` line (with ``value``) stamped after ``after``."""

        def find() -> LogEvent | None:
            for e in self.events:
                if e.kind == kind and e.mono > after and (value is None or e.value == value):
                    return e
            return None

        with self._cond:
            self._cond.wait_for(
                lambda: find() is not None or self.proc.poll() is not None, timeout=timeout_s
            )
            return find()

    def last_before(self, kind: str, value: str, after: float, before: float) -> LogEvent | None:
        with self._cond:
            hits = [
                e
                for e in self.events
                if e.kind == kind and e.value == value and after < e.mono <= before
            ]
        return hits[-1] if hits else None

    def count(self, kind: str, after: float, before: float) -> int:
        with self._cond:
            return sum(1 for e in self.events if e.kind == kind and after < e.mono <= before)

    def tail(self, n: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def proc_cpu_rss(pid: int) -> tuple[float, float, float]:
    """CPU seconds (utime+stime), VmRSS and VmHWM in MB of ``pid``."""
    cpu = _cpu_s(pid)
    rss = hwm = 0.0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return cpu, rss, hwm


# --- phases 1 and 2: kills -------------------------------------------------------------


@dataclass
class Kill:
    n: int
    pid: int
    t0: float
    exit_seen_ms: float | None = None  # kill -> exit seen
    issued_ms: float | None = None  # kill -> start issued (restart=True)
    exit_to_issued_ms: float | None = None
    probe_to_ready_ms: float | None = None  # probe: ok=True -> state: ready (daemon's log)
    kill_to_ready_ms: float | None = None
    polled_ready_ms: float | None = None  # probe: ok=True -> first /status saying ready
    cause: str = ""
    top_ready_while_down: int = 0  # /status polls: unit not ready, top-level "ready": true
    polls: int = 0


@dataclass
class Poll:
    t_send: float
    t_recv: float
    state: str
    top_ready: bool


@dataclass
class StatusPoller:
    """GET /status back to back over one keep-alive connection; keeps state changes."""

    port: int
    changes: list[Poll] = field(default_factory=list)
    count: int = 0
    top_ready_while_down: int = 0
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        request = b"GET /status HTTP/1.1\r\nHost: bench\r\n\r\n"
        sock: socket.socket | None = None
        buf = b""
        last: tuple[str, bool] | None = None
        while not self._stop.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    buf = b""
                t_send = time.monotonic()
                sock.sendall(request)
                while b"\r\n\r\n" not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                found = re.search(rb"(?i)content-length: *(\d+)", head)
                length = int(found[1]) if found else 0
                while len(buf) < length:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    buf += chunk
                body, buf = buf[:length], buf[length:]
                t_recv = time.monotonic()
                doc = json.loads(body)
            except (OSError, ValueError):
                self.errors += 1
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.01)
                continue
            state = str(doc["units"][UNIT]["state"])
            top = bool(doc["ready"])
            with self._lock:
                self.count += 1
                if state != "ready" and top:
                    self.top_ready_while_down += 1
                if (state, top) != last:
                    self.changes.append(Poll(t_send, t_recv, state, top))
                    last = (state, top)
        if sock is not None:
            sock.close()

    def first_ready_after_down(self, since: float) -> Poll | None:
        with self._lock:
            seen_down = False
            for p in self.changes:
                if p.t_send <= since:
                    continue
                if p.state != "ready":
                    seen_down = True
                elif seen_down:
                    return p
        return None

    def stop(self) -> None:
        self._stop.set()


def status_json(port: int) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()  # type: ignore[no-any-return]


def one_kill(
    n: int,
    daemon: Daemon,
    systemctl: Systemctl,
    port: int,
    rng: random.Random,
    poller: StatusPoller | None,
) -> Kill:
    pid = systemctl.main_pid(UNIT)
    if pid <= 1:  # never pid 0 (our process group) nor init
        raise RuntimeError(f"refusing to kill pid {pid}")
    time.sleep(rng.uniform(*SETTLE_S))
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    k = Kill(n, pid, t0)
    seen = daemon.wait("exit seen", t0, LOG_DEADLINE_S)
    issued = daemon.wait("start issued", t0, LOG_DEADLINE_S, value="True")
    if seen is not None:
        k.exit_seen_ms = (seen.mono - t0) * 1000
    if issued is not None:
        k.issued_ms = (issued.mono - t0) * 1000
        if seen is not None:
            k.exit_to_issued_ms = (issued.mono - seen.mono) * 1000
    ready = daemon.wait("state", issued.mono if issued else t0, READY_DEADLINE_S, value="ready")
    if ready is None:
        raise RuntimeError(f"kill {n}: the unit was not ready again within {READY_DEADLINE_S}s")
    k.kill_to_ready_ms = (ready.mono - t0) * 1000
    probe = daemon.last_before("probe", "True", t0, ready.mono)
    if probe is not None:
        k.probe_to_ready_ms = (ready.mono - probe.mono) * 1000
    if poller is not None:
        deadline = time.monotonic() + 5
        seen_poll = poller.first_ready_after_down(t0)
        while seen_poll is None and time.monotonic() < deadline:
            time.sleep(0.005)
            seen_poll = poller.first_ready_after_down(t0)
        if seen_poll is not None and probe is not None:
            k.polled_ready_ms = (seen_poll.t_recv - probe.mono) * 1000
    unit = status_json(port)["units"][UNIT]
    k.cause = str((unit.get("last_exit") or {}).get("cause"))
    return k


def _ms(value: float | None) -> str:
    return f"{value:8.2f}" if value is not None else "       -"


def print_kill(k: Kill, total: int) -> None:
    extra = f" polled-ready {_ms(k.polled_ready_ms)}" if k.polled_ready_ms is not None else ""
    print(
        f"kill {k.n + 1:3d}/{total} pid {k.pid:<7d} exit-seen {_ms(k.exit_seen_ms)} "
        f"issued {_ms(k.issued_ms)} seen->issued {_ms(k.exit_to_issued_ms)} "
        f"probe->ready {_ms(k.probe_to_ready_ms)}{extra} ready {_ms(k.kill_to_ready_ms)} ms "
        f"cause {k.cause}",
        flush=True,
    )


# --- phase 4: HTTP load from another process -------------------------------------------


async def _drive(
    port: int, server_pid: int, path: str, rate: float, duration_s: float
) -> dict[str, Any]:
    pool = _RawPool(port)
    latencies: list[float] = []
    errors = 0

    async def one(scheduled: float) -> None:
        nonlocal errors
        try:
            ok = await pool.get(path) == 200
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            ok = False
        if ok:
            latencies.append((time.perf_counter() - scheduled) * 1000)
        else:
            errors += 1

    await pool.get(path)  # open a connection before the clock starts
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
    server_cpu_s = _cpu_s(server_pid) - cpu_before
    pool.close()
    return {
        "latencies_ms": latencies,
        "errors": errors,
        "elapsed_s": elapsed,
        "server_cpu_s": server_cpu_s,
    }


def _load_worker(
    port: int, pid: int, path: str, rate: float, duration_s: float, conn: Connection
) -> None:
    conn.send(asyncio.run(_drive(port, pid, path, rate, duration_s)))


def http_load(port: int, pid: int, path: str, rate: float, duration_s: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(
        target=_load_worker, args=(port, pid, path, rate, duration_s, theirs), daemon=True
    )
    worker.start()
    try:
        if not ours.poll(duration_s + 60):
            raise RuntimeError(f"the load client for {path} did not finish")
        return ours.recv()  # type: ignore[no-any-return]
    finally:
        worker.join(10)
        if worker.is_alive():
            worker.terminate()


# --- the run ---------------------------------------------------------------------------


@dataclass
class Results:
    kills: list[Kill] = field(default_factory=list)
    polled: list[Kill] = field(default_factory=list)
    poll_rate: float = 0.0
    poll_errors: int = 0
    top_ready_while_down: int = 0
    rss_after_start_mb: float = 0.0
    idle: dict[str, float] = field(default_factory=dict)
    http: dict[str, dict[str, Any]] = field(default_factory=dict)
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0
    notify_messages: int = 0
    notify_kinds: dict[str, int] = field(default_factory=dict)
    log_lines: int = 0


def run_phases(
    args: argparse.Namespace, daemon: Daemon, systemctl: Systemctl, port: int, res: Results
) -> Results:
    rng = random.Random(args.seed)
    first = daemon.wait("state", 0.0, READY_DEADLINE_S, value="ready")
    if first is None:
        raise RuntimeError(f"the unit never became ready; daemon log:\n{daemon.tail()}")
    res.rss_after_start_mb = proc_cpu_rss(daemon.pid)[1]
    print(f"daemon pid {daemon.pid} on 127.0.0.1:{port}; unit ready; RSS "
          f"{res.rss_after_start_mb:.1f} MB", flush=True)  # fmt: skip

    print(f"\n[1] {args.kills} SIGKILLs, nothing polling", flush=True)
    for n in range(args.kills):
        k = one_kill(n, daemon, systemctl, port, rng, None)
        res.kills.append(k)
        print_kill(k, args.kills)

    print(f"\n[2] {args.ready_rounds} SIGKILLs while a thread polls /status back to back",
          flush=True)  # fmt: skip
    poller = StatusPoller(port)
    thread = threading.Thread(target=poller.run, name="status-poller", daemon=True)
    p_start = time.monotonic()
    thread.start()
    try:
        for n in range(args.ready_rounds):
            k = one_kill(n, daemon, systemctl, port, rng, poller)
            res.polled.append(k)
            print_kill(k, args.ready_rounds)
    finally:
        poller.stop()
        thread.join(10)
    res.poll_rate = poller.count / max(1e-9, time.monotonic() - p_start)
    res.poll_errors = poller.errors
    res.top_ready_while_down = poller.top_ready_while_down

    print(f"\n[3] idle for {args.idle_seconds:g} s (unit ready, probe every 30 s, no clients)",
          flush=True)  # fmt: skip
    time.sleep(2.0)
    cpu0, rss0, _ = proc_cpu_rss(daemon.pid)
    i0 = time.monotonic()
    time.sleep(args.idle_seconds)
    cpu1, rss1, hwm1 = proc_cpu_rss(daemon.pid)
    i1 = time.monotonic()
    res.idle = {
        "wall_s": i1 - i0,
        "cpu_s": cpu1 - cpu0,
        "cpu_pct": (cpu1 - cpu0) / (i1 - i0) * 100,
        "rss0_mb": rss0,
        "rss1_mb": rss1,
        "hwm_mb": hwm1,
        "probes": float(daemon.count("probe", i0, i1)),
    }
    idle = res.idle
    print(f"    CPU {idle['cpu_s']:.2f} s in {idle['wall_s']:.1f} s = {idle['cpu_pct']:.3f} % of "
          f"one core; RSS {rss0:.1f} -> {rss1:.1f} MB (peak {hwm1:.1f} MB); "
          f"{idle['probes']:.0f} probes", flush=True)  # fmt: skip

    print(f"\n[4] {args.rate:g} req/s for {args.duration:g} s per endpoint", flush=True)
    for path in ("/status", "/metrics"):
        out = http_load(port, daemon.pid, path, args.rate, args.duration)
        res.http[path] = out
        lat = out["latencies_ms"] or [float("nan")]
        print(f"    {path:9} n={len(out['latencies_ms'])} errors={out['errors']} "
              f"{len(out['latencies_ms']) / out['elapsed_s']:.1f} req/s  "
              f"p50={nearest_rank(lat, 0.5):.2f} ms  p99={nearest_rank(lat, 0.99):.2f} ms  "
              f"max={max(lat):.2f} ms  daemon CPU "
              f"{out['server_cpu_s'] * 1000 / max(1, len(lat)):.3f} ms/req", flush=True)  # fmt: skip
    return res


def _stats(values: list[float | None]) -> tuple[str, str, str, int]:
    got = [v for v in values if v is not None]
    if not got:
        return "-", "-", "-", 0
    return (
        f"{nearest_rank(got, 0.5):.2f}",
        f"{nearest_rank(got, 0.99):.2f}",
        f"{max(got):.2f}",
        len(got),
    )


def report(res: Results, args: argparse.Namespace) -> None:
    k, p = res.kills, res.polled
    rows: list[tuple[str, str, str, str, str, int]] = []

    def add(name: str, target: str, values: list[float | None]) -> None:
        rows.append((name, target, *_stats(values)))

    add("kill -> start issued (restart)", f"p99 < {TARGET_RESTART_P99_MS:g}",
        [x.issued_ms for x in k])  # fmt: skip
    add("exit seen -> start issued", "-", [x.exit_to_issued_ms for x in k])
    add("kill -> exit seen (D-Bus read)", "-", [x.exit_seen_ms for x in k])
    add("probe ok -> state ready (log)", "-", [x.probe_to_ready_ms for x in [*k, *p]])
    add("probe ok -> /status ready (polled)", "-", [x.polled_ready_ms for x in p])
    add("kill -> ready again (log)", "-", [x.kill_to_ready_ms for x in [*k, *p]])
    for path in ("/status", "/metrics"):
        out = res.http.get(path)
        if out is not None:
            add(f"GET {path} @ {args.rate:g}/s (sched. start)",
                f"p99 < {TARGET_HTTP_P99_MS:g}", list(out["latencies_ms"]))  # fmt: skip

    print()
    print(f"Daemon benchmark: {os.cpu_count()} CPUs, load average before "
          f"{'/'.join(f'{x:.2f}' for x in res.load)}, after "
          f"{'/'.join(f'{x:.2f}' for x in res.load_after)}, {res.wall_s:.0f} s")  # fmt: skip
    print(f"config: [flashinfer] enabled=false (warm-cache verification is measured separately "
          f"by bench/flashinfer_warm.py); restart backoff_initial_s={args.backoff_s:g} s "
          f"(0 is rejected: must be > 0), factor 1; probe interval_s 30 (default); "
          f"log_level debug")  # fmt: skip
    print(f"{'latency, ms':<42} {'target':>10} {'p50':>9} {'p99':>9} {'max':>9} {'n':>5}")
    for name, target, p50, p99, mx, n in rows:
        print(f"{name:<42} {target:>10} {p50:>9} {p99:>9} {mx:>9} {n:>5}")
    idle = res.idle
    if idle:
        print(f"{'idle CPU, % of one core':<42} {'< ' + format(TARGET_CPU_PCT, 'g'):>10} "
              f"{idle['cpu_pct']:>9.3f}   over {idle['wall_s']:.0f} s, {idle['probes']:.0f} probes")  # fmt: skip
        print(f"{'idle RSS, MB (start -> end)':<42} {'< ' + format(TARGET_RSS_MB, 'g'):>10} "
              f"{idle['rss0_mb']:>9.1f} {idle['rss1_mb']:>9.1f}   peak {idle['hwm_mb']:.1f}, "
              f"after start-up {res.rss_after_start_mb:.1f}")  # fmt: skip
    print("(nearest-rank percentiles: with fewer than 100 samples p99 is the max)")
    polled_s = res.poll_rate
    if p:
        print(f"/status poller: {polled_s:.0f} polls/s ({1000 / max(polled_s, 1e-9):.2f} ms "
              f"apart), {res.poll_errors} errors; polls where the unit was not ready but "
              f"top-level \"ready\" was true: {res.top_ready_while_down}")  # fmt: skip
    causes = sorted({x.cause for x in [*k, *p]})
    missing = sum(1 for x in [*k, *p] if x.issued_ms is None or x.exit_seen_ms is None)
    print(f"exit causes reported: {', '.join(causes) or '-'}; kills missing a log line: "
          f"{missing}; daemon log lines: {res.log_lines}; sd_notify messages: "
          f"{res.notify_messages} ({', '.join(f'{k} {v}' for k, v in res.notify_kinds.items())})")  # fmt: skip
    for path, out in res.http.items():
        if out["errors"]:
            print(f"{path}: {out['errors']} failed requests")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30, help="phase 1 SIGKILLs (default 30)")
    parser.add_argument(
        "--ready-rounds", type=int, default=20, help="phase 2 SIGKILLs with /status polled"
    )
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="phase 3 (default 60)")
    parser.add_argument("--rate", type=float, default=200.0, help="phase 4 requests per second")
    parser.add_argument("--duration", type=float, default=10.0, help="phase 4 s per endpoint")
    parser.add_argument(
        "--backoff-s", type=float, default=0.001, help="restart backoff (> 0; default 0.001)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for the pre-kill jitter")
    parser.add_argument("--log", type=Path, default=None, help="copy the daemon's log here")
    args = parser.parse_args()
    if args.kills < 1 or args.ready_rounds < 0 or args.idle_seconds <= 0:
        parser.error("--kills >= 1, --ready-rounds >= 0, --idle-seconds > 0")

    res = Results(load=os.getloadavg())
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k26-bench-daemon-") as tmp:
        tmp_path = Path(tmp)
        with sandbox.running(tmp_path / "sandbox") as info:
            systemctl = Systemctl(info)
            standin_port = free_port()
            write_unit(info, standin_port, tmp_path / "standin.out")
            systemctl("daemon-reload")
            port = free_port()
            config = tmp_path / "config.toml"
            write_config(config, port, standin_port, args.backoff_s)
            load_config(config)  # fail here, readably, rather than in the daemon
            notify = NotifySink(tmp_path / "notify.sock")
            daemon = Daemon(info, config, notify.path, tmp_path / "daemon.log")
            try:
                res = run_phases(args, daemon, systemctl, port, res)
            except BaseException:
                print(f"daemon log (tail):\n{daemon.tail()}", file=sys.stderr)
                raise
            finally:
                daemon.stop()
                notify.close()
                systemctl("stop", UNIT, check=False)
                systemctl("reset-failed", UNIT, check=False)
            res.notify_messages = len(notify.messages)
            res.notify_kinds = dict(
                collections.Counter(
                    "+".join(f.split("=", 1)[0] for f in m.splitlines()) for m in notify.messages
                )
            )
            res.log_lines = daemon.lines
            if args.log is not None:
                shutil.copyfile(daemon.log_path, args.log)
    res.wall_s = time.monotonic() - began
    res.load_after = os.getloadavg()
    report(res, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
