"""The daemon supervising a real SGLang, in the project's sandbox, in one run.

    python3 bench/gpu/supervise_real_sglang.py --out DIR [--deadline-s 550]
    python3 bench/gpu/supervise_real_sglang.py --out DIR --server standin   (a CPU rehearsal)

On the lent GPU host: after ``bash bench/gpu/kit_setup.sh && . /tmp/k26kit/env.sh``
(the carried SGLang site, Debian's systemd and dbus as a kit, the daemon's
wheels). It brings up ``k26-dev sandbox`` on the host's single cgroup2
hierarchy, installs two user units and runs the real ``k26-supervisor run``:

- ``k26-eagle-hog.service`` (role eagle3): a small host-memory hog under
  ``MemoryMax=64M``, shaped like SGLang (a launcher whose worker holds the
  memory). The kernel OOM killer kills the worker; systemd's ``OOMPolicy=stop``
  stops the rest and says ``Result=oom-kill``; two such exits engage the fallback;
- ``sglang-k26.service`` (role autoregressive, the fallback): the real
  ``python -m sglang.launch_server`` with a tiny random Llama.

Then, in order, each with a deadline: the FlashInfer warm-up (``norm`` and
``sampling`` for 9.0) before the first start; the hog's two OOM kills, its
standby and the fallback's start; READY only after the sampled probe, and no
FlashInfer JIT in the server (module mtimes before and after); SIGKILL of the
``sglang::scheduler`` child, classified and recovered; ``systemctl --user stop``
respected. Writes DIR/supervise_real_sglang.json and DIR/supervise-logs.tar.gz.

``--server standin`` runs the same plan on a CPU machine against the stand-in
(``devtools/k26dev/standin/sglang_shim``) in a serving venv of the project,
under the same emulated single-cgroup2 layout as tests/integration/test_sandbox.py,
so the script itself is rehearsed before device time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The development tools (k26dev: the sandbox, the stand-in) are a distribution of their
# own in devtools/: a checkout without the editable install (the GPU host) finds them on
# PYTHONPATH, as ``python -m supervisor`` finds the daemon in the working directory.
DEVTOOLS = ROOT / "devtools"
SHIM = DEVTOOLS / "k26dev" / "standin" / "sglang_shim"
# The stand-in's units: SGLang's name (the shim), k26dev and the daemon's core.
STANDIN_PYTHONPATH = f"{SHIM}:{ROOT}:{DEVTOOLS}"
SGLANG_PORT = 30000
SUPERVISOR_PORT = 9436
REAL_FLAGS = (
    "--load-format dummy --attention-backend triton --sampling-backend ${SGLANG_SAMPLING_BACKEND} "
    "--grammar-backend none --cuda-graph-backend-decode disabled "
    "--cuda-graph-backend-prefill disabled --mem-fraction-static 0.05 --max-total-tokens 8192 "
    "--context-length 1024 --skip-server-warmup --enable-metrics "
    f"--host 127.0.0.1 --port {SGLANG_PORT}"
)
# The stand-in behind the same flags (devtools/k26dev/standin/sglang_shim), with
# the real server's timings as seen on the H200 scaled down: load, cold JIT builds.
STANDIN_ARGS = "--load-seconds 3 --cold-norm-seconds 20 --cold-sampling-seconds 20"
# Host memory, 16 MiB a step, capped at 1 GiB: MemoryMax=64M ends it long before; on
# a host where the limit is not enforced it stops there rather than eat the machine.
# As in SGLang, the memory is a worker's, not the launcher's: the kernel kills the
# worker, and the launcher lives on until systemd's OOMPolicy=stop takes the unit
# down with Result=oom-kill (were the main process the victim, its SIGCHLD could
# reach systemd before the cgroup's OOM event, and systemd 252 says Result=signal).
# Like SGLang's launcher it SIGKILLs itself 5 s after its worker died: were systemd's
# OOM watch missing, the exit would still come (Result=signal), and the run go on.
HOG = (
    "import os, signal, time\npid = os.fork()\nif pid == 0:\n    chunks = []\n"
    "    for _ in range(64):\n        chunks.append(bytearray(16 << 20))\n        time.sleep(0.01)\n"
    "    print('hog worker: 1 GiB held, no limit enforced', flush=True)\n    time.sleep(3600)\n"
    "    os._exit(0)\n"
    "print(f'hog launcher: worker pid {pid} allocating', flush=True)\n"
    "_, status = os.waitpid(pid, 0)\n"
    "print(f'hog launcher: worker ended ({status}); 5 s, then SIGKILL of itself', flush=True)\n"
    "time.sleep(5)\nos.kill(os.getpid(), signal.SIGKILL)\n"
)


def http_json(url: str, timeout: float = 5.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return None


def modules(workspace: Path) -> dict[str, float]:
    """Every FlashInfer JIT module in the workspace, with its .so's mtime."""
    found = {}
    for so in workspace.glob(".cache/flashinfer/*/*/cached_ops/*/*.so"):
        found[f"{so.parent.parent.parent.name}/{so.parent.name}"] = so.stat().st_mtime
    return found


