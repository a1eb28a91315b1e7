"""sd_notify: tell systemd we are ready, alive, busy or stopping.

Owns the $NOTIFY_SOCKET protocol (sd_notify(3)): newline-separated
``KEY=VALUE`` fields in one datagram on an AF_UNIX socket, whose address is a
path or, with a leading '@', an abstract name. Without $NOTIFY_SOCKET every
call is a no-op, so the daemon runs the same in a terminal. The socket is
non-blocking and a failed send is logged, never raised: a missed notification
must not take the supervisor down (systemd's watchdog will speak up if it
keeps happening).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _address(notify_socket: str) -> str | None:
    if notify_socket.startswith("@"):
        return "\0" + notify_socket[1:]
    if notify_socket.startswith("/"):
        return notify_socket
    return None  # vsock:… and relative paths: not for us


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


class Notifier:
    """Sends sd_notify messages to ``notify_socket`` (a path or '@abstract'), or nothing."""

    def __init__(self, notify_socket: str | None) -> None:
        self._address = None if not notify_socket else _address(notify_socket)
        if notify_socket and self._address is None:
            log.warning(
                "NOTIFY_SOCKET=%r is not a unix socket address; not notifying", notify_socket
            )
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        return cls((os.environ if env is None else env).get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields as one datagram; True when the kernel took it."""
        if self._address is None:
            return False
        message = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._sock.sendto(message, self._address)
        except OSError as exc:
            log.warning("sd_notify %s failed: %s", fields[0] if fields else "", exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        fields = ["READY=1"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.send(*fields)

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before systemd's start/stop timeout fires."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1_000_000))}")

    def stopping(self, status: str | None = None) -> bool:
        fields = ["STOPPING=1"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.send(*fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s(
    env: Mapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """How often to send WATCHDOG=1: half of $WATCHDOG_USEC, or None when not asked.

    None as well when $WATCHDOG_PID names another process (the variable leaked
    to a child) or the values are not numbers.
    """
    env = os.environ if env is None else env
    pid = os.getpid() if pid is None else pid
    watchdog_pid = env.get("WATCHDOG_PID")
    if watchdog_pid:
        try:
            if int(watchdog_pid) != pid:
                return None
        except ValueError:
            return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 2 / 1_000_000
