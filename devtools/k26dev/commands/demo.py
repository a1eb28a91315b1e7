"""``k26-dev demo``: the incident replayed in a systemd sandbox with stand-in units."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "demo",
        help="replay the incident in a systemd sandbox with stand-in SGLang units",
        description=(
            "Starts a confined systemd, stand-in units for EAGLE-3 and autoregressive "
            "SGLang, and the real daemon; plays the OOM kill, the fallback, a crash on "
            "the first sampled request held back by warm-up, and a SIGKILL recovery; "
            "prints a timeline and tears everything down. Needs root; no GPU."
        ),
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a temp dir)"
    )
    parser.add_argument(
        "--serving-python",
        type=Path,
        default=None,
        help="serving venv interpreter for the real warm-up (default: the shared cache's serving-0.7, which scripts/dev.sh demo makes)",
    )
    parser.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    from k26dev.demo import run_demo

    return run_demo(args.dir, args.serving_python)
