"""Chaos soak: faults of many kinds, in a seeded random order, against the real daemon,
with the invariants checked all the time.

    .venv/bin/python bench/chaos.py [--faults 60] [--seed 1] [--json] [--log FILE]
        [--kinds a,b] [--keep DIR]

Every kind is played once first (in a seeded order), then kinds are drawn at random
from the seed.

Needs root (the confined systemd sandbox, the kernel's OOM killer under MemoryMax=,
/dev/kmsg). One preferred/fallback pair of stand-in SGLang units (``--fail chaos``:
the prompt names the fault, bench's only hook; the rest is real: signals, OOM kills,
kmsg Xid records for the scheduler's own PID on a fake PCI bus id, systemd stops,
SIGHUP, SIGUSR1, a SIGKILLed daemon), and ``python -m supervisor run`` with short
timings (``CONFIG``). Each fault is one episode: the pair is first brought back to
"the preferred unit ready" (SIGUSR1 where an operator would reset it), then the fault,
then the wait for its outcome (``KINDS``: the verdicts its deaths may get, the one it
must get, and the time bound on nothing serving, from the configured timings).

Invariants, checked by a poller of ``/status`` every ``POLL_S`` for the whole run:

- ``ready-unproven``: a unit is ``ready`` while its last probe did not pass, or with
  no passing coverage since its last death (checked per MainPID, so a daemon that
  adopts a ready unit after a restart carries the proof it made before);
- ``operator-overridden``: a unit an operator stopped became active before an
  operator started it;
- ``unserved``: nothing of the pair ready for longer than the kind's bound (a
  hardware Xid's time waiting for its reset excluded, and an operator's stop);
- ``verdict``: a death of the episode got a cause the kind does not allow, or none
  got the one it must;
- ``states``: the preferred unit did not pass through the kind's states;
- ``deadline``: a state held past its deadline (loading past the startup deadline,
  starting past the start deadline, backoff past the longest backoff), with slack;
- ``leak``: within one daemon lifetime of at least 20 episodes, fds or RSS at its
  last episode more than 5 % above the most seen in its episodes 10-19 (warm-up).

The last line printed is one JSON object: ``faults``, ``kinds`` (count per kind),
``violations`` (each with the fault number, its kind, the invariant and the
evidence), ``unserved_s`` and ``unserved_bound_s`` (sum of the bounds),
``verdict_accuracy`` (per kind, deaths with an allowed cause / deaths), and the
daemon lifetimes' fd and RSS figures. Exit 0 always: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import Systemctl, free_port  # bench/common.py
from daemon_bench import Daemon, NotifySink  # bench/daemon_bench.py

from k26dev import sandbox

PREFERRED = "k26-chaos-eagle3.service"
FALLBACK = "k26-chaos-ar.service"
POLL_S = 0.05
SLACK_S = 3.0  # scheduling noise on a loaded 2-core machine, added to every bound
EPISODE_DEADLINE_S = 90.0

# The daemon's timings (the bounds below are computed from them).
BACKOFF_S = (0.05, 2.0, 0.4)  # initial, factor, max
MAX_FAILURES, FAILURE_WINDOW_S = 3, 8.0
PROBE_INTERVAL_S, PROBE_TIMEOUT_S, PROBE_FAILURES = 1.0, 1.5, 2
STARTUP_DEADLINE_S, START_DEADLINE_S = 6.0, 10.0
STALL_AFTER_S, PROGRESS_S = 1.0, 0.2
# A hung server's stop: its drain waits for the stuck request, then systemd's
# TimeoutStopSec (the units': 10 s) ends it with SIGKILL, as for a real SGLang.
STOP_TIMEOUT_S = 10.0
START_S = 2.5  # a stand-in start: a Python process, /health, probe, coverage (measured: ~1.5)

CONFIG = """\
[supervisor]
bus = "user"
listen = "127.0.0.1:{port}"
log_level = "info"

[flashinfer]
enabled = false

[probe]
timeout_s = {probe_timeout}
startup_deadline_s = {startup}
interval_s = {probe_interval}
failures_to_fail = {probe_failures}
stall_after_s = {stall}
progress_interval_s = {progress}

[restart]
backoff_initial_s = {b0}
backoff_factor = {bf}
backoff_max_s = {bmax}
max_failures = {max_failures}
failure_window_s = {window}

