"""Seeing exits the moment they happen, and explaining them.

``ExitTracker`` is pure: fed ``PropertiesChanged`` events and snapshots, it
decides when a unit's main process has exited (a new ``ExecMainPID`` /
``ExecMainExitTimestamp`` pair) or the unit failed without one
(``start-limit-hit``, ``resources``...). systemd repeats its signals often, so
it acts on transitions, never on the mere arrival of a signal.

``adapters.explain`` gathers the evidence for one exit (kernel log, the
unit's own output from this run) and hands it to the pure classifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from supervisor.core.bus_events import PropertiesChanged, UnitSnapshot

SERVICE_IFACE = "org.freedesktop.systemd1.Service"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
# Results that mean "failed" even when no main process exited.
NO_PROCESS_FAILURES = frozenset(
    {"start-limit-hit", "resources", "protocol", "timeout", "exit-code"}
)


@dataclass(frozen=True)
class ExitObserved:
    """A unit's main process ended (or the unit failed without one)."""

    unit: str
    result: str
    exec_main_code: int
    exec_main_status: int
    exec_main_pid: int
    exited_at: datetime
    control_group: str
    output_path: str
    output_offset: int
    observed_at: float  # monotonic, when the D-Bus signal was read
    started_monotonic: float = 0.0  # ExecMainStartTimestampMonotonic, in seconds
    started_at: datetime | None = None


@dataclass(frozen=True)
class ActiveStateChanged:
    unit: str
    old: str
    new: str
    sub_state: str
    at: float


TrackerEvent = ExitObserved | ActiveStateChanged


@dataclass
class UnitTrack:
    unit: str
    active_state: str = ""
    sub_state: str = ""
    main_pid: int = 0
    control_group: str = ""
    output_path: str = ""
    output_offset: int = 0
    last_exit_key: tuple[int, int] = (0, 0)
    last_result: str = "success"
    seeded: bool = False


def _usec_dt(value: int) -> datetime:
    if value <= 0:
        return datetime.now(tz=UTC)
    return datetime.fromtimestamp(value / 1_000_000, tz=UTC)


@dataclass
class ExitTracker:
    """Per-unit memory of what was already seen; pure."""

    units: dict[str, UnitTrack] = field(default_factory=dict)

    def watch(self, unit: str) -> UnitTrack:
        return self.units.setdefault(unit, UnitTrack(unit))

    def seed(self, snap: UnitSnapshot, *, output_offset: int = 0) -> None:
        """Adopt a freshly read snapshot. Exits that happened before are not news."""
        track = self.watch(snap.unit)
        exit_us = int(snap.exec_main_exit.timestamp() * 1_000_000) if snap.exec_main_exit else 0
        if not track.seeded:
            track.last_exit_key = (snap.exec_main_pid, exit_us) if exit_us else (0, 0)
            track.last_result = snap.result or "success"
            track.seeded = True
        track.active_state = snap.active_state
        track.sub_state = snap.sub_state
        track.main_pid = snap.main_pid
        if snap.control_group:
            track.control_group = snap.control_group
        if snap.standard_output_path:
            track.output_path = snap.standard_output_path
        if output_offset:
            track.output_offset = output_offset

    def note_output_offset(self, unit: str, offset: int) -> None:
        self.watch(unit).output_offset = offset

    def feed(self, event: PropertiesChanged) -> list[TrackerEvent]:
        track = self.units.get(event.unit)
        if track is None:
            return []
        out: list[TrackerEvent] = []
        props = event.changed
        if event.interface == UNIT_IFACE and "ActiveState" in props:
            new = str(props["ActiveState"])
            sub = str(props.get("SubState", track.sub_state))
            if new != track.active_state:
                out.append(ActiveStateChanged(event.unit, track.active_state, new, sub, event.at))
                if new in {"activating", "active"}:
                    track.last_result = "success"
            track.active_state = new
            track.sub_state = sub
        elif event.interface == SERVICE_IFACE:
            pid = int(props.get("ExecMainPID", 0) or 0)
            exit_us = int(props.get("ExecMainExitTimestamp", 0) or 0)
            result = str(props.get("Result", "") or "")
            if "MainPID" in props and int(props["MainPID"] or 0):
                track.main_pid = int(props["MainPID"])
            key = (pid, exit_us)
            if exit_us and key != track.last_exit_key:
                track.last_exit_key = key
                track.last_result = result or track.last_result
                out.append(self._observed(track, props, pid, exit_us, event.at))
            elif result and result != track.last_result:
                track.last_result = result
                if result in NO_PROCESS_FAILURES:
                    out.append(self._observed(track, props, 0, 0, event.at))
        return out

    @staticmethod
    def _observed(
        track: UnitTrack, props: dict[str, object], pid: int, exit_us: int, at: float
    ) -> ExitObserved:
        return ExitObserved(
            unit=track.unit,
            result=str(props.get("Result", "") or ""),
            exec_main_code=int(props.get("ExecMainCode", 0) or 0),  # type: ignore[call-overload]
            exec_main_status=int(props.get("ExecMainStatus", 0) or 0),  # type: ignore[call-overload]
            exec_main_pid=pid,
            exited_at=_usec_dt(exit_us),
            control_group=track.control_group,
            output_path=track.output_path,
            output_offset=track.output_offset,
            observed_at=at,
            started_monotonic=int(props.get("ExecMainStartTimestampMonotonic", 0) or 0)  # type: ignore[call-overload]
            / 1_000_000,
            started_at=_usec_dt(int(props.get("ExecMainStartTimestamp", 0) or 0))  # type: ignore[call-overload]
            if props.get("ExecMainStartTimestamp")
            else None,
        )
