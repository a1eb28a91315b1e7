"""Side by side: k26-supervisor against the checks people use without it, in one run.

    .venv/bin/python bench/side_by_side.py [--kills 50] [--kills-5s 20] [--window 20] [--cold]

Needs root: it brings up the project's confined systemd sandbox
(``k26dev.sandbox.running``, torn down on any exit) and measures, one phase
after another, in that one sandbox:

1. detection: bench/exit_detection.py's stand-in unit (``Restart=no``), a running
   ``k26-supervisor watch`` and two ``systemctl --user is-active`` pollers at the
   same time, one every 1 s and one every 5 s. ``--kills`` SIGKILLs; the first
   ``--kills-5s`` of them wait a random 0-5 s (so the kill falls at a random
   phase of the 5 s poll) and are timed for all three, the others wait 0-1 s and
   are timed for watch and the 1 s poller. watch: kill -> classified
   (``classified_monotonic``); a poller: kill -> the first call started after
   the unit was seen active that answered failed/inactive returned.
2. false ready: three stand-in units, each with one fault that a sampled
   request meets and a greedy one does not: ``--fail sampling-arch`` (crashes on
   the first sampled /generate), ``--fail sampled-hang`` (a sampled /generate
   never answers), and a slow load (``--load-seconds`` 3 s past the probe's
   ``startup_deadline_s``). The real daemon supervises all three
   (``[flashinfer] enabled = false``, probe timeout 3 s, startup deadline 5 s,
   interval 2 s, 2 failures to fail; restart backoff 1-2 s, 3 failures to
   ``failed``). From the moment the daemon starts, for ``--window`` s (the window
   is the measurement), every 0.2 s and each in its own thread: the daemon's
   ``GET /status`` (per-unit ``ready``), SGLang's own readiness check ``GET
   /health_generate`` (a greedy one-token generation; ready = 200) and a plain
   ``GET /health`` (ready = 200), against the same units at the same time. A
   unit counts as "said ready" by a check when any of its polls said so.
3. recovery and footprint: bench/daemon_bench.py's phases 1, 3 and 4 (its own
   ``run_phases``, phase 2 off) on its unit and daemon: kill -> restart ``start
   issued``, ``exit seen`` -> ``start issued``, ``probe: ok=True`` -> ``state:
   ready`` from the daemon's log; idle CPU and RSS over ``--idle-seconds``;
   ``GET /status`` and ``/metrics`` at ``--rate`` req/s from another process.
4. warm-up (outside the sandbox): by default the warm-cache verification only:
   ``flashinfer.warm()`` (what the daemon runs before every start) ``--warm-repeat``
   times on an already warm workspace (``--warm-workspace``, default
   bench/gpu/.work/cache as bench/gpu/prepare.py leaves it; ``doctor`` must call it
   warm first, so nothing is ever built there), with the cold figure cited from
   docs/flashinfer.md. ``--cold`` runs bench/flashinfer_warm.py instead (a real
   cold nvcc build, 70-250 s on 2 cores, then its warm verifications).

Percentiles are nearest-rank (below 100 samples p99 is the maximum). Prints one
table (Markdown) plus a few lines of detail; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import daemon_bench as db  # bench/, next to this file
import exit_detection as ed
import httpx
from soak import bench_daemon, running_daemon

from k26dev import sandbox, shared_cache
from supervisor import flashinfer
from supervisor.flashinfer import cache

ROOT = Path(__file__).resolve().parents[1]
SLOW_POLL_S = 5.0
SAMPLE_PERIOD_S = 0.2
STARTUP_DEADLINE_S = 5.0
DEFAULT_WORKSPACE = ROOT / "bench" / "gpu" / ".work" / "cache"
DEFAULT_SERVING_PYTHON = shared_cache.serving_venv("0.7", make=False) / "bin" / "python"
FAULTS: tuple[tuple[str, str, str], ...] = (
    # (label, unit, stand-in options)
    ("sampling crash", "k26-sbs-crash.service", "--load-seconds 1 --fail sampling-arch"),
    ("sampled hang", "k26-sbs-hang.service", "--load-seconds 1 --fail sampled-hang"),
    ("slow load", "k26-sbs-slow.service", f"--load-seconds {STARTUP_DEADLINE_S + 3:g}"),
)


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def pcts(values: list[float], fmt: str = ".1f") -> str:
    if not values:
        return "-"
    p50, p99 = db.nearest_rank(values, 0.5), db.nearest_rank(values, 0.99)
    return f"{p50:{fmt}} / {p99:{fmt}} (n={len(values)})"


# --- 1. detection ------------------------------------------------------------------------


@dataclass
class Detection:
    classified_ms: list[float] = field(default_factory=list)
    poll1_ms: list[float] = field(default_factory=list)
    poll5_ms: list[float] = field(default_factory=list)
    causes: collections.Counter[str] = field(default_factory=collections.Counter)
    missing: int = 0  # kills without a watch line
    unseen: int = 0  # timed poll rounds where the poller never saw the death
    load: str = ""


def _poller(stack: ExitStack, systemctl: ed.Systemctl, interval_s: float) -> ed.Poller:
    poller = ed.Poller(systemctl, interval_s=interval_s)
    thread = threading.Thread(target=poller.run, name=f"is-active-{interval_s:g}s", daemon=True)
    thread.start()
    stack.callback(thread.join, 10)
    stack.callback(poller.stop)
    return poller


def detection(info: sandbox.SandboxInfo, tmp: Path, args: argparse.Namespace) -> Detection:
    rng = random.Random(args.seed)
    out = Detection(load=loadavg())
    output = tmp / "exit-standin.out"
    systemctl = ed.Systemctl(info)
    ed.write_unit(info, ed.free_port(), output)
    systemctl("daemon-reload")
    print(f"\n[1] detection: {args.kills} SIGKILLs ({args.kills_5s} also timed for the 5 s poller)",
          flush=True)  # fmt: skip
    try:
        with ExitStack() as stack:
            watch = stack.enter_context(ed.watching(info))
            fast = _poller(stack, systemctl, ed.POLL_INTERVAL_S)
            slow = _poller(stack, systemctl, SLOW_POLL_S)
            for n in range(args.kills):
                timed_slow = n < args.kills_5s
                pid = ed.start_and_wait(systemctl, output, loads_before=n)
                seen_active = time.monotonic()
                # A random phase against the slowest poller this round is timed for.
                time.sleep(rng.uniform(0.0, SLOW_POLL_S if timed_slow else ed.POLL_INTERVAL_S))
                if pid <= 1:  # never pid 0 (our process group) nor init
                    raise RuntimeError(f"refusing to kill pid {pid}")
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                rec, _others = watch.exit_of(pid, ed.WATCH_DEADLINE_S)
                if rec is None:
                    out.missing += 1
                else:
                    out.classified_ms.append((float(rec["classified_monotonic"]) - t0) * 1000)
                    out.causes[str(rec.get("cause"))] += 1
                pollers = [(fast, out.poll1_ms, ed.POLL_DEADLINE_S)]
                if timed_slow:
                    pollers.append((slow, out.poll5_ms, SLOW_POLL_S + ed.POLL_DEADLINE_S))
                for poller, into, deadline in pollers:
                    found = poller.first_dead_after(seen_active, deadline)
                    if found is None:
                        out.unseen += 1
                    else:
                        into.append((found.done - t0) * 1000)
                systemctl("reset-failed", ed.UNIT, check=False)
                if (n + 1) % 10 == 0:
                    print(f"    {n + 1}/{args.kills} kills", flush=True)
    finally:
        systemctl("stop", ed.UNIT, check=False)
        systemctl("reset-failed", ed.UNIT, check=False)
    return out


# --- 2. false ready ----------------------------------------------------------------------


def write_fault_unit(
    info: sandbox.SandboxInfo, name: str, port: int, output: Path, opts: str
) -> None:
    """daemon_bench's stand-in unit, under another name, with the fault's options."""
    db.write_unit(info, port, output)
    written = info.unit_dir / db.UNIT
    text = written.read_text().replace(f"--port {port}\n", f"--port {port} {opts}\n")
    written.unlink()
    (info.unit_dir / name).write_text(text)


def fault_config(path: Path, listen_port: int, units: dict[str, int]) -> None:
    body = textwrap.dedent(
        f"""\
        [supervisor]
        bus = "user"
        listen = "127.0.0.1:{listen_port}"

        [flashinfer]
        enabled = false

        [probe]
        timeout_s = 3
        startup_deadline_s = {STARTUP_DEADLINE_S!r}
        interval_s = 2
        failures_to_fail = 2

        [restart]
        backoff_initial_s = 1
        backoff_max_s = 2
        max_failures = 3
        failure_window_s = 60
        """
    )
    for name, port in units.items():
        body += f'\n[[units]]\nname = "{name}"\nrole = "autoregressive"\n'
        body += f'url = "http://127.0.0.1:{port}"\n'
    path.write_text(body)


class Sampler:
    """``fn()`` every SAMPLE_PERIOD_S in a thread until ``until``; keeps (s since start, value)."""

    def __init__(self, fn: Callable[[], Any], started: float, until: float) -> None:
        self.fn, self.started, self.until = fn, started, until
        self.samples: list[tuple[float, Any]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = time.monotonic()
        while time.monotonic() < self.until:
            t = time.monotonic()
            try:
                value = self.fn()
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                value = None
            self.samples.append((t - self.started, value))
            tick = max(tick + SAMPLE_PERIOD_S, time.monotonic())
            time.sleep(max(0.0, min(tick, self.until) - time.monotonic()))

    def join(self) -> None:
        self._thread.join(10)


@dataclass
class Verdict:
    polls: int
    ready_polls: int
    first_ready_s: float | None

    def cell(self) -> str:
        if not self.ready_polls:
            return f"no (0/{self.polls} polls)"
        return (
            f"**yes**: {self.ready_polls}/{self.polls} polls, first at {self.first_ready_s:.1f} s"
        )


def verdict(samples: list[tuple[float, Any]], said_ready: Callable[[Any], bool]) -> Verdict:
    hits = [t for t, v in samples if v is not None and said_ready(v)]
    return Verdict(len(samples), len(hits), hits[0] if hits else None)


@dataclass
class FaultResult:
    label: str
    unit: str
    opts: str
    supervisor: Verdict
    greedy: Verdict
    health: Verdict
    final: dict[str, Any]


def _status_code(client: httpx.Client, url: str) -> int:
    return client.get(url).status_code


def _unit_ready(unit: str, units: dict[str, Any]) -> bool:
    return bool(units[unit]["ready"])


def _ok(status: int) -> bool:
    return status == 200


def false_ready(
    info: sandbox.SandboxInfo, tmp: Path, ports: dict[str, int], args: argparse.Namespace
) -> tuple[list[FaultResult], str]:
    load = loadavg()
    print(f"\n[2] false ready: {len(FAULTS)} faulty units, {args.window:g} s window", flush=True)
    listen = db.free_port()
    config = tmp / "faults.toml"
    fault_config(config, listen, ports)
    units = [unit for _label, unit, _opts in FAULTS]
    started = time.monotonic()
    until = started + args.window
    with (
        ExitStack() as clients,
        running_daemon(info, config, tmp, units, prefix="faults-") as (_daemon, notify),
    ):

        def client() -> httpx.Client:
            return clients.enter_context(httpx.Client(timeout=2.0))

        status = client()
        sup = Sampler(
            lambda: status.get(f"http://127.0.0.1:{listen}/status").json()["units"],
            started,
            until,
        )
        probes: dict[tuple[str, str], Sampler] = {}
        for unit in units:
            for path in ("/health_generate", "/health"):
                url = f"http://127.0.0.1:{ports[unit]}{path}"
                probes[unit, path] = Sampler(partial(_status_code, client(), url), started, until)
        for s in [sup, *probes.values()]:
            s.join()
        final = status.get(f"http://127.0.0.1:{listen}/status").json()["units"]
    results = [
        FaultResult(
            label,
            unit,
            opts,
            verdict(sup.samples, partial(_unit_ready, unit)),
            verdict(probes[unit, "/health_generate"].samples, _ok),
            verdict(probes[unit, "/health"].samples, _ok),
            final[unit],
        )
        for label, unit, opts in FAULTS
    ]
    if any("READY=1" in m for m in notify.messages):
        print("    note: the daemon sent READY=1 during the window", flush=True)
    return results, load


# --- 3. recovery and footprint ---------------------------------------------------------


def recovery(
    info: sandbox.SandboxInfo, tmp: Path, args: argparse.Namespace
) -> tuple[db.Results, str]:
    load = loadavg()
    print(f"\n[3] recovery and footprint (bench/daemon_bench.py: {args.recovery_kills} kills, "
          f"{args.idle_seconds:g} s idle, {args.rate:g} req/s)", flush=True)  # fmt: skip
    phases = argparse.Namespace(
        kills=args.recovery_kills,
        ready_rounds=0,
        idle_seconds=args.idle_seconds,
        rate=args.rate,
        duration=args.duration,
        seed=args.seed,
    )
    bench_dir = tmp / "recovery"
    bench_dir.mkdir()
    with bench_daemon(info, bench_dir, 0.001) as bench:
        res = db.run_phases(phases, bench.daemon, bench.systemctl, bench.port, db.Results())
    return res, load


# --- 4. warm-up --------------------------------------------------------------------------


@dataclass
class Warm:
    verify: str = "not measured"
    verify_note: str = ""
    cold: str = ""
    cold_note: str = ""
    load: str = ""


def cited_cold() -> str:
    """The cold warm-up figure recorded in docs/flashinfer.md's benchmark table."""
    doc = ROOT / "docs" / "flashinfer.md"
    try:
        for line in doc.read_text().splitlines():
            if line.startswith("| cold warm-up"):
                return line.strip("| ").split("|")[-1].strip().split(". ")[0]
    except OSError:
        pass
    return "not found in docs/flashinfer.md"


