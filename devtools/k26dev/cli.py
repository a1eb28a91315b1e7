"""Command-line entry point of the development tools: ``k26-dev <command>``.

The product's CLI machinery (``supervisor.cli``: one module per command, errors
as one stderr line and a sysexits code, SIGTERM ending a command as Ctrl-C does)
with the commands that only development needs: ``sandbox``, ``standin``, ``demo``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from supervisor import cli

PROG = "k26-dev"
DESCRIPTION = (
    "Development tools for k26-supervisor: a confined systemd sandbox or a booted "
    "host, the stand-in SGLang server, the demo. Not part of the product."
)

COMMAND_MODULES: tuple[str, ...] = (
    "k26dev.commands.sandbox",
    "k26dev.commands.demo",
    "k26dev.commands.standin",
)


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(PROG, DESCRIPTION, COMMAND_MODULES)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, prog=PROG, description=DESCRIPTION, modules=COMMAND_MODULES)
