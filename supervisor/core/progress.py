"""Forward progress of a ready server: requests in flight, tokens produced.

A ready unit whose server reports requests running (or queued) while it produces no
token for ``stall_after_s`` has stalled: a hung scheduler, a deadlocked collective, a
kernel that never returns. Its ``/health`` may still say 200 (the HTTP server is a
different process). The periodic sampled probe would catch it only after
``failures_to_fail`` timeouts; this catches it from the server's own counters.

Read from SGLang's ``/metrics`` (``--enable-metrics``; sglang 0.5.17,
``srt/observability/metrics_collector.py``): the gauges ``sglang:num_running_reqs``
and ``sglang:num_queue_reqs``, and the counter ``sglang:realtime_tokens_total``
(``mode`` = ``prefill_compute``, ``prefill_cache``, ``decode``), which the scheduler
advances after every decode step and after every prefill chunk. The request-level
counters (``sglang:generation_tokens_total``, ``sglang:prompt_tokens_total``) move only
when a request finishes, so they stand in only where the realtime one is missing.

The rule. The clock restarts whenever one of these is seen:

- the token counter moved, or nothing is running or queued (an idle server is the
  periodic probe's to judge, a hung idle scheduler included);
- a JIT compile in progress: a file written in one of the unit's JIT caches (the JIT
  watch), or a compiler running in the unit's cgroup (nvcc, cicc, ptxas, ninja, a C
  or C++ compiler: Triton, FlashInfer, inductor and TVM-FFI all shell out to one);
- a long prompt's prefill advances the counter after each chunk (at most
  ``--chunked-prefill-size`` tokens), so it shows progress chunk by chunk: the budget
  is for one chunk's forward pass, not for the whole prompt.

Past ``stall_after_s`` with none of them, the unit has stalled. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
REALTIME_TOKENS = "sglang:realtime_tokens_total"
# Only when a request finishes; used where the realtime counter is absent.
FINISHED_TOKENS = ("sglang:generation_tokens_total", "sglang:prompt_tokens_total")
# The processes a JIT compile runs (their /proc/PID/comm, at most 15 characters).
COMPILERS = frozenset(
    {"nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "ninja", "cc1", "cc1plus", "gcc", "g++",
     "c++", "cc", "clang", "clang++", "ld", "collect2", "as"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What one scrape of the server's /metrics said."""

    running: float
    queued: float
    tokens: float  # a counter: every token the scheduler has processed so far
    counter: str  # which counter ``tokens`` sums


class MetricsUnreadable(ValueError):
    """The text is not Prometheus exposition, or lacks SGLang's gauges."""


# One sample line of the text exposition format: name, optional {labels}, value,
# optional timestamp. Label values may hold any character but an unescaped quote.
_SAMPLE_RE = re.compile(
    r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?'
    r"\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)


def parse_sglang_metrics(text: str) -> ServerLoad:
    """Sum each series over its labels (tp ranks, modes). Raises MetricsUnreadable."""
    sums: dict[str, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if match is None:
            raise MetricsUnreadable(f"not Prometheus text at line {number}: {line[:80]!r}")
        try:
            value = float(match.group("value"))
        except ValueError:
            raise MetricsUnreadable(
                f"line {number}: {match.group('value')!r} is no number"
            ) from None
        if math.isfinite(value):
            name = match.group("name")
            sums[name] = sums.get(name, 0.0) + value
    if RUNNING not in sums:
        raise MetricsUnreadable(f"no {RUNNING} gauge: is this an SGLang server?")
    if REALTIME_TOKENS in sums:
        tokens, counter = sums[REALTIME_TOKENS], REALTIME_TOKENS
    else:
        tokens = sum(sums.get(name, 0.0) for name in FINISHED_TOKENS)
        counter = "+".join(FINISHED_TOKENS)
    return ServerLoad(sums[RUNNING], sums.get(QUEUED, 0.0), tokens, counter)


class ProgressJudge:
    """The rule above, for one ready run of a unit."""

    def __init__(self, stall_after_s: float, now: float) -> None:
        self.stall_after_s = stall_after_s
        self._tokens: float | None = None
        self._since = now  # the last sign of progress

    def activity(self, now: float) -> None:
        """A JIT compile is in progress (a cache file, a compiler process)."""
        self._since = max(self._since, now)

    def observe(self, load: ServerLoad, now: float) -> str | None:
        """One scrape; the reason to call it stalled, or None."""
        busy = load.running > 0 or load.queued > 0
        if not busy or load.tokens != self._tokens:
            self._tokens = load.tokens
            self._since = max(self._since, now)
            return None
        silent = now - self._since
        if silent < self.stall_after_s:
            return None
        return (
            f"{load.running:g} requests running and {load.queued:g} queued, but no token "
            f"in {silent:.0f} s ({load.counter} flat at {load.tokens:g}) and no JIT compile "
            f"seen (stall_after_s = {self.stall_after_s:g})"
        )
