"""Soak: many SIGKILL/recover cycles against the real daemon, with /status and /metrics loaded.

    .venv/bin/python bench/soak.py [--cycles 200] [--rate 100] [--seed N] [--log FILE]

Needs root: it brings up the project's confined systemd sandbox
(``k26dev.sandbox.running``, torn down on any exit) and, in it, the same
set-up as bench/daemon_bench.py (whose unit, config, daemon and log parser it
imports): one fast-loading stand-in unit (``Type=simple``, ``Restart=no``,
``StartLimitIntervalSec=0``) and the real daemon, ``python -m supervisor run``,
with ``[flashinfer] enabled = false``, a 1 ms restart backoff, ``max_failures =
1000000`` and ``log_level = "debug"``.

Each cycle: wait until ``GET /status`` shows the unit ``ready``; read its MainPID
from systemd; a random 0 to ``--settle`` s more; SIGKILL the MainPID; wait until
``/status`` shows it ``ready`` again with a new ``main_pid`` and a ``last_exit``
about the killed PID. For the whole run a second process sends ``GET /status``
and ``GET /metrics`` at ``--rate`` req/s each (open loop, fixed schedule, at
most ``--connections`` in flight per path, latency from the scheduled start).

Reported, from /status, systemd and the daemon's log (``exit seen``, ``start
issued ... restart=``, ``state: ... ready`` lines with CLOCK_MONOTONIC stamps):

- missed exits: kills with no ``exit seen`` line in their cycle, or whose
  ``last_exit`` on /status never named the killed PID (expect 0);
- double restarts: more than one ``start issued`` between a kill and the unit's
  next ``state: ready`` (expect 0);
- restarts of a healthy unit: a ``start issued`` after the unit was ready again
  and before the next kill (or before the first kill, past the initial start),
  a MainPID that changed with no kill, and the stand-in's process count
  (``standin: listening`` lines) against kills + 1 (expect 0, 0, equal);
- the daemon's open fds (/proc/PID/fd) and VmRSS after cycle 10 and at the end
  (target: under 5 % growth), sampled every 10 cycles;
- the load's failed requests (connection errors, timeouts, non-200).

Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import httpx
from daemon_bench import (  # bench/daemon_bench.py, next to this file
    UNIT,
    Daemon,
    LogEvent,
    NotifySink,
    Systemctl,
    free_port,
    nearest_rank,
    proc_cpu_rss,
    write_config,
    write_unit,
)
from http_load import _RawPool

from k26dev import sandbox
from supervisor.adapters.config_file import load_config

READY_DEADLINE_S = 60.0
POLL_S = 0.02
REQUEST_TIMEOUT_S = 5.0
BASELINE_CYCLE = 10
SAMPLE_EVERY = 10
TARGET_GROWTH_PCT = 5.0


# --- daemon_bench's set-up, as a context manager (bench/side_by_side.py uses it too) -----


@dataclass
class Bench:
    systemctl: Systemctl
    daemon: Daemon
    port: int  # the daemon's /status
    output: Path  # the stand-in's output file


@contextmanager
def running_daemon(
    info: sandbox.SandboxInfo, config: Path, tmp_path: Path, units: Sequence[str], prefix: str = ""
) -> Iterator[tuple[Daemon, NotifySink]]:
    """``python -m supervisor run --config CONFIG``; on exit stopped, and ``units`` too."""
    load_config(config)  # fail here, readably, rather than in the daemon
    systemctl = Systemctl(info)
    notify = NotifySink(tmp_path / f"{prefix}notify.sock")
    daemon = Daemon(info, config, notify.path, tmp_path / f"{prefix}daemon.log")
    try:
        yield daemon, notify
    except BaseException:
        print(f"daemon log (tail):\n{daemon.tail()}", file=sys.stderr)
        raise
    finally:
        daemon.stop()
        notify.close()
        for unit in units:
            systemctl("stop", unit, check=False)
            systemctl("reset-failed", unit, check=False)


@contextmanager
def bench_daemon(info: sandbox.SandboxInfo, tmp_path: Path, backoff_s: float) -> Iterator[Bench]:
    """daemon_bench's stand-in unit and daemon in ``info``'s sandbox; stopped on exit."""
    systemctl = Systemctl(info)
    standin_port = free_port()
    output = tmp_path / "standin.out"
    write_unit(info, standin_port, output)
    systemctl("daemon-reload")
    port = free_port()
    config = tmp_path / "config.toml"
    write_config(config, port, standin_port, backoff_s)
    with running_daemon(info, config, tmp_path, [UNIT]) as (daemon, _notify):
        yield Bench(systemctl, daemon, port, output)


# --- the load: another process -----------------------------------------------------------


async def _hammer_path(
    port: int, path: str, rate: float, stop: MpEvent, max_s: float, connections: int
) -> dict[str, Any]:
    pool = _RawPool(port)
    gate = asyncio.Semaphore(connections)
    latencies: list[tuple[float, float]] = []  # (scheduled, ms); CLOCK_MONOTONIC
    failures: collections.Counter[str] = collections.Counter()
    tasks: set[asyncio.Task[None]] = set()

    async def one(scheduled: float) -> None:
        async with gate:
            try:
                status = await asyncio.wait_for(pool.get(path), REQUEST_TIMEOUT_S)
            except (
                OSError,
                TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ValueError,
                IndexError,
            ) as exc:
                failures[type(exc).__name__] += 1
                return
        if status == 200:
            latencies.append((scheduled, (time.monotonic() - scheduled) * 1000))
        else:
            failures[f"HTTP {status}"] += 1

    start = time.monotonic()
    sent = 0
    while not stop.is_set() and time.monotonic() - start < max_s:
        scheduled = start + sent / rate
        delay = scheduled - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sent += 1
        if len(tasks) >= 50 * connections:  # a stalled server: count, do not pile up
            failures["dropped (backlog)"] += 1
            continue
        task = asyncio.create_task(one(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    pool.close()
    return {
        "latencies_ms": latencies,
        "failures": dict(failures),
        "sent": sent,
        "elapsed_s": time.monotonic() - start,
    }


def _hammer(
    port: int, rate: float, stop: MpEvent, max_s: float, connections: int, conn: Connection
) -> None:
    async def both() -> dict[str, Any]:
        paths = ("/status", "/metrics")
        outs = await asyncio.gather(
            *(_hammer_path(port, p, rate, stop, max_s, connections) for p in paths)
        )
        return dict(zip(paths, outs, strict=True))

    conn.send(asyncio.run(both()))


class Load:
    """The load process: started once the daemon answers, stopped after the last cycle."""

    def __init__(self, port: int, rate: float, max_s: float, connections: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop_event = ctx.Event()
        self._ours, theirs = ctx.Pipe()
        self._max_s = max_s
        self.proc = ctx.Process(
            target=_hammer,
            args=(port, rate, self.stop_event, max_s, connections, theirs),
            daemon=True,
        )
        self.proc.start()

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        try:
            if not self._ours.poll(REQUEST_TIMEOUT_S + 30):
                raise RuntimeError("the load process did not report")
            return self._ours.recv()  # type: ignore[no-any-return]
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()


# --- the daemon process's resources ------------------------------------------------------


@dataclass
class Sample:
    cycle: int
    fds: int
    fd_kinds: dict[str, int]
    rss_mb: float
    hwm_mb: float


def sample(pid: int, cycle: int) -> Sample:
    kinds: collections.Counter[str] = collections.Counter()
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:  # closed between listdir and readlink
            continue
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        kinds[kind] += 1
    _cpu, rss, hwm = proc_cpu_rss(pid)
    return Sample(cycle, sum(kinds.values()), dict(kinds), rss, hwm)


# --- cycles ------------------------------------------------------------------------------


@dataclass
class Cycle:
    n: int
    pid: int
    t0: float
    new_pid: int = 0
    ready_ms: float = 0.0  # kill -> /status ready with the new main_pid (polled)
    cause: str = ""
    last_exit_pid: int | None = None
    status_pid_mismatch: bool = False  # /status main_pid != systemd MainPID when ready


@dataclass
class Run:
    cycles: list[Cycle] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    unexpected_pid_changes: list[str] = field(default_factory=list)
    http: dict[str, dict[str, Any]] = field(default_factory=dict)
    final_status: dict[str, Any] = field(default_factory=dict)
    standin_processes: int = 0
    events: list[LogEvent] = field(default_factory=list)
    end_mono: float = 0.0
    log_lines: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0


def unit_status(client: httpx.Client) -> dict[str, Any]:
    return client.get("/status").json()["units"][UNIT]  # type: ignore[no-any-return]


def wait_unit(client: httpx.Client, daemon: Daemon, pred: Any, what: str) -> dict[str, Any]:
    """Poll /status until ``pred(unit)``; RuntimeError with the daemon's log tail if not."""
    deadline = time.monotonic() + READY_DEADLINE_S
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited ({daemon.proc.returncode}):\n{daemon.tail()}")
        try:
            last = unit_status(client)
        except (httpx.HTTPError, ValueError, KeyError):
            last = {}
        else:
            if pred(last):
                return last
        time.sleep(POLL_S)  # polling /status, the thing under test
    raise RuntimeError(f"{what}: not within {READY_DEADLINE_S:g}s; last {last}\n{daemon.tail()}")


