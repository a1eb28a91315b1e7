"""Seeing exits the moment they happen, and who asked for them.

``ExitTracker`` is pure: fed ``PropertiesChanged`` events and snapshots, it
decides when a unit's main process has exited (a new ``ExecMainPID`` /
``ExecMainExitTimestamp`` pair) or the unit failed without one
(``start-limit-hit``, ``resources``...). systemd repeats its signals often, so
it acts on transitions, never on the mere arrival of a signal.

It also decides whether an exit was *asked for*, and by whom. systemd puts the
unit's current job in the Unit interface's ``Job`` property, and publishes it
before the job runs. A job the supervisor did not issue (it announces its own
with ``expect_job``) that is present while the unit is up and ends with the
process gone is an operator's stop or restart, whatever the exit looks like:
real SGLang SIGKILLs itself after draining on SIGTERM, so an ordinary
``systemctl stop`` ends in ``Result=signal``/status 9. A process that dies on its
own has no job: systemd's clean-up of the rest of its cgroup runs without one.

``reconcile`` compares a fresh snapshot with what the signals said, so that a
periodic re-read catches an exit whose signal was lost.

``adapters.exit_watch`` gathers the evidence for one exit (kernel log, the
unit's own output from this run or the journal) and hands it to the classifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from supervisor.core.bus_events import PropertiesChanged, UnitSnapshot, hex_id, job_path

SERVICE_IFACE = "org.freedesktop.systemd1.Service"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
# Results that mean "failed" even when no main process exited.
NO_PROCESS_FAILURES = frozenset(
    {"start-limit-hit", "resources", "protocol", "timeout", "exit-code"}
)
# ActiveStates in which a job on the unit can only mean "take it down" (stop,
# restart) or a no-op (start, verify-active) that finishes at once.
_UP = frozenset({"active", "reloading", "deactivating"})

StopBy = Literal["supervisor", "operator"]


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
    # Who asked for the unit to go down: a stop/restart job was in flight. None
    # when the process ended on its own.
    stop_by: StopBy | None = None


@dataclass(frozen=True)
class ActiveStateChanged:
    unit: str
    old: str
    new: str
    sub_state: str
    at: float


@dataclass(frozen=True)
class ForeignJobDone:
    """A job the supervisor did not issue finished on a unit that is down: an
    operator's ``systemctl stop`` of a unit between runs (in backoff, warming up, in
    standby). No process exits, so no exit says so; the job is all there is. Whether
    the unit is still down is for a fresh read to confirm (a ``systemctl start``'s
    job also ends, with the unit up)."""

    unit: str
    job: str
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
    job: str = ""  # the unit's current job path ("" for none)
    job_owner: dict[str, StopBy] = field(default_factory=dict)  # job path -> who issued it
    own_jobs: int = 0  # jobs the supervisor has asked for and not yet seen answered
    # Jobs first seen while one of the supervisor's calls was unanswered: taken as its
    # own until its answer names another path (then they are an operator's).
    unconfirmed: set[str] = field(default_factory=set)
    stop_by: StopBy | None = None  # a job asked this run to go down, issued by ...
    signals: int = 0  # PropertiesChanged signals fed so far (see ``reconcile``)
    invocation_id: str = ""  # systemd's InvocationID of the current (or last) run


def _usec_dt(value: int) -> datetime:
    if value <= 0:
        return datetime.now(tz=UTC)
    return datetime.fromtimestamp(value / 1_000_000, tz=UTC)


_JOB_OWNERS_KEPT = 64


@dataclass
class ExitTracker:
    """Per-unit memory of what was already seen; pure."""

    units: dict[str, UnitTrack] = field(default_factory=dict)

    def watch(self, unit: str) -> UnitTrack:
        return self.units.setdefault(unit, UnitTrack(unit))

    def seed(self, snap: UnitSnapshot, *, output_offset: int = 0) -> None:
        """Adopt a freshly read snapshot. Exits that happened before are not news."""
        track = self.watch(snap.unit)
        if not track.seeded:
            track.last_exit_key = _exit_key(snap)
            track.last_result = snap.result or "success"
            track.seeded = True
        track.active_state = snap.active_state
        track.sub_state = snap.sub_state
        track.main_pid = snap.main_pid
        if snap.invocation_id:
            track.invocation_id = snap.invocation_id
        self._see_job(track, snap.job)
        if snap.control_group:
            track.control_group = snap.control_group
        if snap.standard_output_path:
            track.output_path = snap.standard_output_path
        if output_offset:
            track.output_offset = output_offset

    def note_output_offset(self, unit: str, offset: int) -> None:
        self.watch(unit).output_offset = offset

    def signal_count(self, unit: str) -> int:
        return self.watch(unit).signals

    # --- jobs: whose stop was it? ----------------------------------------------------

    def expect_job(self, unit: str) -> None:
        """The supervisor is about to ask systemd for a job on ``unit``. Call it before
        the D-Bus call: systemd may publish the job before the call returns."""
        self.watch(unit).own_jobs += 1

    def job_answered(self, unit: str, job: str = "") -> None:
        """The supervisor's job on ``unit`` was answered (JobRemoved, or the call failed).
        ``job``: its path, so that its signals still queued are known as ours."""
        track = self.watch(unit)
        track.own_jobs = max(0, track.own_jobs - 1)
        if not job:
            return  # the call failed: a job it may have left stays taken as ours
        track.job_owner[job] = "supervisor"
        track.unconfirmed.discard(job)
        if track.own_jobs or not track.unconfirmed:
            return
        # Every call is answered, and none named these: an operator's `systemctl stop`
        # that landed while ours was in flight (it replaces our start job).
        for other in track.unconfirmed:
            track.job_owner[other] = "operator"
        track.unconfirmed.clear()
        if track.job and track.stop_by is not None:
            track.stop_by = track.job_owner.get(track.job, track.stop_by)

    def _see_job(self, track: UnitTrack, job: str) -> None:
        if job and job not in track.job_owner:
            if track.own_jobs:
                track.job_owner[job] = "supervisor"
                track.unconfirmed.add(job)
            else:
                track.job_owner[job] = "operator"
        track.job = job
        if job and track.active_state in _UP:
            track.stop_by = track.job_owner[job]
        elif not job and track.active_state in ("active", "reloading"):
            track.stop_by = None  # a no-op job (start of an active unit) came and went

    def job_removed(self, unit: str, job: str, result: str, at: float) -> ForeignJobDone | None:
        """systemd's JobRemoved for ``unit``: a ForeignJobDone when a job nobody here
        asked for finished successfully while the unit was down."""
        track = self.units.get(unit)
        if track is None or result != "done" or track.active_state in (*_UP, "activating"):
            return None
        owner = track.job_owner.get(job)
        if owner == "supervisor" or job in track.unconfirmed:
            return None
        if owner is None and track.own_jobs:
            return None  # maybe ours: its call is still unanswered
        track.job_owner.setdefault(job, "operator")
        return ForeignJobDone(unit, job, at)

    # --- signals ------------------------------------------------------------------

    def feed(self, event: PropertiesChanged) -> list[TrackerEvent]:
        track = self.units.get(event.unit)
        if track is None:
            return []
        out: list[TrackerEvent] = []
        track.signals += 1
        props = event.changed
        if event.interface == UNIT_IFACE:
            if "ActiveState" in props:
                new = str(props["ActiveState"])
                sub = str(props.get("SubState", track.sub_state))
                if new != track.active_state:
                    out.append(
                        ActiveStateChanged(event.unit, track.active_state, new, sub, event.at)
                    )
                    if new in {"activating", "active"} and track.active_state in (
                        "inactive",
                        "failed",
                        "",
                    ):
                        self._new_run(track)
                    if new in {"activating", "active"}:
                        track.last_result = "success"
                track.active_state = new
                track.sub_state = sub
            if "Job" in props:
                self._see_job(track, job_path(props["Job"]))
            invocation = hex_id(props.get("InvocationID"))
            if invocation:
                track.invocation_id = invocation
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
                # While the main process lives (a stop or start timeout: systemd sets
                # Result before its SIGKILL lands), its exit is still to come.
                alive = props.get("MainPID") not in (None, 0, "0")
                if result in NO_PROCESS_FAILURES and not alive:
                    out.append(self._observed(track, props, 0, 0, event.at))
        return out

    def reconcile(
        self, snap: UnitSnapshot, at: float, *, signals_seen: int | None = None
    ) -> list[TrackerEvent]:
        """What a fresh snapshot shows that no signal told us: an exit, a new state.

        The safety net for a lost signal (the periodic resync). Events come out
        exactly as ``feed`` would have made them, so they go down the same path.
        ``signals_seen`` is ``signal_count(unit)`` taken before the snapshot was
        asked for: if signals arrived meanwhile, they are flowing and are newer
        than the snapshot's news, so nothing is reported (an old snapshot must not
        undo what a signal said). Omit it after a reconnect, when signals were lost.
        """
        track = self.watch(snap.unit)
        out: list[TrackerEvent] = []
        if signals_seen is not None and track.signals != signals_seen:
            return out
        key = _exit_key(snap)
        if key != (0, 0) and key[1] > track.last_exit_key[1]:
            track.last_exit_key = key
            track.last_result = snap.result or track.last_result
            out.append(
                ExitObserved(
                    unit=snap.unit,
                    result=snap.result,
                    exec_main_code=snap.exec_main_code,
                    exec_main_status=snap.exec_main_status,
                    exec_main_pid=snap.exec_main_pid,
                    exited_at=snap.exec_main_exit or _usec_dt(0),
                    control_group=snap.control_group or track.control_group,
                    output_path=track.output_path or snap.standard_output_path,
                    output_offset=track.output_offset,
                    observed_at=at,
                    started_monotonic=snap.exec_main_start_monotonic,
                    started_at=snap.exec_main_start,
                    stop_by=track.stop_by,
                )
            )
        if snap.active_state != track.active_state:
            out.append(
                ActiveStateChanged(
                    snap.unit, track.active_state, snap.active_state, snap.sub_state, at
                )
            )
            if snap.active_state in ("activating", "active"):
                self._new_run(track)
            track.active_state = snap.active_state
            track.sub_state = snap.sub_state
        track.main_pid = snap.main_pid
        if snap.control_group:
            track.control_group = snap.control_group
        return out

    @staticmethod
    def _new_run(track: UnitTrack) -> None:
        """A new run of the unit begins: an earlier stop request is over."""
        track.stop_by = None
        # Owners of earlier jobs are kept (job paths are never reused): a signal about
        # the supervisor's own stop may be read only after this run's start signal,
        # and after the stop's answer already came back. Bounded, oldest first out.
        while len(track.job_owner) > _JOB_OWNERS_KEPT:
            track.unconfirmed.discard(next(iter(track.job_owner)))
            del track.job_owner[next(iter(track.job_owner))]

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
            stop_by=track.stop_by,
        )


def _exit_key(snap: UnitSnapshot) -> tuple[int, int]:
    exit_us = snap.exec_main_exit_us
    return (snap.exec_main_pid, exit_us) if exit_us else (0, 0)
