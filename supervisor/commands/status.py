"""``k26-supervisor status``: the running daemon's /status as a table, or as JSON.

Asks the daemon (``GET /status`` on its loopback listener) and prints one row
per unit: role, state, ready, last exit (cause, when), last sampled probe and
restarts, under a header line with the overall readiness and warm-up state.

Exit 0 when the supervisor reports ready, 1 when it does not, 69 when it
cannot be reached, 65 when what answered is not a k26-supervisor /status.
A supervisor that is not running still answers through the /status it saved as
it exited (``last-status.json`` in its runtime directory): why it exited (a
start-up that could not succeed, say), then that table; exit 69.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from supervisor.adapters.config_file import load_config
from supervisor.adapters.state_file import read_last_status
from supervisor.commands.parsers import Subparsers, add_command
from supervisor.core.config import InvalidConfig, normalize_server_url
from supervisor.core.errors import InputError, UnavailableError, UsageError
from supervisor.core.timeline import compact

DEFAULT_URL = "http://127.0.0.1:9436"
DEFAULT_CONFIG = Path("/etc/k26-supervisor/config.toml")
TIMEOUT_S = 5.0
_MAX_PROBE_ERROR = 40
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_HINT = "is it running? try: systemctl status k26-supervisor"


_USAGE = f"""show the running supervisor's units, readiness and last exits

Ask the running supervisor for GET /status and print a table: each unit's role, state,
readiness, last exit (cause and when), last sampled probe and restarts. The address is
--url, else the listen address of --config, else that of {DEFAULT_CONFIG} if it exists,
else {DEFAULT_URL}. Exit 0 when the supervisor is ready, 1 when it is not, 69 when it
cannot be reached, 65 when the answer is not a /status document."""


def register(sub: Subparsers) -> None:
    parser = add_command(sub, "status", _USAGE, _status)
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--url", help=f"the supervisor's base URL (default {DEFAULT_URL}, or from the config)"
    )
    where.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"take the address from FILE's [supervisor] listen (default {DEFAULT_CONFIG})",
    )
    parser.add_argument("--json", action="store_true", help="print /status as JSON, unchanged")


def _status(args: argparse.Namespace) -> int:
    url = resolve_url(args.url, args.config)
    try:
        body = fetch(url)
    except UnavailableError as exc:
        # Not running: what it saved as it exited still says why (a start that could
        # not succeed, say), if this user may read its runtime directory.
        last = _last_status(args.config)
        if last is None:
            raise
        print(f"k26-supervisor: {exc}", file=sys.stderr)
        if args.json:
            sys.stdout.write(json.dumps(last, indent=1) + "\n")
        else:
            sys.stdout.write(render_exited(last))
        return UnavailableError.exit_code
    status = parse_status(body, url)
    if args.json:
        sys.stdout.write(body if body.endswith("\n") else body + "\n")
    else:
        sys.stdout.write(render_table(status))
    return 0 if status["ready"] is True else 1


def _last_status(config: Path | None) -> dict[str, Any] | None:
    """The /status the daemon saved when it last exited, from its runtime directory
    (the bus of --config or the default config; else the system's, then the user's)."""
    buses = ["system", "user"]
    path = config if config is not None else DEFAULT_CONFIG
    if path.exists():
        with contextlib.suppress(InvalidConfig):  # unreadable: try both
            buses = [str(load_config(path).supervisor.bus)]
    for bus in buses:
        found = read_last_status(bus)
        if found is not None and _shape_problem(found) is None:
            return found
    return None


def render_exited(last: Mapping[str, Any], *, now: datetime | None = None) -> str:
    """The saved /status of a supervisor that is not running, under why it exited."""
    now = datetime.now(UTC) if now is None else now
    sup = last.get("supervisor") or {}
    exit_ = sup.get("exit") or {}
    at = sup.get("exited_at")
    head = "supervisor: NOT RUNNING; it exited" + (f" {_when(at, now)}" if at else "")
    if exit_.get("code") is not None:
        head += f" with status {_clean(exit_['code'])}"
    lines = [head]
    if exit_.get("reason"):
        lines.append(f"why: {_clean(exit_['reason'])}")
    lines.append("its last /status:")
    return "\n".join(lines) + "\n" + render_table(last, now=now, running=False)


# --- where and what -----------------------------------------------------------------


def resolve_url(url: str | None, config: Path | None) -> str:
    """--url, else --config's listen, else the default config's if it exists, else the default."""
    if url is not None:
        if url.rstrip("/").endswith("/status"):
            url = url.rstrip("/")[: -len("/status")]
        try:
            return normalize_server_url(url)
        except ValueError as exc:
            raise UsageError(f"status: --url {exc}") from None
    if config is not None:
        section = load_config(config).supervisor
        return listen_url(section.listen_host, section.listen_port)
    if not DEFAULT_CONFIG.exists():
        return DEFAULT_URL
    try:
        section = load_config(DEFAULT_CONFIG).supervisor
    except InvalidConfig as exc:
        # Not asked for: an unreadable (e.g. root-only) default config is no reason to give up.
        first = str(exc).splitlines()[0]
        print(f"k26-supervisor: warning: {first}; trying {DEFAULT_URL}", file=sys.stderr)
        return DEFAULT_URL
    return listen_url(section.listen_host, section.listen_port)


def listen_url(host: str, port: int) -> str:
    """Where a client reaches a listener: a wildcard address means this host's loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def fetch(url: str) -> str:
    """The body of GET URL/status; UnavailableError when nothing answers."""
    target = f"{url}/status"
    try:
        with httpx.Client(trust_env=False, timeout=TIMEOUT_S) as client:
            response = client.get(target, headers={"Accept": "application/json"})
    except httpx.TimeoutException:
        raise UnavailableError(
            f"supervisor at {url} did not answer GET /status within {TIMEOUT_S:g} s; {_HINT}"
        ) from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise UsageError(f"status: --url {url!r}: {_one_line(str(exc))}") from None
    except httpx.HTTPError as exc:
        reason = _one_line(str(exc)) or type(exc).__name__
        raise UnavailableError(f"cannot reach the supervisor at {url}: {reason}; {_HINT}") from None
    if response.status_code >= 500:
        raise UnavailableError(
            f"supervisor at {url} answered GET /status with HTTP {response.status_code}; "
            "see: journalctl -u k26-supervisor"
        )
    if response.status_code != 200:
        raise InputError(
            f"{target} answered HTTP {response.status_code}: not a k26-supervisor "
            "(check --url or the config's listen)"
        )
    return response.text


