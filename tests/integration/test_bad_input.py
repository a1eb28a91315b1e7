"""Bad input, for real: hostile configs, hostile HTTP clients, a server that is not SGLang.

- Every malformed or hostile config makes ``k26-supervisor run --config`` and
  ``check-config`` exit 78 with one clear error that names the field (or the
  file, for a file that is not TOML at all), no traceback, and nothing started:
  no unit comes up in the sandbox and no HTTP port is bound.
- The daemon's status server answers odd paths, methods, oversized heads and
  raw garbage with a proper status code, and keeps serving /status.
- A server whose /health is fine but whose /generate answer is not SGLang-shaped
  is never reported ready; its probes fail as ``malformed``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k26dev import sandbox

from .conftest import StandinUnit, free_port, write_unit
from .daemon_harness import Supervisor, write_config

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0

# ------------------------------------------------------------------ configs

_HEAD = """\
[supervisor]
bus = "user"
listen = "127.0.0.1:{port}"

[flashinfer]
enabled = false
"""
_UNIT = """
[[units]]
name = {name}
role = "autoregressive"
url = "http://127.0.0.1:{unit_port}"
"""


def _name(value: str) -> str:
    return _UNIT.replace("{name}", json.dumps(value))


@dataclass(frozen=True)
class Case:
    """A config body (``{head}`` and ``{companion}`` filled in) and what the error names."""

    body: str
    names: str  # the field path (or text) the one error line must contain


_CASES: dict[str, Case] = {
    # Unit names that try injection, traversal, forged lines, odd characters, length.
    "name-shell-injection": Case("{head}" + _name("x.service; rm -rf /"), "units[0].name"),
    "name-command-substitution": Case("{head}" + _name("$(reboot).service"), "units[0].name"),
    "name-path-traversal": Case("{head}" + _name("../../etc/passwd"), "units[0].name"),
    "name-newline": Case("{head}" + _name("a\nb.service"), "units[0].name"),
    "name-nul": Case("{head}" + _name("a\x00.service"), "units[0].name"),
    "name-space": Case("{head}" + _name("my unit.service"), "units[0].name"),
    "name-unicode": Case("{head}" + _name("sglang-ü.service"), "units[0].name"),
    "name-rtl-override": Case("{head}" + _name("sglang\u202e.service"), "units[0].name"),
    "name-300-chars": Case("{head}" + _name("a" * 292 + ".service"), "units[0].name"),
    "name-not-a-service": Case("{head}" + _name("multi-user.target"), "units[0].name"),
    "name-template": Case("{head}" + _name("foo@.service"), "units[0].name"),
    "name-empty": Case("{head}" + _name(""), "units[0].name"),
    "fallback-injection": Case(
        "{head}" + _name("a.service") + 'fallback = "b.service; reboot"\n', "units[0].fallback"
    ),
    # Wrong types.
    "name-integer": Case("{head}" + _UNIT.replace("{name}", "5"), "units[0].name"),
    "name-array": Case("{head}" + _UNIT.replace("{name}", '["a.service"]'), "units[0].name"),
    "role-unknown": Case(
        "{head}" + _name("a.service").replace("autoregressive", "fast"), "units[0].role"
    ),
    "url-integer": Case(
        "{head}" + _name("a.service").replace('"http://127.0.0.1:{unit_port}"', "30000"),
        "units[0].url",
    ),
    "url-not-http": Case(
        "{head}" + _name("a.service").replace("http://127.0.0.1:{unit_port}", "file:///etc/passwd"),
        "units[0].url",
    ),
    "listen-integer": Case(
        _HEAD.replace('"127.0.0.1:{port}"', "{port}") + "{companion}", "supervisor.listen"
    ),
    "listen-injection": Case(
        _HEAD.replace(":{port}", ":{port}; rm -rf /") + "{companion}", "supervisor.listen"
    ),
    "bus-unknown": Case(
        _HEAD.replace('bus = "user"', 'bus = "session"') + "{companion}", "supervisor.bus"
    ),
    "enabled-integer": Case(
        _HEAD.replace("enabled = false", "enabled = 0") + "{companion}", "flashinfer.enabled"
    ),
    "timeout-string": Case('{head}[probe]\ntimeout_s = "10"\n{companion}', "probe.timeout_s"),
    "interval-inf": Case("{head}[probe]\ninterval_s = inf\n{companion}", "probe.interval_s"),
    "interval-nan": Case("{head}[probe]\ninterval_s = nan\n{companion}", "probe.interval_s"),
    "interval-negative": Case("{head}[probe]\ninterval_s = -1.0\n{companion}", "probe.interval_s"),
    "top-k-greedy": Case("{head}[probe]\ntop_k = 1\n{companion}", "probe.top_k"),
    "section-not-a-table": Case('supervisor = "x"\n{companion}', "supervisor"),
    "units-not-an-array": Case('units = "x"\n{head}', "units"),
    # Unknown keys.
    "unknown-key-in-section": Case(
        _HEAD.replace("[flashinfer]", "foo = 1\n[flashinfer]") + "{companion}",
        "supervisor.foo",
    ),
    "unknown-key-in-unit": Case(
        "{head}" + _name("a.service") + 'restart = "always"\n', "units[0].restart"
    ),
    "unknown-section": Case("{head}[extra]\nx = 1\n{companion}", "extra"),
    # Files that are not a usable TOML document at all: the error names the file.
    "toml-syntax": Case("{head}[[units]\n", "TOML syntax error"),
    "deep-nesting": Case("{head}x = " + "[" * 5000 + "]" * 5000 + "\n{companion}", "{path}"),
    "deep-inline-tables": Case("{head}x = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n", "{path}"),
    "no-units": Case("{head}", "units"),
    "empty-file": Case("", "units"),
}
_BINARY: dict[str, bytes] = {
    "binary-garbage": b"\x00\xff\xfe\x89PNG\r\n\x1a\n\x00\x00",
    "latin-1": b'[supervisor]\nbus = "user"\n# caf\xe9\n',
}


@pytest.fixture(scope="module")
def companion(
    sbx: sandbox.SandboxInfo, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandinUnit]:
    """A real, valid, stopped unit named next to the bad field: it must stay down."""
    tmp = tmp_path_factory.mktemp("companion")
    name = "k26b-companion.service"
    port = free_port()
    output = tmp / f"{name}.out"
    write_unit(sbx, name, f"{sys.executable} -m k26dev.standin --port {port}", output)
    unit = StandinUnit(name, port, output, sbx)
    yield unit
    unit.systemctl("stop", name, check=False)
    (sbx.unit_dir / name).unlink(missing_ok=True)


def _active_units(info: sandbox.SandboxInfo) -> set[str]:
    out = subprocess.run(
        ["systemctl", "--user", "list-units", "--all", "--plain", "--no-legend", "--no-pager"],
        env=dict(os.environ, **info.env),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    active = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] in ("active", "activating", "reloading"):
            active.add(fields[0])
    return active


def _port_bound(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _check_rejected(proc: subprocess.CompletedProcess[str], names: str, command: str) -> None:
    err = proc.stderr
    shown = f"{command}: rc={proc.returncode}\nstdout: {proc.stdout[-500:]}\nstderr: {err[-1500:]}"
    assert proc.returncode == 78, shown
    assert "Traceback" not in err and "Error:" not in err.replace("error:", ""), shown
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("k26-supervisor: error: "), shown
    # One error: a single line, or a head saying "(1 problem)" and that one problem.
    assert len(lines) == 1 or (len(lines) == 2 and "(1 problem)" in lines[0]), shown
    if len(lines) == 2:  # "  field.path: what is wrong"
        assert lines[1].strip().startswith(f"{names}: "), f"does not name {names!r}\n{shown}"
    else:
        assert names in lines[0].removeprefix("k26-supervisor: error: "), shown
    assert len(err) < 2000, shown


def _write_case(tmp: Path, case_id: str, companion: StandinUnit, port: int) -> tuple[Path, str]:
    path = tmp / f"{case_id}.toml"
    if case_id in _BINARY:
        path.write_bytes(_BINARY[case_id])
        return path, str(path)
    case = _CASES[case_id]
    companion_table = _name(companion.name)
    text = (
        case.body.replace("{head}", _HEAD)
        .replace("{companion}", companion_table)
        .replace("{port}", str(port))
        .replace("{unit_port}", str(companion.port))
    )
    path.write_text(text)
    return path, case.names.replace("{path}", str(path))


@pytest.mark.parametrize("case_id", [*_CASES, *_BINARY])
def test_bad_config_is_refused_with_one_clear_error_and_starts_nothing(
    case_id: str, sbx: sandbox.SandboxInfo, companion: StandinUnit, tmp_path: Path
) -> None:
    port = free_port()
    path, names = _write_case(tmp_path, case_id, companion, port)
    before = _active_units(sbx)
    env = dict(os.environ, **sbx.env)
    env.pop("NOTIFY_SOCKET", None)
    for command in (["check-config", str(path)], ["run", "--config", str(path)]):
        proc = subprocess.run(
            [sys.executable, "-m", "supervisor", *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        _check_rejected(proc, names, command[0])
        assert not _port_bound(port), f"{command[0]} left 127.0.0.1:{port} bound"
    assert companion.show("ActiveState") == "inactive"
    assert _active_units(sbx) <= before, _active_units(sbx) - before


def test_missing_and_unreadable_config_files(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.toml", tmp_path):
        for command in (["check-config", str(path)], ["run", "--config", str(path)]):
            proc = subprocess.run(
                [sys.executable, "-m", "supervisor", *command],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            _check_rejected(proc, str(path), command[0])
            assert "cannot read" in proc.stderr


# ------------------------------------------------------------------ HTTP


@dataclass
class StatusDaemon:
    sup: Supervisor
    port: int


@pytest.fixture(scope="module")
def status_daemon(
    sbx: sandbox.SandboxInfo, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StatusDaemon]:
    tmp = tmp_path_factory.mktemp("http")
    name = "k26b-http.service"
    port = free_port()
    output = tmp / f"{name}.out"
    write_unit(sbx, name, f"{sys.executable} -m k26dev.standin --port {port}", output)
    unit = StandinUnit(name, port, output, sbx)
    sup = Supervisor(sbx, write_config(tmp, [(unit, "autoregressive", None)]), tmp)
    try:
        sup.notify.wait_for("READY=1", DEADLINE_S)
        yield StatusDaemon(sup, sup.port)
    finally:
        sup.stop()
        unit.systemctl("stop", name, check=False)
        (sbx.unit_dir / name).unlink(missing_ok=True)


def _exchange(port: int, data: bytes, *, half_close: bool = True, timeout_s: float = 20) -> bytes:
    """Send raw bytes, then read everything the server says until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        reply = bytearray()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
        return bytes(reply)


