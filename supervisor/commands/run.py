"""``k26-supervisor run --config FILE``: the daemon."""

from __future__ import annotations

import argparse
from pathlib import Path

from supervisor import daemon
from supervisor.commands.parsers import Subparsers, add_command

_USAGE = """run the supervisor daemon (systemd Type=notify)

Supervise the configured SGLang units: warm FlashInfer before every start, report ready
only after a sampled generation, explain every exit. SIGTERM leaves the units running;
SIGHUP reloads the config; SIGUSR1 resets failed units and retries preferred units in
standby."""


def register(sub: Subparsers) -> None:
    parser = add_command(sub, "run", _USAGE, _run)
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("/etc/k26-supervisor/config.toml"),
        help="TOML config (default /etc/k26-supervisor/config.toml)",
    )


def _run(args: argparse.Namespace) -> int:
    return daemon.run(args.config)
