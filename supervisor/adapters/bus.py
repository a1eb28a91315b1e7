"""The bus as the daemon and its adapters use it: a manager's units, their jobs and
the signals about them. Six calls, nothing more.

``systemd_bus.SystemdBus`` is the implementation (pystemd, a real systemd manager
over D-Bus). Callers are typed against this Protocol, so a test that needs a bus no
real manager can play (a refusal at a chosen moment, a job that never ends) writes a
small fake of it instead of reaching into SystemdBus. Every failure of a real bus is
a ``core.errors.BusError`` (``BusRefused`` when polkit or the bus policy says no);
anything else a call raises is a bug and propagates as itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Literal, Protocol

from supervisor.core.bus_events import BusEvent, JobResult, UnitSnapshot

BusKind = Literal["system", "user"]
JobVerb = Literal["start", "stop"]
JobMode = Literal["replace", "fail", "isolate", "ignore-dependencies", "ignore-requirements"]


class Bus(Protocol):
    kind: BusKind

    async def connect(self) -> None:
        """Open the call and signal connections and subscribe to the manager."""

    async def close(self) -> None:
        """Close both; jobs still awaited fail with BusError."""

    def events(self) -> AsyncIterator[BusEvent]:
        """Every signal, in order, as plain values (a reconnect is one of them)."""

    def pending_events(self) -> list[BusEvent]:
        """The events already read and not yet taken, without waiting."""

    async def snapshot(self, unit: str) -> UnitSnapshot:
        """The unit's properties now (it is loaded first, so any unit name answers)."""

    async def job(
        self,
        verb: JobVerb,
        unit: str,
        *,
        mode: JobMode = "replace",
        timeout_s: float = 900.0,
        enqueued: Callable[[], None] | None = None,
    ) -> JobResult:
        """Start or stop it and wait for the job's end; ``enqueued`` once systemd took it."""