def _status_code(reply: bytes) -> int | None:
    if not reply:
        return None
    line = reply.split(b"\r\n", 1)[0].split()
    assert len(line) >= 2 and line[0] == b"HTTP/1.1", reply[:200]
    return int(line[1])


def _get(target: str, *headers: str) -> bytes:
    head = [f"GET {target} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


_HTTP_CASES: dict[str, tuple[bytes, set[int | None]]] = {
    "dotdot-path": (_get("/status/../metrics"), {404, 400}),
    "double-slash": (_get("//status"), {404, 400}),
    "encoded-dotdot": (_get("/%2e%2e/status"), {404, 400}),
    "encoded-dotdot-between": (_get("/status/%2e%2e/metrics"), {404, 400}),
    "encoded-traversal": (_get("/%2e%2e/%2e%2e/etc/passwd"), {404, 400}),
    "encoded-nul": (_get("/status%00"), {404, 400}),
    "asterisk": (_get("*"), {404, 400}),
    "non-ascii-path": (b"GET /st\xc3\xa4tus HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    "query-is-ignored": (_get("/status?x=../../etc/passwd"), {200}),
    "absolute-form": (_get("http://127.0.0.1/status"), {200}),
    "post": (
        b"POST /status HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
        {405},
    ),
    "delete": (b"DELETE /status HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    "put-metrics": (b"PUT /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", {405}),
    "trace": (b"TRACE /status HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    "options": (b"OPTIONS /status HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    "connect": (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x\r\n\r\n", {400, 404, 405}),
    "made-up-method": (b"FROBNICATE /status HTTP/1.1\r\nHost: x\r\n\r\n", {405, 501}),
    "lowercase-method": (b"get /status HTTP/1.1\r\nHost: x\r\n\r\n", {400, 405, 501}),
    "method-with-control-bytes": (b"G\x00T /status HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    "oversized-header": (_get("/status", "X-Big: " + "a" * 20000), {431}),
    "too-many-headers": (_get("/status", *(f"X-H{i}: v" for i in range(300))), {431}),
    "huge-uri": (_get("/status?" + "a" * 10000), {414}),
    "huge-path": (_get("/" + "a" * 100000), {414}),
    "http2-version": (b"GET /status HTTP/2.0\r\nHost: x\r\n\r\n", {505}),
    "http-9-version": (b"GET /status HTTP/9.9\r\nHost: x\r\n\r\n", {505}),
    "http09-request": (b"GET /status\r\n\r\n", {400}),
    "header-without-colon": (_get("/status", "NoColonHere"), {400}),
    "header-name-with-space": (_get("/status", "Bad Name: x"), {400}),
    "nul-in-header-value": (b"GET /status HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", {400}),
    "tls-client-hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\r\n\r\n", {400}),
    "binary-garbage": (b"\xff\xfe\xfd\x00\x01\x02garbage\x7f\r\n\r\n", {400}),
    "random-bytes": (bytes(range(256)) * 4 + b"\r\n\r\n", {400, 414}),
    "garbage-then-close": (b"\x00\x01\x02 no end of head", {None, 400}),
    "only-blank-lines": (b"\r\n\r\n\r\n\r\n", {None, 400}),
}


@pytest.mark.parametrize("case_id", list(_HTTP_CASES))
def test_hostile_http_gets_a_proper_status_and_status_keeps_serving(
    case_id: str, status_daemon: StatusDaemon
) -> None:
    data, expected = _HTTP_CASES[case_id]
    reply = _exchange(status_daemon.port, data)
    code = _status_code(reply)
    assert code in expected, (case_id, reply[:300])
    if code == 405:
        assert b"\r\nAllow: GET, HEAD\r\n" in reply, reply[:300]
    if code is not None and code >= 400:
        assert b'"units"' not in reply and b"k26_" not in reply, reply[:300]
    _assert_still_serving(status_daemon)


def test_a_head_that_never_ends_is_timed_out_with_408(status_daemon: StatusDaemon) -> None:
    reply = _exchange(status_daemon.port, b"GET /status HTTP/1.1\r\nX-Slow: ", half_close=False)
    assert _status_code(reply) == 408, reply[:300]
    _assert_still_serving(status_daemon)


def test_head_is_answered_without_a_body(status_daemon: StatusDaemon) -> None:
    reply = _exchange(status_daemon.port, b"HEAD /status HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status_code(reply) == 200
    assert reply.endswith(b"\r\n\r\n"), reply[-200:]
    _assert_still_serving(status_daemon)


def _assert_still_serving(daemon: StatusDaemon) -> None:
    assert daemon.sup.proc.poll() is None, daemon.sup.log.read_text()[-3000:]
    response = httpx.get(f"http://127.0.0.1:{daemon.port}/status", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["ready"] is True and len(body["units"]) == 1, body


# ------------------------------------------------------------------ not SGLang

NOT_SGLANG = textwrap.dedent(
    """\
    import http.server, sys

    port, mode = int(sys.argv[1]), sys.argv[2]
    BODIES = {
        "foo": b'{"foo": 1}',
        "not-json": b'this is not json {"text": ',
        "tokens-as-string": b'{"text": " Paris", "meta_info": {"completion_tokens": "4"}}',
        "json-array": b'[{"text": " Paris", "meta_info": {"completion_tokens": 4}}]',
    }


    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send(self, code, body):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.send(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            print(f"not-sglang: POST {self.path}", flush=True)
            self.send(200, BODIES[mode])


    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def not_sglang_unit(
    bus_env: sandbox.SandboxInfo, tmp_path: Path
) -> Iterator[Callable[[str], StandinUnit]]:
    made: list[StandinUnit] = []

    def make(mode: str) -> StandinUnit:
        script = tmp_path / "not_sglang.py"
        script.write_text(NOT_SGLANG)
        name = f"k26b-not-sglang-{mode}.service"
        port = free_port()
        output = tmp_path / f"{name}.out"
        write_unit(bus_env, name, f"{sys.executable} {script} {port} {mode}", output)
        made.append(StandinUnit(name, port, output, bus_env))
        return made[-1]

    yield make
    for u in made:
        u.systemctl("stop", u.name, check=False)
        u.systemctl("reset-failed", u.name, check=False)
        (bus_env.unit_dir / u.name).unlink(missing_ok=True)


def _malformed_failures(sup: Supervisor, unit: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "k26_probe_failures_total"
                and sample.labels.get("unit") == unit
                and sample.labels.get("reason") == "malformed"
            ):
                return float(sample.value)
    return 0.0


@pytest.mark.parametrize("mode", ["foo", "not-json", "tokens-as-string", "json-array"])
def test_a_generate_answer_that_is_not_sglang_shaped_is_never_ready(
    mode: str,
    not_sglang_unit: Callable[[str], StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = not_sglang_unit(mode)
    sup = supervise(write_config(tmp_path, [(unit, "autoregressive", None)]))
    seen: list[dict[str, Any]] = []

    def two_malformed(s: dict[str, Any]) -> bool:
        u = s["units"][unit.name]
        seen.append(u)
        assert u["state"] != "ready" and u["ready"] is False and s["ready"] is False, u
        return _malformed_failures(sup, unit.name) >= 2

    status = sup.wait_status(two_malformed)
    assert "not-sglang: POST /generate" in unit.output.read_text()
    assert not any("READY=1" in m for _, m in sup.notify.messages)
    assert not any(u["state"] == "ready" for u in seen)
    probe = status["units"][unit.name]["last_probe"]
    assert probe is not None and probe["ok"] is False and probe["completion_tokens"] is None
    metrics = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=10).text
    assert f'k26_unit_ready{{unit="{unit.name}"}} 0.0' in metrics
    # The reason must be visible in /status itself, not only in /metrics.
    error = (probe["error"] or "").lower()
    assert "malformed" in error or probe.get("reason") == "malformed", probe