[fallback]
oom_exits = 1000
window_s = 60
retry_preferred_after_s = 0

[coverage]
enabled = true
shapes = ["greedy", "repetition-penalty", "parallel-n"]

[[units]]
name = "{preferred}"
role = "eagle3"
url = "http://127.0.0.1:{p_port}"
fallback = "{fallback}"

[[units]]
name = "{fallback}"
role = "autoregressive"
url = "http://127.0.0.1:{f_port}"
"""


@dataclass(frozen=True)
class Kind:
    """One kind of fault and what must follow it."""

    name: str
    allowed: frozenset[str]  # causes any death of its episode may get
    must: str | None  # the cause one death must get ("none": no unit dies on its own)
    states: tuple[str, ...]  # states the preferred unit must pass through
    unserved_bound_s: float  # nothing serving for at most this long (+ SLACK_S)


def _bound_restart() -> float:
    return BACKOFF_S[2] + START_S


def _bound_escalation() -> float:
    # max_failures deaths, each a start and a backoff, then the fallback's start.
    return MAX_FAILURES * (BACKOFF_S[2] + START_S) + START_S


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("sigkill", frozenset({"sigkill"}), "sigkill", ("backoff", "ready"), _bound_restart()),
        Kind(
            "oom-kill", frozenset({"oom-kill"}), "oom-kill", ("backoff", "ready"), _bound_restart()
        ),
        Kind(
            "cuda-oom-at-start",
            frozenset({"sigkill", "gpu-oom"}),
            "gpu-oom",
            ("backoff", "failed"),
            _bound_escalation(),
        ),
        Kind(
            "device-assert-xid43",
            frozenset({"cuda-error"}),
            "cuda-error",
            ("backoff", "ready"),
            _bound_restart(),
        ),
        Kind("hardware-xid48-then-reset", frozenset({"gpu-xid"}), "gpu-xid", ("failed",), 0.0),
        # The GPU falls off the bus under a request: its Xid 79 is logged and the
        # scheduler hangs, alive. The daemon acts on the Xid itself (its stop, a clean
        # exit, may carry it), before any stall is called: a person, the fallback off.
        Kind("hardware-xid79-stall", frozenset({"stopped", "gpu-xid"}), None, ("failed",), 0.0),
        Kind(
            "crash-exit-0",
            frozenset({"cuda-error"}),
            "cuda-error",
            ("backoff", "ready"),
            _bound_restart(),
        ),
        Kind(
            "hang-health-200",
            frozenset({"stopped"}),
            None,
            ("backoff", "ready"),
            max(STALL_AFTER_S, PROBE_FAILURES * (PROBE_INTERVAL_S + PROBE_TIMEOUT_S))
            + STOP_TIMEOUT_S
            + _bound_restart(),
        ),
        Kind(
            "stall-running",
            frozenset({"stopped"}),
            None,
            ("backoff", "ready"),
            STALL_AFTER_S + PROGRESS_S + STOP_TIMEOUT_S + _bound_restart(),
        ),
        Kind(
            "slow-start",
            frozenset({"sigkill", "stopped"}),
            "sigkill",
            ("loading", "backoff", "standby"),
            MAX_FAILURES * (STARTUP_DEADLINE_S + BACKOFF_S[2]) + START_S,
        ),
        Kind("operator-stop-start", frozenset({"stopped"}), None, ("stopped", "ready"), 0.0),
        Kind("daemon-sigkill-restart", frozenset(), None, (), 0.0),
        Kind("sighup-config", frozenset(), None, (), 0.0),
        Kind("jit-after-ready", frozenset(), None, (), 0.0),
        Kind(
            "program-fault-burst",
            frozenset({"cuda-error"}),
            "cuda-error",
            ("backoff", "failed"),
            _bound_escalation(),
        ),
    )
}


def _set_slack(seconds: float) -> None:
    global SLACK_S
    SLACK_S = seconds


def _set_units(tag: str) -> None:
    """Unit names of this run's own: two runs on one host never share a unit name (an
    OOM record names its cgroup, which ends in the unit's name)."""
    global PREFERRED, FALLBACK
    PREFERRED, FALLBACK = f"k26-chaos-{tag}-eagle3.service", f"k26-chaos-{tag}-ar.service"