def one_cycle(
    n: int,
    client: httpx.Client,
    daemon: Daemon,
    systemctl: Systemctl,
    rng: random.Random,
    settle_s: float,
    expected_pid: int | None,
    run: Run,
) -> Cycle:
    wait_unit(client, daemon, lambda u: u.get("state") == "ready", f"cycle {n}: ready")
    time.sleep(rng.uniform(0.0, settle_s))  # kill at a random point of the ready period
    pid = systemctl.main_pid(UNIT)
    if expected_pid is not None and pid != expected_pid:
        run.unexpected_pid_changes.append(f"before kill {n}: MainPID {expected_pid} -> {pid}")
    if pid <= 1:  # never pid 0 (our process group) nor init
        raise RuntimeError(f"refusing to kill pid {pid}")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    c = Cycle(n, pid, t0)

    def recovered(u: dict[str, Any]) -> bool:
        last_exit = u.get("last_exit") or {}
        return (
            u.get("state") == "ready"
            and u.get("main_pid") not in (None, 0, pid)
            and last_exit.get("main_pid") == pid
        )

    try:
        unit = wait_unit(client, daemon, recovered, f"cycle {n}: ready again after kill")
    except RuntimeError:
        # The unit came back but /status never named the killed PID: a missed exit.
        unit = wait_unit(
            client,
            daemon,
            lambda u: u.get("state") == "ready" and u.get("main_pid") not in (None, 0, pid),
            f"cycle {n}: ready again after kill",
        )
    c.ready_ms = (time.monotonic() - t0) * 1000
    c.cause = str((unit.get("last_exit") or {}).get("cause"))
    c.last_exit_pid = (unit.get("last_exit") or {}).get("main_pid")
    c.new_pid = systemctl.main_pid(UNIT)
    c.status_pid_mismatch = unit.get("main_pid") != c.new_pid
    return c


