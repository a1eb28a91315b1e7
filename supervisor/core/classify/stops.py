"""Stops: did a stop (an operator's, the supervisor's) end the process, or a crash?

SGLang's stop begins at its "SIGTERM received ... Draining requests" line and goes on
with "Gracefully exiting...", a "Force exiting" line, or "kill_process_tree called:
..., include_parent=True". Its child-failure lines ("Received sigquit from a child
process", "SIGQUIT received ... one child failed", "Subprocess ... crashed with exit
code", ...) mean a child died: printed before the stop began, it was already dying.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .evidence import OutputHit, Scan, deciding
from .model import ExitCause, ExitSnapshot

# SGLang: a child process failed (the launcher then SIGKILLs itself), not a stop.
_CRASH_RE = re.compile(
    r"Received sigquit from a child proces"  # 0.4.x-0.5.x ("proces." typo in early 0.4)
    r"|SIGQUIT received\. .*It usually means one child failed"  # 0.5.x running phase
    r"|Subprocess \S+ \(pid=\d+\) crashed with exit code"  # 0.5.17+ SubprocessWatchdog
    r"|Sleeping 5 seconds before crash diagnostics"
    r"|Rank \d+ scheduler is dead"
    r"|\b(?:Scheduler|TpModelWorkerClient|TokenizerManager|DetokenizerManager"
    r"|DataParallelController) hit an exception"
    r"|Exception in (?:ControllerSingle|ControllerMulti|TokenizerManager):"
    r"|Initialization failed\. warmup error"
)
_CRASH_NEEDLES = ("sigquit", "SIGQUIT", "crashed with", "Sleeping 5", "is dead", "xception", "rror")


def is_crash(line: str) -> bool:
    return any(n in line for n in _CRASH_NEEDLES) and _CRASH_RE.search(line) is not None


# SGLang: SIGTERM reached the tokenizer manager (0.3.6-0.5.x).
_STOP_BEGIN_RE = re.compile(r"SIGTERM received\. .*Draining requests and shutting down")
# ... and it went on to stop: drain, force exit, or kill its own tree (0.5.17+).
_STOP_FOLLOW_RE = re.compile(
    r"Gracefully exiting\.\.\. [Rr]emaining number of requests"
    r"|Signal SIGTERM received while .*(?:Force exiting|Exiting\.\.\.)"
    r"|kill_process_tree called: parent_pid=\d+, include_parent=True"
)


@dataclass(frozen=True)
class Stop:
    lines: tuple[str, ...]  # SGLang's stop lines (evidence)
    graceful: bool  # SGLang drained and killed its own tree after the SIGTERM
    after: OutputHit | None  # evidence printed after the stop began
    before: OutputHit | None  # evidence printed before it (survived)
    crash_after: bool  # a child failed after the stop began


def crash_lines(found: Scan) -> list[str]:
    return [found.lines[i] for i in found.candidates if is_crash(found.lines[i])]


def find_stop(snapshot: ExitSnapshot, found: Scan, *, self_kill: bool) -> Stop | None:
    """For a process that ended by SIGTERM or SIGKILL: did a stop end it?
    ``self_kill``: SIGKILL that was not systemd's stop timeout (that is Result=timeout)."""
    lines, candidates = found.lines, found.candidates
    begin = next((i for i in candidates if _STOP_BEGIN_RE.search(lines[i])), None)
    follow = (
        [i for i in candidates if i > begin and _STOP_FOLLOW_RE.search(lines[i])]
        if begin is not None
        else []
    )
    crashes = [i for i in candidates if is_crash(lines[i])]
    if begin is not None and (snapshot.stop_requested or follow):
        start = begin
    elif not snapshot.stop_requested:
        return None
    elif self_kill:
        # SIGKILLed before it logged the SIGTERM, and not by systemd's stop timeout:
        # SGLang's own kill after a failure, so what it printed decides.
        if crashes:
            return None
        start = 0
    else:
        # Exit 0, SIGTERM, stop timeout: it was alive when the stop came, so what it
        # printed came before the stop and was survived.
        start = len(lines)
    if any(i < start for i in crashes):
        return None  # a child had failed before the stop: it was dying anyway
    stop_lines: list[str] = []
    if begin is not None:
        stop_lines.append(lines[begin])
        gracefully = [i for i in follow if "Gracefully exiting" in lines[i]]
        others = [i for i in follow if i not in gracefully]
        stop_lines.extend(lines[i] for i in sorted(gracefully[-1:] + others))
    return Stop(
        lines=tuple(stop_lines),
        graceful=bool(follow),
        # NCCL errors while it stops are the teardown's echo (peer ranks going away).
        after=deciding(
            found,
            start,
            ignore=frozenset({ExitCause.NCCL}) if begin is not None else frozenset(),
        ),
        before=deciding(found, end=start),
        crash_after=any(i >= start for i in crashes),
    )
