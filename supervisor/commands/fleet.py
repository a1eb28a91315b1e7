"""``k26-supervisor flashinfer bundle export|import|push|pull``: warmed caches for other hosts.

Thin, like the other flashinfer commands: parse, run the library with
``asyncio.run``, print. ``export`` exits 0 with the archive written, 74 when
no fingerprint vouches for the cache; ``import`` exits 0 with the bundle
installed, 65 when the bundle does not fit this host or the archive is not
exactly what its manifest lists (nothing changed), 74 when installing failed
(the old cache left in place), 69 when the serving venv cannot answer or a
warm-up holds the workspace.

``push`` bundles every JIT cache the units' environment pins (FlashInfer's, and
Triton's, inductor's, TVM-FFI's and DeepGEMM's where present) and pushes it to an
OCI registry; ``pull`` finds this node's bundle there (or the one ``--digest``
names), checks it and installs it (docs/fleet.md). ``pull`` exits 65 when the
bundle does not fit this node or is not what its digests say (nothing changed),
69 when the registry is unreachable or holds no bundle for this node, 77 when it
wants credentials that are missing, wrong or not enough (``--registry-auth``); with
``--verify-key``, 65 when no given key signed it or it is older than the signed
bundle this node accepted from the tag (nothing changed); that record is the
daemon's, in its state directory (``--state-dir``, ``--bus``: found as the daemon
finds it), never in the workspace the units can write. ``push``
exits 74 when ``--coverage-from`` shows the caches are not the ones the unit's
coverage warm-up passed with (nothing pushed), 69 when the registry or the daemon
cannot be reached.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from supervisor.adapters.learned_shapes import merge_learned_file
from supervisor.commands.parsers import Handler, Subparsers, add_command, add_commands
from supervisor.commands.serving_args import (
    add_module_args,
    add_serving_args,
    add_state_dir_args,
    daemon_state_dir,
    learned_modules,
    module_names,
    run_serving,
)
from supervisor.core.errors import UsageError
from supervisor.fleet import accepted, bundle, distribute, registry
from supervisor.fleet.archive import DEFAULT_LIMITS, Limits


def _print(result: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(result, indent=2) if as_json else text)


def _export(args: argparse.Namespace) -> int:
    result = run_serving(
        bundle.export_bundle, args, args.out, module_names(args), learned=learned_modules(args)
    )
    size_mib = result["size_bytes"] / (1 << 20)
    _print(
        result,
        args.json,
        f"wrote {result['archive']} ({size_mib:.2f} MiB, {result['files']} files, "
        f"modules {', '.join(result['modules'])}) in {result['duration_s']:.2f} s\n"
        f"sha256 {result['sha256']}" + "".join(f"\nnote: {note}" for note in result["notes"]),
    )
    return 0


def _import(args: argparse.Namespace) -> int:
    result = run_serving(bundle.import_bundle, args, args.archive, limits=_limits(args))
    verb = "replaced" if result["replaced"] else "installed"
    _print(
        result,
        args.json,
        f"{verb} {result['cache_dir']} from {result['archive']} "
        f"(modules {', '.join(result['modules'])}, {result['files']} files) "
        f"in {result['duration_s']:.2f} s",
    )
    return 0


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(args.max_entries, args.max_entry_bytes, args.max_total_bytes)


def _limit_args(parser: argparse.ArgumentParser) -> None:
    """What one archive may hold (a daemon's: ``[flashinfer]`` ``bundle_max_*``)."""
    for flag, default, what in (
        ("--max-entries", DEFAULT_LIMITS.max_entries, "files"),
        ("--max-entry-bytes", DEFAULT_LIMITS.max_entry_bytes, "bytes in one of its files"),
        ("--max-total-bytes", DEFAULT_LIMITS.max_total_bytes, "bytes in all its files"),
    ):
        parser.add_argument(
            flag,
            type=_positive,
            default=default,
            metavar="N",
            help=f"refuse a layer with more {what} ({default})",
        )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def _caches(args: argparse.Namespace) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for item in args.cache:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--cache {item!r}: expected NAME=DIR, e.g. triton=/var/cache/triton")
        out[name] = Path(path)
    return out


def _access(args: argparse.Namespace) -> registry.Access:
    return registry.Access(args.registry_auth, args.registry_ca, "--registry-auth", "--registry-ca")


def _push(args: argparse.Namespace) -> int:
    result = run_serving(
        distribute.push,
        args,
        args.registry,
        modules=module_names(args),
        learned_modules=learned_modules(args),
        caches=_caches(args),
        coverage_from=args.coverage_from,
        unit=args.unit,
        learned=args.learned,
        tags=args.tag,
        chunk_size=args.chunk_size,
        timeout_s=args.timeout,
        access=_access(args),
        sign_key=args.sign_key,
        sign_passphrase=args.sign_passphrase_file,
    )
    lines = [
        f"pushed {result['reference']} in {result['duration_s']:.2f} s "
        f"({result['layers_uploaded']} layers sent, {result['layers_already_there']} already "
        f"there, {result['bytes_sent']} bytes)",
        f"tags {', '.join(result['tags'])}",
    ]
    if result["signature"]:
        signed = result["signature"]
        verb = "signed" if signed["added"] else "already signed"
        lines.append(f"{verb}: {signed['tag']} (key sha256 {signed['key']})")
    for entry in result["caches"]:
        where = "any path" if entry["relocatable"] else f"only at {entry['path']}"
        lines.append(
            f"  {entry['cache']}: {entry['files']} files, {entry['bytes']} bytes "
            f"(layer {entry['size_bytes']} bytes), restores {where}"
        )
    if result["coverage"]:
        lines.append(f"coverage: {result['coverage']['unit']} passed at {result['coverage']['at']}")
    for unit, count in result["learned_shapes"].items():
        lines.append(f"learned shapes: {count} of {unit}")
    lines.extend(f"note: {note}" for note in result["notes"])
    _print(result, args.json, "\n".join(lines))
    return 0


def _pull(args: argparse.Namespace) -> int:
    result = run_serving(
        distribute.pull,
        args,
        args.registry,
        reference=args.digest or args.tag,
        caches=_caches(args),
        timeout_s=args.timeout,
        access=_access(args),
        keys=args.verify_key,
        # The daemon's own record (fleet/accepted.py): one for both, in its state
        # directory, which the units cannot write.
        accepted_record=accepted.record_path(daemon_state_dir(args)),
        limits=_limits(args),
    )
    lines = [
        f"pulled {result['registry']}@{result['digest']} in {result['duration_s']:.2f} s "
        f"({result['bytes_fetched']} bytes fetched)"
    ]
    if result["verified_by"]:
        lines.append(f"signature: verified with {result['verified_by']}")
    for entry in result["installed"]:
        lines.append(f"  {entry['cache']}: {entry['files']} files into {entry['path']}")
    if not result["installed"]:
        lines.append("  nothing to install")
    coverage = result["coverage"]
    lines.append(
        f"coverage: passed on {coverage['unit']} at {coverage['at']} ({coverage['shapes']} shapes)"
        if coverage
        else "coverage: the bundle carries no coverage marker"
    )
    lines.extend(_learned_into(result.get("learned_shapes"), args.learned_into))
    lines.extend(f"note: {note}" for note in result["notes"])
    _print(result, args.json, "\n".join(lines))
    return 0


def _learned_into(document: dict[str, Any] | None, into: Path | None) -> list[str]:
    """The pulled bundle's learned shapes: said, and merged into ``into`` when given
    (a daemon reads its file as it starts: restart it, or let its own pull do this)."""
    if not document:
        return []
    carried = {unit: len(records) for unit, records in document["units"].items()}
    said = ", ".join(f"{count} of {unit}" for unit, count in carried.items())
    if into is None:
        return [f"learned shapes: {said} (not kept: give --learned-into FILE)"]
    new = merge_learned_file(into, document)
    return [f"learned shapes: {said}; {new} new, merged into {into}"]


def _registry_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--registry",
        required=True,
        metavar="URL",
        help="an OCI registry repository, e.g. http://registry:5000/k26/bundles",
    )
    parser.add_argument(
        "--cache",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="where a cache lives when the --env-file does not pin it "
        "(triton, inductor, tvm-ffi, deepgemm; repeatable)",
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, metavar="S", help="each registry request (30)"
    )
    parser.add_argument(
        "--registry-auth",
        type=Path,
        metavar="FILE",
        help="the registry's credentials: a Docker-style config.json (its auths entry for "
        "the registry's host) or one USER:PASSWORD line; mode 0600",
    )
    parser.add_argument(
        "--registry-ca",
        type=Path,
        metavar="FILE",
        help="a PEM CA bundle the registry's TLS certificate must chain to",
    )


