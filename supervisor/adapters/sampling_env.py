"""The last-resort sampling switch: SGLang with ``--sampling-backend pytorch``.

Off by default. The shipped SGLang units read
``EnvironmentFile=-/run/k26-supervisor/sampling/%n.env`` and pass
``--sampling-backend ${SGLANG_SAMPLING_BACKEND}`` (``flashinfer`` unless that
file says otherwise). The supervisor writes or removes that file before a start:
no unit file or drop-in is edited, no daemon-reload is needed, and ``/run``
forgets it on reboot. (A writable drop-in directory would let the supervisor
make a unit run as anything; an environment file cannot.)
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from supervisor.atomic_write import write_atomic
from supervisor.core.events import SamplingBackend

ENV_TEXT = (
    "# Written by k26-supervisor: FlashInfer sampling could not be warmed, so this\n"
    "# unit runs SGLang's pytorch sampling backend. Removed when warm-up succeeds.\n"
    "SGLANG_SAMPLING_BACKEND=pytorch\n"
)


def runtime_dir(bus: str) -> Path:
    """The supervisor's runtime directory (the unit's ``RuntimeDirectory=``)."""
    if bus == "user":
        base = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
        return Path(base) / "k26-supervisor"
    return Path("/run/k26-supervisor")


def env_dir(bus: str) -> Path:
    return runtime_dir(bus) / "sampling"


def env_path(bus: str, unit: str) -> Path:
    return env_dir(bus) / f"{unit}.env"


def _apply(path: Path, wanted: bool) -> bool:
    if wanted:
        if path.exists() and path.read_text() == ENV_TEXT:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        # /run forgets it at reboot anyway: no fsync. A unit starting now reads the
        # old file or the new one, never half of one.
        write_atomic(path, ENV_TEXT, new_mode=0o666, durable=False)
        return True
    if path.exists():
        path.unlink()
        return True
    return False


async def apply(bus: str, unit: str, pytorch: bool) -> bool:
    """Make the file present exactly when ``pytorch``; True if anything changed."""
    return await asyncio.to_thread(_apply, env_path(bus, unit), pytorch)


async def current_backend(bus: str, unit: str) -> SamplingBackend:
    exists = await asyncio.to_thread(env_path(bus, unit).exists)
    return SamplingBackend.PYTORCH if exists else SamplingBackend.FLASHINFER