def warm_cold(args: argparse.Namespace) -> Warm:
    out = Warm(load=loadavg())
    script = ROOT / "bench" / "flashinfer_warm.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--repeat", str(args.warm_repeat)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    cold = re.search(r"cold warm-up \((.*)\): ([\d.]+) s", proc.stdout)
    again = re.search(r"median ([\d.]+) s, max ([\d.]+) s over (\d+) runs", proc.stdout)
    if proc.returncode != 0 or cold is None or again is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        out.cold = f"failed (exit {proc.returncode}): {' / '.join(tail)}"
        return out
    out.cold = f"{float(cold[2]):.1f} s"
    out.cold_note = f"measured now by bench/flashinfer_warm.py ({cold[1]})"
    out.verify_note = (
        f"bench/flashinfer_warm.py: median {again[1]} s, max {again[2]} s over {again[3]} runs"
    )
    out.verify = f"median {float(again[1]):.3f} s, max {float(again[2]):.3f} s (n={again[3]})"
    return out


def warm_verify(args: argparse.Namespace) -> Warm:
    out = Warm(load=loadavg(), cold=cited_cold(), cold_note="cited from docs/flashinfer.md")
    workspace: Path = args.warm_workspace
    python: Path = args.serving_python
    prints = list(cache.find_fingerprints(workspace)) if workspace.is_dir() else []
    if not prints or not python.exists():
        out.verify_note = (
            f"not measured: no warm workspace at {workspace} or no serving venv {python} "
            "(pass --warm-workspace DIR, or --cold)"
        )
        return out
    arch = prints[0].arch
    env_file = python.parent.parent / "k26-build.env"
    env = flashinfer.read_env_file(env_file) if env_file.exists() else {}
    report = asyncio.run(flashinfer.doctor(python, arch, workspace, env=env))
    if str(report.status) != "warm":
        out.verify_note = f"not measured: doctor says {report.status} for {workspace} ({arch})"
        return out
    runs: list[float] = []
    for _ in range(args.warm_repeat):
        # Never a build here: doctor just called the cache warm, and a short timeout.
        result = asyncio.run(flashinfer.warm(python, arch, workspace, env=env, timeout_s=60))
        if not result.ok or result.built:
            out.verify_note = f"warm() did not verify: built {result.built}, {result.error}"
            return out
        runs.append(result.duration_s)
    out.verify = f"median {statistics.median(runs):.3f} s, max {max(runs):.3f} s (n={len(runs)})"
    out.verify_note = (
        f"flashinfer.warm() on {workspace.relative_to(ROOT) if workspace.is_relative_to(ROOT) else workspace} "
        f"(arch {arch})"
    )
    return out