def run_cycles(
    args: argparse.Namespace, daemon: Daemon, systemctl: Systemctl, port: int, run: Run
) -> None:
    rng = random.Random(args.seed)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S) as client:
        wait_unit(client, daemon, lambda u: u.get("state") == "ready", "first ready")
        print(f"daemon pid {daemon.pid} on 127.0.0.1:{port}; unit ready; load: "
              f"{args.rate:g} req/s each on /status and /metrics", flush=True)  # fmt: skip
        load = Load(port, args.rate, args.cycles * 30.0 + 60.0, args.connections)
        expected: int | None = None
        try:
            for n in range(args.cycles):
                c = one_cycle(n, client, daemon, systemctl, rng, args.settle, expected, run)
                run.cycles.append(c)
                expected = c.new_pid
                done = n + 1
                if done == BASELINE_CYCLE or done % SAMPLE_EVERY == 0 or done == args.cycles:
                    s = sample(daemon.pid, done)
                    run.samples.append(s)
                    print(f"cycle {done:4d}/{args.cycles}: kill->ready {c.ready_ms:7.1f} ms, "
                          f"cause {c.cause}; daemon fds {s.fds} {s.fd_kinds} RSS "
                          f"{s.rss_mb:.1f} MB", flush=True)  # fmt: skip
            # One more look after the last recovery: a healthy unit must keep its PID.
            wait_unit(client, daemon, lambda u: u.get("state") == "ready", "final ready")
            final_pid = systemctl.main_pid(UNIT)
            if expected is not None and final_pid != expected:
                run.unexpected_pid_changes.append(f"after the last kill: {expected} -> {final_pid}")
        finally:
            run.http = load.stop()
        run.final_status = unit_status(client)
    run.end_mono = time.monotonic()


