"""A real SGLang 0.5.17 on the GPU host: what it does, captured for the product to meet.

    python3 bench/gpu/real_sglang.py --out DIR [--deadline-s 540]

Needs the carried SGLang site on PYTHONPATH (bench/gpu/kit_setup.sh) and nvcc.
Each phase starts the real server (``python3 -m sglang.launch_server``, a tiny
random Llama, --load-format dummy) as a plain process, causes one thing, and
keeps the server's whole output and how it ended (exit status or signal, as
systemd would see it as the unit's main process). In the order of value, until
the deadline:

- ``cold``: empty FlashInfer/tvm-ffi/Triton caches: seconds to /health, the
  first sampled /generate (temperature 0.7, top_k 20, top_p 0.8), which
  FlashInfer modules got built (cached_ops/*, with mtimes);
- ``scheduler-kill``: SIGKILL of the ``sglang::scheduler`` child, and the end;
- ``warm``: the same caches again: /health and the first sampled request, and
  whether any module was built (mtimes);
- ``graceful-stop``: SIGTERM, and the end;
- ``gpu-oom``: another process holds all but 1 GiB of GPU memory at start-up;
- ``arch-reject``: FLASHINFER_CUDA_ARCH_LIST=7.0 on an empty cache.

Writes DIR/real_sglang.json and DIR/real_sglang-logs.tar.gz.
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
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PORT = 30000
URL = f"http://127.0.0.1:{PORT}"
SAMPLED = {
    "text": "The capital of France is",
    "sampling_params": {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "max_new_tokens": 4,
        "sampling_seed": 1234,
    },
}
FLAGS = [
    "--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "flashinfer",
    "--grammar-backend", "none", "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled", "--mem-fraction-static", "0.05",
    "--max-total-tokens", "8192", "--context-length", "1024", "--skip-server-warmup",
    "--host", "127.0.0.1", "--port", str(PORT),
]  # fmt: skip


def http(method: str, path: str, body: Any = None, timeout: float = 5.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        URL + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def modules(workspace: Path) -> dict[str, float]:
    """Every FlashInfer JIT module under the workspace, with its .so's mtime."""
    found = {}
    for so in workspace.glob(".cache/flashinfer/*/*/cached_ops/*/*.so"):
        found[f"{so.parent.parent.parent.name}/{so.parent.name}"] = so.stat().st_mtime
    return found


