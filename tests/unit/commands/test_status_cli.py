"""``k26-supervisor status``: the pure table, and the command against real local HTTP servers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from supervisor import cli
from supervisor.adapters.http import StatusServer
from supervisor.adapters.metrics import build_registry
from supervisor.commands import status as status_cmd
from supervisor.commands.status import render_table, resolve_url
from supervisor.core.status import ExitInfo, ProbeInfo, StatusBoard, iso8601

ROOT = Path(__file__).resolve().parents[3]
NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
AR = "sglang-k26.service"
EAGLE = "sglang-k26-eagle3.service"


def _at(seconds_ago: float) -> str:
    at = iso8601(NOW - timedelta(seconds=seconds_ago))
    assert at is not None
    return at


def _unit(**over: Any) -> dict[str, Any]:
    unit: dict[str, Any] = {
        "role": "autoregressive",
        "state": "ready",
        "ready": True,
        "since": _at(600),
        "restarts": 0,
        "main_pid": 4242,
        "active_state": "active",
        "fallback_engaged": False,
        "sampling_backend": "flashinfer",
        "last_exit": None,
        "last_probe": None,
    }
    unit.update(over)
    return unit


def _doc(units: dict[str, Any], *, ready: bool, warmup: Any = "default") -> dict[str, Any]:
    return {
        "ready": ready,
        "supervisor": {
            "version": "0.1.0",
            "started_at": _at(2 * 3600 + 5 * 60),
            "pid": 123,
            "config": "/etc/k26-supervisor/config.toml",
        },
        "units": units,
        "warmup": (
            {"arch": "12.0", "state": "warm", "at": _at(300), "error": None}
            if warmup == "default"
            else warmup
        ),
    }


def _row(table: str, unit: str) -> str:
    rows = [line for line in table.splitlines() if line.startswith(unit + " ")]
    assert len(rows) == 1, table
    return rows[0]


# --- render_table -------------------------------------------------------------------


def test_render_ready_unit() -> None:
    doc = _doc(
        {
            AR: _unit(
                restarts=1,
                last_exit={
                    "cause": "sigkill",
                    "at": _at(180),
                    "main_pid": 4200,
                    "exit_code": None,
                    "signal": 9,
                    "evidence": ["Main process exited, code=killed, status=9/KILL"],
                },
                last_probe={
                    "ok": True,
                    "at": _at(1),
                    "latency_ms": 12.34,
                    "error": None,
                    "completion_tokens": 4,
                },
            )
        },
        ready=True,
    )
    table = render_table(doc, now=NOW)
    header = table.splitlines()[0]
    assert header.startswith("supervisor: READY; ")
    assert "warm-up (arch 12.0): warm 5m ago (2024-05-01T11:55:00Z)" in header
    assert "version 0.1.0, pid 123, up 2h 5m" in header
    columns = table.splitlines()[2].split()
    assert columns[:4] == ["UNIT", "ROLE", "STATE", "READY"]
    assert table.splitlines()[2].rstrip().endswith("RESTARTS")
    row = _row(table, AR)
    assert row.split()[:4] == [AR, "autoregressive", "ready", "yes"]
    assert "sigkill 3m ago (2024-05-01T11:57:00Z)" in row
    assert "ok 12.3 ms" in row
    assert row.split()[-1] == "1"
    # Nothing to note: no fallback, flashinfer sampling.
    assert "fallback" not in table and "pytorch" not in table
    assert table.endswith("\n") and not any(line != line.rstrip() for line in table.splitlines())


def test_render_failed_unit_with_its_last_exit_and_probe_error() -> None:
    long_error = (
        "server-died: the server exited during the sampled /generate "
        "(RuntimeError: FlashInfer sampling: unsupported arch sm_120)"
    )
    doc = _doc(
        {
            AR: _unit(
                state="failed",
                ready=False,
                restarts=4,
                active_state="failed",
                main_pid=None,
                last_exit={
                    "cause": "flashinfer-arch",
                    "at": _at(2 * 3600 + 5 * 60 + 10),
                    "main_pid": 4300,
                    "exit_code": 1,
                    "signal": None,
                    "evidence": ["RuntimeError: ... arch"],
                },
                last_probe={
                    "ok": False,
                    "at": _at(7300),
                    "latency_ms": None,
                    "error": long_error,
                    "completion_tokens": None,
                },
            )
        },
        ready=False,
        warmup={"arch": "12.0", "state": "failed", "at": _at(90), "error": "nvcc not found"},
    )
    table = render_table(doc, now=NOW)
    lines = table.splitlines()
    assert lines[0].startswith("supervisor: NOT READY; warm-up (arch 12.0): failed 1m ago (")
    assert "warm-up error: nvcc not found" in lines
    row = _row(table, AR)
    assert row.split()[:4] == [AR, "autoregressive", "failed", "no"]
    assert "flashinfer-arch 2h 5m ago (2024-05-01T09:54:50Z)" in row
    assert "FAIL server-died: the server exited" in row and "..." in row
    assert long_error not in row  # the table keeps its width ...
    assert f"  {AR}: last probe: FAIL {long_error}" in lines  # ... the note has it all
    assert row.split()[-1] == "4"


def test_render_standby_with_fallback_engaged_and_pytorch_sampling() -> None:
    doc = _doc(
        {
            EAGLE: _unit(
                role="eagle3",
                state="standby",
                ready=False,
                fallback_engaged=True,
                active_state="inactive",
                main_pid=None,
                restarts=2,
                last_exit={
                    "cause": "oom-kill",
                    "at": _at(45),
                    "main_pid": 5100,
                    "exit_code": None,
                    "signal": 9,
                    "evidence": ["oom-kill: constraint=CONSTRAINT_MEMCG"],
                },
            ),
            AR: _unit(
                sampling_backend="pytorch",
                last_probe={
                    "ok": True,
                    "at": _at(2),
                    "latency_ms": 250,
                    "error": None,
                    "completion_tokens": 4,
                },
            ),
        },
        ready=True,
        warmup=None,
    )
    table = render_table(doc, now=NOW)
    lines = table.splitlines()
    assert lines[0].startswith("supervisor: READY; warm-up: none")
    eagle = _row(table, EAGLE)
    assert eagle.split()[:4] == [EAGLE, "eagle3", "standby", "no"]
    assert "oom-kill 45s ago (2024-05-01T11:59:15Z)" in eagle
    ar = _row(table, AR)
    assert "ok 250.0 ms" in ar
    assert f"  {EAGLE}: fallback engaged (its fallback unit serves)" in lines
    assert f"  {AR}: sampling backend pytorch (last-resort drop-in active)" in lines
    # Units in the order /status lists them (the config's order).
    assert lines.index(eagle) < lines.index(ar)


def test_render_no_units_and_missing_optional_fields() -> None:
    table = render_table({"ready": False, "units": {}}, now=NOW)
    assert (
        table
        == "supervisor: NOT READY; warm-up: none (disabled or not run yet)\nno units configured\n"
    )
    bare = render_table({"ready": False, "units": {"a.service": {"state": "stopped"}}}, now=NOW)
    assert _row(bare, "a.service").split() == ["a.service", "-", "stopped", "no", "-", "-", "-"]


def test_render_keeps_terminal_escapes_out() -> None:
    doc = {"ready": False, "units": {"a\x1b[2J.service": _unit(role="x\ny", ready=False)}}
    table = render_table(doc, now=NOW)
    assert "\x1b" not in table
    assert "a?[2J.service" in table and "x?y" in table


def test_render_odd_times_are_shown_as_given() -> None:
    unit = _unit(last_exit={"cause": "clean", "at": "yesterday"})
    assert "clean yesterday" in render_table({"ready": True, "units": {AR: unit}}, now=NOW)
    future = _unit(last_exit={"cause": "clean", "at": iso8601(NOW + timedelta(seconds=3))})
    assert "clean in 3s (" in render_table({"ready": True, "units": {AR: future}}, now=NOW)


def test_render_a_real_board_snapshot() -> None:
    board = StatusBoard(version="0.1.0", config_path="/etc/k26-supervisor/config.toml")
    board.add_unit(AR, "autoregressive")
    board.set_state(AR, "ready")
    board.record_exit(AR, ExitInfo("sigkill", datetime.now(UTC), 4200, None, 9, ("killed",)))
    board.record_probe(AR, ProbeInfo(True, datetime.now(UTC), 8.0, None, 4))
    table = render_table(json.loads(json.dumps(board.snapshot().to_json())))
    assert table.startswith("supervisor: NOT READY; warm-up: none")
    row = _row(table, AR)
    assert row.split()[:4] == [AR, "autoregressive", "ready", "yes"]
    assert "sigkill 0s ago (" in row and "ok 8.0 ms" in row


# --- the command --------------------------------------------------------------------


def _board(*, ready: bool) -> StatusBoard:
    board = StatusBoard(version="0.1.0", config_path="/etc/k26-supervisor/config.toml")
    board.add_unit(AR, "autoregressive")
    board.add_unit(EAGLE, "eagle3", state="standby")
    board.set_fallback_engaged(EAGLE, True)
    if ready:
        board.set_state(AR, "ready")
        board.record_probe(AR, ProbeInfo(True, datetime.now(UTC), 12.3, None, 4))
        board.set_ready(True)
    else:
        board.set_state(AR, "backoff")
        board.record_probe(
            AR,
            ProbeInfo(False, datetime.now(UTC), None, "timeout after 3 s"),
            failure_reason="timeout",
        )
    return board


class _ServerThread:
    """The daemon's real StatusServer on 127.0.0.1:0, on an event loop of its own."""

    def __init__(self, board: StatusBoard) -> None:
        self.board = board
        self.loop = asyncio.new_event_loop()
        self.server = StatusServer(
            "127.0.0.1:0", lambda: board.snapshot().to_json(), build_registry(board)
        )
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def serve_board() -> Iterator[Callable[[StatusBoard], str]]:
    servers: list[_ServerThread] = []

    def start(board: StatusBoard) -> str:
        servers.append(_ServerThread(board))
        return servers[-1].url

    yield start
    for s in servers:
        s.close()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def test_status_of_a_ready_supervisor_exits_0(serve_board: Callable[[StatusBoard], str]) -> None:
    url = serve_board(_board(ready=True))
    proc = run_cli("status", "--url", url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith("supervisor: READY; warm-up: none")
    assert _row(proc.stdout, AR).split()[:4] == [AR, "autoregressive", "ready", "yes"]
    assert "ok 12.3 ms" in _row(proc.stdout, AR)
    assert _row(proc.stdout, EAGLE).split()[:4] == [EAGLE, "eagle3", "standby", "no"]
    assert f"  {EAGLE}: fallback engaged" in proc.stdout


def test_status_of_a_not_ready_supervisor_exits_1(
    serve_board: Callable[[StatusBoard], str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = serve_board(_board(ready=False))
    assert cli.main(["status", "--url", url + "/"]) == 1
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("supervisor: NOT READY")
    row = _row(out, AR)
    assert row.split()[:4] == [AR, "autoregressive", "backoff", "no"]
    assert "FAIL timeout after 3 s" in row


def test_status_json_prints_the_raw_document(
    serve_board: Callable[[StatusBoard], str], capsys: pytest.CaptureFixture[str]
) -> None:
    board = _board(ready=True)
    url = serve_board(board)
    assert cli.main(["status", "--url", f"{url}/status", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out) == board.snapshot().to_json()
    assert out.count("\n") == 1  # as the daemon sent it


def test_status_json_of_a_not_ready_supervisor_exits_1(
    serve_board: Callable[[StatusBoard], str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = serve_board(_board(ready=False))
    assert cli.main(["status", "--url", url, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ready"] is False


def test_status_takes_the_address_from_the_config(
    serve_board: Callable[[StatusBoard], str], tmp_path: Path
) -> None:
    url = serve_board(_board(ready=True))
    port = url.rsplit(":", 1)[1]
    config = tmp_path / "k26.toml"
    config.write_text(
        f'[supervisor]\nlisten = "127.0.0.1:{port}"\n\n[flashinfer]\nenabled = false\n\n'
        '[[units]]\nname = "sglang-k26.service"\nrole = "autoregressive"\n'
        'url = "http://127.0.0.1:30000"\n'
    )
    proc = run_cli("status", "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("supervisor: READY")


def test_resolve_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "absent.toml"
    monkeypatch.setattr(status_cmd, "DEFAULT_CONFIG", missing)
    assert resolve_url(None, None) == "http://127.0.0.1:9436"
    assert resolve_url("http://[::1]:9/status/", None) == "http://[::1]:9"
    default = tmp_path / "config.toml"
    default.write_text(
        '[supervisor]\nlisten = "0.0.0.0:9555"\n[flashinfer]\nenabled = false\n'
        '[[units]]\nname = "a.service"\nrole = "autoregressive"\nurl = "http://127.0.0.1:1"\n'
    )
    monkeypatch.setattr(status_cmd, "DEFAULT_CONFIG", default)
    assert resolve_url(None, None) == "http://127.0.0.1:9555"
    default.write_text(default.read_text().replace("0.0.0.0:9555", "[::]:9556"))
    assert resolve_url(None, None) == "http://[::1]:9556"
    assert resolve_url("http://127.0.0.1:1", None) == "http://127.0.0.1:1"


def test_an_unusable_default_config_falls_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "config.toml"
    broken.write_text("[supervisor\n")
    monkeypatch.setattr(status_cmd, "DEFAULT_CONFIG", broken)
    assert resolve_url(None, None) == "http://127.0.0.1:9436"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and str(broken) in err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.stdout == ""
    return lines[0]


def test_unreachable_supervisor_exits_69_with_one_line() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = run_cli("status", "--url", url)
    assert proc.returncode == 69
    line = _one_error_line(proc)
    assert line.startswith("k26-supervisor: error: ")
    assert url in line and "systemctl status k26-supervisor" in line


def test_unreachable_with_json_exits_69_too() -> None:
    proc = run_cli("status", "--json", "--url", f"http://127.0.0.1:{_closed_port()}")
    assert proc.returncode == 69
    _one_error_line(proc)


def test_a_silent_supervisor_times_out_with_69(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(status_cmd, "TIMEOUT_S", 0.3)
    with socket.socket() as listener:  # accepts (in the kernel) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        assert cli.main(["status", "--url", url]) == 69
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and url in err and "did not answer" in err


class _Canned(BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, str, bytes]] = {}

    def do_GET(self) -> None:
        key = self.server.server_address[1]  # type: ignore[index]
        code, content_type, body = self.answers[str(key)]
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def canned() -> Iterator[Callable[[int, str, bytes], str]]:
    servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def start(code: int, content_type: str, body: bytes) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
        port = server.server_address[1]
        _Canned.answers[str(port)] = (code, content_type, body)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    ("code", "body", "exit_code", "needle"),
    [
        (200, b"<html>hello</html>", 65, "did not answer JSON"),
        (200, b"[1, 2]", 65, "expected a JSON object"),
        (200, b'{"ready": "yes", "units": {}}', 65, "'ready'"),
        (200, b'{"ready": true}', 65, "'units'"),
        (200, b'{"ready": true, "units": {"a.service": 3}}', 65, "units['a.service']"),
        (
            200,
            b'{"ready": true, "units": {"a.service": {"state": "ready", "last_exit": 1}}}',
            65,
            "last_exit",
        ),
        (404, b"not found\n", 65, "HTTP 404"),
        (500, b"internal error\n", 69, "HTTP 500"),
    ],
)
def test_answers_that_are_not_a_status_document(
    canned: Callable[[int, str, bytes], str], code: int, body: bytes, exit_code: int, needle: str
) -> None:
    url = canned(code, "application/json", body)
    proc = run_cli("status", "--url", url)
    assert proc.returncode == exit_code, proc.stderr
    line = _one_error_line(proc)
    assert needle in line and url in line


def test_bad_url_is_a_usage_error() -> None:
    proc = run_cli("status", "--url", "127.0.0.1:9436")
    assert proc.returncode == 64
    assert "http://" in _one_error_line(proc)


def test_url_and_config_together_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("status", "--url", "http://127.0.0.1:1", "--config", str(tmp_path / "c.toml"))
    assert proc.returncode == 64
    assert "not allowed with" in _one_error_line(proc)


def test_missing_config_exits_78() -> None:
    proc = run_cli("status", "--config", "/nonexistent/k26.toml")
    assert proc.returncode == 78
    assert "/nonexistent/k26.toml" in _one_error_line(proc)


# --- a supervisor that exited: what it saved still says why ---------------------------


def test_a_supervisor_that_could_not_start_is_shown_from_its_saved_status(
    tmp_path: Path,
) -> None:
    """``status`` with nothing listening reads last-status.json from the runtime
    directory of the config's bus, names why the daemon exited and each failed unit."""
    runtime = tmp_path / "run"
    (runtime / "k26-supervisor").mkdir(parents=True)
    reason = "warm-up failed: the serving venv cannot import FlashInfer's JIT"
    last = _doc({AR: _unit(state="failed", ready=False, reason=reason)}, ready=False)
    last["supervisor"]["exited_at"] = iso8601(datetime.now(UTC) - timedelta(seconds=30))
    why = f"start-up cannot succeed, no unit can serve: {AR}: {reason}"
    last["supervisor"]["exit"] = {"code": 79, "reason": why}
    (runtime / "k26-supervisor" / "last-status.json").write_text(json.dumps(last))
    config = tmp_path / "config.toml"
    port = _closed_port()
    config.write_text(
        f'[supervisor]\nbus = "user"\nlisten = "127.0.0.1:{port}"\n\n[flashinfer]\nenabled = false\n'
        f'\n[[units]]\nname = "{AR}"\nrole = "autoregressive"\nurl = "http://127.0.0.1:30000"\n'
    )
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--config", str(config)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 69, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr  # what failed is still said, on stderr
    head = done.stdout.splitlines()[0]
    assert re.fullmatch(r"supervisor: NOT RUNNING; it exited 3\ds ago \(.*Z\) with status 79", head)
    assert " up " not in done.stdout  # it is not up
    assert f"why: {why}" in done.stdout
    assert _row(done.stdout, AR).split()[:4] == [AR, "autoregressive", "failed", "no"]
    assert f"{AR}: failed: {reason}" in done.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--config", str(config), "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert as_json.returncode == 69 and json.loads(as_json.stdout) == last
    # Another runtime directory, nothing saved there: the plain one-line error.
    empty = {**env, "XDG_RUNTIME_DIR": str(tmp_path / "elsewhere")}
    plain = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--config", str(config)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=empty, check=False,
    )  # fmt: skip
    assert plain.returncode == 69 and plain.stdout == "" and plain.stderr.count("\n") == 1