def parse_status(body: str, url: str) -> dict[str, Any]:
    """The /status document, checked for the shape this command reads; InputError if not."""
    where = f"{url}/status"
    try:
        doc = json.loads(body)
    except ValueError:
        raise InputError(
            f"{where} did not answer JSON ({_one_line(body)[:60]!r}): not a k26-supervisor"
        ) from None
    problem = _shape_problem(doc)
    if problem is not None:
        raise InputError(f"{where} is not a k26-supervisor /status document: {problem}")
    result: dict[str, Any] = doc
    return result


def _shape_problem(doc: object) -> str | None:
    if not isinstance(doc, dict):
        return f"expected a JSON object, got {type(doc).__name__}"
    if not isinstance(doc.get("ready"), bool):
        return "'ready' is missing or not true/false"
    units = doc.get("units")
    if not isinstance(units, dict):
        return "'units' is missing or not an object"
    for key in ("supervisor", "warmup"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            return f"{key!r} is not an object"
    for name, unit in units.items():
        if not isinstance(unit, dict):
            return f"units[{name!r}] is not an object"
        if not isinstance(unit.get("state"), str):
            return f"units[{name!r}].state is missing or not a string"
        for key in ("last_exit", "last_probe"):
            if unit.get(key) is not None and not isinstance(unit[key], dict):
                return f"units[{name!r}].{key} is not an object"
    return None


# --- rendering (pure) --------------------------------------------------------------


def render_table(
    status: Mapping[str, Any], *, now: datetime | None = None, running: bool = True
) -> str:
    """The human view of a /status document: header, one row per unit, then notes."""
    now = datetime.now(UTC) if now is None else now
    lines = [_header(status, now, running)]
    warmup = status.get("warmup") or {}
    if warmup.get("error"):
        lines.append(f"warm-up error: {_clean(warmup['error'])}")
    units: Mapping[str, Any] = status.get("units") or {}
    if not units:
        lines.append("no units configured")
        return "\n".join(lines) + "\n"
    header = ("UNIT", "ROLE", "STATE", "READY", "LAST EXIT", "LAST PROBE", "RESTARTS")
    rows = [header]
    notes: list[str] = []
    for name, unit in units.items():
        rows.append(
            (
                _clean(name),
                _clean(unit.get("role") or "-"),
                _clean(unit.get("state") or "-"),
                "yes" if unit.get("ready") is True else "no",
                _last_exit(unit.get("last_exit"), now),
                _last_probe(unit.get("last_probe"), short=True),
                _clean(unit.get("restarts", "-")),
            )
        )
        note = _notes(unit)
        if note:
            notes.append(f"  {_clean(name)}: {note}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if notes:
        lines.append("")
        lines.extend(notes)
    for name, unit in units.items():
        for key in ("last_start", "last_recovery"):
            timeline = unit.get(key)
            if not isinstance(timeline, dict):
                continue
            what = "last start" if key == "last_start" else "last recovery"
            cause = f" from {_clean(timeline['cause'])}" if timeline.get("cause") else ""
            total = timeline.get("total_s")
            took = f"{total:.1f} s" if isinstance(total, int | float) else "?"
            lines.append("")
            lines.append(f"{_clean(name)}: {what}{cause}, {took} to READY:")
            lines.extend(f"  {_clean(line)}" for line in compact(timeline))
    return "\n".join(lines) + "\n"


def _header(status: Mapping[str, Any], now: datetime, running: bool) -> str:
    ready = "READY" if status.get("ready") is True else "NOT READY"
    warmup = status.get("warmup")
    if warmup:
        state = _clean(warmup.get("state") or "?")
        at = warmup.get("at")
        when = f" {_when(at, now)}" if at else ""
        warm = f"warm-up (arch {_clean(warmup.get('arch') or '?')}): {state}{when}"
    else:
        warm = "warm-up: none (disabled or not run yet)"
    parts = [f"supervisor: {ready}", warm]
    sup = status.get("supervisor") or {}
    about = []
    if sup.get("version"):
        about.append(f"version {_clean(sup['version'])}")
    if sup.get("pid") is not None:
        about.append(f"pid {_clean(sup['pid'])}")
    started = _parse_time(sup.get("started_at"))
    if started is not None and running:
        about.append(f"up {_span((now - started).total_seconds())}")
    if about:
        parts.append(", ".join(about))
    return "; ".join(parts)


def _last_exit(last_exit: Mapping[str, Any] | None, now: datetime) -> str:
    if not last_exit:
        return "-"
    cause = _clean(last_exit.get("cause") or "?")
    at = last_exit.get("at")
    return f"{cause} {_when(at, now)}" if at else cause


def _last_probe(probe: Mapping[str, Any] | None, *, short: bool) -> str:
    if not probe:
        return "-"
    if probe.get("ok") is True:
        latency = probe.get("latency_ms")
        if isinstance(latency, int | float) and not isinstance(latency, bool):
            return f"ok {latency:.1f} ms"
        return "ok"
    error = _clean(probe.get("error") or "unknown error")
    if short and len(error) > _MAX_PROBE_ERROR:
        error = error[: _MAX_PROBE_ERROR - 3] + "..."
    return f"FAIL {error}"


def _notes(unit: Mapping[str, Any]) -> str:
    notes = []
    if unit.get("state") == "failed" and unit.get("reason"):
        notes.append(f"failed: {_clean(unit['reason'])}")
    if unit.get("fallback_engaged") is True:
        notes.append("fallback engaged (its fallback unit serves)")
    if unit.get("sampling_backend") == "pytorch":
        notes.append("sampling backend pytorch (last-resort drop-in active)")
    probe = unit.get("last_probe")
    if probe and probe.get("ok") is not True:
        full = _last_probe(probe, short=False)
        if full != _last_probe(probe, short=True):
            notes.append(f"last probe: {full}")
    return "; ".join(notes)


def _when(at: object, now: datetime) -> str:
    """'3m ago (2024-05-01T12:00:00Z)'; the raw text when it is not a time."""
    parsed = _parse_time(at)
    if parsed is None:
        return _clean(at)
    seconds = (now - parsed).total_seconds()
    relative = f"{_span(seconds)} ago" if seconds >= 0 else f"in {_span(-seconds)}"
    iso = parsed.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return f"{relative} ({iso})"


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _span(seconds: float) -> str:
    """A short human duration: 12s, 3m, 2h 5m, 4d 3h."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        hours, minutes = divmod(s // 60, 60)
        return f"{hours}h {minutes}m" if minutes else f"{hours}h"
    days, hours = divmod(s // 3600, 24)
    return f"{days}d {hours}h" if hours else f"{days}d"


def _clean(value: object) -> str:
    """Text from the wire, safe for a terminal: one line, no control characters."""
    return _CONTROL.sub("?", str(value))


def _one_line(text: str) -> str:
    return " ".join(text.split())
