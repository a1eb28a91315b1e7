"""``k26-supervisor probe --url URL``: run the daemon's sampled probe once.

Waits for ``/health`` (long enough for a 10-minute model load, with progress on
stderr), then sends one sampled ``/generate``. Exit 0 when it passes, 1 when it
fails; ``--json`` prints the result as one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from supervisor.adapters.config_file import load_config
from supervisor.adapters.probe import HealthProgress, ProbeParams, ProbeResult, probe_once
from supervisor.core.config import ProbeSection, normalize_server_url
from supervisor.core.errors import UsageError

_PROGRESS_EVERY_S = 5.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = ProbeSection()
    parser = sub.add_parser(
        "probe",
        help="wait for an SGLang server, then run one sampled generation against it",
        description=(
            "Wait for URL/health, then POST URL/generate with temperature > 0, top_k > 1 "
            "and top_p < 1, so FlashInfer's sampling kernels run (a greedy health check "
            "never reaches them). Exit 0 if the server answers with at least one "
            "completion token, else 1. Defaults come from --config's [probe] table, if given."
        ),
    )
    parser.add_argument(
        "--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--config", type=Path, metavar="FILE", help="take defaults from FILE")
    parser.add_argument(
        "--startup-deadline",
        type=float,
        metavar="S",
        help=f"seconds to wait for /health (default {defaults.startup_deadline_s:g})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help=f"seconds for the sampled request (default {defaults.timeout_s:g})",
    )
    parser.add_argument("--temperature", type=float, help=f"default {defaults.temperature}")
    parser.add_argument("--top-k", type=int, help=f"> 1, or -1 for all (default {defaults.top_k})")
    parser.add_argument("--top-p", type=float, help=f"in (0, 1) (default {defaults.top_p})")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {defaults.max_new_tokens}")
    parser.add_argument("--seed", type=int, help=f"sampling seed (default {defaults.seed})")
    parser.add_argument("--prompt", help="the prompt text")
    parser.set_defaults(handler=_probe)


def _params(args: argparse.Namespace, section: ProbeSection) -> ProbeParams:
    """Flags win over the config's [probe] table, which wins over the defaults."""
    a, s = args, section
    try:
        return ProbeParams(
            temperature=s.temperature if a.temperature is None else a.temperature,
            top_k=s.top_k if a.top_k is None else a.top_k,
            top_p=s.top_p if a.top_p is None else a.top_p,
            max_new_tokens=s.max_new_tokens if a.max_new_tokens is None else a.max_new_tokens,
            seed=s.seed if a.seed is None else a.seed,
            prompt=s.prompt if a.prompt is None else a.prompt,
        )
    except ValueError as exc:
        raise UsageError(f"probe: {exc}") from None


def _probe(args: argparse.Namespace) -> int:
    section = load_config(args.config).probe if args.config else ProbeSection()
    try:
        url = normalize_server_url(args.url)
    except ValueError as exc:
        raise UsageError(f"probe: --url {exc}") from None
    params = _params(args, section)
    deadline = (
        section.startup_deadline_s if args.startup_deadline is None else args.startup_deadline
    )
    timeout = section.timeout_s if args.timeout is None else args.timeout
    for flag, value in (("--startup-deadline", deadline), ("--timeout", timeout)):
        if not value > 0:
            raise UsageError(f"probe: {flag} must be > 0, got {value:g}")
    progress = None if args.quiet else _Progress()
    result = asyncio.run(
        probe_once(url, params, startup_deadline_s=deadline, timeout_s=timeout, progress=progress)
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(describe(result))
    return 0 if result.ok else 1


def describe(result: ProbeResult) -> str:
    sp = result.sampling_params
    used = (
        f"temperature={sp['temperature']} top_k={sp['top_k']} top_p={sp['top_p']} "
        f"max_new_tokens={sp['max_new_tokens']} seed={sp['sampling_seed']}"
    )
    if result.ok:
        return (
            f"OK: {result.url} sampled {result.completion_tokens} token(s) in "
            f"{result.latency_ms:.1f} ms ({used})"
        )
    reason = result.reason.value if result.reason else "unknown"
    return f"FAILED ({reason}): {result.url}: {result.error} ({used})"


class _Progress:
    """Prints the /health wait to stderr when its answer changes, or every few seconds."""

    def __init__(self) -> None:
        self._last_key: tuple[int | None, str | None] | None = None
        self._last_at = 0.0

    def __call__(self, p: HealthProgress) -> None:
        key = (p.status, p.error)
        now = time.monotonic()
        if key == self._last_key and now - self._last_at < _PROGRESS_EVERY_S:
            return
        self._last_key, self._last_at = key, now
        state = "healthy" if p.status == 200 else (p.error or f"HTTP {p.status}")
        print(
            f"waiting for {p.url}/health: {state} "
            f"({p.elapsed_s:.0f} s of {p.deadline_s:g} s, {p.attempts} polls)",
            file=sys.stderr,
            flush=True,
        )
