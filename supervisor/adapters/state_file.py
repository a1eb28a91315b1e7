"""What the supervisor must remember across its own restarts: units an operator stopped.

An operator's ``systemctl stop sglang-k26.service`` must outlive a
``systemctl restart k26-supervisor``: nothing in systemd says afterwards who
stopped the unit (a real SGLang stop and a crash both end ``Result=signal``).
The daemon writes each held unit with the InvocationID of the run the operator
stopped. On start-up a hold counts only while the unit is still down with that
same invocation: once anyone has started the unit again, it is void.

The file lives in the runtime directory (``/run/k26-supervisor/state.json``, or
``$XDG_RUNTIME_DIR/k26-supervisor/`` for a user manager), which the unit keeps
across restarts (``RuntimeDirectoryPreserve=yes``) and a reboot clears, as it
clears the stopped units' state. A corrupt or unreadable file is reported and
treated as empty: it can only ever hold a unit back, never start one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.adapters.sampling_env import runtime_dir
from supervisor.atomic_write import write_atomic

log = logging.getLogger("k26.state")

STATE_NAME = "state.json"
LAST_STATUS_NAME = "last-status.json"
_SCHEMA = 1


def state_path(bus: str) -> Path:
    return runtime_dir(bus) / STATE_NAME


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error("%s is unreadable (%s); assuming no unit is held by an operator", path, exc)
        return {}
    holds = data.get("operator_stopped") if isinstance(data, dict) else None
    if not isinstance(holds, dict) or data.get("schema") != _SCHEMA:
        log.error("%s is not a k26-supervisor state file; assuming no unit is held", path)
        return {}
    return {str(k): str(v) for k, v in holds.items() if isinstance(v, str)}


def _write(path: Path, holds: Mapping[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"schema": _SCHEMA, "operator_stopped": dict(holds)}, indent=1)
    write_atomic(path, text + "\n")


# --- the daemon's last /status, for `k26-supervisor status` once it has exited ------


def last_status_path(bus: str) -> Path:
    return runtime_dir(bus) / LAST_STATUS_NAME


def save_last_status(bus: str, doc: Mapping[str, Any]) -> None:
    """The /status document the daemon ended with (and why it ended), so that
    ``k26-supervisor status`` can still say what happened after it exited.
    Best effort: a daemon that cannot write it says so and exits anyway."""
    path = last_status_path(bus)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(doc, indent=1) + "\n", durable=False)
    except OSError as exc:
        log.error("cannot save %s (%s)", path, exc)


def read_last_status(bus: str) -> dict[str, Any] | None:
    """What ``save_last_status`` wrote, or None (absent, unreadable, not ours)."""
    try:
        doc = json.loads(last_status_path(bus).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("units"), dict) else None


class OperatorHolds:
    """unit -> InvocationID of the run an operator stopped; saved atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._holds: dict[str, str] = {}

    async def load(self) -> Mapping[str, str]:
        self._holds = await asyncio.to_thread(_read, self.path)
        return dict(self._holds)

    def holds(self, unit: str, invocation_id: str) -> bool:
        """True when ``unit`` is held and its last run is still the one stopped."""
        return bool(invocation_id) and self._holds.get(unit) == invocation_id

    async def set(self, unit: str, invocation_id: str | None) -> None:
        """Hold ``unit`` (its stopped run's InvocationID), or release it (None)."""
        wanted = dict(self._holds)
        if invocation_id:
            wanted[unit] = invocation_id
        else:
            wanted.pop(unit, None)
        if wanted == self._holds:
            return
        try:
            await asyncio.to_thread(_write, self.path, wanted)
        except OSError as exc:
            # Losing this only matters if the supervisor restarts before the operator
            # acts; say so loudly, and keep the hold in memory.
            log.error("cannot save %s (%s): a supervisor restart would forget it", self.path, exc)
        self._holds = wanted
