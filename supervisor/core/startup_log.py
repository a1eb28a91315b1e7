"""The server's own account of a start, from its output (pure).

SGLang 0.5.17 ends its start-up with one line of its own timings (``srt/entrypoints/
engine.py``; every ``cuda_graph`` key is always present, those not captured at 0.00):

    Engine startup timings (s): load_weight=0.11, kv_cache_allocation=1.20,
    scheduler_e2e=5.38, cuda_graph={prefill=0.00, decode=0.00, target_verify=0.00,
    draft_prefill=0.00, draft_decode=0.00, draft_extend=0.00}, tokenizer_e2e=33.24

Releases before 0.5.17 lack that line. Then what the per-phase lines say is used:
``Load weight end. elapsed=X s`` (target and draft, summed; older releases print no
``elapsed=``, and the line's timestamp against ``Load weight begin.``'s gives it to
the second), ``Capture <kind> CUDA graph end. elapsed=X s`` (0.5.16), the older
``Capture cuda graph end. Time elapsed: X s`` (decode) and ``Capture draft cuda
graph end. Time elapsed: X s``. Every TP rank prints its own lines: a phase is
summed within a rank and the slowest rank counts. A phase no line speaks of is
unknown (``None``), never zero. JIT build lines seen during the
load (DeepGEMM, FlashInfer's autotuner and old JIT loader, the stand-in's) are kept
as they are, for the timeline.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

GRAPH_KINDS = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)

_TIMINGS = re.compile(r"Engine startup timings \(s\): (?P<body>.*)$")
_PAIR = re.compile(r"([a-z][a-z0-9_]*)=([0-9.]+)")
_GRAPHS = re.compile(r"cuda_graph=\{([^}]*)\}")
_WEIGHT_BEGIN = re.compile(r"Load weight begin\.")
_WEIGHT_END_ANY = re.compile(r"Load weight end\.|Draft model loaded\.")
_WEIGHT_END = re.compile(r"(?:Load weight end|Draft model loaded)\. elapsed=([0-9.]+) s")
_RANK = re.compile(r"^\s*\[[^\]]*\bTP(\d+)\b[^\]]*\]")
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_CAPTURE_END = re.compile(
    r"Capture (?P<role>target|draft) (?P<what>prefill|decode|verify|extend) CUDA graph end\. "
    r"elapsed=(?P<s>[0-9.]+) s"
)
_OLD_CAPTURE_END = re.compile(
    r"Capture (?P<draft>draft )?cuda graph end\. Time elapsed: (?P<s>[0-9.]+) s"
)
# Where a start begins in the output (a file holds every run, one after another),
# in order of preference: the launcher's first line, the stand-in's, and the torch
# distributed set-up (printed again for an EAGLE-3 draft, a few lines later).
_STARTS = (
    re.compile(r"server_args=ServerArgs\("),
    re.compile(r"standin: loading model"),
    re.compile(r"Init torch distributed begin\."),
)
_SAME_START_LINES = 40
_JIT = re.compile(
    r"DeepGEMM JIT|Try DeepGEMM JIT Compiling|DeepGEMM warmup|Running FlashInfer autotune|"
    r"FlashInfer autotune completed|\[Autotuner\]: Autotuning process|Loading JIT ops|"
    r"Finished loading JIT ops|JIT-building FlashInfer|flashinfer\.jit: .*(?:build|compil)|"
    r"Compiling .*(?:kernel|extension)|Building extension",
    re.IGNORECASE,
)
_MAX_JIT_LINES = 50


@dataclass(frozen=True, slots=True)
class ServerTimings:
    """Seconds per phase of the server's own start, ``None`` where nothing says."""

    load_weight_s: float | None = None
    kv_cache_s: float | None = None
    scheduler_s: float | None = None
    tokenizer_s: float | None = None
    cuda_graph_s: dict[str, float | None] = field(default_factory=dict)
    jit_lines: tuple[str, ...] = ()
    source: str = "none"  # "engine-timings", "phase-lines" or "none"

    def phases(self) -> dict[str, float | None]:
        """Every phase by name (the metric's ``phase`` label), unknown ones as None."""
        out: dict[str, float | None] = {
            "server_load_weight": self.load_weight_s,
            "server_kv_cache": self.kv_cache_s,
        }
        for kind in GRAPH_KINDS:
            out[f"server_cuda_graph_{kind}"] = self.cuda_graph_s.get(kind)
        out["server_scheduler"] = self.scheduler_s
        out["server_tokenizer"] = self.tokenizer_s
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "load_weight_s": self.load_weight_s,
            "kv_cache_allocation_s": self.kv_cache_s,
            "scheduler_e2e_s": self.scheduler_s,
            "tokenizer_e2e_s": self.tokenizer_s,
            "cuda_graph_s": dict(self.cuda_graph_s),
            "jit_lines": list(self.jit_lines),
        }


