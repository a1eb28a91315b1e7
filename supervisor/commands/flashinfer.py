"""``k26-supervisor flashinfer doctor|warm|patch|revert``: the JIT cache from a shell.

Thin: parses arguments, runs the library's async API with ``asyncio.run`` and
prints. Exit codes of ``doctor``: 0 warm and valid, 2 needs warm-up, 3 cannot
determine. ``warm`` exits 0 only when doctor would now say warm, else with the
code of its error (74 cache unusable or build failed, 69 venv unavailable or
another warm-up running). ``patch``/``revert`` exit 0 on success or no-op,
65 when the files are not what the patch expects.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from supervisor import flashinfer
from supervisor.commands import fleet
from supervisor.commands.parsers import Subparsers, add_command, add_commands
from supervisor.commands.serving_args import (
    add_module_args,
    add_serving_args,
    add_state_dir_args,
    daemon_state_dir,
    learned_modules,
    module_names,
    run_serving,
    serving_env,
)
from supervisor.core.errors import InputError, SupervisorError
from supervisor.core.learned_shapes import LEARNED_SHAPES_NAME
from supervisor.flashinfer.models import DoctorReport, PatchResult


def _print_report(report: DoctorReport) -> None:
    meaning = {
        "warm": "warm and valid",
        "needs-warmup": "needs warm-up",
        "unknown": "cannot determine",
    }
    v = report.versions
    print(f"status: {report.status} ({meaning[report.status]})")
    print(f"python: {report.python}")
    if v:
        print(
            f"versions: flashinfer {v.get('flashinfer')}, torch {v.get('torch')} "
            f"(built for CUDA {v.get('torch_cuda') or 'none'}), CUDA {v.get('cuda')} "
            f"(nvcc {v.get('nvcc')})"
        )
    print(f"arch: {report.arch} -> {report.arch_tag or '?'}")
    print(f"cache: {report.cache_dir or '?'}")
    gate = report.gate
    flags = f" ({' '.join(gate.arch_flags)})" if gate.arch_flags else ""
    print(f"gate: {gate.verdict}{flags}" + (f": {gate.error}" if gate.error else ""))
    without = report.gate_without_arch_list
    if without is not None:
        print(
            f"  without FLASHINFER_CUDA_ARCH_LIST: {without.verdict}"
            + (f": {without.error}" if without.error else "")
        )
    for module in report.modules:
        state = "ok" if module.ok else "NOT OK"
        print(
            f"module {module.name}: {state}; compiled={module.compiled} "
            f"complete={module.complete} loads={module.loads} "
            f"targets={','.join(module.targets) or '-'} "
            f"holds {report.arch}={module.holds_target_arch} "
            f"fingerprint={'ok' if module.fingerprint_ok else 'no'}"
        )
        if module.path:
            print(f"  path: {module.path}")
        print(f"  from: {module.source_detail or 'the JIT workspace (built by warm)'}")
    for lock in report.locks:
        print(f"lock: {lock.path}: {lock.state} ({lock.detail})")
    fp = report.fingerprint
    if fp:
        print(f"fingerprint: {fp.get('state')}" + (f" ({fp['path']})" if fp.get("path") else ""))
        for line in fp.get("differences", [])[:8]:
            print(f"  {line}")
    if report.learned:
        print(f"learned from ready units: {', '.join(report.learned)}")
    for name, why in report.not_rebuildable.items():
        print(f"not rebuildable: {name}: {why}")
    for name, what in report.others.items():
        print(f"also in the cache (neither asked for nor learned yet): {name}: {what}")
    for problem in report.problems:
        print(f"problem: {problem}")
    for hint in report.hints:
        print(f"hint: {hint}")


def _doctor(args: argparse.Namespace) -> int:
    report = run_serving(flashinfer.doctor, args, module_names(args), learned=learned_modules(args))
    caches, env = asyncio.run(_unit_caches(args.unit, args.bus)) if args.unit else (None, {})
    roots = _unwatched_roots(args, env) if args.unit else None
    state = daemon_state_dir(args)
    shapes = _learned_shapes(args.unit, state) if args.unit else None
    bundles = _accepted_bundles(state)
    if args.json:
        doc = report.as_dict()
        doc["accepted_bundles"] = bundles
        if caches is not None:
            doc["unit_caches"] = caches
        if shapes is not None:
            doc["learned_shapes"] = shapes
        if roots is not None:
            doc["unwatched_cache_roots"] = roots
        print(json.dumps(doc, indent=2))
    else:
        _print_report(report)
        for cache in caches or []:
            kept = "kept across restarts" if cache["kept"] else "WIPED at restart"
            pinned = cache["source"] if cache["pinned"] else f"default: {cache['source']}"
            print(f"{args.unit} cache {cache['cache']}: {cache['path']} ({pinned}); {kept}")
            if cache["problem"]:
                print(f"problem: {cache['problem']}")
        if shapes is not None:
            _print_learned(args.unit, shapes)
        _print_accepted(bundles)
        for variable, found in (roots or {}).items():
            files = found["files"]
            where = f"{', '.join(files[:3])}{', ...' if len(files) > 3 else ''}"
            if found["pinned"]:
                print(
                    f"note: the serving venv's code can write a cache named by {variable} "
                    f"({where}); {args.unit} pins it at {found['pinned']}, which the JIT "
                    "watch does not follow"
                )
            else:
                print(
                    f"problem: the serving venv's code can write a cache named by {variable} "
                    f"({where}), which k26-supervisor does not know: pin {variable} under "
                    f"{args.unit}'s CacheDirectory= so that it outlives restarts"
                )
    unpinned = any(not found["pinned"] for found in (roots or {}).values())
    problems = unpinned or any(c["problem"] for c in caches or [])
    if problems:  # a cache a restart wipes, or one nothing watches: a cold start to come
        return max(report.exit_code, 2)
    return report.exit_code


def _unwatched_roots(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """Cache variables the serving venv's code reads that no watched cache follows:
    the files that read each, and where the unit's environment pins it (or None)."""
    from supervisor.core import jit_caches
    from supervisor.flashinfer.venv import ServingEnv
    from supervisor.fleet import cache_layers

    serving = ServingEnv(args.python, args.arch, args.workspace, serving_env(args))
    found = asyncio.run(cache_layers.cache_roots(serving))
    return {
        v: {"files": found.variables[v], "pinned": env.get(v) or None}
        for v in jit_caches.unknown(found.variables)
    }