# --- analysis ----------------------------------------------------------------------------


@dataclass
class Verdicts:
    missed: list[str] = field(default_factory=list)
    double: list[str] = field(default_factory=list)
    healthy: list[str] = field(default_factory=list)
    extra_exits: list[str] = field(default_factory=list)


def analyse(run: Run) -> Verdicts:
    v = Verdicts()
    events = run.events
    cycles = run.cycles
    starts = [e for e in events if e.kind == "start issued"]
    if cycles:
        before = [e for e in starts if e.mono < cycles[0].t0]
        for e in before[1:]:  # the first is the daemon's initial start
            v.healthy.append(f"before the first kill: start issued restart={e.value}")
    for i, c in enumerate(cycles):
        end = cycles[i + 1].t0 if i + 1 < len(cycles) else run.end_mono
        window = [e for e in events if c.t0 < e.mono <= end]
        seen = [e for e in window if e.kind == "exit seen"]
        ready = next((e for e in window if e.kind == "state" and e.value == "ready"), None)
        ready_at = ready.mono if ready is not None else end
        issued = [e for e in window if e.kind == "start issued"]
        if not seen or c.last_exit_pid != c.pid:
            v.missed.append(
                f"kill {c.n} pid {c.pid}: {len(seen)} exit-seen lines, "
                f"last_exit.main_pid {c.last_exit_pid}, cause {c.cause}"
            )
        if len(seen) > 1:
            v.extra_exits.append(f"kill {c.n} pid {c.pid}: {len(seen)} exit-seen lines")
        during = [e for e in issued if e.mono <= ready_at]
        after = [e for e in issued if e.mono > ready_at]
        if len(during) > 1:
            v.double.append(
                f"kill {c.n} pid {c.pid}: {len(during)} starts issued "
                f"(restart={','.join(e.value for e in during)})"
            )
        for e in after:
            v.healthy.append(f"after kill {c.n} was ready: start issued restart={e.value}")
        if not during:
            v.missed.append(f"kill {c.n} pid {c.pid}: no start issued before ready again")
    v.healthy.extend(run.unexpected_pid_changes)
    return v


def split_by_recovery(
    samples: list[tuple[float, float]], cycles: list[Cycle]
) -> tuple[list[float], list[float]]:
    """Latencies of requests scheduled between a kill and ready-again, and of the rest."""
    spans = sorted((c.t0, c.t0 + c.ready_ms / 1000) for c in cycles)
    starts = [a for a, _b in spans]
    near: list[float] = []
    far: list[float] = []
    for scheduled, ms in samples:
        i = bisect.bisect_right(starts, scheduled) - 1
        (near if i >= 0 and scheduled <= spans[i][1] else far).append(ms)
    return near, far


def _pct(values: list[float], q: float) -> str:
    return f"{nearest_rank(values, q):.2f}" if values else "-"


