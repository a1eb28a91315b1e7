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

from supervisor.adapters.evidence import KernelLog
from supervisor.adapters.explain import explain, output_size
from supervisor.adapters.systemd_bus import BusKind, SystemdBus
from supervisor.core.bus_events import BusReconnected, PropertiesChanged
from supervisor.core.errors import UsageError
from supervisor.core.exits import ActiveStateChanged, ExitObserved, ExitTracker
from supervisor.core.unitname import validate_service_name


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "watch",
        help="print one JSON line per unit exit, with its cause and evidence",
        description=(
            "Watch systemd units over D-Bus and print one JSON line per exit as it happens: "
            "unit, cause, at, main_pid, exit_code or signal, and evidence."
        ),
    )
    parser.add_argument("units", nargs="+", metavar="UNIT", help="service units to watch")
    parser.add_argument("--bus", choices=["system", "user"], default="system")
    parser.add_argument("--count", type=int, default=0, help="exit after N exits (0: forever)")
    parser.add_argument(
        "--timeout", type=float, default=0.0, help="give up after S seconds (0: never)"
    )
    parser.set_defaults(handler=_handler)


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
    kernel_log = KernelLog()
    await kernel_log.start()
    bus = SystemdBus(bus_kind)
    await bus.connect()
    tracker = ExitTracker()
    seen = 0
    pending: set[asyncio.Task[None]] = set()

    async def seed(unit: str) -> None:
        snap = await bus.snapshot(unit)
        tracker.seed(snap, output_offset=await output_size(snap.standard_output_path))

    try:
        for unit in units:
            await seed(unit)
        if on_ready is not None:
            on_ready()
        async for event in bus.events():
            if isinstance(event, BusReconnected):
                for unit in units:
                    await seed(unit)
                continue
            if not isinstance(event, PropertiesChanged):
                continue
            for change in tracker.feed(event):
                if isinstance(change, ActiveStateChanged):
                    if change.new in {"activating", "active"}:
                        # Learn the new run's cgroup for OOM evidence, off the hot path.
                        task = asyncio.create_task(seed(change.unit))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                    continue
                verdict = await explain(change, kernel_log, user_bus=bus_kind == "user")
                emit(exit_record(change, verdict))
                # The next run's output starts after what we have read.
                tracker.note_output_offset(change.unit, await output_size(change.output_path))
                seen += 1
                if count and seen >= count:
                    return
    finally:
        for task in pending:
            task.cancel()
        with contextlib.suppress(Exception):
            await bus.close()
        kernel_log.close()
