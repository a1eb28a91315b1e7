"""``k26-supervisor watch UNIT...``: one JSON line per exit, as it happens.

The operator's ``journalctl -f`` for deaths: each line says which unit died,
why (the classified cause), when, and the evidence that decided it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from supervisor.adapters.bus import BusKind
from supervisor.adapters.evidence import KernelLog
from supervisor.adapters.exit_watch import ExitWatch, ExplainedExit, JournalReader
from supervisor.adapters.systemd_bus import SystemdBus
from supervisor.commands.parsers import Subparsers, add_bus_arg, add_command
from supervisor.core.errors import UsageError
from supervisor.core.exits import ExitObserved
from supervisor.core.unitname import validate_service_name

_USAGE = """print one JSON line per unit exit, with its cause and evidence

Watch systemd units over D-Bus and print one JSON line per exit as it happens: unit,
cause, at, main_pid, exit_code or signal, and evidence."""


def register(sub: Subparsers) -> None:
    parser = add_command(sub, "watch", _USAGE, _handler)
    parser.add_argument("units", nargs="+", metavar="UNIT", help="service units to watch")
    add_bus_arg(parser)
    parser.add_argument("--count", type=int, default=0, help="exit after N exits (0: forever)")
    parser.add_argument(
        "--timeout", type=float, default=0.0, help="give up after S seconds (0: never)"
    )


def _handler(args: argparse.Namespace) -> int:
    units = [validate_service_name(u) for u in args.units]
    if args.count < 0 or args.timeout < 0:
        raise UsageError("--count and --timeout must not be negative")

    def emit(record: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()

    def announce() -> None:
        print(
            f"k26-supervisor: watching {', '.join(units)} on the {args.bus} bus",
            file=sys.stderr,
            flush=True,
        )

    coro = watch(units, args.bus, emit=emit, count=args.count, on_ready=announce)
    try:
        if args.timeout:
            asyncio.run(asyncio.wait_for(coro, args.timeout))
        else:
            asyncio.run(coro)
    except TimeoutError:
        print(f"k26-supervisor: watch: no more exits within {args.timeout:g}s", file=sys.stderr)
        return 1
    return 0


def exit_record(exit_: ExitObserved, verdict: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "unit": exit_.unit,
        "cause": str(verdict.cause),
        "summary": verdict.summary,
        "at": exit_.exited_at.isoformat(),
        "main_pid": exit_.exec_main_pid,
        "result": exit_.result,
        "stop_by": exit_.stop_by,
        "exit_code": verdict.exit_code,
        "signal": verdict.signal,
        "evidence": list(verdict.evidence),
        # CLOCK_MONOTONIC is machine-wide: lets a benchmark compare with its kill time.
        "observed_monotonic": exit_.observed_at,
        "classified_monotonic": time.monotonic(),
    }
    return record


async def watch(
    units: Sequence[str],
    bus_kind: BusKind,
    *,
    emit: Callable[[dict[str, Any]], None],
    count: int = 0,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """The daemon's own exit pipeline (``ExitWatch``), printing instead of acting."""
    kernel_log = KernelLog()
    await kernel_log.start()
    bus = SystemdBus(bus_kind)
    await bus.connect()
    exits = ExitWatch(
        bus, units, kernel_log=kernel_log, journal=JournalReader(user=bus_kind == "user")
    )
    seen = 0
    try:
        for unit in units:
            await exits.seed(unit)
        if on_ready is not None:
            on_ready()
        async for event in bus.events():
            for change in await exits.handle(event):
                if not isinstance(change, ExplainedExit):
                    continue
                emit(exit_record(change.exit, change.verdict))
                seen += 1
                if count and seen >= count:
                    return
    finally:
        with contextlib.suppress(Exception):
            await exits.close()
        with contextlib.suppress(Exception):
            await bus.close()
        kernel_log.close()
