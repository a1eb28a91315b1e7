"""``k26-supervisor explain``: why did it die? A post-mortem for a person.

``explain UNIT`` reads the unit's last exit from systemd, this run's output (its
journal, or its ``StandardOutput=append:`` file) and the kernel log, and prints
the verdict, what to do, and the lines that decided it. ``explain --output FILE``
does the same for logs pasted from somewhere else. How it ended is given by hand
(``--exit-status N``, ``--signal N``, ``--result R``), or else read from what the
text itself shows: systemd's own ``Failed with result 'oom-kill'`` and ``Main
process exited, code=..., status=...`` lines, a shell's ``Segmentation fault (core
dumped)`` or its final ``Killed``; with none of those, SGLang's usual end, its own
SIGKILL. Without ``--pid``, a kernel ``Killed process N (...)`` line (in ``--kernel``
or pasted with the output) makes N the probable main PID, and the verdict says so.
Both use the daemon's own classifier (``core.classify``) and nothing else.
``--json`` prints the verdict as one JSON object.

Exit 0 when a verdict was printed, 65 for unreadable input, 69 when systemd
cannot be asked.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.adapters.evidence import OutputTail, journal_lines, kernel_history
from supervisor.adapters.systemd_bus import SystemdBus
from supervisor.commands.parsers import Subparsers, add_bus_arg, add_command
from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.classify import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    ExitCause,
    ExitSnapshot,
    Verdict,
    classify,
)
from supervisor.core.errors import InputError, UsageError
from supervisor.core.unitname import validate_service_name

_MAX_LINES = 2000
_SGLANG_END = 9  # SGLang's launcher ends every failure with its own SIGKILL


_USAGE = """explain a unit's last exit, or pasted logs, with the daemon's classifier

