"""The arguments every command that drives the serving venv shares (``flashinfer``
and its ``bundle`` commands): the venv, the arch, the workspace, the modules, the
daemon's state directory; and the one way they call the library with them."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from supervisor.commands.parsers import add_bus_arg
from supervisor.flashinfer import learned, read_env_file

T = TypeVar("T")


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    """The serving venv, the target arch and the workspace, as every command names them."""
    parser.add_argument("--python", required=True, type=Path, help="the serving venv's interpreter")
    parser.add_argument("--arch", required=True, help="target compute capability, e.g. 12.0")
    parser.add_argument(
        "--workspace",
        required=True,
        type=Path,
        help="the units' FLASHINFER_WORKSPACE_BASE",
    )
    parser.add_argument(
        "--env-file",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="KEY=VALUE file with the units' extra environment (CUDA_HOME, CPATH, ...)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_module_args(parser: argparse.ArgumentParser) -> None:
    """Which JIT modules: --module (repeatable) and --no-learned."""
    parser.add_argument(
        "--module",
        action="append",
        dest="modules",
        metavar="NAME",
        help="a JIT module to check or build (repeatable; default: sampling)",
    )
    parser.add_argument(
        "--no-learned",
        action="store_true",
        help="leave out the modules learned from ready units (k26-learned-modules.json)",
    )


def run_serving(
    action: Callable[..., Coroutine[Any, Any, T]],
    args: argparse.Namespace,
    *more: Any,
    **options: Any,
) -> T:
    """``action(python, arch, workspace, *more, env=..., **options)`` run to its end:
    how each of these commands calls the library, with the serving venv as given."""
    return asyncio.run(
        action(args.python, args.arch, args.workspace, *more, env=serving_env(args), **options)
    )


def serving_env(args: argparse.Namespace) -> dict[str, str]:
    """The units' extra environment, from every --env-file in order."""
    env: dict[str, str] = {}
    for path in args.env_file:
        env.update(read_env_file(path))
    return env


def module_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The modules asked for, sampling when none was."""
    return tuple(args.modules or ("sampling",))


def learned_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """The modules ready units built for this arch (``k26-learned-modules.json``),
    unless --no-learned."""
    if args.no_learned:
        return ()
    return tuple(learned.learned(args.workspace, args.arch))


def add_state_dir_args(parser: argparse.ArgumentParser, what: str, bus_help: str) -> None:
    """``--state-dir`` and ``--bus`` (``bus_help``): the daemon's state directory,
    found as the daemon finds it (``daemon_state_dir``), for ``what``."""
    add_bus_arg(parser, bus_help)
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"the daemon's state directory, for {what} (default: the daemon's own: "
        "$STATE_DIRECTORY, else /var/lib/k26-supervisor for the system bus, "
        "$XDG_STATE_HOME/k26-supervisor for the user bus)",
    )


def daemon_state_dir(args: argparse.Namespace) -> Path:
    """The daemon's state directory: --state-dir, else where the daemon keeps it for
    --bus (``learned_shapes.state_dir``, as the daemon resolves it)."""
    from supervisor.adapters.learned_shapes import state_dir

    return state_dir(args.state_dir, args.bus)
