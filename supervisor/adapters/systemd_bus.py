"""Async adapter over pystemd: systemd's manager, driven from the event loop.

Two connections, by design:

* the *signal* connection is owned by the event loop. Its fd is registered
  with ``loop.add_reader``; the loop only ever calls ``process()`` on it, so
  a signal can never be stranded in sd-bus's queue by a synchronous call (the
  pitfall in ``shared/docs/systemd-sandbox.md``). It holds ``Subscribe()`` and
  the match rules.
* the *call* connection is owned by one worker thread. Method calls and
  property reads run there, so a slow manager never blocks the loop.

Jobs are race-free: ``JobRemoved`` can arrive on the signal connection before
the ``StartUnit`` reply returns on the call connection, so removed jobs are kept
for a short while and matched when the job path arrives.

pystemd's ``bytes`` and ``DBus*Error`` never leave this module: values are
``str``/``int``, failures are ``BusError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from supervisor.adapters.bus import BusKind, JobMode, JobVerb
from supervisor.adapters.evidence import read_unit_output_path
from supervisor.core.bus_events import (
    BusEvent,
    BusReconnected,
    JobRemoved,
    JobResult,
    PropertiesChanged,
    UnitRemoved,
    UnitSnapshot,
)
from supervisor.core.errors import BusError, BusRefused
from supervisor.core.unitname import validate_unit_name

log = logging.getLogger(__name__)

SYSTEMD = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER_IFACE = b"org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPS_IFACE = b"org.freedesktop.DBus.Properties"
DBUS_NAME = b"org.freedesktop.DBus"
UNIT_PATH_PREFIX = "/org/freedesktop/systemd1/unit/"

T = TypeVar("T")


# ------------------------------------------------------- value conversion


def _to_py(value: Any) -> Any:
    """pystemd bodies hold bytes; turn them into str, recursively."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, dict):
        return {_to_py(k): _to_py(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_py(v) for v in value]
    return value


def escape_unit_path(unit: str) -> str:
    """systemd's bus_label_escape: the object path of a unit."""
    out = []
    for i, ch in enumerate(unit.encode()):
        c = chr(ch)
        if c.isascii() and (c.isalpha() or (c.isdigit() and i > 0)):
            out.append(c)
        else:
            out.append(f"_{ch:02x}")
    return UNIT_PATH_PREFIX + "".join(out)


def unescape_unit_path(path: str) -> str | None:
    if not path.startswith(UNIT_PATH_PREFIX):
        return None
    label = path[len(UNIT_PATH_PREFIX) :]
    raw = bytearray()
    i = 0
    while i < len(label):
        if label[i] == "_" and i + 3 <= len(label):
            try:
                raw.append(int(label[i + 1 : i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        raw.append(ord(label[i]))
        i += 1
    return raw.decode("utf-8", errors="replace")


@functools.cache
def _bus_failures() -> tuple[type[BaseException], ...]:
    """What a real bus failure raises: pystemd's D-Bus errors (each carrying sd-bus's
    errno, a mapped D-Bus error name choosing its class) and the socket's own. Anything
    else is a bug and is not dressed up as a bus outage."""
    from pystemd.dbusexc import DBusBaseError  # here: the package imports no pystemd

    return (DBusBaseError, OSError)


# sd-bus's errnos for a connection that is gone (the call can be retried once, fresh).
_GONE = frozenset({errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE, errno.ECONNABORTED})
_JOB_METHODS: dict[JobVerb, bytes] = {"start": b"StartUnit", "stop": b"StopUnit"}


def _is_disconnected(exc: BaseException) -> bool:
    from pystemd.dbusexc import DBusDisconnectedError

    if isinstance(exc, DBusDisconnectedError):
        return True
    return isinstance(exc, _bus_failures()) and abs(getattr(exc, "errno", 0) or 0) in _GONE


def _is_unknown_interface(exc: BaseException) -> bool:
    from pystemd.dbusexc import DBusUnknownInterfaceError

    return isinstance(exc, DBusUnknownInterfaceError)


def _bus_error(what: str, exc: BaseException) -> BusError:
    """pystemd's error as ours: its text decoded, a permission refusal told apart."""
    raw = getattr(exc, "err_message", None)
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")
    text = text.strip() or str(exc).strip() or type(exc).__name__
    if abs(getattr(exc, "errno", 0) or 0) == errno.EACCES:
        # sd-bus turns AccessDenied and InteractiveAuthorizationRequired into EACCES.
        return BusRefused(
            f"{what}: refused by systemd ({text}): polkit or the bus policy does not "
            f"allow this user (uid {os.getuid()}) to do it"
        )
    return BusError(f"{what}: {text}")


# -------------------------------------------------------------- adapter


class SystemdBus:
    """The supervisor's view of one systemd manager (system or user bus)."""

    def __init__(self, kind: BusKind = "system", *, reconnect_max_s: float = 5.0) -> None:
        if kind not in ("system", "user"):
            raise BusError(f"bus must be 'system' or 'user', not {kind!r}")
        self.kind = kind
        self._reconnect_max_s = reconnect_max_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k26-dbus")
        self._call_bus: Any = None  # touched only in the executor thread
        self._sig_bus: Any = None  # touched only on the loop (after setup)
        self._sig_fd: int | None = None
        self._queue: asyncio.Queue[BusEvent] = asyncio.Queue()
        self._job_waiters: dict[str, asyncio.Future[JobRemoved]] = {}
        self._removed_jobs: OrderedDict[str, JobRemoved] = OrderedDict()
        self._closed = False
        self._connected = asyncio.Event()
        self._reconnect_task: asyncio.Task[None] | None = None
        self.reconnects = 0
        self._callbacks: list[_Callback] = []

    # ---- lifecycle

    async def connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._run(self._open_call_bus)
        await self._attach_signal_bus()

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect_task
        self._detach_signal_bus()
        try:
            await self._run(self._close_call_bus)
        except RuntimeError as exc:  # the executor is already shut down: nothing to close
            log.debug("closing the %s bus connection: %s", self.kind, exc)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for fut in self._job_waiters.values():
            if not fut.done():
                fut.set_exception(BusError("bus closed while waiting for a job"))

    async def __aenter__(self) -> SystemdBus:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _new_bus(self) -> Any:
        from pystemd.dbuslib import DBus  # imported here: the rest of the package needs no pystemd

        bus = DBus(user_mode=self.kind == "user")
        bus.open()
        return bus

    def _open_call_bus(self) -> None:
        self._close_call_bus()
        try:
            self._call_bus = self._new_bus()
        except _bus_failures() as exc:
            raise _bus_error(f"cannot connect to the {self.kind} bus", exc) from exc

    def _close_call_bus(self) -> None:
        if self._call_bus is not None:
            try:
                self._call_bus.close()
            except _bus_failures() as exc:  # going anyway; said, not raised
                log.warning("closing the %s bus connection: %s", self.kind, exc)
            self._call_bus = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    # ---- the signal connection

    def _setup_signal_bus(self) -> Any:
        """Open, match and Subscribe(); runs in the executor before the loop owns it."""
        bus = self._new_bus()
        # pystemd keeps only a borrowed pointer to each callback: hold them here.
        self._callbacks = [
            _Callback(self._on_props),
            _Callback(self._on_job),
            _Callback(self._on_removed),
            _Callback(self._on_owner),
        ]
        on_props, on_job, on_removed, on_owner = self._callbacks
        try:
            bus.match_signal(SYSTEMD, None, PROPS_IFACE, b"PropertiesChanged", on_props)
            bus.match_signal(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"JobRemoved", on_job)
            bus.match_signal(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"UnitRemoved", on_removed)
            bus.match_signal(
                DBUS_NAME, b"/org/freedesktop/DBus", DBUS_NAME, b"NameOwnerChanged", on_owner
            )
            # Only talk to a manager that is on the bus. Calling an absent name
            # makes dbus-daemon try to *activate* it, which can hang for the
            # default 25 s call timeout while a bus is coming back.
            from pystemd.dbuslib import apply_signature

            bus.call_method(
                DBUS_NAME,
                b"/org/freedesktop/DBus",
                DBUS_NAME,
                b"GetNameOwner",
                apply_signature(b"s", [SYSTEMD]),
            )
            bus.call_method(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"Subscribe", [])
        except BaseException:
            with contextlib.suppress(*_bus_failures()):
                bus.close()  # half set up: the first error is the one to report
            raise
        return bus

    async def _attach_signal_bus(self) -> None:
        try:
            bus = await self._run(self._setup_signal_bus)
        except _bus_failures() as exc:
            raise _bus_error(f"cannot subscribe to systemd on the {self.kind} bus", exc) from exc
        assert self._loop is not None
        self._sig_bus = bus
        self._sig_fd = bus.get_fd()
        self._loop.add_reader(self._sig_fd, self._drain)
        self._connected.set()
        # Signals may already be queued from the setup calls: drain them now.
        self._drain()

    def _detach_signal_bus(self) -> None:
        self._connected.clear()
        if self._sig_fd is not None and self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._sig_fd)  # may already be closed by sd-bus
        self._sig_fd = None
        if self._sig_bus is not None:
            try:
                self._sig_bus.close()
            except _bus_failures() as exc:  # dropped either way
                log.debug("closing the signal connection: %s", exc)
        self._sig_bus = None

    def _drain(self) -> None:
        bus = self._sig_bus
        if bus is None:
            return
        try:
            # process() dispatches one message per call; go until nothing is left.
            for _ in range(10_000):
                try:
                    msg = bus.process()
                finally:
                    self._reraise_interrupt()
                if msg.is_empty():
                    break
            if bus.get_fd() != self._sig_fd:
                # On EOF sd-bus closes the fd itself and process() neither raises
                # nor hands out its Disconnected message: notice it here.
                self._lost("the bus closed the connection (dbus-daemon restarted?)")
                return
        except _bus_failures() as exc:  # the connection is gone
            log.warning("signal connection lost: %s", exc)
            self._lost(f"signal connection lost: {exc}")

    def _reraise_interrupt(self) -> None:
        """A signal that interrupted a callback ends the caller, as it would have."""
        for callback in self._callbacks:
            interrupted, callback.interrupted = callback.interrupted, None
            if interrupted is not None:
                raise interrupted

    def _lost(self, reason: str) -> None:
        self._detach_signal_bus()
        if not self._closed and (self._reconnect_task is None or self._reconnect_task.done()):
            assert self._loop is not None
            self._reconnect_task = self._loop.create_task(self._reconnect(reason))

    async def _reconnect(self, reason: str) -> None:
        delay = 0.05
        while not self._closed:
            try:
                await self._run(self._open_call_bus)
                await self._attach_signal_bus()
            except BusError as exc:
                log.info("reconnect failed (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)  # waiting for an outside resource to return
                delay = min(delay * 2, self._reconnect_max_s)
                continue
            if self._sig_bus is None:
                continue  # lost again while attaching (e.g. the manager re-executed)
            self.reconnects += 1
            self._queue.put_nowait(BusReconnected(reason=reason, at=time.monotonic()))
            return

    # ---- signal callbacks (run inside process(), on the loop)

    def _on_props(self, msg: Any, error: Any = None, userdata: Any = None) -> None:
        msg.process_reply(True)
        path = _to_py(msg.headers.get("Path", b""))
        unit = unescape_unit_path(path) if isinstance(path, str) else None
        if unit is None:
            return
        body = _to_py(msg.body)
        if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], dict):
            return
        self._queue.put_nowait(
            PropertiesChanged(
                unit=unit, interface=str(body[0]), changed=body[1], at=time.monotonic()
            )
        )

    def _on_job(self, msg: Any, error: Any = None, userdata: Any = None) -> None:
        msg.process_reply(True)
        body = _to_py(msg.body)
        if not isinstance(body, list) or len(body) < 4:
            return
        event = JobRemoved(
            job_id=int(body[0]),
            job_path=str(body[1]),
            unit=str(body[2]),
            result=str(body[3]),
            at=time.monotonic(),
        )
        waiter = self._job_waiters.pop(event.job_path, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(event)
        else:
            self._removed_jobs[event.job_path] = event
            while len(self._removed_jobs) > 256:
                self._removed_jobs.popitem(last=False)
        self._queue.put_nowait(event)

    def _on_removed(self, msg: Any, error: Any = None, userdata: Any = None) -> None:
        msg.process_reply(True)
        body = _to_py(msg.body)
        if isinstance(body, list) and body:
            self._queue.put_nowait(UnitRemoved(unit=str(body[0]), at=time.monotonic()))

    def _on_owner(self, msg: Any, error: Any = None, userdata: Any = None) -> None:
        msg.process_reply(True)
        body = _to_py(msg.body)
        if not isinstance(body, list) or len(body) < 3 or body[0] != SYSTEMD.decode():
            return
        if body[2]:
            # A new manager owns the name: our Subscribe() died with the old one.
            self._lost(f"systemd manager restarted (new owner {body[2]})")

    # ---- events

    async def events(self) -> AsyncIterator[BusEvent]:
        while True:
            yield await self._queue.get()

    def pending_events(self) -> list[BusEvent]:
        """Every event already read and not yet taken, in order, without waiting."""
        out: list[BusEvent] = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    # ---- calls (executor thread)

    def _call(self, method: bytes, signature: bytes, args: list[Any]) -> Any:
        from pystemd.dbuslib import apply_signature

        if self._call_bus is None:
            self._open_call_bus()
        try:
            reply = self._call_bus.call_method(
                SYSTEMD, MANAGER_PATH, MANAGER_IFACE, method, apply_signature(signature, args)
            )
        except _bus_failures() as exc:
            if _is_disconnected(exc):
                self._open_call_bus()  # one retry on a fresh connection
                reply = self._call_bus.call_method(
                    SYSTEMD, MANAGER_PATH, MANAGER_IFACE, method, apply_signature(signature, args)
                )
            else:
                raise
        return _to_py(reply.body)

    def _get_all(self, unit: str) -> dict[str, Any]:
        from pystemd.dbuslib import apply_signature

        if self._call_bus is None:
            self._open_call_bus()
        path = escape_unit_path(unit).encode()
        props: dict[str, Any] = {}
        # LoadUnit makes sure the object exists even for a unit never started.
        self._call(b"LoadUnit", b"s", [unit.encode()])
        for iface in (UNIT_IFACE, SERVICE_IFACE):
            try:
                reply = self._call_bus.call_method(
                    SYSTEMD, path, PROPS_IFACE, b"GetAll", apply_signature(b"s", [iface.encode()])
                )
            except _bus_failures() as exc:
                if iface == SERVICE_IFACE and _is_unknown_interface(exc):
                    continue
                raise
            body = _to_py(reply.body)
            if isinstance(body, dict):
                props.update(body)
        if props.get("StandardOutput") in {"file", "append", "truncate"} and not props.get(
            "StandardOutputFileDescriptorName"
        ):
            # systemd 252 does not publish the FILE of StandardOutput=append:FILE
            # over D-Bus; read it from the unit file and its drop-ins (we are
            # already off the event loop here).
            out_path = read_unit_output_path(
                unit, str(props.get("FragmentPath") or ""), list(props.get("DropInPaths") or [])
            )
            props["StandardOutputFileDescriptorName"] = str(out_path) if out_path else ""
        return props

    async def _manager_call(
        self, what: str, method: bytes, signature: bytes, args: list[Any]
    ) -> Any:
        try:
            return await self._run(self._call, method, signature, args)
        except _bus_failures() as exc:
            raise _bus_error(what, exc) from exc

    async def snapshot(self, unit: str) -> UnitSnapshot:
        validate_unit_name(unit)
        try:
            props = await self._run(self._get_all, unit)
        except _bus_failures() as exc:
            raise _bus_error(f"cannot read properties of {unit}", exc) from exc
        return UnitSnapshot.from_props(unit, props, time.monotonic())

    async def job(
        self,
        verb: JobVerb,
        unit: str,
        *,
        mode: JobMode = "replace",
        timeout_s: float = 900.0,
        enqueued: Callable[[], None] | None = None,
    ) -> JobResult:
        """Issue the job (StartUnit or StopUnit) and wait for its end. ``enqueued`` is
        called once systemd has taken the job (its path is known), before the wait."""
        method = _JOB_METHODS[verb]
        validate_unit_name(unit)
        await self._connected.wait()
        issued = time.monotonic()
        job_path = str(
            await self._manager_call(
                f"{verb} {unit}", method, b"ss", [unit.encode(), mode.encode()]
            )
        )
        if enqueued is not None:
            enqueued()
        removed = self._removed_jobs.pop(job_path, None)
        if removed is None:
            assert self._loop is not None
            fut: asyncio.Future[JobRemoved] = self._loop.create_future()
            self._job_waiters[job_path] = fut
            # The reply may have raced ahead of signals the loop has not read yet.
            self._drain()
            try:
                removed = await asyncio.wait_for(fut, timeout_s)
            except TimeoutError as exc:
                raise BusError(
                    f"{verb} {unit}: job {job_path} not finished within {timeout_s:.0f}s"
                ) from exc
            finally:
                self._job_waiters.pop(job_path, None)
        return JobResult(unit, verb, job_path, removed.result, issued, removed.at)


class _Callback:
    """A signal callback pystemd can tag with ``metadata`` (bound methods can't be).

    sd-bus calls it from inside ``process()``: anything it raises comes out of
    ``process()`` as a SystemError, which reads as a lost connection. A command's
    SIGTERM (raised as ``Terminated`` wherever Python is, see ``supervisor.cli``)
    that lands here would be swallowed that way, with further signals already
    ignored, and ``watch`` would never end: it is kept in ``interrupted`` and
    re-raised by the caller of ``process()`` instead."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.metadata: dict[str, Any] = {}
        self.interrupted: BaseException | None = None

    def __call__(self, msg: Any, error: Any = None, userdata: Any = None) -> None:
        try:
            self.fn(msg)
        except Exception:  # an exception here would surface as a confusing SystemError
            log.exception("error handling a D-Bus signal")
        except BaseException as exc:  # KeyboardInterrupt, Terminated, SystemExit
            self.interrupted = exc
