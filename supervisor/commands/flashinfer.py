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
import json
import sys

from supervisor import flashinfer
from supervisor.commands import fleet
from supervisor.commands.serving_args import (
    add_module_args,
    add_serving_args,
    module_names,
    serving_env,
)
from supervisor.core.errors import InputError
from supervisor.flashinfer import learned
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


def _learned(args: argparse.Namespace) -> tuple[str, ...]:
    """The modules ready units built for this arch, unless --no-learned."""
    if args.no_learned:
        return ()
    return tuple(learned.learned(args.workspace, args.arch))


def _doctor(args: argparse.Namespace) -> int:
    report = asyncio.run(
        flashinfer.doctor(
            args.python,
            args.arch,
            args.workspace,
            module_names(args),
            learned=_learned(args),
            env=serving_env(args),
        )
    )
    caches = asyncio.run(_unit_caches(args.unit, args.bus)) if args.unit else None
    if args.json:
        doc = report.as_dict()
        if caches is not None:
            doc["unit_caches"] = caches
        print(json.dumps(doc, indent=2))
    else:
        _print_report(report)
        for cache in caches or []:
            kept = "kept across restarts" if cache["kept"] else "WIPED at restart"
            pinned = cache["source"] if cache["pinned"] else f"default: {cache['source']}"
            print(f"{args.unit} cache {cache['cache']}: {cache['path']} ({pinned}); {kept}")
            if cache["problem"]:
                print(f"problem: {cache['problem']}")
    if caches and any(c["problem"] for c in caches):
        return max(report.exit_code, 2)  # a cache a restart wipes is a cold start to come
    return report.exit_code


async def _unit_caches(unit: str, bus_kind: str) -> list[dict[str, object]]:
    """Where each JIT cache of ``unit`` lives, from its own environment over D-Bus."""
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
    ]


def _warm(args: argparse.Namespace) -> int:
    def progress(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result = asyncio.run(
        flashinfer.warm(
            args.python,
            args.arch,
            args.workspace,
            module_names(args),
            timeout_s=args.timeout,
            progress=progress,
            env=serving_env(args),
            learned=_learned(args),
        )
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


def _print_patch(result: PatchResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
    if result.diff and (result.dry_run or result.changed):
        print(result.diff, end="" if result.diff.endswith("\n") else "\n")
    print(f"{result.message} [strategy: {result.strategy}]")


def _patch(args: argparse.Namespace) -> int:
    result = asyncio.run(
        flashinfer.patch(
            args.python, args.arch, args.workspace, dry_run=args.dry_run, env=serving_env(args)
        )
    )
    _print_patch(result, args.json)
    return 0


def _revert(args: argparse.Namespace) -> int:
    result = asyncio.run(
        flashinfer.revert(
            args.python, args.arch, args.workspace, dry_run=args.dry_run, env=serving_env(args)
        )
    )
    _print_patch(result, args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "flashinfer",
        help="FlashInfer JIT cache: doctor, warm, patch, revert",
        description="Inspect, warm and patch the serving venv's FlashInfer JIT cache.",
    )
    commands = parser.add_subparsers(dest="flashinfer_command", metavar="ACTION", required=True)
    doctor = commands.add_parser(
        "doctor",
        help="is the cache warm and valid? (exit 0 warm, 2 needs warm-up, 3 cannot determine)",
    )
    add_serving_args(doctor)
    add_module_args(doctor)
    doctor.add_argument(
        "--unit",
        metavar="UNIT",
        help="also check where each JIT cache of UNIT lives (its Environment=, "
        "EnvironmentFile= and home, over D-Bus) and whether a restart keeps it",
    )
    doctor.add_argument(
        "--bus", choices=["system", "user"], default="system", help="UNIT's manager (system)"
    )
    doctor.set_defaults(handler=_doctor)
    warm = commands.add_parser("warm", help="build what is missing, then verify")
    add_serving_args(warm)
    add_module_args(warm)
    warm.add_argument(
        "--timeout", type=float, default=1800.0, metavar="S", help="build time limit (s)"
    )
    warm.set_defaults(handler=_warm)
    for name, handler, text in (
        ("patch", _patch, "make FlashInfer's gate accept the arch (SM120 patch)"),
        ("revert", _revert, "restore the exact bytes the patch replaced"),
    ):
        command = commands.add_parser(name, help=text)
        add_serving_args(command)
        command.add_argument("--dry-run", action="store_true", help="show the diff only")
        command.set_defaults(handler=handler)
    fleet.register(commands)