def _learned_shapes(unit: str, state: Path) -> dict[str, Any]:
    """What ``unit`` compiled after READY on earlier starts (the daemon's record, in
    its state directory ``state``)."""
    from supervisor.adapters import learned_shapes

    path = state / LEARNED_SHAPES_NAME
    try:
        records = learned_shapes.read_records(path).get(unit, [])
    except (OSError, ValueError) as exc:
        return {"path": str(path), "problem": f"{exc}; the daemon moves it aside at its start"}
    return learned_shapes.status_json(path, records)


def _accepted_bundles(state: Path) -> dict[str, Any]:
    """The newest signed bundle this node accepted from each tag (fleet/accepted.py),
    as the daemon's state directory ``state`` records it."""
    from supervisor.fleet import accepted

    path = accepted.record_path(state)
    try:
        record = accepted.read(path)
    except SupervisorError as exc:
        return {"path": str(path), "problem": str(exc)}
    return {"path": str(path), "tags": {k: v.model_dump() for k, v in record.tags.items()}}


def _print_accepted(bundles: Mapping[str, Any]) -> None:
    if "problem" in bundles:
        print(f"problem: {bundles['problem']}")
        return
    for tag, entry in bundles["tags"].items():
        print(
            f"accepted from {tag}: {entry['digest']} (created {entry['created_at']}, "
            f"verified with {entry['key']}): an older signed bundle there is refused"
        )


