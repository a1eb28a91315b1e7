"""``k26-supervisor explain``: why did it die? A post-mortem for a person.

``explain UNIT`` reads the unit's last exit from systemd, this run's output (its
journal, or its ``StandardOutput=append:`` file) and the kernel log, and prints
the verdict, what to do, and the lines that decided it. ``explain --output FILE``
does the same for logs pasted from somewhere else, with the exit status given
by hand (``--exit-status N`` or ``--signal N``; neither: SGLang's usual end, its
own SIGKILL). Both use the daemon's own classifier (``core.classify``) and
nothing else. ``--json`` prints the verdict as one JSON object.

Exit 0 when a verdict was printed, 65 for unreadable input, 69 when systemd
cannot be asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from supervisor.adapters.evidence import OutputTail, journal_lines, kernel_history
from supervisor.adapters.systemd_bus import SystemdBus
from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.classify import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    ExitSnapshot,
    Verdict,
    classify,
)
from supervisor.core.errors import InputError, UsageError
from supervisor.core.unitname import validate_service_name

_MAX_LINES = 2000
_SGLANG_END = 9  # SGLang's launcher ends every failure with its own SIGKILL


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "explain",
        help="explain a unit's last exit, or pasted logs, with the daemon's classifier",
        description=(
            "Print why a unit's main process died: the cause, what to do, and the "
            "evidence. UNIT: read its last exit from systemd, this run's journal or output "
            "file, and the kernel log. --output FILE: classify pasted logs instead."
        ),
    )
    parser.add_argument("unit", nargs="?", metavar="UNIT", help="a service unit")
    parser.add_argument("--bus", choices=["system", "user"], default="system")
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
    parser.set_defaults(handler=_explain)


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


def _from_files(args: argparse.Namespace) -> tuple[Verdict, dict[str, Any]]:
    output = _read_lines(args.output, "--output")
    kernel = _read_lines(args.kernel, "--kernel") if args.kernel else []
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
    snapshot = ExitSnapshot(
        unit="(pasted)",
        result=result,
        exec_main_code=code,
        exec_main_status=status,
        main_pid=args.pid,
        stop_requested=args.stopped,
    )
    return classify(snapshot, kernel, output), {"source": str(args.output)}


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
    if context.get("source") and context.get("unit"):
        print(f"(output from {context['source']}; {context['kernel_lines']} kernel lines read)")
    sys.stdout.flush()
