"""``k26-dev sandbox up|down|shell|sweep|status``: a real systemd, confined.

Two kinds, one command: a systemd *user* manager in a cgroup subtree of its own
(``up``), or, with ``--boot``, a booted host: systemd as PID 1 of a container
with the system bus, journald and polkit (``up --boot``, then a shell inside,
torn down when the shell exits; ``--detach`` leaves it up for ``shell`` and
``down``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k26dev import bootedhost, cgroups, sandbox
from k26dev.errors import SandboxError
from supervisor.core.errors import UsageError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sandbox",
        help="run a real systemd user manager confined to its own cgroup subtree",
        description=(
            "Start or stop a systemd user manager that is confined to a cgroup subtree of "
            "its own, for tests and demos on hosts where systemd is not PID 1. "
            "'up' prints shell export lines; use: eval \"$(k26-dev sandbox up --dir D)\""
        ),
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    up = verbs.add_parser("up", help="start the sandbox and print export lines")
    up.add_argument("--dir", required=True, type=Path, help="state and runtime directory")
    up.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    up.add_argument(
        "--boot",
        action="store_true",
        help="boot a container whose PID 1 is systemd (system bus, journald, polkit) and "
        "open a shell in it; the host is torn down when the shell exits",
    )
    up.add_argument(
        "--detach",
        action="store_true",
        help="with --boot: leave it up instead of opening a shell (then: shell, down)",
    )
    up.set_defaults(handler=_up)
    down = verbs.add_parser("down", help="stop the sandbox or booted host and remove its cgroups")
    down.add_argument("--dir", required=True, type=Path)
    down.set_defaults(handler=_down)
    shell = verbs.add_parser("shell", help="a shell inside the booted host in DIR")
    shell.add_argument("--dir", required=True, type=Path)
    shell.set_defaults(handler=_shell)
    sweep = verbs.add_parser("sweep", help="remove k26sbx-*/k26host-* cgroups left by killed runs")
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
    if args.detach and not args.boot:
        raise UsageError("sandbox up: --detach goes with --boot")
    if not args.boot:
        info = sandbox.up(args.dir, timeout_s=args.timeout)
        sys.stdout.write(info.exports())
        print(f"# sandbox {info.name} up; units go in {info.unit_dir}", file=sys.stderr)
        return 0
    timeout_s = max(args.timeout, 60.0)
    if args.detach:
        host = bootedhost.up(args.dir, timeout_s=timeout_s)
        _say_up(host)
        print(f"enter: k26-dev sandbox shell --dir {args.dir}", file=sys.stderr)
        print(f"end:   k26-dev sandbox down --dir {args.dir}", file=sys.stderr)
        return 0
    # The host is torn down however the shell ends, a signal that lands before the
    # shell starts included.
    with bootedhost.running(args.dir, timeout_s=timeout_s) as host:
        _say_up(host)
        code = bootedhost.shell(host)
    print(f"booted host {host.name} is down; cgroups removed", file=sys.stderr)
    return code


def _say_up(host: bootedhost.HostInfo) -> None:
    print(
        f"booted host {host.name} up in {host.boot_s:.1f} s (PID 1 is {host.leader_pid} "
        "on this machine)",
        file=sys.stderr,
    )


def _down(args: argparse.Namespace) -> int:
    if (args.dir / bootedhost.STATE_FILE).exists():
        bootedhost.down(args.dir)
        print(f"booted host in {args.dir} is down; cgroups removed", file=sys.stderr)
        return 0
    sandbox.down(args.dir)
    print(f"sandbox in {args.dir} is down; cgroups removed", file=sys.stderr)
    return 0


def _shell(args: argparse.Namespace) -> int:
    return bootedhost.shell(bootedhost.HostInfo.load(args.dir))


def _sweep(args: argparse.Namespace) -> int:
    only = sandbox.registered(args.registry) if args.registry is not None else None
    removed = sandbox.sweep(force=args.force, only=only)
    removed += bootedhost.sweep(force=args.force, only=only)
    everything = [*sandbox.leftovers(), *bootedhost.leftovers()]
    left = sorted({p.name for p in everything if only is None or p.name in only})
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
