"""Free loopback ports for what the development tools start (demo, tests, benches).

The kernel's pick for ``bind(("127.0.0.1", 0))`` is free only until the socket is
closed, and whoever gets the port binds it later (a unit, a daemon). Two picks in
a row can return the same port: seen in the demo, whose EAGLE-3 unit got the
daemon's status port and died of port-in-use. So a port handed out once is never
handed out again by this process, nor by any other process that shares the
claims directory ``$K26_PORT_CLAIMS`` (the test session's workers do): a port is
claimed there with an exclusive create before it is handed out.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

CLAIMS_ENV = "K26_PORT_CLAIMS"
_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def _claim(port: int) -> bool:
    """True if no process sharing the claims directory has handed ``port`` out."""
    claims = os.environ.get(CLAIMS_ENV)
    if not claims:
        return True
    try:
        fd = os.open(Path(claims) / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def free_port() -> int:
    """A loopback TCP port free right now that was not handed out before (by this
    process, or by one that shares ``$K26_PORT_CLAIMS``)."""
    with _LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port in _GIVEN:
                continue
            _GIVEN.add(port)
            if _claim(port):
                return port
