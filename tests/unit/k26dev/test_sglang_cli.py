"""``python -m sglang.launch_server`` played by the stand-in: SGLang's own flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from k26dev.ports import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
DEVTOOLS = ROOT / "devtools"  # k26dev, a distribution of its own
SHIM = DEVTOOLS / "k26dev" / "standin" / "sglang_shim"
# The flags bench/gpu/real_sglang.py gave the real sglang 0.5.17 on the H200.
REAL_FLAGS = [
    "--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend",
    "flashinfer", "--grammar-backend", "none", "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled", "--mem-fraction-static", "0.05",
    "--max-total-tokens", "8192", "--context-length", "1024", "--skip-server-warmup",
    "--host", "127.0.0.1",
]  # fmt: skip


def _launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *args],
        env={**os.environ, "PYTHONPATH": f"{SHIM}:{ROOT}:{DEVTOOLS}", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_real_servers_flags_start_the_stand_in(tmp_path: Path) -> None:
    port = free_port()
    proc = _launch(
        "--model-path", "/nowhere/tiny", *REAL_FLAGS, "--port", str(port),
        env={"K26_STANDIN_ARGS": "--stop-mode clean --sigterm-poll-seconds 0.1",
             "FLASHINFER_WORKSPACE_BASE": str(tmp_path)},
    )  # fmt: skip
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 20, "the stand-in behind SGLang's flags to answer /health")
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0  # --stop-mode clean came through K26_STANDIN_ARGS
    assert "The server is fired up and ready to roll!" in out
    assert "SIGTERM received. signum=None frame=None." in out


def test_an_unknown_flag_is_refused_as_sglangs_argparse_does() -> None:
    proc = _launch("--model-path", "m", "--no-such-flag")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert "usage: launch_server.py" in out and "unrecognized arguments: --no-such-flag" in out


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--sampling-backend", "magic"], "invalid choice: 'magic'"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1)"),
        (["--speculative-algorithm", "EAGLE3"], "needs a draft model"),
    ],
)
def test_bad_values_are_refused_with_sglangs_words(args: list[str], text: str) -> None:
    proc = _launch("--model-path", "m", *args)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert text in out


def test_a_model_path_without_a_model_fails_as_transformers_does(tmp_path: Path) -> None:
    proc = _launch("--model-path", str(tmp_path / "empty"), "--port", str(free_port()))
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 1
    assert "does not appear to have a file named config.json" in out
