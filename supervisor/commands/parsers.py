"""What every command's ``register`` shares: a command's parser, made from its usage
text and the handler that runs it, and a command of commands (``flashinfer``,
``units``, ``flashinfer bundle``).

A usage text is written as a docstring is: the help line the command above lists,
then, after a blank line, the description the command's own ``--help`` opens with.
argparse re-flows both, so the text's own line breaks never show.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeAlias

# A string: argparse's action is not subscriptable at run time.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Handler = Callable[[argparse.Namespace], int]


def add_command(
    sub: Subparsers, name: str, usage: str, handler: Handler | None = None
) -> argparse.ArgumentParser:
    """Add command ``name`` (its help line, then its description, from ``usage``) that
    ``handler`` runs; a command of commands has none (see ``add_commands``)."""
    help_line, _, description = usage.partition("\n\n")
    parser = sub.add_parser(name, help=help_line, description=description or None)
    if handler is not None:
        parser.set_defaults(handler=handler)
    return parser


def add_commands(sub: Subparsers, name: str, usage: str, dest: str, metavar: str) -> Subparsers:
    """Add command ``name`` whose own commands (one of them required, kept in ``dest``)
    are added to what this returns."""
    parser = add_command(sub, name, usage)
    return parser.add_subparsers(dest=dest, metavar=metavar, required=True)


def add_bus_arg(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--bus system|user``: the systemd manager to ask (the system's by default)."""
    parser.add_argument("--bus", choices=["system", "user"], default="system", help=help)