# --- the table ---------------------------------------------------------------------------


def _ms(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def table(
    det: Detection,
    faults: list[FaultResult],
    rec: db.Results,
    warm: Warm,
    args: argparse.Namespace,
) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = [
        ("**detection** (kill → seen), ms p50 / p99", "`watch`: classified", "`systemctl is-active` every 1 s", "every 5 s"),
        ("SIGKILL of the unit's MainPID", pcts(det.classified_ms), pcts(det.poll1_ms, ".0f"), pcts(det.poll5_ms, ".0f")),
        ("**false ready** (said ready in the window)", "`/status` per-unit ready", "`GET /health_generate` = 200", "`GET /health` = 200"),
    ]  # fmt: skip
    for f in faults:
        fin = f.final
        end = f"; ends `{fin['state']}`, restarts {fin['restarts']}"
        if fin.get("last_exit"):
            end += f", last exit `{fin['last_exit']['cause']}`"
        rows.append((f"{f.label} (`{f.opts}`)", f.supervisor.cell() + end, f.greedy.cell(), f.health.cell()))  # fmt: skip
    k = rec.kills
    rows += [
        ("**recovery**, ms p50 / p99", "k26-supervisor", "", ""),
        ("kill → `exit seen` (daemon's D-Bus read)", pcts(_ms([x.exit_seen_ms for x in k]), ".2f"), "", ""),
        ("kill → restart `start issued`", pcts(_ms([x.issued_ms for x in k]), ".2f"), "", ""),
        ("  of which `exit seen` → `start issued`", pcts(_ms([x.exit_to_issued_ms for x in k]), ".2f"), "", ""),
        ("probe ok → `state: ready`", pcts(_ms([x.probe_to_ready_ms for x in k]), ".2f"), "", ""),
        ("kill → ready again (stand-in start-up included)", pcts(_ms([x.kill_to_ready_ms for x in k]), ".0f"), "", ""),
        ("**warm-up** (FlashInfer sampling module)", "warm verification", "cold precompile", ""),
    ]  # fmt: skip
    rows.append(("before every (re)start", warm.verify, f"{warm.cold} ({warm.cold_note})", ""))
    idle = rec.idle
    rows.append(("**footprint** (daemon)", "k26-supervisor", "", ""))
    if idle:
        rows += [
            (f"idle CPU, % of one core ({idle['wall_s']:.0f} s, unit ready)", f"{idle['cpu_pct']:.3f}", "", ""),
            ("idle RSS, MB (start → end)", f"{idle['rss0_mb']:.1f} → {idle['rss1_mb']:.1f}", "", ""),
        ]  # fmt: skip
    for path in ("/status", "/metrics"):
        out = rec.http.get(path)
        if out is not None:
            rows.append(
                (f"`GET {path}` @ {args.rate:g}/s, ms p50 / p99", pcts(out["latencies_ms"], ".2f") + f", {out['errors']} errors", "", "")
            )  # fmt: skip
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    header = ("measure", "k26-supervisor", "baseline", "baseline 2")
    widths = [max(w, len(h)) for w, h in zip(widths, header, strict=True)]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="detection SIGKILLs (default 50)")
    parser.add_argument(
        "--kills-5s", type=int, default=20, help="of those, timed for the 5 s poller (default 20)"
    )
    parser.add_argument("--window", type=float, default=20.0, help="false-ready window, s")
    parser.add_argument("--recovery-kills", type=int, default=20, help="daemon_bench phase 1")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="daemon_bench phase 3")
    parser.add_argument("--rate", type=float, default=200.0, help="daemon_bench phase 4 req/s")
    parser.add_argument("--duration", type=float, default=10.0, help="phase 4 s per endpoint")
    parser.add_argument("--cold", action="store_true", help="run a real cold precompile too")
    parser.add_argument("--warm-repeat", type=int, default=5, help="warm verifications")
    parser.add_argument("--warm-workspace", type=Path, default=DEFAULT_WORKSPACE)
    parser.add_argument("--serving-python", type=Path, default=DEFAULT_SERVING_PYTHON)
    parser.add_argument("--seed", type=int, default=None, help="seed for the pre-kill jitter")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy daemon/unit logs here")
    args = parser.parse_args()
    if not 0 <= args.kills_5s <= args.kills or args.kills < 1 or args.recovery_kills < 1:
        parser.error("--kills >= 1, 0 <= --kills-5s <= --kills, --recovery-kills >= 1")

    loads = {"start": loadavg()}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k26-bench-sbs-") as tmp:
        tmp_path = Path(tmp)
        with sandbox.running(tmp_path / "sandbox") as info:
            ports = {unit: db.free_port() for _l, unit, _o in FAULTS}
            for _label, unit, opts in FAULTS:
                write_fault_unit(info, unit, ports[unit], tmp_path / f"{unit}.out", opts)
            det = detection(info, tmp_path, args)  # reloads systemd: the fault units too
            loads["detection"] = det.load
            faults, loads["false ready"] = false_ready(info, tmp_path, ports, args)
            rec, loads["recovery"] = recovery(info, tmp_path, args)
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in [
                *tmp_path.glob("*.log"),
                *tmp_path.glob("*.out"),
                *tmp_path.glob("*/*.log"),
            ]:
                shutil.copyfile(log, args.keep_logs / f"{log.parent.name}-{log.name}")
    print("\n[4] warm-up" + (" (cold precompile: minutes)" if args.cold else ""), flush=True)
    warm = warm_cold(args) if args.cold else warm_verify(args)
    loads["warm-up"] = warm.load
    loads["end"] = loadavg()
    wall = time.monotonic() - began

    print()
    print(f"Side by side: {os.cpu_count()} CPUs, {wall:.0f} s; load average (1/5/15 min) "
          + ", ".join(f"{k} {v}" for k, v in loads.items()))  # fmt: skip
    print_table(table(det, faults, rec, warm, args))
    print()
    print(f"detection: watch causes {dict(det.causes)}; kills without a watch line {det.missing}; "
          f"timed poll rounds that never saw the death {det.unseen}")  # fmt: skip
    print(f"warm-up: verification {warm.verify_note}; cold {warm.cold_note}")
    print("false ready: the stand-in answers /health and /health_generate from one handler "
          "(SGLang 0.5.x): 503 while loading, else a greedy one-token generation")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
