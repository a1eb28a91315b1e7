"""``k26-dev demo``: the incident, replayed in a systemd sandbox with stand-in units.

Act 1, without the supervisor: the autoregressive unit starts on a cold
FlashInfer cache, SGLang's greedy ``/health_generate`` passes, and the first
sampled request kills it. ``watch`` explains the death.

Act 2, with the real daemon: warm-up (a real FlashInfer precompile when a
serving venv is there), EAGLE-3 OOM-killed by the kernel under ``MemoryMax=``
until the supervisor falls back to the autoregressive unit, which is reported
ready only after a sampled generation.

Act 3: a SIGKILL, explained, and the recovery.

Act 4, the production path: a booted host (systemd as PID 1 of a container,
with the system bus, journald and polkit), the Debian package as on a GPU
server, act 2's build exported as a bundle and imported there with the installed
command (no second nvcc build), and ``systemctl start k26-supervisor``, which
returns only once a sampled generation passed. Then a timeline, and teardown.

Acts 1 to 3 run in a mount namespace of the demo's own, where the booted host's
serving paths exist (``deployed.mirror_booted_paths``: ``/opt/sglang/venv``, the
workspace ``/var/cache/sglang-k26/flashinfer``): a FlashInfer build names its
paths, so only a build made at the booted host's paths is one it can import.
Nothing of that reaches this machine: the namespace ends with the demo.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from k26dev import sandbox, shared_cache
from k26dev.deployed import WORKSPACE
from k26dev.ports import free_port
from supervisor.core.errors import SupervisorError, UnavailableError
from supervisor.core.jit_caches import CACHE_ENV, JitCache
from supervisor.flashinfer import read_env_file

AR = "k26demo-sglang-k26.service"
EAGLE = "k26demo-sglang-k26-eagle3.service"
SAMPLED = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 4}


class Story:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.timeline: list[tuple[float, str]] = []

    def say(self, text: str, *, mark: bool = True) -> None:
        t = time.monotonic() - self.t0
        if mark:
            self.timeline.append((t, text))
        print(f"[{t:7.2f}s] {text}", flush=True)


def _systemctl(info: sandbox.SandboxInfo, *args: str) -> str:
    env = dict(os.environ, **info.env)
    done = subprocess.run(["systemctl", "--user", *args], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise SupervisorError(f"demo: {what} did not happen within {timeout_s:.0f}s")


def _unit_file(name: str, port: int, out: Path, flags: str, extra: str = "") -> str:
    # Every JIT cache pinned, as the shipped units pin them: the stand-in compiles
    # Triton- and inductor-like kernels under traffic, never into anyone's home.
    caches = out.with_suffix(".caches")
    pins = "".join(
        f"Environment={var}={caches / var.lower()}\n"
        for cache, var in CACHE_ENV.items()
        if cache is not JitCache.FLASHINFER  # the shared workspace, below
    )
    return (
        f"[Unit]\nDescription=k26 demo stand-in {name}\n{extra}\n"
        f"[Service]\nType=exec\nExecStart={sys.executable} -m k26dev.standin --port {port} "
        f"--load-seconds 2 --triton-compile-seconds 0.2 --inductor-compile-seconds 1 {flags}\n"
        f"StandardOutput=append:{out}\nStandardError=inherit\n"
        f"Environment=FLASHINFER_WORKSPACE_BASE={WORKSPACE}\n{pins}"
        "Restart=no\nKillMode=mixed\nTimeoutStopSec=10\n"
    )


def _default_serving_python() -> Path:
    return shared_cache.serving_venv("0.7", make=False) / "bin" / "python"


def _serving_python(explicit: Path | None) -> tuple[Path | None, Path | None]:
    python = explicit or _default_serving_python()
    if not python.exists():
        return None, None
    env_file = python.parent.parent / "k26-build.env"
    return python, env_file if env_file.exists() else None


def run_demo(workdir: Path | None, serving_python: Path | None) -> int:
    from k26dev import deployed

    python, env_file = _serving_python(serving_python)
    if python is None:
        # Without it the warm-up cannot fix the sampling crash and the story never ends.
        where = serving_python or _default_serving_python()
        raise UnavailableError(
            f"demo: no serving venv at {where} (FlashInfer 0.7.4, for the real warm-up); "
            "run `scripts/dev.sh demo`, which sets it up and runs the demo"
        )
    venv = python.parent.parent
    story = Story()
    base = workdir or Path(tempfile.mkdtemp(prefix="k26-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    story.say(f"workdir {base}", mark=False)
    # The booted host's serving paths, in a mount namespace of the demo's own, so
    # that act 4 can import act 2's build instead of building it again.
    deployed.enter_private_mount_namespace()
    build_env = deployed.mirror_booted_paths(
        venv, read_env_file(env_file) if env_file is not None else {}
    )
    env_file = base / "build.env"
    env_file.write_text(deployed.env_file_text(build_env))
    python = Path(deployed.SERVING) / "bin" / "python"
    workspace = Path(deployed.WORKSPACE)
    bundle = base / "sampling.k26bundle.tar.gz"
    with sandbox.running(base / "sandbox") as info:
        os.environ.update(info.env)
        story.say(f"systemd sandbox {info.name} is up (a real user manager, confined)")
        # Each port distinct (free_port never hands one out twice): the daemon's
        # status port must not come back as a unit's.
        ar_port, eagle_port, listen = free_port(), free_port(), free_port()
        ports = {AR: ar_port, EAGLE: eagle_port}
        outs = {u: base / f"{u}.log" for u in ports}
        (info.unit_dir / AR).write_text(
            _unit_file(
                AR,
                ports[AR],
                outs[AR],
                f"--fail sampling-arch --flashinfer-cache {workspace}",
                f"Conflicts={EAGLE}",
            )
        )
        (info.unit_dir / EAGLE).write_text(
            _unit_file(
                EAGLE,
                ports[EAGLE],
                outs[EAGLE],
                "--fail grow-memory --grow-step-mib 8",
                f"Conflicts={AR}\n",
            )
            + "MemoryMax=160M\nMemorySwapMax=0\n"
        )
        _systemctl(info, "daemon-reload")
        act1(story, info, ports[AR])
        act2_and_3(story, info, base, ports, listen, workspace, python, env_file)
        export_bundle(story, python, workspace, env_file, bundle)
    story.say(
        "sandbox torn down; no k26sbx cgroup left"
        if not [p for p in sandbox.leftovers() if p.name == info.name]
        else "WARNING: cgroups left"
    )
    act4(story, base, venv, bundle)
    print("\nTimeline")
    for t, text in story.timeline:
        print(f"  {t:7.2f}s  {text}")
    return 0


def act1(story: Story, info: sandbox.SandboxInfo, port: int) -> None:
    story.say("ACT 1 - no supervisor: the operator starts the autoregressive unit on a cold cache")
    env = dict(os.environ, **info.env)
    watch = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "watch", "--bus", "user", "--count", "1", AR],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watch.stderr is not None and watch.stdout is not None
    watch.stderr.readline()  # "watching ..." once it has subscribed
    _systemctl(info, "start", AR)
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: _get(url + "/health") == 200, 30, "the stand-in to load")
    story.say(
        "unit loaded; SGLang's /health_generate (greedy, temperature 0) -> "
        f"HTTP {_get(url + '/health_generate')}: looks healthy"
    )
    try:
        httpx.post(
            url + "/generate", json={"text": "Hello", "sampling_params": SAMPLED}, timeout=10
        )
        story.say("sampled request answered (unexpected)")
    except httpx.HTTPError as exc:
        story.say(
            f"first sampled request (temperature 0.7, top_k 20, top_p 0.8): {type(exc).__name__}"
        )
    record = json.loads(watch.stdout.readline())
    watch.wait(timeout=10)
    story.say(f"watch: {AR} died, cause={record['cause']}: {record['summary']}")
    for line in record["evidence"][-3:]:
        print(f"            evidence: {line}")
    _systemctl(info, "reset-failed", AR)


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def act2_and_3(
    story: Story,
    info: sandbox.SandboxInfo,
    base: Path,
    ports: dict[str, int],
    listen: int,
    workspace: Path,
    python: Path,
    env_file: Path | None,
) -> None:
    fi = (
        f'[flashinfer]\nenabled = true\npython = "{python}"\narch = "12.0"\n'
        f'workspace = "{workspace}"\ntimeout_s = 900\n'
    ) + (f'env_file = "{env_file}"\n' if env_file else "")
    config = base / "config.toml"
    config.write_text(
        f'[supervisor]\nbus = "user"\nlisten = "127.0.0.1:{listen}"\njob_timeout_s = 60\n\n{fi}\n'
        "[probe]\ntimeout_s = 5\nstartup_deadline_s = 60\ninterval_s = 2\n\n"
        "[restart]\nbackoff_initial_s = 1\nbackoff_max_s = 4\nmax_failures = 5\n\n"
        "[fallback]\noom_exits = 2\nwindow_s = 300\nretry_preferred_after_s = 0\n\n"
        f'[[units]]\nname = "{EAGLE}"\nrole = "eagle3"\nurl = "http://127.0.0.1:{ports[EAGLE]}"\n'
        f'fallback = "{AR}"\n\n'
        f'[[units]]\nname = "{AR}"\nrole = "autoregressive"\nurl = "http://127.0.0.1:{ports[AR]}"\n'
    )
    story.say(
        f"ACT 2 - k26-supervisor run (the real daemon); status at http://127.0.0.1:{listen}/status"
    )
    story.say(f"FlashInfer warm-up is real: {python} builds 'sampling' for 12.0 with nvcc")
    notify_path = base / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.setblocking(False)
    log = open(base / "supervisor.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
        env=dict(os.environ, **info.env, NOTIFY_SOCKET=str(notify_path)),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    watcher = StatusWatcher(story, f"http://127.0.0.1:{listen}/status", notify, daemon)
    try:
        watcher.until(
            lambda s: (
                s["units"][EAGLE]["state"] == "standby"
                and s["units"][AR]["state"] == "ready"
                and watcher.ready_sent
            ),
            900,
            "fallback to the autoregressive unit, ready after a sampled probe",
        )
        story.say("ACT 3 - SIGKILL of the autoregressive unit's main process")
        pid = int(_systemctl(info, "show", "-p", "MainPID", "--value", AR) or 0)
        if pid <= 0:
            raise SupervisorError("demo: the autoregressive unit has no main PID")
        restarts = watcher.last["units"][AR]["restarts"]
        os.kill(pid, signal.SIGKILL)
        watcher.until(
            lambda s: s["units"][AR]["state"] == "ready" and s["units"][AR]["restarts"] > restarts,
            300,
            "recovery after SIGKILL",
        )
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        log.close()
        notify.close()
        story.say("supervisor stopped with SIGTERM (managed units left running, as designed)")


class StatusWatcher:
    """Turns /status changes and sd_notify messages into story lines."""

    def __init__(
        self, story: Story, url: str, notify: socket.socket, daemon: subprocess.Popen[bytes]
    ) -> None:
        self.story, self.url, self.notify, self.daemon = story, url, notify, daemon
        self.last: dict[str, Any] = {}
        self.ready_sent = False

    def until(self, pred: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise SupervisorError("demo: the supervisor exited; see supervisor.log")
            self._notify()
            try:
                status = httpx.get(self.url, timeout=5).json()
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            self._diff(status)
            if pred(status):
                return
            time.sleep(0.1)
        raise SupervisorError(f"demo: {what} did not happen within {timeout_s:.0f}s")

    def _notify(self) -> None:
        while True:
            try:
                msg = self.notify.recv(65536).decode()
            except BlockingIOError:
                return
            if "READY=1" in msg and not self.ready_sent:
                self.ready_sent = True
                self.story.say("systemd got READY=1 (only now: a sampled generation passed)")

    def _diff(self, status: dict[str, Any]) -> None:
        old = self.last
        w_old, w_new = (old.get("warmup") or {}), (status.get("warmup") or {})
        if w_new and w_new.get("state") != w_old.get("state"):
            self.story.say(
                f"warm-up {w_new.get('state')}"
                + (f": {w_new['error']}" if w_new.get("error") else "")
            )
        for name, unit in status["units"].items():
            prev = (old.get("units") or {}).get(name, {})
            short = name.removeprefix("k26demo-")
            if unit["state"] != prev.get("state"):
                self.story.say(f"{short}: {prev.get('state', '-')} -> {unit['state']}")
            ex, pex = unit.get("last_exit"), prev.get("last_exit")
            if ex and ex != pex:
                evidence = [
                    e for e in ex["evidence"] if "oom" in e.lower() or "Killed" in e or "sm75" in e
                ]
                self.story.say(
                    f"{short} exited: cause={ex['cause']}"
                    + (f" | {evidence[-1][:110]}" if evidence else "")
                )
            pr, ppr = unit.get("last_probe"), prev.get("last_probe")
            if pr and (not ppr or pr["at"] != ppr["at"]) and (not ppr or pr["ok"] != ppr["ok"]):
                self.story.say(
                    f"{short}: sampled probe "
                    + (f"ok in {pr['latency_ms']:.1f} ms" if pr["ok"] else f"failed: {pr['error']}")
                )
        self.last = status


def export_bundle(story: Story, python: Path, workspace: Path, env_file: Path, out: Path) -> None:
    """Act 2's warmed cache as one archive, for act 4's booted host."""
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "flashinfer", "bundle", "export",
         *_cache_args(python, workspace, env_file), "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SupervisorError(f"demo: bundle export failed: {done.stderr.strip()}")
    made = json.loads(done.stdout)
    story.say(
        f"bundle export: act 2's warmed cache, {made['size_bytes'] / 1e6:.1f} MB, "
        f"modules {', '.join(made['modules'])}, in {made['duration_s']:.2f} s"
    )


def _cache_args(python: Path | str, workspace: Path | str, env_file: Path | str) -> list[str]:
    return [
        "--python", str(python), "--arch", "12.0", "--workspace", str(workspace),
        "--env-file", str(env_file),
    ]  # fmt: skip


def act4(story: Story, base: Path, venv: Path, bundle: Path) -> None:
    import shutil

    from k26dev import bootedhost
    from k26dev.deployed import AR as PROD_AR
    from k26dev.deployed import EAGLE as PROD_EAGLE
    from k26dev.deployed import SERVING, SUPERVISOR, WORKSPACE, Product, boot_binds

    story.say(
        "ACT 4 - the production path: a booted host, apt install of the .deb, systemctl start"
    )
    env = read_env_file(venv / "k26-build.env")
    with bootedhost.running(base / "host", binds_ro=boot_binds(venv)) as host:
        story.say(
            f"booted host {host.name}: systemd is PID 1, with dbus, journald, logind and "
            f"polkitd (booted in {host.boot_s:.1f} s)"
        )
        product = Product(host, venv, env)
        product.make_serving_venv()
        done = product.install()
        summary = [ln for ln in done.stdout.splitlines() if ln.startswith("k26-supervisor units: ")]
        story.say(
            f"apt install ./k26-supervisor_*.deb, then units configure: {(summary or ['?'])[-1]}"
        )
        product.configure()
        for unit in (PROD_EAGLE, PROD_AR):
            product.standin_args(unit)
        shutil.copy(bundle, host.path("/root/act2.k26bundle.tar.gz"))
        installed = "/opt/k26-supervisor/venv/bin/k26-supervisor"
        imported = host.run(
            installed, "flashinfer", "bundle", "import",
            *_cache_args(f"{SERVING}/bin/python", WORKSPACE, "/etc/k26-supervisor/build.env"),
            "/root/act2.k26bundle.tar.gz", "--json", check=False, timeout_s=300,
        )  # fmt: skip
        if imported.returncode == 0:
            took_s = json.loads(imported.stdout)["duration_s"]
            story.say(
                f"flashinfer bundle import (the installed command): act 2's build in {took_s:.2f} s, "
                "checked against this host's serving venv: no nvcc build here"
            )
        else:  # honest: then the booted host builds it itself, as a cold node would
            story.say(f"bundle refused ({imported.stderr.strip()}); the warm-up will build")
        story.say(
            "systemctl start k26-supervisor: the warm-up verifies the cache for 12.0 as user "
            "k26-supervisor under ProtectSystem=strict, then the units, then a sampled probe"
        )
        started, took = product.start_supervisor(timeout_s=1200)
        if started.returncode != 0:
            raise SupervisorError(f"demo: systemctl start k26-supervisor failed: {started.stderr}")
        status = product.status()
        eagle = status["units"][PROD_EAGLE]
        story.say(
            f"systemctl start returned after {took:.0f} s, once READY=1 came: "
            f"{PROD_EAGLE} {eagle['state']}, sampled probe {eagle['last_probe']['latency_ms']:.0f} ms"
        )
        shown = host.systemctl("show", "-p", "StatusText", "--value", SUPERVISOR)
        story.say(f"systemctl status k26-supervisor says: {shown}")
        denied = host.run(
            "runuser", "-u", "k26-supervisor", "--", "systemctl", "reset-failed", PROD_EAGLE,
            check=False,
        )  # fmt: skip
        story.say(
            "polkit, for real: k26-supervisor may start/stop/restart the two units, nothing "
            f"else (reset-failed: {(denied.stderr.strip().splitlines() or ['?'])[-1]})"
        )
    # Only this host's: another booted host (a test session's, a user's) is not ours.
    story.say(
        "booted host powered off; no k26host cgroup left"
        if not [p for p in bootedhost.leftovers() if p.name == host.name]
        else f"WARNING: cgroups of {host.name} left"
    )