def last_start(lines: Sequence[str]) -> list[str]:
    """The lines of the last start in ``lines``, from the line that opened it."""
    for marker in _STARTS:
        hits = [i for i, line in enumerate(lines) if marker.search(line)]
        if not hits:
            continue
        begin = hits[-1]
        if marker is _STARTS[-1]:  # printed again for an EAGLE-3 draft: the same start
            for earlier in reversed(hits[:-1]):
                if begin - earlier > _SAME_START_LINES:
                    break
                begin = earlier
        return list(lines[begin:])
    return list(lines)


def parse(lines: Iterable[str]) -> ServerTimings:
    """The server's timings from the output of one start (see ``last_start``)."""
    lines = list(lines)
    jit = tuple(line.strip() for line in lines if _JIT.search(line))[:_MAX_JIT_LINES]
    for line in reversed(lines):
        found = _TIMINGS.search(line)
        if found is not None:
            return _from_engine_line(found.group("body"), jit)
    return _from_phase_lines(lines, jit)


def _from_engine_line(body: str, jit: tuple[str, ...]) -> ServerTimings:
    graphs: dict[str, float | None] = dict.fromkeys(GRAPH_KINDS)
    braces = _GRAPHS.search(body)
    if braces is not None:
        for key, value in _PAIR.findall(braces.group(1)):
            graphs[key] = float(value)
        body = body.replace(braces.group(0), "")
    top = {key: float(value) for key, value in _PAIR.findall(body)}
    return ServerTimings(
        load_weight_s=top.get("load_weight"),
        kv_cache_s=top.get("kv_cache_allocation"),
        scheduler_s=top.get("scheduler_e2e"),
        tokenizer_s=top.get("tokenizer_e2e"),
        cuda_graph_s=graphs,
        jit_lines=jit,
        source="engine-timings",
    )


def _rank(line: str) -> str:
    tag = _RANK.search(line)
    return tag.group(1) if tag else "0"


def _stamp(line: str) -> datetime | None:
    found = _STAMP.match(line.strip())
    if found is None:
        return None
    try:
        return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None


def _from_phase_lines(lines: list[str], jit: tuple[str, ...]) -> ServerTimings:
    """Each rank prints its own lines (``[... TP3] ...``): a phase is summed within a
    rank (target and draft), then the slowest rank counts, as SGLang's own line does."""
    weights: dict[str, float] = {}
    graphs: dict[str, dict[str, float]] = {}
    begun: dict[str, datetime] = {}
    for line in lines:
        rank = _rank(line)
        if _WEIGHT_BEGIN.search(line):
            if (at := _stamp(line)) is not None:
                begun[rank] = at
            continue
        if _WEIGHT_END_ANY.search(line):
            took = _WEIGHT_END.search(line)
            if took is not None:
                weights[rank] = weights.get(rank, 0.0) + float(took.group(1))
            elif rank in begun and (at := _stamp(line)) is not None:
                # Older releases: no elapsed= on the line; the log's own clock tells.
                weights[rank] = weights.get(rank, 0.0) + (at - begun.pop(rank)).total_seconds()
            continue
        kind, took_s = _graph_end(line)
        if kind is not None:
            per_rank = graphs.setdefault(kind, {})
            per_rank[rank] = per_rank.get(rank, 0.0) + took_s
    graph_s: dict[str, float | None] = dict.fromkeys(GRAPH_KINDS)
    for kind, per_rank in graphs.items():
        graph_s[kind] = max(per_rank.values())
    if not weights and not graphs:
        return ServerTimings(cuda_graph_s=graph_s, jit_lines=jit, source="none")
    return ServerTimings(
        load_weight_s=max(weights.values()) if weights else None,
        cuda_graph_s=graph_s,
        jit_lines=jit,
        source="phase-lines",
    )


def _graph_end(line: str) -> tuple[str | None, float]:
    new = _CAPTURE_END.search(line)
    if new is not None:
        role, what = new.group("role"), new.group("what")
        kind = {
            ("target", "verify"): "target_verify",
            ("draft", "prefill"): "draft_prefill",
            ("draft", "decode"): "draft_decode",
            ("draft", "extend"): "draft_extend",
        }.get((role, what), what)
        return kind, float(new.group("s"))
    old = _OLD_CAPTURE_END.search(line)
    if old is not None:
        return ("draft_decode" if old.group("draft") else "decode"), float(old.group("s"))
    return None, 0.0
