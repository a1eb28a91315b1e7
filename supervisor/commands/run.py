"""``k26-supervisor run --config FILE``: the daemon."""

from __future__ import annotations

import argparse
from pathlib import Path

from supervisor import daemon


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "run",
        help="run the supervisor daemon (systemd Type=notify)",
        description=(
            "Supervise the configured SGLang units: warm FlashInfer before every start, "
            "report ready only after a sampled generation, explain every exit. "
            "SIGTERM leaves the units running; SIGHUP reloads the config; SIGUSR1 resets "
            "failed units and retries preferred units in standby."
        ),
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("/etc/k26-supervisor/config.toml"),
        help="TOML config (default /etc/k26-supervisor/config.toml)",
    )
    parser.set_defaults(handler=lambda args: daemon.run(args.config))
