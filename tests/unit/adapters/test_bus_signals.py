"""A command's SIGTERM that lands inside a D-Bus signal callback still ends it.

sd-bus runs the callbacks from inside pystemd's ``process()``; an exception raised
there comes out of ``process()`` as a SystemError, which ``SystemdBus`` reads as a
lost connection. ``k26-supervisor watch`` turns SIGTERM into ``Terminated`` wherever
Python is, then ignores further signals: seen once in CI, a SIGTERM that arrived
while a PropertiesChanged callback ran was swallowed that way and ``watch`` never
ended. The bus below is a stand-in for pystemd's, doing what its ``process()`` does
with a callback's exception.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from supervisor.adapters.systemd_bus import SystemdBus, _Callback
from supervisor.cli import Terminated


class _Message:
    def __init__(self, empty: bool) -> None:
        self.empty = empty

    def is_empty(self) -> bool:
        return self.empty


class _PystemdLikeBus:
    """``process()`` dispatches one queued signal to a callback, as sd-bus does, and
    turns an exception the callback let out into SystemError (pystemd's ``except -1``
    callback returns -1 and leaves the exception set)."""

    def __init__(self, callback: _Callback, signals: int) -> None:
        self.callback = callback
        self.signals = signals
        self.dispatched = 0

    def process(self) -> _Message:
        if self.dispatched == self.signals:
            return _Message(empty=True)
        self.dispatched += 1
        try:
            self.callback(object())
        except BaseException as exc:
            raise SystemError(
                "<built-in method process> returned a result with an exception set"
            ) from exc
        return _Message(empty=False)

    def get_fd(self) -> int:
        return 7


def _terminated_on(call: int) -> Any:
    calls = 0

    def on_props(msg: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            raise Terminated(signal.SIGTERM)

    return on_props


def test_a_callback_keeps_an_interrupt_for_its_caller() -> None:
    callback = _Callback(_terminated_on(1))
    callback(object())  # nothing escapes into sd-bus
    assert isinstance(callback.interrupted, Terminated)


def test_an_error_in_a_callback_is_logged_not_kept(caplog: pytest.LogCaptureFixture) -> None:
    def broken(msg: Any) -> None:
        raise ValueError("a malformed signal")

    callback = _Callback(broken)
    callback(object())
    assert callback.interrupted is None
    assert "error handling a D-Bus signal" in caplog.text


async def test_sigterm_inside_a_callback_ends_the_drain_and_is_not_a_lost_connection() -> None:
    bus = SystemdBus("user")
    callback = _Callback(_terminated_on(2))
    bus._callbacks = [callback]
    bus._loop = asyncio.get_running_loop()
    bus._sig_bus = fake = _PystemdLikeBus(callback, signals=3)
    bus._sig_fd = fake.get_fd()
    with pytest.raises(Terminated):
        bus._drain()
    assert fake.dispatched == 2  # the signal after it waits for whoever handles the exit
    assert bus._reconnect_task is None and bus._sig_bus is fake  # not taken for a lost bus
    assert callback.interrupted is None  # raised once, not again on the next drain
    bus._executor.shutdown(wait=False)