def report(run: Run, args: argparse.Namespace) -> None:
    v = analyse(run)
    n = len(run.cycles)
    causes = collections.Counter(c.cause for c in run.cycles)
    restarts = run.final_status.get("restarts")
    mismatched = sum(1 for c in run.cycles if c.status_pid_mismatch)
    base = next((s for s in run.samples if s.cycle == BASELINE_CYCLE), None)
    last = run.samples[-1] if run.samples else None
    ready = [c.ready_ms for c in run.cycles]

    rows: list[tuple[str, str, str]] = [
        ("kill/recover cycles", str(args.cycles), str(n)),
        ("missed exits (no exit seen / last_exit change)", "0", str(len(v.missed))),
        ("double restarts (> 1 start issued per kill)", "0", str(len(v.double))),
        ("restarts of a healthy unit", "0", str(len(v.healthy))),
        ("  stand-in processes started (kills + 1)", str(n + 1), str(run.standin_processes)),
        ("  exits seen more than once per kill", "0", str(len(v.extra_exits))),
        ("exit causes on /status", "sigkill", ", ".join(f"{k} x{c}" for k, c in causes.items())),
        ("/status restarts counter at the end", str(n), str(restarts)),
        ("/status main_pid != systemd MainPID at ready", "0", str(mismatched)),
        (
            "kill -> /status ready, new PID (ms) p50/p99/max",
            "-",
            f"{_pct(ready, 0.5)} / {_pct(ready, 0.99)} / {max(ready):.2f}" if ready else "-",
        ),
    ]
    if base is not None and last is not None:
        rss_growth = (last.rss_mb - base.rss_mb) / base.rss_mb * 100
        fd_growth = (last.fds - base.fds) / base.fds * 100
        rows += [
            (
                f"daemon fds, cycle {base.cycle} -> {last.cycle}",
                f"< {TARGET_GROWTH_PCT:g} %",
                f"{base.fds} -> {last.fds} ({fd_growth:+.1f} %)",
            ),
            (
                f"daemon RSS MB, cycle {base.cycle} -> {last.cycle}",
                f"< {TARGET_GROWTH_PCT:g} %",
                f"{base.rss_mb:.1f} -> {last.rss_mb:.1f} ({rss_growth:+.1f} %), "
                f"peak {last.hwm_mb:.1f}",
            ),
        ]
    for path, out in run.http.items():
        near, far = split_by_recovery(out["latencies_ms"], run.cycles)
        lat = near + far
        failed = sum(out["failures"].values())
        rows.append(
            (
                f"GET {path} @ {args.rate:g}/s: failed requests",
                "0",
                f"{failed} of {out['sent']} ({out['failures'] or 'none'})",
            )
        )
        for label, values in (
            ("all", lat),
            ("sent while recovering (kill -> ready)", near),
            ("sent while ready", far),
        ):
            rows.append(
                (
                    f"GET {path} latency ms p50/p99/max, {label}",
                    "-",
                    f"{_pct(values, 0.5)} / {_pct(values, 0.99)} / {max(values, default=0):.2f}"
                    f" (n={len(values)})",
                )
            )

    print()
    print(f"Soak: {n} SIGKILL/recover cycles in {run.wall_s:.0f} s, {os.cpu_count()} CPUs, "
          f"load average before {'/'.join(f'{x:.2f}' for x in run.load)}, after "
          f"{'/'.join(f'{x:.2f}' for x in run.load_after)}")  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  {'expect':>10}  measured")
    for name, expect, measured in rows:
        print(f"{name:<{width}}  {expect:>10}  {measured}")
    if run.samples:
        trend = ", ".join(f"{s.cycle}:{s.fds}/{s.rss_mb:.1f}" for s in run.samples)
        print(f"fds/RSS MB by cycle: {trend}")
    print(f"daemon log lines: {run.log_lines}")
    for title, items in (
        ("missed exits", v.missed),
        ("double restarts", v.double),
        ("restarts of a healthy unit", v.healthy),
        ("exits seen more than once", v.extra_exits),
    ):
        for item in items[:20]:
            print(f"  {title}: {item}")
        if len(items) > 20:
            print(f"  {title}: ... {len(items) - 20} more")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=200, help="kill/recover cycles")
    parser.add_argument("--rate", type=float, default=100.0, help="req/s on each endpoint")
    parser.add_argument(
        "--connections", type=int, default=4, help="load: requests in flight per endpoint"
    )
    parser.add_argument(
        "--settle", type=float, default=0.3, help="up to this many s ready before a kill"
    )
    parser.add_argument(
        "--backoff-s", type=float, default=0.001, help="restart backoff (> 0; default 0.001)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for the pre-kill jitter")
    parser.add_argument("--log", type=Path, default=None, help="copy the daemon's log here")
    args = parser.parse_args()
    if args.cycles < BASELINE_CYCLE + 1 or args.rate <= 0 or args.connections < 1:
        parser.error(f"--cycles > {BASELINE_CYCLE}, --rate > 0, --connections >= 1")

    run = Run(load=os.getloadavg())
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k26-bench-soak-") as tmp:
        tmp_path = Path(tmp)
        with (
            sandbox.running(tmp_path / "sandbox") as info,
            bench_daemon(info, tmp_path, args.backoff_s) as bench,
        ):
            run_cycles(args, bench.daemon, bench.systemctl, bench.port, run)
        run.events = list(bench.daemon.events)
        run.log_lines = bench.daemon.lines
        text = bench.output.read_text(errors="replace") if bench.output.exists() else ""
        run.standin_processes = text.count("standin: listening")
        if args.log is not None:
            shutil.copyfile(bench.daemon.log_path, args.log)
    run.wall_s = time.monotonic() - began
    run.load_after = os.getloadavg()
    report(run, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