def scheduler_of(pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            cmd = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and cmd.startswith(b"sglang::scheduler"):
            return int(entry.name)
    return None


def serving_venv(
    server: str, work: Path, carried_site: Path, env: dict[str, str]
) -> tuple[Path, list[str]]:
    """A serving venv and the sys.path it was given: the real one is the image's
    python3 with the carried site on a .pth (no registry there); the stand-in's is
    the project's serving-0.7."""
    if server == "standin":
        from k26dev import shared_cache

        return shared_cache.serving_venv("0.7") / "bin" / "python", []
    venv = work / "sv"
    base = Path(os.path.realpath(shutil.which("python3") or sys.executable))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(base)
    # FlashInfer 0.6's build_and_load runs ninja on every load, warm or not (a no-op
    # when warm): a serving venv has it in bin/ (pip's ninja), and so does this one.
    ninja = shutil.which("ninja", path=env.get("PATH"))
    if ninja:
        (venv / "bin" / "ninja").symlink_to(os.path.realpath(ninja))
    (venv / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = true\n")
    site = venv / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    # Everything the image's python sees as the bench was started (the carried
    # site, the image's own PYTHONPATH and dist-packages), less the daemon's wheels.
    # (python3 there is /opt/torch/.venv's: ask it, not the interpreter it links to.)
    image_python = shutil.which("python3") or sys.executable
    found = subprocess.run(
        [image_python, "-c", "import sys; print('\\n'.join(sys.path))"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    pylib = os.environ.get("K26_PYLIB", "/tmp/k26-pylib")
    paths = [str(carried_site)] + [
        p for p in found.stdout.split("\n") if p and not p.startswith(pylib) and ".zip" not in p
    ]
    (site / "k26-carried-site.pth").write_text("\n".join(paths) + "\n")
    return venv / "bin" / "python", paths


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.work: Path = args.work
        self.logs = self.work / "logs"
        self.result: dict[str, Any] = {"server": args.server, "steps": {}, "timeline": []}
        self.sbx = self.work / "sandbox"
        self.env = dict(os.environ)
        self.daemon: subprocess.Popen[bytes] | None = None

    # --- plumbing -------------------------------------------------------------------

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def mark(self, what: str, **extra: Any) -> None:
        entry = {"t_s": round(time.monotonic() - self.t0, 2), "what": what, **extra}
        self.result["timeline"].append(entry)
        print(f"[{entry['t_s']:7.2f}] {what} {extra if extra else ''}", flush=True)

    def cli(
        self, *args: str, check: bool = True, timeout: float = 60, module: str = "supervisor"
    ) -> str:
        """``k26-supervisor`` (``module="k26dev"``: ``k26-dev``) with ``args``."""
        done = subprocess.run(
            [sys.executable, "-m", module, *args],
            env=self.dev_env() if module == "k26dev" else self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"python -m {module} {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def dev_env(self) -> dict[str, str]:
        """``self.env`` with devtools/ on PYTHONPATH, for ``python -m k26dev`` where no
        editable install provides it (the GPU host runs the checkout as it is)."""
        path = [str(DEVTOOLS), *filter(None, [self.env.get("PYTHONPATH")])]
        return {**self.env, "PYTHONPATH": os.pathsep.join(path)}

    def systemctl(self, *args: str) -> str:
        done = subprocess.run(
            ["systemctl", "--user", *args], env=self.env, capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()

    def prop(self, unit: str, name: str) -> str:
        return self.systemctl("show", "-p", name, "--value", unit)

    def status(self) -> dict[str, Any] | None:
        found = http_json(f"http://127.0.0.1:{SUPERVISOR_PORT}/status")
        return found if isinstance(found, dict) else None

    def wait(
        self,
        what: str,
        pred: Callable[[dict[str, Any]], Any],
        limit_s: float,
        failed: str | None = None,
    ) -> Any:
        """Poll /status until ``pred`` holds (returns it) or the time runs out (None);
        also None at once when unit ``failed`` is in state failed."""
        deadline = time.monotonic() + min(limit_s, self.left())
        while time.monotonic() < deadline:
            if self.daemon is not None and self.daemon.poll() is not None:
                self.mark(f"daemon exited while waiting for {what}", rc=self.daemon.returncode)
                return None
            status = self.status()
            if status is not None:
                value = pred(status)
                if value:
                    self.mark(what)
                    return value
                unit = status.get("units", {}).get(failed or "", {})
                if unit.get("state") == "failed":
                    self.mark(f"{failed} failed while waiting for {what}", unit=unit)
                    return None
            time.sleep(0.25)
        self.mark(f"timed out waiting for {what}", last=self.status())
        return None

    # --- set-up ---------------------------------------------------------------------

    def serving_venv(self) -> Path:
        python, paths = serving_venv(self.args.server, self.work, self.args.site, self.env)
        if paths:
            self.result["serving_sys_path"] = paths
        return python

    def units(
        self, python: Path, unit_dir: Path, workspace: Path, model: Path, memory: bool
    ) -> None:
        caches = self.work / "caches"
        cuda_home = self.env.get("CUDA_HOME", "")
        exec_start = f"{python} -m sglang.launch_server --model-path {model} {REAL_FLAGS}"
        # The manager's PYTHONPATH (the daemon's packages) is not the server's.
        extra = "UnsetEnvironment=PYTHONPATH\n"
        if self.args.server == "standin":
            extra = (
                f"Environment=PYTHONPATH={STANDIN_PYTHONPATH}\n"
                f'Environment="K26_STANDIN_ARGS={STANDIN_ARGS}"\n'
            )
        (unit_dir / "sglang-k26.service").write_text(
            textwrap.dedent(
                f"""\
                [Unit]
                Description=real SGLang (tiny Llama) under k26-supervisor
                Conflicts=k26-eagle-hog.service
                [Service]
                Type=exec
                ExecStart={exec_start}
                Restart=no
                KillMode=mixed
                TimeoutStopSec=60
                OOMPolicy=stop
                Environment=PYTHONUNBUFFERED=1
                Environment=PATH={python.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin
                Environment=CUDA_HOME={cuda_home}
                Environment=FLASHINFER_WORKSPACE_BASE={workspace}
                Environment=FLASHINFER_CUDA_ARCH_LIST={self.args.arch}
                Environment=TORCH_CUDA_ARCH_LIST={self.args.arch}
                Environment=TRITON_CACHE_DIR={caches}/triton
                Environment=TVM_FFI_CACHE_DIR={caches}/tvm-ffi
                Environment=SGLANG_SAMPLING_BACKEND=flashinfer
                EnvironmentFile=-%t/k26-supervisor/sampling/%n.env
                """
            )
            + extra
            + f"StandardOutput=append:{self.logs}/sglang-k26.log\nStandardError=inherit\n"
        )
        hog = self.work / "hog.py"
        hog.write_text(HOG)
        if memory:  # the kernel OOM killer under MemoryMax=: Result=oom-kill
            body = (
                f"ExecStart={sys.executable} -u {hog}\nMemoryAccounting=yes\nMemoryMax=64M\n"
                "MemorySwapMax=0\nOOMPolicy=stop\n"
            )
        else:  # no memory controller (the CPU rehearsal): the stand-in's CUDA OOM instead
            body = (
                f"ExecStart={python} -m sglang.launch_server --model-path {model} {REAL_FLAGS}\n"
                f"Environment=PYTHONPATH={STANDIN_PYTHONPATH}\n"
                "Environment=SGLANG_SAMPLING_BACKEND=flashinfer\n"
                'Environment="K26_STANDIN_ARGS=--fail cuda-oom --crash-diagnostics-seconds 0.2"\n'
            )
        (unit_dir / "k26-eagle-hog.service").write_text(
            "[Unit]\nDescription=in the EAGLE-3 unit's place: a unit that runs out of memory\n"
            "After=sglang-k26.service\n[Service]\nType=exec\nRestart=no\n"
            + body
            + ("UnsetEnvironment=PYTHONPATH\n" if memory else "")
            + f"StandardOutput=append:{self.logs}/k26-eagle-hog.log\nStandardError=inherit\n"
        )

    def config(self, python: Path, workspace: Path) -> Path:
        env_file = self.work / "build.env"
        if self.args.server == "standin":  # the serving venv's own (a stub libcuda, CPATH)
            shutil.copy(python.parent.parent / "k26-build.env", env_file)
        else:
            keys = ("CUDA_HOME", "PATH")
            env_file.write_text("".join(f"{k}={self.env[k]}\n" for k in keys if self.env.get(k)))
        path = self.work / "supervisor.toml"
        modules_list = ", ".join(f'"{m}"' for m in self.args.modules)
        path.write_text(
            textwrap.dedent(
                f"""\
                [supervisor]
                bus = "user"
                listen = "127.0.0.1:{SUPERVISOR_PORT}"
                job_timeout_s = 90
                resync_interval_s = 10

                [flashinfer]
                python = "{python}"
                arch = "{self.args.arch}"
                workspace = "{workspace}"
                modules = [{modules_list}]
                timeout_s = 400
                env_file = "{env_file}"

                [probe]
                timeout_s = 120
                startup_deadline_s = 300
                interval_s = 15
                failures_to_fail = 3

                [restart]
                backoff_initial_s = 1
                backoff_max_s = 4
                max_failures = 6
                failure_window_s = 600

                [fallback]
                oom_exits = 2
                window_s = 600
                retry_preferred_after_s = 0

                [[units]]
                name = "k26-eagle-hog.service"
                role = "eagle3"
                url = "http://127.0.0.1:{SGLANG_PORT}"
                fallback = "sglang-k26.service"

                [[units]]
                name = "sglang-k26.service"
                role = "autoregressive"
                url = "http://127.0.0.1:{SGLANG_PORT}"
                """
            )
        )
        return path

    # --- the run --------------------------------------------------------------------

    def go(self) -> None:
        steps = self.result["steps"]
        self.logs.mkdir(parents=True)
        model = self.work / "model"
        if self.args.server == "real" and not (model / "config.json").exists():
            subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(model)], check=True)
        workspace = self.args.workspace or self.work / "flashinfer"
        python = self.serving_venv()
        self.mark("serving venv", python=str(python))
        pid1_before = Path("/proc/1/cgroup").read_text()
        up = self.cli("sandbox", "up", "--dir", str(self.sbx), module="k26dev")
        for line in up.splitlines():
            if line.startswith("export "):
                key, _, value = line.removeprefix("export ").partition("=")
                self.env[key] = value.strip("'")
        info = json.loads((self.sbx / "sandbox.json").read_text())
        name = info["name"]
        controllers = Path(f"/sys/fs/cgroup/{name}/cgroup.subtree_control")
        steps["sandbox"] = {
            "layout": info.get("layout"),
            "name": name,
            "subtree_control": controllers.read_text().split() if controllers.exists() else None,
            "systemd": str(Path(self.env["K26_SYSTEMD_KIT"]) / "bin" / "systemd")
            if self.env.get("K26_SYSTEMD_KIT")
            else "/usr/lib/systemd/systemd",
        }
        self.mark("sandbox up", **steps["sandbox"])
        unit_dir = Path(self.env["XDG_RUNTIME_DIR"]) / "systemd" / "user"
        memory = "memory" in (steps["sandbox"]["subtree_control"] or [])
        self.units(python, unit_dir, workspace, model, memory)
        self.systemctl("daemon-reload")
        config = self.config(python, workspace)
        check = self.cli("check-config", str(config), check=False)
        self.mark("config", check=check.strip().splitlines()[:1])
        started = time.monotonic()
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
            env=self.env,
            stdout=open(self.logs / "supervisor.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        self.mark("daemon started", pid=self.daemon.pid)
        try:
            self.plan(steps, workspace, started)
        finally:
            self.teardown(steps, pid1_before, name)

    def plan(self, steps: dict[str, Any], workspace: Path, started: float) -> None:
        units = lambda s: s.get("units", {})  # noqa: E731
        hog, ar = "k26-eagle-hog.service", "sglang-k26.service"

        # 1. Warm-up before the first start (norm and sampling, cold: real builds).
        warm = self.wait(
            "first warm-up done",
            lambda s: (
                (s.get("warmup") or {}).get("state") in {"warm", "ok", "done", "failed"}
                and s["warmup"]
            ),
            self.args.warm_limit_s,
        )
        steps["warmup"] = {
            "status": warm,
            "s": round(time.monotonic() - started, 1),
            "modules_after": modules(workspace),
        }
        # 2. The hog's OOM kills engage the fallback.
        standby = self.wait(
            "eagle3 unit in standby, fallback engaged",
            lambda s: units(s).get(hog, {}).get("state") == "standby" and units(s)[hog],
            90,
            failed=hog,
        )
        steps["oom_fallback"] = {
            "hog": standby,
            "systemd_result": self.prop(hog, "Result"),
            "n_restarts": self.prop(hog, "NRestarts"),
        }
        # 3. The fallback: warm, start, READY only after the sampled probe.
        before = modules(workspace)
        t_start = time.monotonic()
        ready = self.wait(
            "sglang-k26 ready",
            lambda s: units(s).get(ar, {}).get("ready") and units(s)[ar],
            self.args.start_limit_s,
            failed=ar,
        )
        after = modules(workspace)
        steps["first_ready"] = {
            "status": ready,
            "s_since_standby": round(time.monotonic() - t_start, 1),
            "modules_before_start": before,
            "modules_after_ready": after,
            "jit_in_server": sorted(k for k in after if after[k] != before.get(k)),
            "jit_lines_in_server_log": self.jit_lines(),
        }
        if not ready:
            return
        # 4. SIGKILL the scheduler: classified, then recovered (warm-up, restart, probe).
        main_pid = int(self.prop(ar, "MainPID") or 0)
        sched = scheduler_of(main_pid)
        self.mark("scheduler", main_pid=main_pid, scheduler=sched)
        if sched is None:
            steps["scheduler_kill"] = {"error": "no sglang::scheduler child found"}
        else:
            restarts = units(ready).get(ar, ready).get("restarts", 0)
            os.kill(sched, signal.SIGKILL)
            t_kill = time.monotonic()
            seen = self.wait(
                "the exit classified",
                lambda s: (
                    (units(s)[ar].get("last_exit") or {}).get("main_pid") == main_pid
                    and units(s)[ar]
                ),
                60,
            )
            systemd_then = {k: self.prop(ar, k) for k in ("Result", "ExecMainStatus")}
            again = self.wait(
                "ready again after the restart",
                lambda s: (
                    units(s)[ar].get("ready")
                    and units(s)[ar].get("restarts", 0) > restarts
                    and units(s)[ar]
                ),
                self.args.start_limit_s,
                failed=ar,
            )
            steps["scheduler_kill"] = {
                "scheduler_pid": sched,
                "exit": (seen or {}).get("last_exit"),
                "systemd": systemd_then,
                "recovered_s": round(time.monotonic() - t_kill, 1) if again else None,
                "status_after": again,
            }
        # 5. The operator's stop is respected: no restart.
        t_stop = time.monotonic()
        self.systemctl("stop", ar)
        held = self.wait(
            "held by the operator",
            lambda s: units(s)[ar].get("held_by_operator") and units(s)[ar],
            90,
        )
        time.sleep(min(10.0, max(0.0, self.left() - 20)))  # a restart would show in this time
        steps["operator_stop"] = {
            "stop_s": round(time.monotonic() - t_stop, 1),
            "status": held,
            "status_10s_later": (self.status() or {}).get("units", {}).get(ar),
            "active_state": self.prop(ar, "ActiveState"),
            "systemd": {k: self.prop(ar, k) for k in ("Result", "ExecMainStatus")},
        }

    def jit_lines(self) -> list[str]:
        log = self.logs / "sglang-k26.log"
        if not log.exists():
            return []
        words = ("ninja", "Compiling", "JIT-building", "build_and_load", "nvcc")
        lines = log.read_text(errors="replace").splitlines()
        return [ln[:200] for ln in lines if any(w in ln for w in words)][:20]

    def teardown(self, steps: dict[str, Any], pid1_before: str, name: str) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        explain = self.cli("explain", "--help", check=False)
        steps["explain_available"] = bool(explain)
        down = subprocess.run(
            [sys.executable, "-m", "k26dev", "sandbox", "down", "--dir", str(self.sbx)],
            env=self.dev_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        steps["teardown"] = {
            "down_rc": down.returncode,
            "down": (down.stdout + down.stderr).strip()[-500:],
            "pid1_unchanged": Path("/proc/1/cgroup").read_text() == pid1_before,
            "left": [p.name for p in Path("/sys/fs/cgroup").glob("k26sbx-*")],
        }
        self.mark("teardown", **steps["teardown"])

    def save(self) -> None:
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        self.result["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (out / "supervise_real_sglang.json").write_text(json.dumps(self.result, indent=1))
        if self.logs.exists():
            with tarfile.open(out / "supervise-logs.tar.gz", "w:gz") as tar:
                tar.add(self.logs, arcname="logs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--server", choices=["real", "standin"], default="real")
    parser.add_argument("--deadline-s", type=float, default=550)
    parser.add_argument("--work", type=Path, default=Path("/tmp/k26-supervise"))
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument(
        "--workspace", type=Path, help="FlashInfer workspace to keep (default: a fresh one)"
    )
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--module", dest="modules", action="append", default=[])
    parser.add_argument("--warm-limit-s", type=float, default=330)
    parser.add_argument("--start-limit-s", type=float, default=200)
    args = parser.parse_args()
    args.modules = args.modules or ["norm", "sampling"]
    shutil.rmtree(args.work, ignore_errors=True)
    run = Run(args)
    code = 0
    try:
        run.go()
    except Exception as exc:  # the JSON says what went wrong, and the logs come back
        run.result["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    finally:
        run.save()
    print(json.dumps(run.result["steps"], indent=1)[:6000])
    return code


if __name__ == "__main__":
    sys.exit(main())