def _print_learned(unit: str, shapes: Mapping[str, Any]) -> None:
    if "problem" in shapes:
        print(f"{unit} learned shapes: {shapes['path']}")
        print(f"problem: {shapes['problem']}")
        return
    print(
        f"{unit} learned shapes: {shapes['count']} ({shapes['replayable']} replayed by its "
        f"coverage) in {shapes['path']}"
    )
    for record in shapes["latest"]:
        replay = ", ".join(record["replay"]) or "not replayable (no batch line near it)"
        print(f"  {record['cache']} {record['kernel']} (seen {record['seen']}x): {replay}")


async def _unit_caches(unit: str, bus_kind: str) -> tuple[list[dict[str, object]], dict[str, str]]:
    """Where each JIT cache of ``unit`` lives, from its own environment over D-Bus;
    and that environment."""
    from supervisor.adapters import unit_env
    from supervisor.adapters.systemd_bus import SystemdBus
    from supervisor.core import jit_caches

    async with SystemdBus(bus_kind) as bus:  # type: ignore[arg-type]
        snap = await bus.snapshot(unit)
    if snap.load_state != "loaded":
        raise InputError(f"--unit {unit}: not a loaded unit on the {bus_kind} bus")
    found = await unit_env.resolve(snap)
    located = jit_caches.locate(found.env, home=found.home, user=found.user)
    return [
        {
            "cache": str(a.location.cache),
            "path": str(a.location.path),
            "pinned": a.location.pinned,
            "source": a.location.source,
            "kept": a.kept,
            "problem": a.problem,
        }
        for a in jit_caches.assess(
            located, private_tmp=snap.private_tmp, cache_directories=snap.cache_directories
        )
    ], dict(found.env)


def _warm(args: argparse.Namespace) -> int:
    def progress(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result = run_serving(
        flashinfer.warm,
        args,
        module_names(args),
        timeout_s=args.timeout,
        progress=progress,
        learned=learned_modules(args),
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    elif result.ok:
        built = ", ".join(result.built) or "nothing"
        print(f"warm and valid in {result.duration_s:.2f} s; built {built}")
    if not result.ok:
        print(f"k26-supervisor: error: {result.error}", file=sys.stderr)
        return result.exit_code or 1
    return 0


def _edit_gate(
    action: Callable[..., Coroutine[Any, Any, PatchResult]], args: argparse.Namespace
) -> int:
    """``patch`` or ``revert`` (``action``), and what it did."""
    result = run_serving(action, args, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    if result.diff and (result.dry_run or result.changed):
        print(result.diff, end="" if result.diff.endswith("\n") else "\n")
    print(f"{result.message} [strategy: {result.strategy}]")
    return 0


_USAGE = """FlashInfer JIT cache: doctor, warm, patch, revert

Inspect, warm and patch the serving venv's FlashInfer JIT cache."""


def register(sub: Subparsers) -> None:
    commands = add_commands(sub, "flashinfer", _USAGE, "flashinfer_command", "ACTION")
    doctor = add_command(
        commands,
        "doctor",
        "is the cache warm and valid? (exit 0 warm, 2 needs warm-up, 3 cannot determine)",
        _doctor,
    )
    add_serving_args(doctor)
    add_module_args(doctor)
    doctor.add_argument(
        "--unit",
        metavar="UNIT",
        help="also check where each JIT cache of UNIT lives (its Environment=, "
        "EnvironmentFile= and home, over D-Bus) and whether a restart keeps it",
    )
    add_state_dir_args(
        doctor,
        "the signed bundles this node accepted and (with --unit) UNIT's learned shapes",
        "UNIT's manager, and the daemon whose state directory is meant (system)",
    )
    warm = add_command(commands, "warm", "build what is missing, then verify", _warm)
    add_serving_args(warm)
    add_module_args(warm)
    warm.add_argument(
        "--timeout", type=float, default=1800.0, metavar="S", help="build time limit (s)"
    )
    for name, action, text in (
        ("patch", flashinfer.patch, "make FlashInfer's gate accept the arch (SM120 patch)"),
        ("revert", flashinfer.revert, "restore the exact bytes the patch replaced"),
    ):
        command = add_command(commands, name, text, functools.partial(_edit_gate, action))
        add_serving_args(command)
        command.add_argument("--dry-run", action="store_true", help="show the diff only")
    fleet.register(commands)
