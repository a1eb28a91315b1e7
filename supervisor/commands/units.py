"""``k26-supervisor units configure``: this host's values for the shipped SGLang units.

The package installs the units with ``@NAME@`` placeholders (``core/unit_values``);
this command validates the serving venv, the model paths and the GPU arch once,
then writes a drop-in per SGLang unit (``/etc/systemd/system/<unit>.d/50-k26-units.conf``),
and one for the supervisor when the serving venv lives in a home directory, all or
nothing, and reloads systemd. A later run without flags re-renders from the values
the drop-ins recorded (the package's upgrade does, so a changed shipped unit takes
effect at the next start of each SGLang unit, never by restarting a running one).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from supervisor.adapters import unit_dropins
from supervisor.commands.parsers import Subparsers, add_command, add_commands
from supervisor.core import unit_values
from supervisor.core.errors import OSLevelError, UsageError
from supervisor.core.unit_values import DROPIN, PLACEHOLDERS, SGLANG_UNITS, SUPERVISOR_UNIT

CONFIG = "/etc/k26-supervisor/config.toml"


_USAGE = """set this host's serving venv, model paths and GPU arch in the SGLang units

Configure the SGLang units the package installed."""
_CONFIGURE_USAGE = f"""write the SGLang units' drop-ins (serving venv, model paths, arch)

Validate the values, then write /etc/systemd/system/<unit>.d/{DROPIN} for both SGLang
units (and for k26-supervisor.service when the serving venv lives under /home, /root or
/run/user), all or nothing, and run systemctl daemon-reload. Running units are not
restarted. Without flags it re-renders from the values the last run recorded. Needs root."""


def register(sub: Subparsers) -> None:
    verbs = add_commands(sub, "units", _USAGE, dest="verb", metavar="VERB")
    configure = add_command(verbs, "configure", _CONFIGURE_USAGE, _configure)
    configure.add_argument(
        "--serving-venv", dest="SERVING_VENV", metavar="DIR", help="SGLang's venv (ExecStart=)"
    )
    configure.add_argument(
        "--model-path", dest="MODEL_PATH", metavar="DIR", help="the model (--model-path)"
    )
    configure.add_argument(
        "--draft-model-path",
        dest="DRAFT_MODEL_PATH",
        metavar="DIR",
        help="the EAGLE-3 draft model (--speculative-draft-model-path)",
    )
    configure.add_argument(
        "--arch",
        dest="CUDA_ARCH",
        metavar="ARCH",
        help=f"the GPU arch FlashInfer builds for, as the config's flashinfer.arch "
        f"(default {unit_values.DEFAULTS['CUDA_ARCH']})",
    )
    configure.add_argument(
        "--dry-run", action="store_true", help="say what would change; write nothing"
    )
    configure.add_argument(
        "--root",
        type=Path,
        default=Path("/"),
        help="configure the units of another tree (an image); systemctl is not run",
    )
    configure.add_argument(
        "--config",
        default=CONFIG,
        metavar="FILE",
        help=f"the supervisor's config to compare with the units (default {CONFIG})",
    )


def _configure(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    if not root.is_dir():
        raise UsageError(f"--root {args.root}: no such directory")
    templates = {name: unit_dropins.shipped_unit(root, name) for name in SGLANG_UNITS}
    paths = {name: unit_dropins.dropin_path(name, DROPIN) for name in SGLANG_UNITS}
    recorded = unit_values.recorded_values(
        unit_dropins.read_text(root, paths[SGLANG_UNITS[0]]) or ""
    )
    values = unit_values.resolve({name: getattr(args, name) for name in PLACEHOLDERS}, recorded)

    # Every text is made before anything is written: a bad template changes nothing.
    wanted: dict[str, str | None] = {
        paths[name]: unit_values.render_dropin(name, text, values, str(source))
        for name, (source, text) in templates.items()
    }
    serving_python = root / values["SERVING_VENV"].lstrip("/") / "bin" / "python"
    # Symlinks resolve on this host only: for another root, trust the path as given.
    interpreter = str(serving_python.resolve()) if root == Path("/") else ""
    wanted[unit_dropins.dropin_path(SUPERVISOR_UNIT, DROPIN)] = unit_values.home_dropin(
        values, interpreter
    )

    if root == Path("/") and not args.dry_run and os.geteuid() != 0:
        raise OSLevelError("units configure writes /etc/systemd/system: run it as root")
    changes = unit_dropins.plan(root, wanted)
    live, why_not = unit_dropins.systemd_running(root)
    for change in changes:
        print(f"{'would ' if args.dry_run else ''}{change.verb:<7} {change.path}")
    if changes and not args.dry_run:
        unit_dropins.apply(root, wanted, changes)
        if live:
            unit_dropins.daemon_reload()

    for note in _notes(root, values, args.config, serving_python):
        print(f"note: {note}")
    if not changes:
        print(f"k26-supervisor units: nothing to do, {', '.join(SGLANG_UNITS)} already configured")
    elif args.dry_run:
        print(f"k26-supervisor units: dry run, {len(changes)} change(s) would be made, none made")
    else:
        print(f"k26-supervisor units: {len(changes)} change(s)")
        if live:
            print(
                "running units keep their settings until their next start; "
                f"next: systemctl enable --now {SUPERVISOR_UNIT}"
            )
        else:
            print(f"note: skipped systemctl daemon-reload: {why_not}")
    return 0


def _notes(root: Path, values: dict[str, str], config: str, serving_python: Path) -> list[str]:
    notes = []
    text = unit_dropins.read_text(root, config)
    if text is not None:
        notes += unit_values.config_disagreements(text, config, values)
    if not serving_python.exists():
        notes.append(
            f"{values['SERVING_VENV']}/bin/python does not exist (yet): "
            "the SGLang units cannot start until it does"
        )
    for name in ("MODEL_PATH", "DRAFT_MODEL_PATH"):
        if not (root / values[name].lstrip("/")).exists():
            notes.append(f"{PLACEHOLDERS[name]} {values[name]} does not exist (yet)")
    return notes