Print why a unit's main process died: the cause, what to do, and the evidence. UNIT: read
its last exit from systemd, this run's journal or output file, and the kernel log.
--output FILE: classify pasted logs instead."""


def register(sub: Subparsers) -> None:
    parser = add_command(sub, "explain", _USAGE, _explain)
    parser.add_argument("unit", nargs="?", metavar="UNIT", help="a service unit")
    add_bus_arg(parser)
    parser.add_argument("--output", type=Path, metavar="FILE", help="the server's output, pasted")
    parser.add_argument("--kernel", type=Path, metavar="FILE", help="kernel log lines (dmesg)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--exit-status", type=int, metavar="N", help="it exited with status N")
    how.add_argument("--signal", type=int, metavar="N", help="it was killed by signal N")
    parser.add_argument(
        "--result",
        metavar="RESULT",
        help="with --output: systemd's Result= (signal, exit-code, core-dump, oom-kill, ...)",
    )
    parser.add_argument(
        "--pid", type=int, default=0, metavar="PID", help="with --output: its main PID"
    )
    parser.add_argument(
        "--stopped",
        action="store_true",
        help="with --output: a stop job was running when it ended (someone asked for it)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")


def _explain(args: argparse.Namespace) -> int:
    if (args.unit is None) == (args.output is None):
        raise UsageError("explain: give a UNIT, or --output FILE (not both)")
    if args.unit is not None and (
        args.kernel or args.exit_status is not None or args.signal is not None or args.stopped
    ):
        raise UsageError(
            "explain: --kernel, --exit-status, --signal and --stopped go with --output"
        )
    if args.unit is not None:
        unit = validate_service_name(args.unit)
        verdict, context = asyncio.run(_from_systemd(unit, args.bus))
    else:
        verdict, context = _from_files(args)
    if args.json:
        print(json.dumps({**verdict.to_json(), **context}, indent=2))
    else:
        _print(verdict, context)
    return 0


def _read_lines(path: Path, what: str) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-_MAX_LINES:]
    except OSError as exc:
        raise InputError(f"explain: cannot read {what} {path}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class _Ending:
    """How the process ended, as systemd would say it, and what said so."""

    code: int
    status: int
    result: str
    told_by: str  # "" when given by hand or assumed


# systemd's own lines, as journalctl prints them: "x.service: Failed with result
# 'oom-kill'.", "x.service: Main process exited, code=killed, status=9/KILL".
_SYSTEMD_RESULT_RE = re.compile(r"\bFailed with result '(?P<result>[\w-]+)'")
_SYSTEMD_EXITED_RE = re.compile(
    r"\bMain process exited, code=(?P<code>exited|killed|dumped), status=(?P<status>\d+)"
)
_CODES = {"exited": CLD_EXITED, "killed": CLD_KILLED, "dumped": CLD_DUMPED}
# A shell's report of its child: "Segmentation fault (core dumped)", "Aborted (core
# dumped)"; "Killed", "./run.sh: line 3: 4242 Killed    python -m sglang...", zsh's
# "zsh: killed     python ...".
_CORE_DUMPED_RE = re.compile(r"(?P<what>[A-Z][\w /-]*?) \(core dumped\)")
_SHELL_SIGNALS = {
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Bus error": signal.SIGBUS,
    "Illegal instruction": signal.SIGILL,
    "Floating point exception": signal.SIGFPE,
    "Trace/breakpoint trap": signal.SIGTRAP,
    "Quit": signal.SIGQUIT,
}
_SHELL_KILLED_RE = re.compile(r"^(?:Killed|(?:.*: line \d+: +)?\d+ Killed\b.*|zsh: killed\b.*)$")
_KERNEL_KILLED_RE = re.compile(r"\bKilled process (?P<pid>\d+) \((?P<comm>[^)]*)\)")
# Kernel OOM records pasted together with the output.
_KERNEL_OOM_TEXT = ("Killed process ", "oom-kill:", "Out of memory: ")


def _ending_by_hand(args: argparse.Namespace) -> _Ending | None:
    if args.exit_status is None and args.signal is None and args.result is None:
        return None
    if args.exit_status is not None:
        code, status = CLD_EXITED, args.exit_status
        result = "success" if status == 0 else "exit-code"
    else:
        code, status = CLD_KILLED, _SGLANG_END if args.signal is None else args.signal
        result = "signal"
    if args.result is not None:
        result = args.result
        if result == "core-dump":
            code = CLD_DUMPED
    return _Ending(code, status, result, "")


def _ending_from_text(output: list[str]) -> _Ending | None:
    """What the pasted text itself shows about how the process ended, if anything:
    systemd's own lines first, then a shell's "(core dumped)", then its final "Killed"."""
    results = [m for ln in output if (m := _SYSTEMD_RESULT_RE.search(ln))]
    exited = [m for ln in output if (m := _SYSTEMD_EXITED_RE.search(ln))]
    if results or exited:
        code = _CODES[exited[-1].group("code")] if exited else CLD_KILLED
        status = int(exited[-1].group("status")) if exited else int(signal.SIGKILL)
        result = results[-1].group("result") if results else ""
        if not result:
            result = {CLD_EXITED: "exit-code", CLD_KILLED: "signal"}.get(code, "core-dump")
            result = "success" if code == CLD_EXITED and status == 0 else result
        elif result == "core-dump":
            code, status = CLD_DUMPED, status if exited else int(signal.SIGABRT)
        said = (results or exited)[-1].group(0)
        return _Ending(code, status, result, f"systemd's line '{said}'")
    for line in reversed(output):
        dumped = _CORE_DUMPED_RE.search(line)
        if dumped is not None:
            number = int(_SHELL_SIGNALS.get(dumped.group("what").strip(), signal.SIGABRT))
            return _Ending(CLD_DUMPED, number, "core-dump", f"the shell's '{dumped.group(0)}'")
    last = next((ln.strip() for ln in reversed(output) if ln.strip()), "")
    if _SHELL_KILLED_RE.match(last):
        return _Ending(CLD_KILLED, int(signal.SIGKILL), "signal", f"the shell's final '{last}'")
    return None


def _from_files(args: argparse.Namespace) -> tuple[Verdict, dict[str, Any]]:
    output = _read_lines(args.output, "--output")
    kernel = _read_lines(args.kernel, "--kernel") if args.kernel else []
    # Kernel OOM records pasted with the output are the kernel's too.
    kernel += [ln for ln in output if any(t in ln for t in _KERNEL_OOM_TEXT) and ln not in kernel]
    context: dict[str, Any] = {"source": str(args.output)}
    ending = _ending_by_hand(args) or _ending_from_text(output)
    if ending is None:
        ending = _Ending(CLD_KILLED, _SGLANG_END, "signal", "")
    elif ending.told_by:
        context["ending"] = f"read from the text: {ending.told_by}"
    pid, killed = args.pid, None
    if not pid:
        killed = next((m for ln in reversed(kernel) if (m := _KERNEL_KILLED_RE.search(ln))), None)
        if killed is not None:
            pid = int(killed.group("pid"))
            context["main_pid"], context["main_pid_probable"] = pid, True
    snapshot = ExitSnapshot(
        unit="(pasted)",
        result=ending.result,
        exec_main_code=ending.code,
        exec_main_status=ending.status,
        main_pid=pid,
        stop_requested=args.stopped,
    )
    verdict = classify(snapshot, kernel, output)
    if killed is not None and verdict.cause is ExitCause.OOM_KILL:
        verdict = dataclasses.replace(
            verdict,
            summary=f"{verdict.summary} (probable: main PID {pid} is the one the kernel's "
            f"'{killed.group(0)}' names; give --pid to be sure)",
        )
    return verdict, context


async def _from_systemd(unit: str, bus_kind: str) -> tuple[Verdict, dict[str, Any]]:
    async with SystemdBus(bus_kind) as bus:  # type: ignore[arg-type]
        snap = await bus.snapshot(unit)
    if not snap.exec_main_exit_us and snap.result in ("", "success"):
        raise InputError(
            f"explain: {unit} has no exit to explain (ActiveState={snap.active_state})"
        )
    output, source = await _this_runs_output(snap, user=bus_kind == "user")
    kernel = await kernel_history(snap.exec_main_start_monotonic or None)
    exit_snapshot = ExitSnapshot(
        unit=unit,
        result=snap.result,
        exec_main_code=snap.exec_main_code,
        exec_main_status=snap.exec_main_status,
        main_pid=snap.exec_main_pid,
        control_group=snap.control_group,
        exited_at=snap.exec_main_exit,
    )
    context = {
        "unit": unit,
        "at": snap.exec_main_exit.isoformat() if snap.exec_main_exit else None,
        "main_pid": snap.exec_main_pid,
        "source": source,
        "kernel_lines": len(kernel),
    }
    return classify(exit_snapshot, kernel, output), context


async def _this_runs_output(snap: UnitSnapshot, *, user: bool) -> tuple[list[str], str]:
    if snap.standard_output_path:
        tail = OutputTail(snap.standard_output_path, max_bytes=256 * 1024)
        lines = await tail.lines(n=_MAX_LINES)
        return lines, snap.standard_output_path
    since = snap.exec_main_start or snap.exec_main_exit
    lines = await journal_lines(snap.unit, since=since, user=user, max_lines=_MAX_LINES)
    return lines, f"journal ({'user' if user else 'system'})"


def _print(verdict: Verdict, context: dict[str, Any]) -> None:
    where = context.get("unit") or context.get("source")
    when = f" at {context['at']}" if context.get("at") else ""
    print(f"{where}{when}: {verdict.cause}")
    print(f"  {verdict.summary}")
    print("evidence:")
    for line in verdict.evidence:
        print(f"  {line}")
    if context.get("ending"):
        print(f"(how it ended: {context['ending']})")
    if context.get("source") and context.get("unit"):
        print(f"(output from {context['source']}; {context['kernel_lines']} kernel lines read)")
    sys.stdout.flush()
