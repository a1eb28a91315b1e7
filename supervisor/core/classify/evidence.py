"""The output's evidence: which lines name which cause, and which cause decides.

A scan reads the output once: each candidate line against the line rules (rules.py),
the tracebacks and C++ frames against the origin rules (origins.py), and marks the
warnings, which decide nothing. ``deciding`` then picks among what a part of the
output holds (the stop logic asks about the lines before and after a stop began):

* the cause whose deciding line comes **last** wins: the last error printed is the
  one that ended the process, an earlier one may have been caught and survived;
* ``nccl`` decides only when no other cause is printed: a collective that fails or
  times out is most often the echo of a peer rank's OOM, CUDA fault or load failure;
* ``flashinfer-jit`` gives way to ``flashinfer-arch``: a build that failed because
  the compiler does not know the GPU's architecture is the architecture's failure;
* a loader's exception raised from, or while handling, a GPU failure (an allocation, a
  CUDA fault, the driver) is that failure's wrapper and keeps its cause, and a line that
  only says a model failed to load (llama.cpp's ``failed to load model``, Ollama's
  ``panic: unable to load model``) is no evidence at all: the same line follows an
  allocation that failed, a missing file and an unknown architecture alike, so the
  line before it decides.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import frames, origins
from .frames import PyError
from .model import ExitCause, dedupe
from .rules import WARNING_HEAD_RE, is_warning, line_rule

# Plain substrings that the traceback, C++, child-failure and stop checks need.
OTHER_NEEDLES: tuple[str, ...] = (
    *("Error", "Exception", 'File "', 'File \\"', "Traceback", "above exception"),
    *("Exception raised from", "frame #", "ProcessGroupNCCL", "NCCLUtils"),
    *("sigquit", "SIGQUIT", "crashed with exit code", "Sleeping 5 seconds"),
    *("scheduler is dead", "hit an exception", "Exception in ", "warmup error"),
    *("SIGTERM received", "Gracefully exiting", "kill_process_tree called"),
    "Warning:",
)
# Every rule needle and every OTHER_NEEDLES item contains one of these words (a test
# checks it), so a line with none of them (the bulk of a healthy log) is skipped by one
# search. Few words keep that search cheap: a few ms for a 2000-line tail.
PREFILTER_WORDS: tuple[str, ...] = (
    *("rror", "xception", "emory", "MEMORY", "CUDA", "cuda", "NCCL", "nccl", "_STATUS_"),
    *("rrno", "EADDRINUSE", "AddrInUse", "in use", "is not available in", "bind"),
    *("usage of each socket", "already allocated"),
    *("not yet initialized", "NVIDIA driver", "version mismatch", "VERSION_MISMATCH"),
    *("Not Loaded", "NOT_LOADED"),
    *("upport", "apabilit", "kernel image", "FlashInfer", "requires SM", "gpu-name"),
    *("sm_", "compute_", "SM", "Ampere", "Hopper", "Blackwell", "Assertion", "OOM when"),
    *("C compiler", "cuInit"),
    *("profiled value", "KV cache", "odel", "implementation", "file named", "gated repo"),
    *("Not Found", "file found", "Can't load", "state_dict", "Invalid credentials"),
    *("huggingface", "illegal", "device-side", "launch failure"),
    *("Watchdog caught", "sigquit", "SIGQUIT", "crashed with", "Sleeping 5", "is dead"),
    *("SIGTERM", "Gracefully exiting", "kill_process_tree", "File ", "Traceback"),
    *("above exception", "frame #", "arning:"),
)


def _trie(words: Sequence[str]) -> str:
    """One regex for "any of the words", nested by shared prefixes: the regex engine
    then tries one branch per character instead of every word at every position."""
    if "" in words:
        return ""
    groups: dict[str, list[str]] = {}
    for word in sorted(set(words)):
        groups.setdefault(word[0], []).append(word[1:])
    parts = [re.escape(first) + _trie(rest) for first, rest in groups.items()]
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


# A word with a shorter one as its prefix adds nothing.
_CANDIDATE_RE = re.compile(
    _trie(
        [w for w in PREFILTER_WORDS if not any(w != o and w.startswith(o) for o in PREFILTER_WORDS)]
    )
)
# What a model's loader can run into on the GPU: a loader error chained to one of these
# is its wrapper.
_GPU_FAILURES = frozenset({ExitCause.GPU_OOM, ExitCause.CUDA_ERROR, ExitCause.GPU_DRIVER})
# A warning whose text starts on the next line runs on for at most this many lines, or
# until an exception line, a frame or a traceback starts.
_WARNING_BODY_LINES = 6


@dataclass(frozen=True)
class Hit:
    cause: ExitCause
    kind: str
    index: int
    lines: tuple[str, ...]  # the lines that show it (the last one is at index)


@dataclass(frozen=True)
class OutputHit:
    cause: ExitCause
    index: int
    lines: tuple[str, ...]
    kind: str


@dataclass(frozen=True)
class Scan:
    lines: Sequence[str]
    candidates: tuple[int, ...]
    hits: tuple[Hit, ...]  # in the order of their index


def candidates(lines: Sequence[str]) -> tuple[int, ...]:
    """The indexes of the lines worth a closer look."""
    search = _CANDIDATE_RE.search
    return tuple(i for i, line in enumerate(lines) if search(line))


def _warnings(lines: Sequence[str], indexes: Sequence[int]) -> set[int]:
    out: set[int] = set()
    for i in indexes:
        line = lines[i]
        if not is_warning(line):
            continue
        out.add(i)
        if WARNING_HEAD_RE.search(line):
            for j in range(i + 1, min(len(lines), i + 1 + _WARNING_BODY_LINES)):
                body = lines[j]
                if (
                    frames.TRACEBACK_HEAD in body
                    or frames.PY_FRAME_RE.search(body)
                    or frames.exception_line(body) is not None
                ):
                    break
                out.add(j)
    return out


def _error_hits(lines: Sequence[str], errors: Sequence[PyError], named: dict[int, Hit]) -> None:
    """Exceptions: the line rule's cause refined by the frames, else the origin's, else
    the cause of the exception it was raised from or during."""
    by_index: dict[int, Hit] = {}
    for error in errors:
        line = lines[error.index]
        hit = named.get(error.index)
        frame_lines = tuple(lines[f.index] for f in error.frames[-1:])
        if hit is not None:
            cause, kind = origins.refine((hit.cause, hit.kind), error)
            hit = Hit(cause, kind, error.index, (*frame_lines, line))
        else:
            found = origins.error_cause(error)
            if found is not None:
                shown = tuple(lines[f.index] for f in found[2]) or frame_lines
                hit = Hit(found[0], found[1], error.index, (*shown, line))
            elif error.cause is not None and (earlier := by_index.get(error.cause.index)):
                hit = Hit(earlier.cause, earlier.kind, error.index, (*earlier.lines, line))
        if hit is not None and hit.cause is ExitCause.MODEL_LOAD and error.cause is not None:
            # A loader's error raised from or while handling a GPU failure (transformers'
            # "OSError: Unable to load weights ..." around a CUDA OOM in torch.load) is
            # that failure's wrapper: the GPU failure keeps its say.
            chained = (by_index.get(e.index) for e in error.cause.chain())
            gpu = next((h for h in chained if h is not None and h.cause in _GPU_FAILURES), None)
            if gpu is not None:
                hit = Hit(gpu.cause, gpu.kind, error.index, (*gpu.lines, line))
        if hit is not None:
            by_index[error.index] = hit
    named.update(by_index)


def scan(lines: Sequence[str], is_crash: Callable[[str], bool]) -> Scan:
    """Read the output once (``is_crash``: a child-failure line, which ends a cut
    traceback)."""
    indexes = candidates(lines)
    warnings = _warnings(lines, indexes)
    named: dict[int, Hit] = {}
    for i in indexes:
        if i in warnings:
            continue
        rule = line_rule(lines[i])
        if rule is not None:
            named[i] = Hit(rule.cause, rule.kind, i, (lines[i],))
            continue
        found = frames.glog(lines[i])
        if found is not None and (glogged := origins.glog_cause(*found, lines[i])):
            named[i] = Hit(glogged[0], glogged[1], i, (lines[i],))
    usable = [i for i in indexes if i not in warnings]
    parsed = frames.parse(lines, usable, is_crash)
    _error_hits(lines, [e for e in parsed.errors if e.index not in warnings], named)
    for cut in parsed.cut:
        found = origins.cut_cause(cut)
        if found is not None and cut[-1].index not in named:
            named[cut[-1].index] = Hit(found[0], found[1], cut[-1].index, (lines[cut[-1].index],))
    for raised in parsed.raises:
        found = origins.cpp_cause(raised)
        if found is not None and raised.index not in named:
            named[raised.index] = Hit(found[0], found[1], raised.index, (lines[raised.index],))
    return Scan(lines, indexes, tuple(named[i] for i in sorted(named)))


def deciding(
    found: Scan,
    start: int = 0,
    end: int | None = None,
    ignore: frozenset[ExitCause] = frozenset(),
) -> OutputHit | None:
    """The deciding evidence among ``lines[start:end]``, leaving out ``ignore``."""
    stop = len(found.lines) if end is None else end
    by_cause: dict[ExitCause, list[Hit]] = {}
    for hit in found.hits:
        if start <= hit.index < stop and hit.cause not in ignore:
            by_cause.setdefault(hit.cause, []).append(hit)
    if not by_cause:
        return None
    if len(by_cause) > 1:
        by_cause.pop(ExitCause.NCCL, None)  # an echo of the other cause
    if ExitCause.FLASHINFER_ARCH in by_cause:
        by_cause.pop(ExitCause.FLASHINFER_JIT, None)  # the arch failed the build
    cause, hits = max(by_cause.items(), key=lambda item: item[1][-1].index)
    lines = dedupe(line for hit in hits for line in hit.lines)
    return OutputHit(cause, hits[-1].index, tuple(lines), hits[-1].kind)
