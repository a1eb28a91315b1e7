"""What the classifier reads and what it returns: the public types and limits."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from supervisor.core.causes import ExitCause as ExitCause  # the classifier's answer

# waitid(2) si_code values, as systemd reports them in ExecMainCode.
CLD_EXITED = 1
CLD_KILLED = 2
CLD_DUMPED = 3

MAX_EVIDENCE_LINES = 20
MAX_LINE_CHARS = 500


@dataclass(frozen=True)
class ExitSnapshot:
    """What systemd reported when the unit's main process went away."""

    unit: str
    result: str
    exec_main_code: int
    exec_main_status: int
    main_pid: int
    control_group: str = ""
    exited_at: datetime | None = None
    # A stop job (an operator's or the supervisor's) was running when it ended.
    stop_requested: bool = False


@dataclass(frozen=True)
class Verdict:
    cause: ExitCause
    summary: str
    evidence: tuple[str, ...]
    exit_code: int | None
    signal: int | None
    # The GPUs' own fault (a hardware or driver Xid, the driver stack): no restart and no
    # fallback on the same GPUs can help, a person must act. A program's fault that the
    # driver logged as an Xid (13, 31, 43) or a contained ECC error (94) is not.
    needs_person: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.cause.value,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "exit_code": self.exit_code,
            "signal": self.signal,
            "needs_person": self.needs_person,
        }


def trim(line: str) -> str:
    line = line.strip()
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…"


# A CUDA kernel's assert prints once per faulting thread, the same line but for its
# coordinates ("block: [300,0,0], thread: [15,0,0] Assertion ..."): hundreds of lines
# that would push every other piece of evidence out.
_CUDA_COORDINATES = re.compile(r"\b(block|thread): \[\d+,\s*\d+,\s*\d+\]")


def dedupe(lines: Iterable[str]) -> list[str]:
    """The lines trimmed, blank and repeated ones dropped, in order. Lines that differ
    only in a CUDA kernel's block and thread coordinates count as repeats."""
    seen: set[str] = set()
    out: list[str] = []
    for line in lines:
        trimmed = trim(line)
        key = _CUDA_COORDINATES.sub(r"\1: [...]", trimmed)
        if trimmed and key not in seen:
            seen.add(key)
            out.append(trimmed)
    return out
