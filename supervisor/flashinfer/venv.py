"""The serving venv as a subprocess: the only door into flashinfer and torch.

Every question for FlashInfer is asked by running ``venv_scripts/k26_serving.py``
with the serving interpreter, under the environment the units get. The child
runs in its own session so a timeout or a cancellation ends the whole build
tree (ninja, nvcc, cicc), never just its Python parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.core.errors import InputError, UnavailableError
from supervisor.flashinfer import protocol
from supervisor.flashinfer.fatbin import parse_arch

SCRIPT = Path(__file__).with_name("venv_scripts") / "k26_serving.py"
RESULT_PREFIX = "K26-RESULT "
PROGRESS_PREFIX = "K26-PROGRESS "
_KILL_GRACE_S = 5.0
_LINE_LIMIT = 1 << 20
# How often a running script's CPU use is looked at (run_script's on_busy).
BUSY_EVERY_S = 15.0


def unit_environment(arch: str, workspace: Path) -> dict[str, str]:
    """The variables a unit needs so FlashInfer finds the cache this code warms.

    FlashInfer 0.2.x reads the arch from TORCH_CUDA_ARCH_LIST, later releases
    from FLASHINFER_CUDA_ARCH_LIST; setting both keeps every release on the
    same cache directory.
    """
    return {
        "FLASHINFER_WORKSPACE_BASE": str(workspace),
        "FLASHINFER_CUDA_ARCH_LIST": arch,
        "TORCH_CUDA_ARCH_LIST": arch,
    }


def tvm_ffi_cache(workspace: Path) -> Path:
    """Where a child run for ``workspace`` keeps tvm-ffi's cache when nothing pins it
    (see ``ServingEnv.environment``): beside FlashInfer's own, never a user's home."""
    return workspace / ".cache" / "tvm-ffi"


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a systemd ``EnvironmentFile=`` (KEY=VALUE lines, # comments, quotes)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read environment file {path}: {exc.strerror}") from exc
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[len("export ") :].strip()
        if not sep or not key.replace("_", "").isalnum():
            raise InputError(f"{path}:{number}: not KEY=VALUE: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


@dataclass(frozen=True)
class ServingEnv:
    """One serving interpreter, target arch and workspace, as the units see them."""

    python: Path
    arch: str
    workspace: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Absolute but not resolved: a venv's python is a symlink to the base
        # interpreter, and resolving it would lose the venv.
        object.__setattr__(self, "python", Path(os.path.abspath(self.python)))
        object.__setattr__(self, "workspace", Path(os.path.abspath(self.workspace)))
        try:
            parse_arch(self.arch)
        except ValueError as exc:
            raise InputError(f"--arch: {exc}") from exc

    @property
    def target(self) -> tuple[int, int]:
        return parse_arch(self.arch)

    def environment(self) -> dict[str, str]:
        """The units' environment for the child. Importing FlashInfer 0.7 with torch
        2.8 builds tvm-ffi's DLPack addon into ``TVM_FFI_CACHE_DIR``; unpinned, that
        is this process's ``~/.cache/tvm-ffi`` (root's, for the daemon), so it goes
        beside FlashInfer's own cache in the workspace instead, built once there."""
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(unit_environment(self.arch, self.workspace))
        if not env.get("TVM_FFI_CACHE_DIR"):
            env["TVM_FFI_CACHE_DIR"] = str(tvm_ffi_cache(self.workspace))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env


@dataclass
class ScriptRun:
    """What one run of the venv script left: exit status, result, output tail."""

    returncode: int
    result: dict[str, Any] | None
    tail: list[str]

    def tail_text(self, lines: int = 20) -> str:
        return "\n".join(self.tail[-lines:])


