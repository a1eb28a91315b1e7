"""``k26-supervisor check-config`` and ``probe``, run as a user would: a subprocess."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.unit.adapters.test_probe import standin

ROOT = Path(__file__).resolve().parents[3]
CLI = ROOT / ".venv" / "bin" / "k26-supervisor"
EXAMPLE = ROOT / "config" / "k26-supervisor.toml"
TIMEOUT_S = 60


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    exe = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "supervisor"]
    return subprocess.run(
        [*exe, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
        check=False,
    )


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


UNIT = """
[[units]]
name = {name}
role = "autoregressive"
url = "http://127.0.0.1:30000"
"""


# --- check-config -------------------------------------------------------------------


def test_check_config_accepts_the_example() -> None:
    proc = cli("check-config", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK: 2 units in ")
    assert "sglang-k26-eagle3.service (eagle3, fallback sglang-k26.service)" in proc.stdout
    no_traceback(proc)


def test_check_config_json_prints_the_effective_config() -> None:
    proc = cli("check-config", "--json", EXAMPLE)
    assert proc.returncode == 0
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True
    assert doc["config"]["probe"]["top_k"] == 20
    assert doc["config"]["units"][1]["name"] == "sglang-k26.service"


def test_check_config_warns_about_a_missing_serving_venv(tmp_path: Path) -> None:
    path = tmp_path / "k26.toml"
    path.write_text(
        f'[flashinfer]\npython = "{tmp_path}/no/python"\n' + UNIT.format(name='"a.service"')
    )
    proc = cli("check-config", path)
    assert proc.returncode == 0
    assert "warning: flashinfer.python" in proc.stderr


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[probe]\ntop_k = 1\n' + UNIT.format(name='"a.service"'), "probe.top_k"),
        ('[supervisor]\nlisten = "x:99999"\n' + UNIT.format(name='"a.service"'),
         "supervisor.listen"),
        (UNIT.format(name='"a.service"').replace("autoregressive", "eagle3"),
         "units[0].fallback"),
        ("", "units"),
    ],
)  # fmt: skip
def test_check_config_rejects_a_bad_config_with_78(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    proc = cli("check-config", path)
    assert proc.returncode == 78
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"k26-supervisor: error: {path}: invalid configuration")
    assert f"\n  {field}: " in proc.stderr
    no_traceback(proc)


@pytest.mark.parametrize(
    "toml_name",
    ['"../../etc/passwd"', '"x.service; rm -rf /"', '"a\\nb.service"', "'$(id).service'"],
)
def test_check_config_rejects_hostile_unit_names(tmp_path: Path, toml_name: str) -> None:
    path = tmp_path / "hostile.toml"
    path.write_text(UNIT.format(name=toml_name))
    proc = cli("check-config", path)
    assert proc.returncode == 78
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("k26-supervisor: error:")
    assert lines[1].startswith("  units[0].name: invalid unit name")
    assert len(lines) == 2  # the name cannot add lines of its own
    no_traceback(proc)


def test_check_config_json_lists_the_problems(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[probe]\ntop_p = 1.5\n" + UNIT.format(name='"a b"'))
    proc = cli("check-config", "--json", path)
    assert proc.returncode == 78
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False
    assert {p["path"] for p in doc["problems"]} == {"probe.top_p", "units[0].name"}


def test_check_config_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "syntax.toml"
    path.write_text('[supervisor]\nbus = "system"\nlisten = 127.0.0.1:9436\n')
    proc = cli("check-config", path)
    assert proc.returncode == 78
    assert proc.stderr.startswith(f"k26-supervisor: error: {path}: line 3, column")
    assert "TOML syntax error" in proc.stderr
    no_traceback(proc)


def test_check_config_missing_file(tmp_path: Path) -> None:
    proc = cli("check-config", tmp_path / "absent.toml")
    assert proc.returncode == 78
    assert "cannot read the config file" in proc.stderr


def test_check_config_needs_a_file() -> None:
    proc = cli("check-config")
    assert proc.returncode == 64
    no_traceback(proc)


# --- probe ----------------------------------------------------------------------------


class _Broken(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b'{"error": {"message": "sampling exploded"}}'
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def broken_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_probe_reports_an_http_error_with_exit_1(broken_server: str) -> None:
    proc = cli("probe", "--url", broken_server, "--json", "--quiet")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["reason"] == "http-status"
    assert "sampling exploded" in doc["error"]
    assert doc["sampling_params"] == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "max_new_tokens": 4,
        "sampling_seed": 1234,
    }


def test_probe_text_output(broken_server: str) -> None:
    proc = cli("probe", "--url", broken_server, "--top-k", "-1", "--seed", "7")
    assert proc.returncode == 1
    assert proc.stdout.startswith("FAILED (http-status): ")
    assert "top_k=-1" in proc.stdout and "seed=7" in proc.stdout
    assert proc.stderr == ""  # asked once: nothing to wait for, no progress
    proc = cli("probe", "--url", broken_server, "--wait", "30")
    assert "/health: healthy" in proc.stderr  # waiting shows its progress


def _closed_port() -> int:
    """A port nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_probe_answers_at_once_when_nothing_listens() -> None:
    """A one-shot command run by hand: no 900 s wait, no progress, one line, exit 69."""
    url = f"http://127.0.0.1:{_closed_port()}"
    for extra in ([], ["--json"]):
        proc = cli("probe", "--url", url, *extra)
        assert proc.returncode == 69, proc.stderr
        assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert f"nothing listens at {url}" in proc.stderr and "--wait S" in proc.stderr
        assert "waiting for" not in proc.stderr
        no_traceback(proc)