_USAGE = """move warmed caches between hosts: an archive, or an OCI registry

Move warmed, fingerprinted JIT caches between hosts (docs/fleet.md)."""
_ACTIONS: tuple[tuple[str, str, Handler], ...] = (
    ("export", "write the vouched-for cache and its fingerprint to one archive", _export),
    ("import", "check a bundle against this host's serving venv, verify, install", _import),
    ("push", "bundle every JIT cache the units pin and push it to an OCI registry", _push),
    ("pull", "find this node's bundle in an OCI registry, check it, install it", _pull),
)


def register(commands: Subparsers) -> None:
    """Add ``bundle export|import|push|pull`` under ``flashinfer``."""
    actions = add_commands(commands, "bundle", _USAGE, "bundle_command", "ACTION")
    export, imp, push, pull = (add_command(actions, *action) for action in _ACTIONS)
    for parser in (export, imp, push, pull):
        add_serving_args(parser)
    add_module_args(export)
    export.add_argument("--out", required=True, type=Path, metavar="FILE", help="the archive")
    imp.add_argument("archive", type=Path, metavar="FILE", help="a bundle written by export")
    _limit_args(imp)
    add_module_args(push)
    _registry_args(push)
    push.add_argument(
        "--coverage-from",
        metavar="URL",
        help="this host's daemon (e.g. http://127.0.0.1:9436): record that --unit's "
        "coverage warm-up passed with exactly these caches",
    )
    push.add_argument("--unit", metavar="UNIT", help="the unit whose coverage is recorded")
    push.add_argument(
        "--learned",
        type=Path,
        metavar="FILE",
        help="carry these learned shapes (the daemon's state file, e.g. "
        "/var/lib/k26-supervisor/k26-learned-shapes.json): pulling nodes replay them",
    )
    push.add_argument(
        "--tag", action="append", default=[], help="another tag for the artifact (repeatable)"
    )
    push.add_argument(
        "--sign-key",
        type=Path,
        metavar="FILE",
        help="sign the bundle with this ECDSA P-256 private key (PEM PKCS#8, mode 0600), "
        "cosign's way: a sha256-<digest>.sig manifest beside it",
    )
    push.add_argument(
        "--sign-passphrase-file",
        type=Path,
        metavar="FILE",
        help="the passphrase of an encrypted --sign-key (mode 0600)",
    )
    push.add_argument(
        "--chunk-size",
        type=int,
        metavar="BYTES",
        help="upload each layer in PATCH chunks of this size (default: one PUT)",
    )
    _registry_args(pull)
    _limit_args(pull)
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--digest", metavar="sha256:HEX", help="pull this artifact (by digest)")
    which.add_argument("--tag", help="pull the artifact this tag names")
    pull.add_argument(
        "--verify-key",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a public key (PEM) the bundle must be signed with (repeatable: any one "
        "will do); none: installed unverified, with a warning",
    )
    add_state_dir_args(
        pull,
        "the newest signed bundle this node accepted from each tag, which a verified "
        "pull by tag may not go back from (k26-accepted-bundles.json)",
        "the daemon whose state directory is meant (system)",
    )
    pull.add_argument(
        "--learned-into",
        type=Path,
        metavar="FILE",
        help="merge the bundle's learned shapes into this file (a daemon's state file; "
        "the daemon reads it when it starts)",
    )