def table() -> str:
    """KINDS as the markdown table docs/benchmarks.md shows (a test keeps them equal)."""
    rows = [
        "| kind | a death's verdict may be | one death must be | the preferred unit passes "
        "through | nothing serving at most (s, + slack) |",
        "|---|---|---|---|---|",
    ]
    for kind in KINDS.values():
        allowed = ", ".join(f"`{c}`" for c in sorted(kind.allowed)) or "no death"
        states = " → ".join(kind.states) or "stays ready"
        rows.append(
            f"| {kind.name} | {allowed} | {f'`{kind.must}`' if kind.must else 'none'} | "
            f"{states} | {kind.unserved_bound_s:.1f} |"
        )
    return "\n".join(rows) + "\n"


@dataclass
class Violation:
    fault: int
    kind: str
    invariant: str
    evidence: str

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "kind": self.kind, "invariant": self.invariant,
                "evidence": self.evidence}  # fmt: skip


@dataclass
class Lifetime:
    """One daemon process: its fds and RSS after each episode."""

    pid: int
    samples: list[tuple[int, float]] = field(default_factory=list)  # (fds, rss MB)


def fds_rss(pid: int) -> tuple[int, float]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0.0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return fds, rss


class Harness:
    """The sandbox's pair, the daemon, the poller, and the invariants."""

    def __init__(self, info: sandbox.SandboxInfo, work: Path, log: Callable[[str], None]) -> None:
        self.info, self.work, self.say = info, work, log
        self.systemctl = Systemctl(info)
        self.port = free_port()
        self.ports = {PREFERRED: free_port(), FALLBACK: free_port()}
        self.pci = f"00{os.getpid() % 0xFF:02x}:6{os.getpid() % 16:x}:00"
        self.env_file = work / "chaos.env"
        self.config = work / "config.toml"
        self.interval = PROBE_INTERVAL_S
        self.violations: list[Violation] = []
        self.fault, self.kind = 0, "start-up"
        self.lock = threading.Lock()
        self.status: dict[str, Any] = {}
        self.held: set[str] = set()  # stopped by the operator (this harness)
        self.awaiting_reset = False  # a hardware Xid: nothing serves until the reset
        self.proven: dict[tuple[str, int], bool] = {}  # (unit, MainPID) passed coverage
        self.unserved_s = 0.0
        self.episode_unserved = 0.0
        self.episode_states: set[str] = set()  # the preferred unit's, this episode
        self.last_state: dict[str, str] = {}  # each unit's state at the previous poll
        # each unit's (state, since) and the monotonic time the poller first saw it
        self.state_seen: dict[str, tuple[tuple[str, str], float]] = {}
        self.lifetimes: list[Lifetime] = []
        self._stop = threading.Event()
        self.daemon: Daemon | None = None
        self.notify: NotifySink | None = None

    # --- set-up --------------------------------------------------------------

    def write_units(self) -> None:
        for unit, extra in ((PREFERRED, "MemoryMax=200M\nMemorySwapMax=0\n"), (FALLBACK, "")):
            out = self.work / f"{unit}.out"
            caches = self.work / "caches" / unit
            cmd = (
                f"{sys.executable} -m k26dev.standin --port {self.ports[unit]} --fail chaos "
                f"--enable-metrics --xid-pci {self.pci} --no-access-log "
                # SGLang waits 5 s before it kills its tree: 1 s here keeps the faulting
                # scheduler alive while the daemon attributes its Xid (evidence.py).
                "--sigterm-poll-seconds 0.2 --crash-diagnostics-seconds 1.0 "
                "--triton-compile-seconds 0.05 --inductor-compile-seconds 0.3 "
                "--grow-step-mib 16 $CHAOS_FLAGS"
            )
            text = textwrap.dedent(
                f"""\
                [Unit]
                Description=k26 chaos stand-in
                StartLimitIntervalSec=0

                [Service]
                Type=simple
                EnvironmentFile=-{self.env_file if unit == PREFERRED else "/nonexistent"}
                Environment=TRITON_CACHE_DIR={caches}/triton
                Environment=TORCHINDUCTOR_CACHE_DIR={caches}/inductor
                Environment=HOME={caches}
                ExecStart={cmd}
                StandardOutput=append:{out}
                StandardError=inherit
                Restart=no
                KillMode=mixed
                TimeoutStopSec=10
                {extra}"""
            )
            (self.info.unit_dir / unit).write_text(text)
        self.systemctl("daemon-reload")

    def write_config(self) -> None:
        self.config.write_text(
            CONFIG.format(
                port=self.port,
                probe_timeout=PROBE_TIMEOUT_S,
                startup=STARTUP_DEADLINE_S,
                probe_interval=self.interval,
                probe_failures=PROBE_FAILURES,
                stall=STALL_AFTER_S,
                progress=PROGRESS_S,
                b0=BACKOFF_S[0],
                bf=BACKOFF_S[1],
                bmax=BACKOFF_S[2],
                max_failures=MAX_FAILURES,
                window=FAILURE_WINDOW_S,
                preferred=PREFERRED,
                fallback=FALLBACK,
                p_port=self.ports[PREFERRED],
                f_port=self.ports[FALLBACK],
            )
        )

    def start_daemon(self) -> None:
        assert self.notify is not None
        n = len(self.lifetimes)
        self.daemon = Daemon(self.info, self.config, self.notify.path, self.work / f"daemon{n}.log")
        self.lifetimes.append(Lifetime(self.daemon.pid))

    # --- observing ------------------------------------------------------------

    def get_status(self) -> dict[str, Any] | None:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/status", timeout=2).json()  # type: ignore[no-any-return]
        except (httpx.HTTPError, ValueError):
            return None

    def unit(self, name: str) -> dict[str, Any]:
        """The unit as the running daemon last said; nothing while that is not yet
        known (a status read from a daemon killed since is not the new one's word)."""
        with self.lock:
            status, daemon = self.status, self.daemon
        if daemon is None or (status.get("supervisor") or {}).get("pid") != daemon.pid:
            return {}
        return dict((status.get("units") or {}).get(name) or {})

    def violate(self, invariant: str, evidence: str) -> None:
        with self.lock:
            key = (self.fault, invariant)
            if any((v.fault, v.invariant) == key for v in self.violations):
                return
            self.violations.append(Violation(self.fault, self.kind, invariant, evidence))
        self.say(f"VIOLATION fault {self.fault} ({self.kind}): {invariant}: {evidence}")

    def poll(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(POLL_S):
            status = self.get_status()
            now = time.monotonic()
            daemon = self.daemon
            if status is None or daemon is None or status["supervisor"]["pid"] != daemon.pid:
                with self.lock:
                    self.status = {}  # the daemon is down or not yet the new one
                last = now
                continue
            with self.lock:
                self.status = status
            units = status.get("units") or {}
            serving = any(units.get(u, {}).get("state") == "ready" for u in (PREFERRED, FALLBACK))
            if not serving and not self.awaiting_reset and not self.held:
                self.unserved_s += now - last
                self.episode_unserved += now - last
            last = now
            self.episode_states.add(str(units.get(PREFERRED, {}).get("state", "")))
            for name, u in units.items():
                self.check_unit(name, u, now)

    def check_unit(self, name: str, u: dict[str, Any], now: float) -> None:
        pid = u.get("main_pid") or 0
        cov, exit_ = u.get("coverage") or {}, u.get("last_exit") or {}
        if cov.get("ok") and (not exit_ or (cov.get("at") or "") >= (exit_.get("at") or "")):
            self.proven[(name, pid)] = True
        entered = u.get("state") == "ready" and self.last_state.get(name) != "ready"
        self.last_state[name] = str(u.get("state", ""))
        if entered:  # READY must be earned when it is entered; later probes may fail
            probe = u.get("last_probe") or {}
            if not probe.get("ok") or not self.proven.get((name, pid)):
                self.violate(
                    "ready-unproven",
                    f"{name} ready (pid {pid}) with last_probe={probe} coverage={cov.get('at')} "
                    f"after exit at {exit_.get('at')}",
                )
        if name in self.held and u.get("active_state") in ("active", "activating"):
            self.violate("operator-overridden", f"{name} became {u['active_state']} while held")
        since = u.get("since")
        if since:
            # Timed on this process's monotonic clock from when the poller first saw the
            # state: /status's `since` is wall time, and a step of the host's clock (seen
            # in seed 101: +28 s) would make any state look that much older.
            key = (str(u.get("state", "")), str(since))
            seen = self.state_seen.get(name)
            if seen is None or seen[0] != key:
                seen = self.state_seen[name] = (key, now)
            held_s = now - seen[1]
            limits = {"loading": STARTUP_DEADLINE_S, "starting": START_DEADLINE_S,
                      "backoff": BACKOFF_S[2]}  # fmt: skip
            limit = limits.get(u.get("state", ""))
            if limit is not None and held_s > limit + SLACK_S:
                daemon = self.daemon.pid if self.daemon is not None else None
                self.violate(
                    "deadline",
                    f"{name} {u['state']} for {held_s:.1f} s (> {limit} s): since {since}, "
                    f"main_pid {u.get('main_pid')}, daemon {daemon}, restarts {u.get('restarts')}",
                )

    # --- acting -------------------------------------------------------------

    def wait(
        self, what: str, pred: Callable[[], bool], timeout_s: float = EPISODE_DEADLINE_S
    ) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(POLL_S)
        self.violate("deadline", f"waited {timeout_s:g} s for {what}: {self.unit(PREFERRED)}")
        return False

    def state(self, name: str) -> str:
        return str(self.unit(name).get("state", ""))

    def request(self, unit: str, text: str, timeout_s: float = 5.0, **params: Any) -> None:
        """Deliver one request: retried while the server does not accept it yet (a
        restart still under way); once sent, its fate is the fault's."""
        body = {"text": text, "sampling_params": {"max_new_tokens": 2, **params}}
        url = f"http://127.0.0.1:{self.ports[unit]}/generate"
        deadline = time.monotonic() + 20.0
        while True:
            try:
                answer = httpx.post(url, json=body, timeout=timeout_s)
            except httpx.ConnectError:
                answer = None
            except httpx.HTTPError:
                return  # it died under the request, as meant
            if answer is not None and answer.status_code != 503:
                return
            if time.monotonic() > deadline:
                self.violate("deadline", f"{unit} never accepted the fault's request {text!r}")
                return
            time.sleep(POLL_S)

    def background(self, unit: str, text: str) -> None:
        threading.Thread(target=self.request, args=(unit, text, 30.0), daemon=True).start()

    def reset(self) -> None:
        assert self.daemon is not None
        os.kill(self.daemon.pid, signal.SIGUSR1)

    def restore(self) -> None:
        """The pair back to: the preferred unit ready, the fallback down."""
        self.env_file.write_text("")
        self.held.clear()
        for _ in range(3):
            if self.state(PREFERRED) == "ready" and self.state(FALLBACK) != "ready":
                return
            if self.state(PREFERRED) in ("failed", "standby") or self.state(FALLBACK) == "ready":
                self.reset()
            self.wait("the preferred unit ready", lambda: self.state(PREFERRED) == "ready", 30)

    def exits(self) -> Counter[str]:
        try:
            text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return Counter()
        counts: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("k26_unit_exits_total{") and f'unit="{PREFERRED}"' in line:
                labels, _, value = line.rpartition(" ")
                cause = labels.split('cause="', 1)[1].split('"', 1)[0]
                counts[cause] += int(float(value))
        return counts

    def pid(self, unit: str) -> int:
        """The unit's MainPID, waiting for one (never 0: os.kill(0) is our own group)."""
        pid = 0
        deadline = time.monotonic() + 20.0
        while pid <= 1 and time.monotonic() < deadline:
            pid = self.systemctl.main_pid(unit)
            if pid <= 1:
                time.sleep(POLL_S)
        if pid <= 1:
            raise RuntimeError(f"{unit} has no MainPID")
        return pid

    # --- the faults ------------------------------------------------------------

    def play(self, kind: str) -> None:
        p = PREFERRED
        ready_again = lambda: self.state(p) == "ready"  # noqa: E731
        if kind == "sigkill":
            os.kill(self.pid(p), signal.SIGKILL)
        elif kind == "oom-kill":
            self.background(p, "k26-chaos:grow-memory")
        elif kind in ("device-assert-xid43", "crash-exit-0"):
            name = "device-assert" if kind.startswith("device") else "crash-exit-0"
            self.request(p, f"k26-chaos:{name}:43")
        elif kind in ("hardware-xid48-then-reset", "hardware-xid79-stall"):
            self.awaiting_reset = True
            if kind.startswith("hardware-xid48"):
                self.request(p, "k26-chaos:device-assert:48")
            else:
                self.background(p, "k26-chaos:stall:79")
            self.wait("failed, needs a person", lambda: self.state(p) == "failed")
            if self.state(FALLBACK) not in ("stopped", ""):
                self.violate(
                    "verdict", f"the fallback is {self.state(FALLBACK)} after a hardware Xid"
                )
            if not self.unit(p).get("needs_person"):
                self.violate("verdict", "a hardware Xid without needs_person on /status")
            self.awaiting_reset = False
            self.reset()
        elif kind in ("hang-health-200", "stall-running"):
            self.background(p, "k26-chaos:" + ("hang" if kind.startswith("hang") else "stall"))
        elif kind in ("cuda-oom-at-start", "slow-start"):
            flags = (
                "--fail cuda-oom --load-seconds 0.1"
                if kind.startswith("cuda")
                else "--load-seconds 60"
            )
            self.env_file.write_text(f"CHAOS_FLAGS={flags}\n")
            os.kill(self.pid(p), signal.SIGKILL)
            self.wait("failed, the fallback ready",
                      lambda: self.state(p) in ("failed", "standby") and self.state(FALLBACK) == "ready")  # fmt: skip
        elif kind == "operator-stop-start":
            self.systemctl("stop", p)
            held = lambda: self.state(p) == "stopped" and bool(self.unit(p).get("held_by_operator"))  # noqa: E731
            self.wait("held", held)
            self.held.add(p)  # from here on, no start but the operator's
            time.sleep(random.uniform(0.5, 2.0))  # the operator takes a while
            self.held.discard(p)
            self.systemctl("start", p)
        elif kind == "daemon-sigkill-restart":
            assert self.daemon is not None
            before = self.unit(p).get("main_pid")
            os.kill(self.daemon.pid, signal.SIGKILL)
            self.daemon.proc.wait()
            self.start_daemon()
            self.wait("adopted ready", ready_again)
            if self.unit(p).get("main_pid") != before:
                self.violate(
                    "verdict",
                    f"a healthy unit was restarted by the new daemon: {before} -> {self.pid(p)}",
                )
        elif kind == "sighup-config":
            assert self.daemon is not None
            assert self.notify is not None
            before = self.pid(p)
            said = sum("SIGHUP:" in m for m in self.notify.messages)
            self.interval = 1.5 if self.interval == PROBE_INTERVAL_S else PROBE_INTERVAL_S
            self.write_config()
            os.kill(self.daemon.pid, signal.SIGHUP)
            reloaded = lambda: sum("SIGHUP:" in m for m in self.notify.messages) > said  # noqa: E731
            self.wait("the reload said", reloaded, 10)
            if not any("configuration reloaded" in m for m in self.notify.messages[-3:]):
                self.violate("verdict", f"SIGHUP not applied: {self.notify.messages[-3:]}")
            if self.pid(p) != before or self.state(p) != "ready":
                self.violate(
                    "verdict",
                    f"SIGHUP disturbed the unit: {before} -> {self.pid(p)}, {self.state(p)}",
                )
        elif kind == "jit-after-ready":
            # The JIT watch starts with READY, a moment after: a compile before it is set
            # up is not seen (the known edge); wait for it, as traffic would.
            watched = lambda: bool(self.unit(p).get("jit_after_ready", {}).get("watched"))  # noqa: E731
            self.wait("the JIT watch set up", watched, 10)
            before = self.unit(p).get("jit_after_ready", {}).get("count", 0)
            # A kernel variant no request compiled before (traffic's new shape): its
            # files are new paths in the Triton cache, as a real late compile's are.
            self.request(p, f"k26-chaos:compile:{self.fault}")
            self.wait(
                "the compile seen",
                lambda: self.unit(p).get("jit_after_ready", {}).get("count", 0) > before,
                10,
            )
            if self.state(p) != "ready":
                self.violate(
                    "verdict",
                    f"a compile after READY took the unit out: {self.unit(p).get('reason')}",
                )
        elif kind == "program-fault-burst":
            # Faults until the failure budget is spent (earlier episodes may have spent
            # some of it): then failed, and the fallback serves.
            settled = ("ready", "failed", "standby")
            for _ in range(MAX_FAILURES + 1):
                if not self.wait("ready again", lambda: self.state(p) in settled, 30):
                    break
                if self.state(p) != "ready":
                    break
                self.request(p, "k26-chaos:device-assert:43")
                self.wait("the death seen", lambda: self.state(p) != "ready", 10)
            self.wait("failed, the fallback ready",
                      lambda: self.state(p) in ("failed", "standby") and self.state(FALLBACK) == "ready")  # fmt: skip
        if KINDS[kind].must is not None or "backoff" in KINDS[kind].states:
            # Any state but ready (a backoff of 50 ms can fall between two polls).
            self.wait("its death", lambda: bool(self.episode_states - {"ready", ""}), 30)
        self.wait(
            "the preferred unit back",
            lambda: self.state(p) == "ready" or self.state(FALLBACK) == "ready",
        )

    # --- the run ----------------------------------------------------------------

    def run(self, faults: int, seed: int, names: list[str] | None = None) -> dict[str, Any]:
        rng = random.Random(seed)
        random.seed(seed)
        kinds: Counter[str] = Counter()
        deaths: dict[str, list[int]] = {}  # kind -> [allowed, all]
        bounds = 0.0
        poller = threading.Thread(target=self.poll, daemon=True)
        poller.start()
        done = 0
        stopped_early = False
        try:
            self.wait("start-up", lambda: self.state(PREFERRED) == "ready", 60)
            names = names or sorted(KINDS)
            # Every kind once, in a seeded order, then seeded draws: a short run still
            # plays each kind.
            first = rng.sample(names, len(names))
            for n in range(1, faults + 1):
                kind = KINDS[first[n - 1] if n <= len(first) else rng.choice(names)]
                self.restore()
                before = self.exits()
                self.fault, self.kind = n, kind.name
                self.episode_unserved = 0.0
                started = time.monotonic()
                self.episode_states.clear()
                self.play(kind.name)
                after = self.exits()
                # A single fault may land while earlier episodes' failures still fill
                # the window: then it escalates, and the fallback's start is in the bound.
                escalated = bool(self.episode_states & {"failed", "standby"})
                bound = max(kind.unserved_bound_s, _bound_escalation() if escalated else 0.0)
                self.check_states(kind, escalated)
                self.restore()
                self.check_episode(kind, before, after, deaths, escalated)
                kinds[kind.name] += 1
                bounds += bound
                if self.episode_unserved > bound + SLACK_S:
                    self.violate("unserved", f"{self.episode_unserved:.1f} s > {bound:.1f} s")
                self.sample_lifetime()
                done = n
                self.say(f"fault {n}/{faults} {kind.name}: {time.monotonic() - started:.1f} s, "
                         f"unserved {self.episode_unserved:.1f} s")  # fmt: skip
        except SystemExit:  # a signal: report what was played, then tear down
            stopped_early = True
        finally:
            self._stop.set()
            poller.join(timeout=5)
        self.check_leaks()
        return {
            "faults": done,
            "asked": faults,
            "stopped_early": stopped_early,
            "seed": seed,
            "kinds": dict(kinds),
            "violations": [v.to_json() for v in self.violations],
            "unserved_s": round(self.unserved_s, 2),
            "unserved_bound_s": round(bounds + SLACK_S * faults, 2),
            "verdict_accuracy": {k: (a / t if t else None) for k, (a, t) in deaths.items()},
            "daemons": [
                {
                    "pid": lt.pid,
                    "episodes": len(lt.samples),
                    "fds": [lt.samples[0][0], lt.samples[-1][0]] if lt.samples else None,
                    "rss_mb": [round(lt.samples[0][1], 1), round(lt.samples[-1][1], 1)]
                    if lt.samples
                    else None,
                }
                for lt in self.lifetimes
            ],
        }

    def check_episode(
        self,
        kind: Kind,
        before: Counter[str],
        after: Counter[str],
        deaths: dict[str, list[int]],
        escalated: bool = False,
    ) -> None:
        if kind.name == "daemon-sigkill-restart":
            return  # the counters start again with the new daemon
        new = after - before
        tally = deaths.setdefault(kind.name, [0, 0])
        allowed = sum(n for cause, n in new.items() if cause in kind.allowed)
        tally[0] += allowed
        tally[1] += sum(new.values())
        wrong = {c: n for c, n in new.items() if c not in kind.allowed}
        if wrong:
            self.violate("verdict", f"causes {wrong} (allowed: {sorted(kind.allowed)})")
        # A fault whose first death already spent the failure budget hands over at once:
        # the death the kind's own cause would have come from never happens.
        at_once = escalated and sum(new.values()) <= 1
        if kind.must is not None and new[kind.must] < 1 and not at_once:
            self.violate("verdict", f"no {kind.must} death (saw {dict(new)})")

    def check_states(self, kind: Kind, escalated: bool) -> None:
        """The states the kind passes through, as the poller saw them. A backoff (50 ms
        here) can fall between two polls and is not required; failed and standby both
        mean "handed over"; a fault that escalated need show only the hand-over."""
        need = {s for s in kind.states if s != "backoff"}
        seen = set(self.episode_states)
        if seen & {"failed", "standby"}:
            seen |= {"failed", "standby"}
        if escalated:  # it handed over at once: that is all a single fault may show
            need &= {"failed", "standby"}
        missing = need - seen
        if missing:
            self.violate("states", f"never {sorted(missing)}; seen {sorted(seen - {''})}")

    def sample_lifetime(self) -> None:
        if self.daemon is None or self.daemon.proc.poll() is not None:
            return
        lifetime = self.lifetimes[-1]
        with suppress(OSError):
            lifetime.samples.append(fds_rss(lifetime.pid))

    def check_leaks(self) -> None:
        for lt in self.lifetimes:
            if len(lt.samples) < 20:
                continue  # too short a life to tell growth from warm-up
            # The baseline: the most seen in episodes 10-19 of this lifetime (an fd or
            # two come and go with keep-alive connections and inotify watches).
            fd0 = max(f for f, _ in lt.samples[9:19])
            rss0 = max(r for _, r in lt.samples[9:19])
            fd1, rss1 = lt.samples[-1]
            if fd1 > fd0 * 1.05 or rss1 > rss0 * 1.05:
                self.fault, self.kind = -1, "lifetime"
                self.violate(
                    "leak", f"daemon {lt.pid}: fds {fd0} -> {fd1}, RSS {rss0:.1f} -> {rss1:.1f} MB"
                )


@contextmanager
def harness(log: Callable[[str], None], keep: Path | None = None) -> Iterator[Harness]:
    with tempfile.TemporaryDirectory(prefix="k26-chaos-") as tmp:
        work = Path(tmp)
        with sandbox.running(work / "sandbox") as info:
            h = Harness(info, work, log)
            h.write_units()
            h.write_config()
            h.notify = NotifySink(work / "notify.sock")
            h.start_daemon()
            try:
                yield h
            finally:
                if h.daemon is not None:
                    h.daemon.stop()
                h.notify.close()
                for unit in (PREFERRED, FALLBACK):
                    h.systemctl("stop", unit, check=False)
                    h.systemctl("reset-failed", unit, check=False)
                if keep is not None:
                    shutil.copytree(
                        work,
                        keep,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("sandbox", "*.sock"),
                    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    parser.add_argument("--log", type=Path, help="also write the progress lines here")
    parser.add_argument(
        "--kinds", help="comma-separated kinds to draw from (default: all of KINDS)"
    )
    parser.add_argument("--keep", type=Path, help="copy the work folder (logs) here at the end")
    parser.add_argument("--table", action="store_true", help="print KINDS as markdown, and exit")
    parser.add_argument(
        "--slack",
        type=float,
        default=3.0,
        metavar="S",
        help="scheduling noise added to every bound and deadline (default 3 s; "
        "the suite's run, beside other tests on 2 cores, gives more)",
    )
    args = parser.parse_args()
    if args.table:
        print(table(), end="")
        return 0
    sink = open(args.log, "w") if args.log else None  # noqa: SIM115

    def say(line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, file=sys.stderr if args.json else sys.stdout, flush=True)
        if sink is not None:
            sink.write(stamped + "\n")
            sink.flush()

    # A signal ends the run through its teardown (daemon, units, sandbox), not around it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    names = args.kinds.split(",") if args.kinds else None
    unknown = sorted(set(names or ()) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {sorted(KINDS)}")
    _set_slack(args.slack)
    _set_units(f"{os.getpid()}")
    with harness(say, args.keep) as h:
        result = h.run(args.faults, args.seed, names)
    if not args.json:
        say(f"{len(result['violations'])} violations over {args.faults} faults; "
            f"unserved {result['unserved_s']} s (bound {result['unserved_bound_s']} s)")  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
