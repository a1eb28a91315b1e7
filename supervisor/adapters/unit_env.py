"""A unit's environment as systemd gives it to the unit's processes.

``Environment=`` assignments, then each ``EnvironmentFile=`` in order (a later
assignment wins, as in systemd), and the home of the unit's ``User=`` (or of this
process's user, for a user manager's units). Read off the event loop; a file
this process may not read is reported and skipped, never guessed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.errors import InputError
from supervisor.flashinfer.venv import read_env_file

log = logging.getLogger("k26.unitenv")


@dataclass(frozen=True, slots=True)
class UnitEnvironment:
    env: dict[str, str]
    user: str
    home: str
    problems: tuple[str, ...] = field(default_factory=tuple)


def _resolve(snapshot: UnitSnapshot) -> UnitEnvironment:
    env: dict[str, str] = {}
    problems: list[str] = []
    for assignment in snapshot.environment:
        key, sep, value = assignment.partition("=")
        if sep:
            env[key] = value
    for path, optional in snapshot.environment_files:
        try:
            env.update(read_env_file(Path(path)))
        except InputError as exc:
            if not (optional and not Path(path).exists()):
                problems.append(f"{snapshot.unit}: {exc}")
    user = snapshot.user
    try:
        entry = pwd.getpwnam(user) if user else pwd.getpwuid(os.getuid())
    except KeyError:
        problems.append(f"{snapshot.unit}: no such user {user!r}; HOME taken as /")
        return UnitEnvironment(env, user, "/", tuple(problems))
    return UnitEnvironment(env, user or entry.pw_name, entry.pw_dir, tuple(problems))


async def resolve(snapshot: UnitSnapshot) -> UnitEnvironment:
    found = await asyncio.to_thread(_resolve, snapshot)
    for problem in found.problems:
        log.warning("%s", problem)
    return found
