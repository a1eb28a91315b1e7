"""Command-line entry point: ``k26-supervisor <command>``.

Each command lives in its own module with a ``register(subparsers)`` function
that adds its parser and sets ``handler`` (``args -> int``); the module is named
after its command (``check_config`` registers ``check-config``). A command line
that names a command imports that one module only: the others bring pydantic,
httpx and the daemon, 0.7 s of imports that ``explain`` or ``status`` never use.
Help, ``--version`` and a mistyped command get every module. This module only
dispatches, and is the one place that turns a ``SupervisorError`` into one line
on stderr and an exit code. No traceback reaches the user.

SIGTERM and SIGHUP end a command the way Ctrl-C (SIGINT) does: as an exception
raised where the command is, so every ``finally`` and context manager runs and
a command that brought up a sandbox tears it down. Further signals are ignored
while it does. (The daemon installs its own handlers and is not affected.)
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from supervisor import __version__
from supervisor.core.errors import SupervisorError, UsageError

# Modules that provide commands, in the order `--help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "supervisor.commands.watch",
    "supervisor.commands.explain",
    "supervisor.commands.run",
    "supervisor.commands.status",
    "supervisor.commands.check_config",
    "supervisor.commands.units",
    "supervisor.commands.probe",
    "supervisor.commands.flashinfer",
)


_ENDING = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, delivered as Ctrl-C is, so that cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _terminate(signum: int, frame: FrameType | None) -> None:
    for sig in _ENDING:  # one ending at a time: the teardown must not be cut short
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


def _install_signal_handlers() -> None:
    for sig in _ENDING:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup and friends keep theirs
            signal.signal(sig, _terminate)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see --help)")


def command_of(module: str) -> str:
    """The command a module registers: its own name, ``_`` as ``-``."""
    return module.rpartition(".")[2].replace("_", "-")


def _needed(argv: Sequence[str], modules: Sequence[str]) -> Sequence[str]:
    """The one module of the command ``argv`` names first, else all of them."""
    named = [m for m in modules if argv and command_of(m) == argv[0]]
    return named or modules


def build_parser(
    prog: str = "k26-supervisor",
    description: str = "Keeps SGLang inference units honest.",
    modules: Sequence[str] = COMMAND_MODULES,
) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = "k26-supervisor",
    description: str = "Keeps SGLang inference units honest.",
    modules: Sequence[str] = COMMAND_MODULES,
) -> int:
    """Parse, dispatch, and map errors; ``k26-dev`` (``k26dev.cli``) reuses it with
    its own ``prog`` and command modules."""
    _install_signal_handlers()
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = build_parser(prog, description, _needed(argv, modules))
        args = parser.parse_args(argv)
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return UsageError.exit_code
        return int(handler(args))
    except SupervisorError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
