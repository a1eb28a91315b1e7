"""Free loopback ports for what the development tools start (demo, tests, benches).

The kernel's pick for ``bind(("127.0.0.1", 0))`` is free only until the socket is
closed, and whoever gets the port binds it later (a unit, a daemon). Two picks in
a row can return the same port: seen in the demo, whose EAGLE-3 unit got the
daemon's status port and died of port-in-use. So a port handed out once is never
handed out again by this process.
"""

from __future__ import annotations

import socket
import threading

_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback TCP port free right now that this process has not handed out before."""
    with _LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