def test_probe_wait_waits_then_says_nothing_listened() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = cli("probe", "--url", url, "--wait", "0.3")
    assert proc.returncode == 69, proc.stderr
    assert "waiting for" in proc.stderr  # progress while it waits
    last = proc.stderr.splitlines()[-1]
    assert f"nothing listens at {url} after waiting 0.3 s" in last
    # the old spelling of the flag still works
    proc = cli("probe", "--url", url, "--startup-deadline", "0.3", "--quiet")
    assert proc.returncode == 69 and len(proc.stderr.splitlines()) == 1


class _Loading(BaseHTTPRequestHandler):
    """/health answers 503 for its first ``loading_polls`` polls, then 200."""

    loading_polls = 0
    polls = 0

    def do_GET(self) -> None:
        type(self).polls += 1
        self.send_response(503 if type(self).polls <= self.loading_polls else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        _Broken.do_POST(self)  # type: ignore[arg-type]

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def loading_server() -> Iterator[tuple[str, type[_Loading]]]:
    handler = type("Loading", (_Loading,), {"loading_polls": 3, "polls": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_probe_without_wait_fails_on_a_server_still_loading(
    loading_server: tuple[str, type[_Loading]],
) -> None:
    url, handler = loading_server
    proc = cli("probe", "--url", url, "--json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["reason"] == "http-status" and doc["http_status"] == 503
    assert "--wait S" in doc["error"]
    assert handler.polls == 1  # asked once


def test_probe_wait_waits_for_a_server_still_loading(
    loading_server: tuple[str, type[_Loading]],
) -> None:
    url, handler = loading_server
    proc = cli("probe", "--url", url, "--wait", "30", "--json")
    assert handler.polls == 4  # three 503s, then 200
    assert "HTTP 503" in proc.stderr and "/health: healthy" in proc.stderr
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1 and doc["reason"] == "http-status"  # then /generate fails
    assert "sampling exploded" in doc["error"] and doc["health_wait_s"] > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--temperature", "0"], "temperature must be > 0"),
        (["--top-k", "1"], "top_k must be > 1 or -1"),
        (["--top-p", "1"], "top_p must be between 0 and 1"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--wait", "0"], "--wait must be > 0"),
        (["--url", "ftp://x"], "--url must start with http"),
        (["--url", "http://h:1/generate"], "base URL"),
    ],
)
def test_probe_usage_errors_exit_64(args: list[str], needle: str) -> None:
    base = ["--url", "http://127.0.0.1:1"] if "--url" not in args else []
    proc = cli("probe", *base, *args)
    assert proc.returncode == 64, proc.stderr
    assert needle in proc.stderr
    no_traceback(proc)


def test_probe_takes_defaults_from_a_config(tmp_path: Path, broken_server: str) -> None:
    path = tmp_path / "k26.toml"
    path.write_text("[probe]\ntemperature = 1.1\n" + UNIT.format(name='"a.service"'))
    proc = cli("probe", "--url", broken_server, "--config", path, "--json", "--quiet")
    assert json.loads(proc.stdout)["sampling_params"]["temperature"] == 1.1


def test_probe_with_a_bad_config_exits_78(tmp_path: Path) -> None:
    path = tmp_path / "k26.toml"
    path.write_text("[probe]\ntemperature = 0\n")
    proc = cli("probe", "--url", "http://127.0.0.1:1", "--config", path)
    assert proc.returncode == 78
    assert "probe.temperature" in proc.stderr


def test_probe_passes_against_the_standin() -> None:
    with standin("--load-seconds", "0.5") as url:
        proc = cli("probe", "--url", url, "--json", "--wait", "30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["completion_tokens"] == 4 and doc["error"] is None
    assert doc["latency_ms"] > 0


def test_probe_catches_the_sampling_crash_greedy_health_misses() -> None:
    with standin("--fail", "sampling-arch") as url:
        proc = cli("probe", "--url", url)
    assert proc.returncode == 1
    assert proc.stdout.startswith("FAILED (server-died): ")
