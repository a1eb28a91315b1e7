"""``k26-supervisor sandbox up|down|sweep|status``: a confined systemd user manager."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor.core.errors import SandboxError
from supervisor.devtools import cgroups, sandbox


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sandbox",
        help="run a real systemd user manager confined to its own cgroup subtree",
        description=(
            "Start or stop a systemd user manager that is confined to a cgroup subtree of "
            "its own, for tests and demos on hosts where systemd is not PID 1. "
            "'up' prints shell export lines; use: eval \"$(k26-supervisor sandbox up --dir D)\""
        ),
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    up = verbs.add_parser("up", help="start the sandbox and print export lines")
    up.add_argument("--dir", required=True, type=Path, help="state and runtime directory")
    up.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    up.set_defaults(handler=_up)
    down = verbs.add_parser("down", help="stop the sandbox and remove its cgroups")
    down.add_argument("--dir", required=True, type=Path)
    down.set_defaults(handler=_down)
    sweep = verbs.add_parser("sweep", help="remove k26sbx-* cgroups left by killed runs")
    sweep.add_argument("--force", action="store_true", help="kill processes still inside first")
    sweep.add_argument(
        "--registry",
        type=Path,
        metavar="FILE",
        help="only the sandboxes named in FILE (what one run recorded in $K26_SANDBOX_REGISTRY)",
    )
    sweep.set_defaults(handler=_sweep)
    status = verbs.add_parser("status", help="show the sandbox in DIR as JSON")
    status.add_argument("--dir", required=True, type=Path)
    status.set_defaults(handler=_status)


def _up(args: argparse.Namespace) -> int:
    info = sandbox.up(args.dir, timeout_s=args.timeout)
    sys.stdout.write(info.exports())
    print(f"# sandbox {info.name} up; units go in {info.unit_dir}", file=sys.stderr)
    return 0


def _down(args: argparse.Namespace) -> int:
    sandbox.down(args.dir)
    print(f"sandbox in {args.dir} is down; cgroups removed", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    only = sandbox.registered(args.registry) if args.registry is not None else None
    removed = sandbox.sweep(force=args.force, only=only)
    left = sorted({p.name for p in sandbox.leftovers() if only is None or p.name in only})
    for name in removed:
        print(f"removed {name}")
    if left:
        raise SandboxError("still present (busy; use --force): " + ", ".join(left))
    return 0


def _status(args: argparse.Namespace) -> int:
    info = sandbox.SandboxInfo.load(args.dir)
    data = {
        "name": info.name,
        "launcher_pid": info.launcher_pid,
        "alive": cgroups.pid_alive(info.launcher_pid),
        **info.env,
    }
    print(json.dumps(data, indent=2))
    return 0