class Server:
    def __init__(self, log: Path, env: dict[str, str], model: Path) -> None:
        self.log = log
        self.started = time.monotonic()
        self.handle = open(log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *FLAGS],
            env=env,
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_health(self, timeout: float) -> float | None:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            if http("GET", "/health", timeout=2)[0] == 200:
                return time.monotonic() - self.started
            time.sleep(0.25)
        return None

    def ended(self, timeout: float) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
            return {"ended": "killed by the bench after timeout", "returncode": code}
        self.handle.close()
        out = {"returncode": code, "after_s": round(time.monotonic() - self.started, 2)}
        # As systemd records the unit's main process.
        if code < 0:
            out.update(result="signal", exec_main_code=2, exec_main_status=-code)
        else:
            out.update(
                result="success" if code == 0 else "exit-code",
                exec_main_code=1,
                exec_main_status=code,
            )
        return out

    def kill_group(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if not self.handle.closed:
            self.handle.close()


def scheduler_of(pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            cmd = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if ppid == pid and cmd.startswith(b"sglang::scheduler"):
            return int(entry.name)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--work", type=Path, default=Path("/tmp/k26-real"))
    args = parser.parse_args()
    t0 = time.monotonic()
    out, work = args.out, args.work
    logs = work / "logs"
    shutil.rmtree(work, ignore_errors=True)
    logs.mkdir(parents=True)
    model = work / "model"
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(model)], check=True)
    nvcc = shutil.which("nvcc")
    cuda_home = str(Path(os.path.realpath(nvcc)).parent.parent) if nvcc else ""
    results: dict[str, Any] = {"phases": {}, "facts": {"nvcc": nvcc, "cuda_home": cuda_home}}

    def env_for(name: str, arch: str = "9.0") -> dict[str, str]:
        base = work / f"caches-{name}"
        env = dict(os.environ)
        env.update(
            CUDA_HOME=cuda_home,
            FLASHINFER_WORKSPACE_BASE=str(base / "flashinfer"),
            FLASHINFER_CUDA_ARCH_LIST=arch,
            TVM_FFI_CACHE_DIR=str(base / "tvm-ffi"),
            TRITON_CACHE_DIR=str(base / "triton"),
            PYTHONUNBUFFERED="1",
        )
        return env

    def left() -> float:
        return args.deadline_s - (time.monotonic() - t0)

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        (out / "real_sglang.json").write_text(json.dumps(results, indent=1))
        with tarfile.open(out / "real_sglang-logs.tar.gz", "w:gz") as tar:
            tar.add(logs, arcname="logs")

    phases = results["phases"]
    # --- cold, then a SIGKILLed scheduler
    if left() > 300:
        env = env_for("main")
        server = Server(logs / "cold.log", env, model)
        health = server.wait_health(min(300, left()))
        phase: dict[str, Any] = {"health_s": health}
        if health is not None:
            t = time.monotonic()
            code, body = http("POST", "/generate", SAMPLED, timeout=min(300, left()))
            phase.update(first_sampled_s=round(time.monotonic() - t, 3), status=code)
            phase["answer"] = body[:300].decode(errors="replace")
        phase["modules"] = modules(Path(env["FLASHINFER_WORKSPACE_BASE"]))
        phases["cold"] = phase
        save()
        sched = scheduler_of(server.proc.pid)
        phases["scheduler-kill"] = {"scheduler_pid": sched}
        if sched is not None:
            killed_at = time.monotonic()
            os.kill(sched, signal.SIGKILL)
            end = server.ended(60)
            end["after_kill_s"] = round(time.monotonic() - killed_at, 2)
            phases["scheduler-kill"].update(end)
        server.kill_group()
        save()
    # --- warm restart, then a graceful stop
    if left() > 120 and "cold" in phases:
        env = env_for("main")
        before = modules(Path(env["FLASHINFER_WORKSPACE_BASE"]))
        server = Server(logs / "warm.log", env, model)
        health = server.wait_health(min(240, left()))
        phase = {"health_s": health}
        if health is not None:
            t = time.monotonic()
            code, _ = http("POST", "/generate", SAMPLED, timeout=min(300, left()))
            phase.update(first_sampled_s=round(time.monotonic() - t, 3), status=code)
        after = modules(Path(env["FLASHINFER_WORKSPACE_BASE"]))
        phase["rebuilt"] = sorted(k for k, v in after.items() if before.get(k) != v)
        phases["warm"] = phase
        save()
        stop_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        end = server.ended(60)
        end["after_sigterm_s"] = round(time.monotonic() - stop_at, 2)
        phases["graceful-stop"] = end
        server.kill_group()
        save()
    # --- GPU memory held by another process at start-up
    if left() > 90:
        hog_code = (
            "import torch, time, sys\n"
            "free, total = torch.cuda.mem_get_info()\n"
            "x = torch.empty(free - (1 << 30), dtype=torch.uint8, device='cuda')\n"
            "print('held', x.numel() >> 30, 'GiB of', total >> 30, flush=True)\n"
            "sys.stdin.read()\n"
        )
        hog = subprocess.Popen(
            [sys.executable, "-c", hog_code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        held = hog.stdout.readline().strip() if hog.stdout else ""
        server = Server(logs / "gpu-oom.log", env_for("oom"), model)
        end = server.ended(min(240, left()))
        phases["gpu-oom"] = {"hog": held, **end}
        server.kill_group()
        hog.kill()
        hog.wait()
        save()
    # --- the FlashInfer gate rejecting the arch, on an empty cache
    if left() > 60:
        server = Server(logs / "arch-reject.log", env_for("arch", "7.0"), model)
        health = server.wait_health(min(240, left()))
        phases["arch-reject"] = {"health_s": health}
        if health is None:
            phases["arch-reject"].update(server.ended(30))
        server.kill_group()
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