async def _stop_group(proc: asyncio.subprocess.Process) -> None:
    """End the child's whole session: TERM, then KILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), _KILL_GRACE_S)
            return
        except TimeoutError:
            continue


def session_cpu_ticks(sid: int) -> int:
    """CPU time, in clock ticks, that the live processes of session ``sid`` and the
    children they reaped have used so far (a build's nvcc runs in the script's)."""
    total = 0
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:  # gone meanwhile
                continue
            # After "pid (comm) ": state ppid pgrp session ... utime stime cutime cstime
            fields = raw[raw.rfind(b")") + 2 :].split()
            if len(fields) > 14 and int(fields[3]) == sid:
                total += sum(int(x) for x in fields[11:15])
    return total


async def _while_busy(sid: int, every_s: float, on_busy: Callable[[], None]) -> None:
    """Call ``on_busy`` each ``every_s`` in which session ``sid`` used the CPU: one
    nvcc step can run minutes without a line of output, yet is not stuck."""
    last = await asyncio.to_thread(session_cpu_ticks, sid)
    while True:
        await asyncio.sleep(every_s)
        now = await asyncio.to_thread(session_cpu_ticks, sid)
        if now > last:
            on_busy()
        last = now


def spawn_script(
    serving: ServingEnv, script: Path, args: Sequence[str], **options: Any
) -> Coroutine[Any, Any, asyncio.subprocess.Process]:
    """Start ``script ARGS`` with the serving interpreter, the one way every venv script
    is started: the units' environment, no stdin, output and errors on one pipe, ``/``
    as its directory and its own session (so that its whole group can be ended).
    ``options``: more of ``create_subprocess_exec``'s (a line ``limit``)."""
    return asyncio.create_subprocess_exec(
        str(serving.python),
        str(script),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=serving.environment(),
        cwd="/",
        start_new_session=True,
        **options,
    )


async def run_script(
    serving: ServingEnv,
    args: Sequence[str],
    *,
    timeout_s: float,
    on_line: Callable[[str], None] | None = None,
    on_busy: Callable[[], None] | None = None,
    busy_every_s: float = BUSY_EVERY_S,
) -> ScriptRun:
    """Run ``k26_serving.py ARGS`` with the serving interpreter.

    ``on_line``: each line of output; ``on_busy``: every ``busy_every_s`` in which the
    script's session (its build steps included) used CPU time, with or without output.
    Raises UnavailableError when the interpreter cannot be started, and
    TimeoutError (after ending the process group) when it runs too long.
    """
    spawn = asyncio.ensure_future(spawn_script(serving, SCRIPT, args, limit=_LINE_LIMIT))
    try:
        proc = await asyncio.shield(spawn)
    except asyncio.CancelledError:
        # Cancelled while spawning: the child may exist already; never orphan a build.
        with contextlib.suppress(Exception):
            await _stop_group(await spawn)
        raise
    except OSError as exc:
        raise UnavailableError(
            f"serving interpreter {serving.python} cannot run: {exc.strerror or exc}"
        ) from exc
    tail: deque[str] = deque(maxlen=400)
    result: dict[str, Any] | None = None
    assert proc.stdout is not None
    busy = (
        asyncio.create_task(_while_busy(proc.pid, busy_every_s, on_busy))
        if on_busy is not None
        else None
    )
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    raw = await proc.stdout.readline()
                except ValueError:  # a line longer than the limit: skip it
                    raw = b"<line too long>\n"
                if not raw:
                    break
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if line.startswith(RESULT_PREFIX):
                    try:
                        result = json.loads(line[len(RESULT_PREFIX) :])
                    except json.JSONDecodeError:
                        result = None
                    continue
                if line.startswith(PROGRESS_PREFIX):
                    line = "k26: " + line[len(PROGRESS_PREFIX) :]
                tail.append(line)
                if on_line is not None:
                    on_line(line)
            returncode = await proc.wait()
    except BaseException:
        await asyncio.shield(_stop_group(proc))
        raise
    finally:
        if busy is not None:
            busy.cancel()
    return ScriptRun(returncode, result, list(tail))


async def ask(serving: ServingEnv, args: Sequence[str], *, timeout_s: float) -> dict[str, Any]:
    """Run a question that must answer with a result; raise UnavailableError if not."""
    try:
        run = await run_script(serving, args, timeout_s=timeout_s)
    except TimeoutError as exc:
        raise UnavailableError(
            f"{serving.python} {args[0]}: no answer within {timeout_s:.0f} s"
        ) from exc
    if run.result is None:
        raise UnavailableError(
            f"{serving.python} {args[0]} exited {run.returncode} without an answer: "
            + (run.tail_text(5) or "no output")
        )
    return run.result


async def answer(
    serving: ServingEnv, model: type[protocol.R], args: Sequence[str], *, timeout_s: float
) -> protocol.R:
    """``ask``, with the reply validated against the command's model."""
    return protocol.parse(model, args[0], await ask(serving, args, timeout_s=timeout_s))


async def identity(serving: ServingEnv, *, timeout_s: float = 60.0) -> protocol.Identity:
    """Who would build here: versions and hashes, without importing flashinfer or torch."""
    return await answer(serving, protocol.Identity, ["identity"], timeout_s=timeout_s)
