"""MTTR, death to ready: the warm-up before the start against the warm-up alongside the load.

    .venv/bin/python bench/mttr.py [--load-seconds 100]

Needs root and the serving venv ``serving-0.7`` of the shared cache (FlashInfer 0.7.4, which
accepts 12.0 unpatched; ``scripts/serving-venv.sh 0.7`` makes it). It brings up
the project's confined systemd sandbox (torn down on any exit), one stand-in
SGLang unit that loads for ``--load-seconds`` (read from an EnvironmentFile at
each start, so the first start can be quick) and crashes on a sampled request
unless ``sampling`` is in the workspace, and the real daemon with FlashInfer
warm-up on: a real nvcc build of ``sampling`` for 12.0 when the workspace is
cold, a verification when it is warm.

One daemon, one unit, one workspace; ``flashinfer.overlap`` is switched between
rounds by rewriting the config and sending SIGHUP. Setup: the first start (load
1 s), which also asks the gate once. Then four rounds, each: (cold rounds) empty
the workspace, ``t0 = time.monotonic()``, SIGKILL the unit's MainPID, and wait
for the daemon's ``state: unit=U ready monotonic=T`` line (CLOCK_MONOTONIC, the
same clock as this process's). Restart backoff is set to the smallest the
config allows (1 ms) and the periodic probe to 600 s, so neither is in the
numbers.

Per round, from the daemon's log and /status: death -> ready (``T - t0``);
warm-up (``warmup.duration_s``, the adapter's wall time); load (``start issued``
to the first state after ``loading``, i.e. /health answered); probe (the last
``probing`` entry to ``ready``). The bound is max(load, warm-up) + probe, the
physical limit of a restart; the ratio is death -> ready over it (goal for the
overlapped rounds: at most 1.05).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# The benches' shared helpers (bench/common.py, next to this file).
from common import Systemctl, free_port

from k26dev import sandbox, shared_cache
from supervisor.core.errors import SupervisorError
from supervisor.flashinfer import read_env_file

ROOT = Path(__file__).resolve().parents[1]
UNIT = "k26-bench-mttr.service"
ARCH = "12.0"
_LINE = re.compile(
    r"(?P<kind>start issued|state|exit seen): unit=(?P<unit>\S+)"
    r"(?: restart=\w+| (?P<state>[a-z]+))? monotonic=(?P<mono>\d+\.\d+)"
)


@dataclass(frozen=True)
class Round:
    mode: str  # the plan the daemon reported: sequential or overlapped
    cache: str  # cold or warm
    warmup_s: float
    load_s: float
    probe_s: float
    mttr_s: float

    @property
    def bound_s(self) -> float:
        return max(self.load_s, self.warmup_s) + self.probe_s

    @property
    def sum_s(self) -> float:
        return self.warmup_s + self.load_s + self.probe_s


class Bench:
    def __init__(self, info: sandbox.SandboxInfo, tmp: Path, load_s: float) -> None:
        self.info = info
        self.tmp = tmp
        self.load_s = load_s
        self.systemctl = Systemctl(info)
        self.workspace = tmp / "workspace"
        self.workspace.mkdir()
        self.load_env = tmp / "load.env"
        self.config = tmp / "config.toml"
        self.log = tmp / "supervisor.log"
        self.port = free_port()
        self.listen = free_port()
        venv = shared_cache.serving_venv("0.7", make=False)
        self.python = venv / "bin" / "python"
        self.build_env = venv / "k26-build.env"
        self.proc: subprocess.Popen[bytes] | None = None

    def write_unit(self) -> None:
        cmd = (
            f"{sys.executable} -m k26dev.standin --port {self.port} "
            f"--load-seconds ${{K26_LOAD_S}} --fail sampling-arch "
            f"--flashinfer-cache {self.workspace}"
        )
        text = textwrap.dedent(
            f"""\
            [Unit]
            Description=k26 MTTR benchmark stand-in
            StartLimitIntervalSec=0

            [Service]
            Type=simple
            EnvironmentFile={self.load_env}
            ExecStart={cmd}
            StandardOutput=append:{self.tmp / "unit.out"}
            StandardError=inherit
            Restart=no
            KillMode=mixed
            TimeoutStopSec=10
            """
        )
        (self.info.unit_dir / UNIT).write_text(text)
        self.systemctl("daemon-reload")

    def set_load(self, seconds: float) -> None:
        self.load_env.write_text(f"K26_LOAD_S={seconds:g}\n")  # read at each start

    def write_config(self, overlap: str) -> None:
        self.config.write_text(
            textwrap.dedent(
                f"""\
                [supervisor]
                bus = "user"
                listen = "127.0.0.1:{self.listen}"

                [flashinfer]
                enabled = true
                python = "{self.python}"
                arch = "{ARCH}"
                workspace = "{self.workspace}"
                env_file = "{self.build_env}"
                timeout_s = 900
                overlap = "{overlap}"

                [probe]
                startup_deadline_s = 900
                interval_s = 600

                [restart]
                backoff_initial_s = 0.001
                backoff_factor = 1
                backoff_max_s = 0.001
                max_failures = 100

                [[units]]
                name = "{UNIT}"
                role = "autoregressive"
                url = "http://127.0.0.1:{self.port}"
                """
            )
        )

    def start_daemon(self) -> None:
        env = dict(os.environ, **self.info.env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(self.config)],
            env=env,
            stdout=open(self.log, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

    def stop_daemon(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def status(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.listen}/status", timeout=5).json()  # type: ignore[no-any-return]

    def lines(self, since: float) -> list[tuple[str, str | None, float]]:
        found = []
        for match in _LINE.finditer(self.log.read_text(errors="replace")):
            mono = float(match["mono"])
            if match["unit"] == UNIT and mono >= since:
                found.append((match["kind"], match["state"], mono))
        return found

    def wait_ready(self, since: float, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            for kind, state, mono in self.lines(since):
                if kind == "state" and state == "ready":
                    return mono
            time.sleep(0.2)
        raise SystemExit(f"not ready within {timeout_s:g} s:\n{self.log.read_text()[-3000:]}")

    def reload(self, overlap: str) -> None:
        assert self.proc is not None
        self.write_config(overlap)
        before = self.log.read_text().count("configuration reloaded")
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while self.log.read_text().count("configuration reloaded") == before:
            if time.monotonic() > deadline:
                raise SystemExit("SIGHUP was not applied:\n" + self.log.read_text()[-2000:])
            time.sleep(0.05)

    def round(self, overlap: str, cache: str) -> Round:
        self.reload(overlap)
        self.set_load(self.load_s)
        if cache == "cold":
            shutil.rmtree(self.workspace / ".cache", ignore_errors=True)
        pid = self.systemctl.main_pid(UNIT)
        assert pid > 0
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ready = self.wait_ready(t0, timeout_s=self.load_s + 1200)
        lines = self.lines(t0)
        started = max(m for k, _, m in lines if k == "start issued" and m <= ready)
        loading = [m for k, s, m in lines if k == "state" and s == "loading" and m >= started]
        after = [m for k, s, m in lines if k == "state" and m > loading[0] and s != "loading"]
        probing = max(m for k, s, m in lines if k == "state" and s == "probing" and m <= ready)
        status = self.status()
        unit = status["units"][UNIT]
        assert unit["state"] == "ready", unit
        return Round(
            mode=unit["warmup"]["mode"],
            cache=cache,
            warmup_s=float(status["warmup"]["duration_s"]),
            load_s=after[0] - started,
            probe_s=ready - probing,
            mttr_s=ready - t0,
        )


def table(rounds: list[Round]) -> str:
    head = (
        "| plan | cache | warm-up s | load s | probe s | death -> ready s "
        "| max(load, warm-up) + probe s | ratio | warm-up + load + probe s |"
    )
    rows = [head, "|" + "---|" * 9]
    for r in rounds:
        rows.append(
            f"| {r.mode} | {r.cache} | {r.warmup_s:.1f} | {r.load_s:.1f} | {r.probe_s:.3f} "
            f"| {r.mttr_s:.1f} | {r.bound_s:.1f} | {r.mttr_s / r.bound_s:.3f} | {r.sum_s:.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-seconds", type=float, default=100.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/mttr.py needs root (the confined systemd sandbox)", file=sys.stderr)
        return 77
    try:
        venv = shared_cache.serving_venv("0.7")
    except SupervisorError as exc:
        print(exc, file=sys.stderr)
        return 69
    read_env_file(venv / "k26-build.env")  # fail early if unreadable
    tmp = Path(tempfile.mkdtemp(prefix="k26-mttr-"))
    began = time.monotonic()
    try:
        with sandbox.running(tmp / "sandbox") as info:
            bench = Bench(info, tmp, args.load_seconds)
            bench.set_load(1)
            bench.write_unit()
            bench.write_config("auto")
            bench.start_daemon()
            try:
                first = bench.wait_ready(0.0, timeout_s=1200)
                print(
                    f"setup: first start (cold build, load 1 s) ready after {first - began:.1f} s",
                    flush=True,
                )
                rounds = []
                for overlap, cache in (
                    ("never", "warm"),
                    ("auto", "warm"),
                    ("never", "cold"),
                    ("auto", "cold"),
                ):
                    rounds.append(bench.round(overlap, cache))
                    r = rounds[-1]
                    print(f"{r.mode} {r.cache}: death -> ready {r.mttr_s:.1f} s", flush=True)
            finally:
                bench.stop_daemon()
                bench.systemctl("stop", UNIT, check=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nload {args.load_seconds:g} s; bench wall time {time.monotonic() - began:.0f} s\n")
    print(table(rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
