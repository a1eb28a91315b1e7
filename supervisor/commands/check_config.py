"""``k26-supervisor check-config FILE``: validate a config without starting anything.

Exit 0 with a one-line summary when the file is usable; exit 78 (EX_CONFIG)
with every bad field's path and what to do when it is not. Host facts that a
config cannot know (is the serving venv's python there?) are warnings only:
the file may be checked on another machine than the one it is for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from supervisor.adapters.config_file import load_config
from supervisor.commands.parsers import Subparsers, add_command
from supervisor.core.config import Config, InvalidConfig

_USAGE = """validate a configuration file and exit (78 if it is invalid)

Parse and validate FILE exactly as 'run' would, print a summary and exit 0, or name every
bad field and exit 78. Nothing is started."""


def register(sub: Subparsers) -> None:
    parser = add_command(sub, "check-config", _USAGE, _check)
    parser.add_argument("file", type=Path, metavar="FILE", help="the TOML configuration")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the effective configuration (defaults filled in), or the problems, as JSON",
    )


def _check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except InvalidConfig as exc:
        if args.json:
            problems = [{"path": p.path, "message": p.message} for p in exc.problems]
            print(json.dumps({"ok": False, "file": exc.source, "problems": problems}, indent=2))
        raise
    for warning in host_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        doc = {"ok": True, "file": str(args.file), "config": config.model_dump(mode="json")}
        print(json.dumps(doc, indent=2))
    else:
        print(summary(config, args.file))
    return 0


def summary(config: Config, path: Path) -> str:
    units = ", ".join(
        f"{u.name} ({u.role.value}{f', fallback {u.fallback}' if u.fallback else ''})"
        for u in config.units
    )
    fi = config.flashinfer
    warmup = f"FlashInfer warm-up for arch {fi.arch}" if fi.enabled else "no FlashInfer warm-up"
    extras = []
    if fi.enabled and fi.allow_patch:
        extras.append("patching allowed")
    if fi.enabled and fi.pytorch_sampling_fallback:
        extras.append("pytorch-sampling last resort enabled")
    extra = f" ({', '.join(extras)})" if extras else ""
    count = len(config.units)
    return (
        f"OK: {count} unit{'s' if count != 1 else ''} in {path}: {units}; "
        f"{config.supervisor.bus} bus, listening on {config.supervisor.listen}; {warmup}{extra}"
    )


def host_warnings(config: Config) -> list[str]:
    fi = config.flashinfer
    if not fi.enabled:
        return []
    warnings = []
    if not os.access(fi.python, os.X_OK):
        warnings.append(
            f"flashinfer.python {str(fi.python)!r} is not an executable on this host; "
            "warm-up will fail here (set flashinfer.enabled = false on hosts without a "
            "serving venv)"
        )
    return warnings
