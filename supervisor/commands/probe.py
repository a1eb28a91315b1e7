"""``k26-supervisor probe --url URL``: run the daemon's sampled probe once.

Asks ``/health`` once, then sends one sampled ``/generate``. A command run by hand
answers at once: when nothing listens at the URL (connection refused) it exits 69
with one line, and when the server answers but is not healthy yet it fails (exit 1).
``--wait S`` waits up to S seconds for ``/health`` instead (a model that is still
loading, with progress on stderr). The daemon's own start-up deadline (config
``probe.startup_deadline_s``) is the daemon's, not this command's. Exit 0 when the
probe passes, 1 when it fails; ``--json`` prints the result as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from supervisor.adapters.config_file import load_config
from supervisor.adapters.probe import (
    HealthProgress,
    ProbeFailure,
    ProbeParams,
    ProbeResult,
    probe_once,
)
from supervisor.commands.parsers import Subparsers, add_command
from supervisor.core.config import ProbeSection, normalize_server_url
from supervisor.core.errors import UnavailableError, UsageError

_PROGRESS_EVERY_S = 5.0


_USAGE = """wait for an SGLang server, then run one sampled generation against it

Ask URL/health (once, or for up to --wait seconds), then POST URL/generate with
temperature > 0, top_k > 1 and top_p < 1, so FlashInfer's sampling kernels run (a greedy
health check never reaches them). Exit 0 if the server answers with at least one
completion token, 1 if not, 69 if nothing listens at URL. Defaults come from --config's
[probe] table, if given."""


def register(sub: Subparsers) -> None:
    defaults = ProbeSection()
    parser = add_command(sub, "probe", _USAGE, _probe)
    parser.add_argument(
        "--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--config", type=Path, metavar="FILE", help="take defaults from FILE")
    parser.add_argument(
        "--wait",
        "--startup-deadline",
        dest="wait",
        type=float,
        metavar="S",
        help="wait up to S seconds for /health to answer 200 (default: ask once, do not wait)",
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


# The longest the one /health request of a probe that does not wait may take.
_ASK_ONCE_S = 5.0


class _NotHealthy(Exception):
    """The one /health poll of a probe that does not wait did not answer 200."""

    def __init__(self, poll: HealthProgress) -> None:
        super().__init__(poll.error)
        self.poll = poll


def _ask_once(poll: HealthProgress) -> None:
    # probe_once polls /health until its deadline; without --wait the first answer is
    # the answer, so the wait is ended here, at the first poll that is not a 200.
    if poll.status != 200:
        raise _NotHealthy(poll)


def _nothing_listens(url: str, error: str | None, waited: str) -> UnavailableError:
    hint = "" if waited else "; start the server, or pass --wait S to wait for it"
    return UnavailableError(f"probe: nothing listens at {url}{waited} ({error}){hint}")


def _probe(args: argparse.Namespace) -> int:
    section = load_config(args.config).probe if args.config else ProbeSection()
    try:
        url = normalize_server_url(args.url)
    except ValueError as exc:
        raise UsageError(f"probe: --url {exc}") from None
    params = _params(args, section)
    timeout = section.timeout_s if args.timeout is None else args.timeout
    for flag, value in (("--wait", args.wait), ("--timeout", timeout)):
        if value is not None and not value > 0:
            raise UsageError(f"probe: {flag} must be > 0, got {value:g}")
    progress: Callable[[HealthProgress], None] | None
    if args.wait is None:
        deadline, progress = _ASK_ONCE_S, _ask_once
    else:
        deadline, progress = args.wait, None if args.quiet else _Progress()
    try:
        result = asyncio.run(
            probe_once(
                url, params, startup_deadline_s=deadline, timeout_s=timeout, progress=progress
            )
        )
    except _NotHealthy as not_healthy:
        poll = not_healthy.poll
        if poll.status is None and (poll.error or "").startswith("cannot connect"):
            raise _nothing_listens(url, poll.error, "") from None
        result = _not_healthy_yet(url, params, poll)
    else:
        health_failed = not result.ok and result.latency_ms is None
        if health_failed and result.reason is ProbeFailure.CONNECT_REFUSED:
            waited = "" if args.wait is None else f" after waiting {args.wait:g} s"
            raise _nothing_listens(url, result.error, waited)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(describe(result))
    return 0 if result.ok else 1


def _not_healthy_yet(url: str, params: ProbeParams, poll: HealthProgress) -> ProbeResult:
    reason = ProbeFailure.HTTP_STATUS if poll.status is not None else ProbeFailure.TIMEOUT
    return ProbeResult(
        ok=False,
        reason=reason,
        latency_ms=None,
        completion_tokens=None,
        sampling_params=params.sampling_params(),
        error=f"not healthy: {poll.error}; pass --wait S to wait for it",
        at=datetime.now(UTC),
        url=url,
        http_status=poll.status,
        health_wait_s=poll.elapsed_s,
    )


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
