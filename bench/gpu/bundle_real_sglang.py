"""A FlashInfer cache bundle on the GPU host: a real SGLang starts from it with no JIT.

    python3 bench/gpu/bundle_real_sglang.py --out DIR [--deadline-s 480]
    python3 bench/gpu/bundle_real_sglang.py --out DIR --server standin --module api_log_stats

On the lent GPU host, after ``bash bench/gpu/kit_setup.sh && . /tmp/k26kit/env.sh``.
With the product's own commands, in order:

1. ``flashinfer warm`` builds ``norm`` and ``sampling`` for 9.0 into workspace W
   (the build host's, cold: real nvcc builds);
2. ``flashinfer bundle export`` writes the archive;
3. W is moved aside whole, so nothing of the build host's is left where the
   node's units look (a bundle installs only at the workspace path it was built
   for: FlashInfer's build.ninja embeds it);
4. ``flashinfer bundle import`` installs the archive into the empty W, and
   ``flashinfer doctor`` judges it;
5. the real server (``python -m sglang.launch_server``, the tiny Llama, the
   units' environment, fresh Triton and tvm-ffi caches) starts on W: seconds to
   /health, the first sampled /generate, and every file under W's FlashInfer
   cache compared before the start and after that request (a JIT build rewrites
   objects, the ``.so`` or ninja's log);
6. a graceful stop (SIGTERM), and ``k26-supervisor explain`` on the server's own
   output and the exit systemd would record.

``--server standin`` rehearses the same plan on a CPU machine: the project's
serving-0.7 venv, module ``api_log_stats``, and the stand-in behind SGLang's
flags, which JIT-builds that module for real when the cache lacks it.
Writes DIR/bundle_real_sglang.json and DIR/bundle-logs.tar.gz.
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
from pathlib import Path
from typing import Any

from real_sglang import FLAGS, SAMPLED, http
from supervise_real_sglang import STANDIN_PYTHONPATH, serving_venv

HERE = Path(__file__).resolve().parent
BUILD_OUTPUTS = (".so", ".o", ".ninja_log", ".ninja_deps", "build.ninja")


def files(workspace: Path) -> dict[str, tuple[int, int]]:
    """Every file under the workspace's FlashInfer cache: (size, mtime_ns)."""
    root = workspace / ".cache" / "flashinfer"
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            stat = path.stat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.work: Path = args.work
        self.logs = self.work / "logs"
        self.env = dict(os.environ)
        self.result: dict[str, Any] = {"server": args.server, "steps": {}, "timeline": []}

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def mark(self, what: str, **extra: Any) -> None:
        entry = {"t_s": round(time.monotonic() - self.t0, 2), "what": what, **extra}
        self.result["timeline"].append(entry)
        print(f"[{entry['t_s']:7.2f}] {what} {extra if extra else ''}", flush=True)

    def k26(self, *argv: str, timeout: float = 120) -> tuple[int, Any, float]:
        """One product command with --json: its exit code, its report, its seconds."""
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", *argv, "--json"],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        seconds = round(time.monotonic() - started, 2)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            report = {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
        (self.logs / f"k26-{argv[0]}-{argv[1]}-{len(self.result['timeline'])}.log").write_text(
            done.stdout + done.stderr
        )
        return done.returncode, report, seconds

    def serving(self, python: Path, workspace: Path, env_file: Path) -> list[str]:
        return [
            "--python", str(python), "--arch", self.args.arch, "--workspace", str(workspace),
            "--env-file", str(env_file),
        ]  # fmt: skip

    def server_env(self, python: Path, workspace: Path) -> dict[str, str]:
        """The units' environment (units/sglang-k26.service), fresh non-FlashInfer caches."""
        env = {k: v for k, v in self.env.items() if k != "PYTHONPATH"}
        caches = self.work / "caches"
        env.update(
            PATH=f"{python.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
            FLASHINFER_WORKSPACE_BASE=str(workspace),
            FLASHINFER_CUDA_ARCH_LIST=self.args.arch,
            TORCH_CUDA_ARCH_LIST=self.args.arch,
            TRITON_CACHE_DIR=str(caches / "triton"),
            TVM_FFI_CACHE_DIR=str(caches / "tvm-ffi"),
            PYTHONUNBUFFERED="1",
        )
        if self.args.server == "standin":
            env["PYTHONPATH"] = STANDIN_PYTHONPATH
            env["K26_STANDIN_ARGS"] = " ".join(
                [f"--jit-module {m}" for m in self.args.modules] + [f"--jit-python {python}"]
            )
        return env

    def go(self) -> None:
        steps = self.result["steps"]
        self.logs.mkdir(parents=True)
        model = self.work / "model"
        if self.args.server == "real":
            subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(model)], check=True)
        python, _ = serving_venv(self.args.server, self.work, self.args.site, self.env)
        env_file = self.work / "build.env"
        if self.args.server == "standin":  # the serving venv's own (a stub libcuda, CPATH)
            shutil.copy(python.parent.parent / "k26-build.env", env_file)
        else:
            keys = ("CUDA_HOME", "PATH")
            env_file.write_text("".join(f"{k}={self.env[k]}\n" for k in keys if self.env.get(k)))
        workspace = self.work / "flashinfer"
        serving = self.serving(python, workspace, env_file)
        fi = [*serving, *(a for m in self.args.modules for a in ("--module", m))]
        bundle = self.work / "bundle.tar.gz"

        # 1. The build host's warm-up.
        rc, report, seconds = self.k26(
            "flashinfer", "warm", *fi, timeout=max(60, self.left() - 150)
        )
        steps["warm"] = {
            "rc": rc,
            "s": seconds,
            "built": report.get("built"),
            "error": report.get("error"),
        }
        self.mark("warm", **steps["warm"])
        if rc != 0:
            return
        # 2. Export.
        rc, report, seconds = self.k26("flashinfer", "bundle", "export", *fi, "--out", str(bundle))
        steps["export"] = {
            "rc": rc,
            "s": seconds,
            "bytes": bundle.stat().st_size if bundle.exists() else None,
            "report": report,
        }
        self.mark("export", rc=rc, s=seconds, bytes=steps["export"]["bytes"])
        if rc != 0:
            return
        # 3. Nothing of the build host's is left at W.
        aside = self.work / "flashinfer-build-host"
        workspace.rename(aside)
        # 4. Import into the empty workspace, and doctor's verdict.
        rc, report, seconds = self.k26("flashinfer", "bundle", "import", *serving, str(bundle))
        steps["import"] = {"rc": rc, "s": seconds, "report": report}
        self.mark("import", rc=rc, s=seconds)
        if rc != 0:
            return
        rc, report, seconds = self.k26("flashinfer", "doctor", *fi)
        steps["doctor"] = {
            "rc": rc,
            "s": seconds,
            "status": report.get("status"),
            "problems": report.get("problems"),
        }
        self.mark("doctor", **steps["doctor"])
        # 5. The server on the imported cache.
        before = files(workspace)
        log = self.logs / "server.log"
        started = time.monotonic()
        with log.open("ab") as sink:
            server = subprocess.Popen(
                [str(python), "-m", "sglang.launch_server", "--model-path", str(model), *FLAGS],
                env=self.server_env(python, workspace), stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            health = None
            while time.monotonic() - started < min(300, self.left() - 30):
                if server.poll() is not None:
                    break
                if http("GET", "/health", timeout=2)[0] == 200:
                    health = round(time.monotonic() - started, 2)
                    break
                time.sleep(0.25)
            serve: dict[str, Any] = {"health_s": health}
            self.mark("server /health", s=health)
            if health is not None:
                t = time.monotonic()
                code, body = http(
                    "POST", "/generate", SAMPLED, timeout=max(10, min(300, self.left() - 20))
                )
                serve.update(first_sampled_s=round(time.monotonic() - t, 3), status=code)
                serve["answer"] = body[:300].decode(errors="replace")
                self.mark("first sampled request", s=serve["first_sampled_s"], status=code)
            after = files(workspace)
            changed = sorted(k for k in after if after[k] != before.get(k))
            serve["files_changed"] = changed
            serve["files_gone"] = sorted(k for k in before if k not in after)
            serve["jit_in_server"] = [k for k in changed if k.endswith(BUILD_OUTPUTS)]
            steps["server"] = serve
            # 6. A graceful stop, and the product's verdict on what the server printed.
            if server.poll() is None:
                t = time.monotonic()
                server.send_signal(signal.SIGTERM)
                try:
                    code = server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    code = None
                stop: dict[str, Any] = {
                    "returncode": code,
                    "after_sigterm_s": round(time.monotonic() - t, 2),
                }
                if code is not None and code < 0:
                    rc, report, _ = self.k26(
                        "explain", "--output", str(log), "--signal", str(-code)
                    )
                else:
                    rc, report, _ = self.k26(
                        "explain", "--output", str(log), "--exit-status", str(code or 0)
                    )
                stop["explain"] = {
                    "rc": rc,
                    "cause": report.get("cause"),
                    "summary": report.get("summary"),
                    "evidence": report.get("evidence"),
                }
                steps["graceful_stop"] = stop
                self.mark("graceful stop", returncode=code, cause=stop["explain"]["cause"])
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()

    def save(self) -> None:
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        self.result["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (out / "bundle_real_sglang.json").write_text(json.dumps(self.result, indent=1))
        if self.logs.exists():
            with tarfile.open(out / "bundle-logs.tar.gz", "w:gz") as tar:
                tar.add(self.logs, arcname="logs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--server", choices=["real", "standin"], default="real")
    parser.add_argument("--deadline-s", type=float, default=480)
    parser.add_argument("--work", type=Path, default=Path("/tmp/k26-bundle"))
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--module", dest="modules", action="append", default=[])
    args = parser.parse_args()
    args.modules = args.modules or ["norm", "sampling"]
    shutil.rmtree(args.work, ignore_errors=True)
    bench = Bench(args)
    code = 0
    try:
        bench.go()
    except Exception as exc:  # the JSON says what went wrong, and the logs come back
        bench.result["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    finally:
        bench.save()
    print(json.dumps(bench.result["steps"], indent=1, default=str)[:6000])
    return code


if __name__ == "__main__":
    sys.exit(main())
