"""What systemd tells the supervisor, as plain values: D-Bus events and unit snapshots.

The adapter (``adapters.systemd_bus``) turns pystemd's messages into these; the
pure core (``core.exits``, the daemon's decisions) reads them. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class PropertiesChanged:
    unit: str
    interface: str
    changed: dict[str, Any]
    at: float  # time.monotonic() when the loop read it


@dataclass(frozen=True)
class JobRemoved:
    job_id: int
    job_path: str
    unit: str
    result: str  # done, canceled, timeout, failed, dependency, skipped
    at: float


@dataclass(frozen=True)
class UnitRemoved:
    unit: str
    at: float


@dataclass(frozen=True)
class BusReconnected:
    """The bus or the manager came back; every unit's state must be re-read."""

    reason: str
    at: float


BusEvent = PropertiesChanged | JobRemoved | UnitRemoved | BusReconnected


@dataclass(frozen=True)
class JobResult:
    unit: str
    verb: str
    job_path: str
    result: str
    issued_at: float
    done_at: float

    @property
    def ok(self) -> bool:
        return self.result == "done"


def _usec_to_dt(value: int) -> datetime | None:
    if not value or value >= 2**64 - 1:
        return None
    return datetime.fromtimestamp(value / 1_000_000, tz=UTC)


@dataclass(frozen=True)
class UnitSnapshot:
    """One consistent read of the properties the supervisor decides on."""

    unit: str
    load_state: str
    active_state: str
    sub_state: str
    result: str
    exec_main_code: int
    exec_main_status: int
    exec_main_pid: int
    main_pid: int
    n_restarts: int
    control_group: str
    restart: str
    standard_output: str
    standard_output_path: str  # the FILE of StandardOutput=append:FILE / file:FILE
    fragment_path: str
    invocation_id: str
    active_enter: datetime | None
    active_exit: datetime | None
    inactive_enter: datetime | None
    inactive_exit: datetime | None
    exec_main_start: datetime | None
    exec_main_exit: datetime | None
    state_change: datetime | None
    read_at: float = field(default=0.0)
    # Exact values, for comparing with what signals carried (a datetime round trip
    # through a float can be a microsecond off).
    exec_main_exit_us: int = 0
    exec_main_start_monotonic: float = 0.0  # seconds, CLOCK_MONOTONIC
    job: str = ""  # the unit's current job path, "" when none
    # What the unit runs with (its JIT caches are found from these; core/jit_caches).
    environment: tuple[str, ...] = ()  # Environment=, as KEY=VALUE
    environment_files: tuple[tuple[str, bool], ...] = ()  # (path, "-": a missing one is fine)
    user: str = ""
    private_tmp: bool = False
    cache_directories: tuple[str, ...] = ()

    @classmethod
    def from_props(cls, unit: str, p: dict[str, Any], read_at: float) -> UnitSnapshot:
        def s(key: str) -> str:
            return str(p.get(key, "") or "")

        def i(key: str) -> int:
            value = p.get(key, 0)
            return int(value) if isinstance(value, int) else 0

        def ts(key: str) -> datetime | None:
            return _usec_to_dt(i(key))

        return cls(
            unit=unit,
            load_state=s("LoadState"),
            active_state=s("ActiveState"),
            sub_state=s("SubState"),
            result=s("Result"),
            exec_main_code=i("ExecMainCode"),
            exec_main_status=i("ExecMainStatus"),
            exec_main_pid=i("ExecMainPID"),
            main_pid=i("MainPID"),
            n_restarts=i("NRestarts"),
            control_group=s("ControlGroup"),
            restart=s("Restart"),
            standard_output=s("StandardOutput"),
            standard_output_path=(
                s("StandardOutputFileDescriptorName")
                if s("StandardOutput") in {"file", "append", "truncate"}
                else ""
            ),
            fragment_path=s("FragmentPath"),
            invocation_id=hex_id(p.get("InvocationID")),
            active_enter=ts("ActiveEnterTimestamp"),
            active_exit=ts("ActiveExitTimestamp"),
            inactive_enter=ts("InactiveEnterTimestamp"),
            inactive_exit=ts("InactiveExitTimestamp"),
            exec_main_start=ts("ExecMainStartTimestamp"),
            exec_main_exit=ts("ExecMainExitTimestamp"),
            state_change=ts("StateChangeTimestamp"),
            read_at=read_at,
            exec_main_exit_us=i("ExecMainExitTimestamp"),
            exec_main_start_monotonic=i("ExecMainStartTimestampMonotonic") / 1_000_000,
            job=job_path(p.get("Job")),
            environment=tuple(str(e) for e in p.get("Environment") or () if isinstance(e, str)),
            environment_files=tuple(
                (str(f[0]), bool(f[1]))
                for f in p.get("EnvironmentFiles") or ()
                if isinstance(f, list | tuple) and len(f) == 2
            ),
            user=s("User"),
            private_tmp=bool(p.get("PrivateTmp")),
            cache_directories=tuple(
                str(d) for d in p.get("CacheDirectory") or () if isinstance(d, str)
            ),
        )


def job_path(value: Any) -> str:
    """systemd's ``Job`` property, ``(id, path)``; "" when the unit has no job."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[0]:
        return str(value[1])
    return ""


def hex_id(value: Any) -> str:
    if isinstance(value, list | bytes):
        return bytes(value).hex()
    return str(value or "")
