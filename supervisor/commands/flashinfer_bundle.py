"""``k26-supervisor flashinfer bundle export|import``: a warmed cache for other hosts.

Thin, like the other flashinfer commands: parse, run the library with
``asyncio.run``, print. ``export`` exits 0 with the archive written, 74 when
no fingerprint vouches for the cache; ``import`` exits 0 with the bundle
installed, 65 when the bundle does not fit this host or the archive is not
exactly what its manifest lists (nothing changed), 74 when installing failed
(the old cache left in place), 69 when the serving venv cannot answer or a
warm-up holds the workspace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from supervisor.commands.flashinfer import _common, _env, _module_names, _modules
from supervisor.flashinfer import bundle


def _print(result: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(result, indent=2) if as_json else text)


def _export(args: argparse.Namespace) -> int:
    result = asyncio.run(
        bundle.export_bundle(
            args.python, args.arch, args.workspace, args.out, _module_names(args), env=_env(args)
        )
    )
    size_mib = result["size_bytes"] / (1 << 20)
    _print(
        result,
        args.json,
        f"wrote {result['archive']} ({size_mib:.2f} MiB, {result['files']} files, "
        f"modules {', '.join(result['modules'])}) in {result['duration_s']:.2f} s\n"
        f"sha256 {result['sha256']}",
    )
    return 0


def _import(args: argparse.Namespace) -> int:
    result = asyncio.run(
        bundle.import_bundle(args.python, args.arch, args.workspace, args.archive, env=_env(args))
    )
    verb = "replaced" if result["replaced"] else "installed"
    _print(
        result,
        args.json,
        f"{verb} {result['cache_dir']} from {result['archive']} "
        f"(modules {', '.join(result['modules'])}, {result['files']} files) "
        f"in {result['duration_s']:.2f} s",
    )
    return 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bundle export|import`` under ``flashinfer``."""
    parser = commands.add_parser(
        "bundle",
        help="export a warmed cache as one archive, or import one (checked, atomic)",
        description="Move a warmed, fingerprinted JIT cache between hosts (docs/fleet.md).",
    )
    actions = parser.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export", help="write the vouched-for cache and its fingerprint to one archive"
    )
    _common(export)
    _modules(export)
    export.add_argument("--out", required=True, type=Path, metavar="FILE", help="the archive")
    export.set_defaults(handler=_export)
    imp = actions.add_parser(
        "import", help="check a bundle against this host's serving venv, verify, install"
    )
    _common(imp)
    imp.add_argument("archive", type=Path, metavar="FILE", help="a bundle written by export")
    imp.set_defaults(handler=_import)
