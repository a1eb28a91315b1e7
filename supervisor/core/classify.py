"""The exit classifier: why did a unit's main process die?

Pure: it reads an ``ExitSnapshot`` (what systemd said) plus kernel-log and unit-output
lines (gathered by ``evidence``) and returns a ``Verdict``. No I/O happens here.

Order of the rules, first match wins:

1. ``Result=start-limit-hit`` → ``start-limit`` (systemd refused to start it again).
2. ``Result=oom-kill`` → ``oom-kill`` (a cgroup2 host, or systemd-oomd).
3. A kernel OOM-kill record for this unit → ``oom-kill``. A record counts when its
   ``oom_memcg``/``task_memcg`` is the unit's control group (kernel paths are seen
   from the root cgroup, ``/k26sbx-1/app.slice/x.service``, so they are matched by
   suffix, or by the unit name as the last path component), or when a
   ``Killed process PID`` line names the main PID. This catches the hybrid-cgroup
   host where systemd only reports ``Result=signal`` with status 9, and a child of
   the unit (an SGLang scheduler) being killed, after which the main process exits.
4. ``Result=watchdog`` → ``watchdog``; ``Result=timeout`` → ``timeout``.
5. Output evidence: CUDA out-of-memory text → ``gpu-oom``; FlashInfer or CUDA
   rejecting the GPU architecture → ``flashinfer-arch``. When both appear, the one
   whose deciding line comes **last** wins: the last error printed is the one that
   ended the process, an earlier one may have been caught and survived. These
   override ``exit-code``, ``signal``, ``sigkill`` and ``core-dump``, because they
   explain them: SGLang's main process SIGKILLs itself (``kill_process_tree``) after
   "Received sigquit from a child process", so a scheduler's CUDA OOM reaches
   systemd as ``Result=signal`` / status 9.
6. ``Result=core-dump`` or ``ExecMainCode=3`` → ``core-dump``.
7. ``ExecMainCode=2``: status 9 → ``sigkill``, any other signal → ``signal``.
8. Exit status 0 with ``Result=success`` → ``clean``; anything else → ``exit-code``.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

# waitid(2) si_code values, as systemd reports them in ExecMainCode.
CLD_EXITED = 1
CLD_KILLED = 2
CLD_DUMPED = 3

MAX_EVIDENCE_LINES = 20
MAX_LINE_CHARS = 500
# How far above an "IndexError" line to look for the torch/FlashInfer frames that
# make it an architecture rejection (a traceback is a few dozen lines at most).
_TRACEBACK_LOOKBACK = 40


class ExitCause(StrEnum):
    CLEAN = "clean"
    EXIT_CODE = "exit-code"
    SIGKILL = "sigkill"
    OOM_KILL = "oom-kill"
    GPU_OOM = "gpu-oom"
    FLASHINFER_ARCH = "flashinfer-arch"
    SIGNAL = "signal"
    CORE_DUMP = "core-dump"
    WATCHDOG = "watchdog"
    TIMEOUT = "timeout"
    START_LIMIT = "start-limit"


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


@dataclass(frozen=True)
class Verdict:
    cause: ExitCause
    summary: str
    evidence: tuple[str, ...]
    exit_code: int | None
    signal: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.cause.value,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "exit_code": self.exit_code,
            "signal": self.signal,
        }


# --- kernel OOM records ---------------------------------------------------------

_OOM_KILL_RE = re.compile(r"\boom-kill:(?P<fields>\S+)")
_KILLED_PROCESS_RE = re.compile(r"\bKilled process (?P<pid>\d+) \((?P<comm>[^)]*)\)")


@dataclass(frozen=True)
class _OomRecord:
    line: str
    pid: int | None
    task: str
    oom_memcg: str
    task_memcg: str


def _parse_oom_kill(line: str) -> _OomRecord | None:
    match = _OOM_KILL_RE.search(line)
    if match is None:
        return None
    fields: dict[str, str] = {}
    # mems_allowed may itself hold commas ("0,2"); parts without "=" belong to it.
    for part in match.group("fields").split(","):
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value
    pid_text = fields.get("pid", "")
    return _OomRecord(
        line=line,
        pid=int(pid_text) if pid_text.isdigit() else None,
        task=fields.get("task", "?"),
        oom_memcg=fields.get("oom_memcg", ""),
        task_memcg=fields.get("task_memcg", ""),
    )


def _memcg_is_unit(memcg: str, snapshot: ExitSnapshot) -> bool:
    memcg = memcg.rstrip("/")
    if not memcg:
        return False
    group = snapshot.control_group.rstrip("/")
    if group and (
        memcg == group or memcg.endswith(group if group.startswith("/") else "/" + group)
    ):
        return True
    return bool(snapshot.unit) and memcg.rsplit("/", 1)[-1] == snapshot.unit


@dataclass(frozen=True)
class _KernelOom:
    lines: tuple[str, ...]
    main_pid_killed: bool
    first: _OomRecord | None


def _find_kernel_oom(snapshot: ExitSnapshot, kernel_lines: Sequence[str]) -> _KernelOom | None:
    records = [r for r in map(_parse_oom_kill, kernel_lines) if r is not None]
    unit_records = [
        r
        for r in records
        if _memcg_is_unit(r.task_memcg, snapshot)
        or _memcg_is_unit(r.oom_memcg, snapshot)
        or (snapshot.main_pid > 0 and r.pid == snapshot.main_pid)
    ]
    unit_pids = {r.pid for r in unit_records if r.pid is not None}
    if snapshot.main_pid > 0:
        unit_pids.add(snapshot.main_pid)
    matched: list[str] = []
    main_killed = False
    for line in kernel_lines:
        record = _parse_oom_kill(line)
        if record is not None and record in unit_records:
            matched.append(line)
            main_killed = main_killed or record.pid == snapshot.main_pid
            continue
        killed = _KILLED_PROCESS_RE.search(line)
        if killed is not None and int(killed.group("pid")) in unit_pids:
            matched.append(line)
            main_killed = main_killed or int(killed.group("pid")) == snapshot.main_pid
    if not matched:
        return None
    return _KernelOom(tuple(matched), main_killed, unit_records[0] if unit_records else None)


# --- output evidence ------------------------------------------------------------

# Real texts, see tests/unit/samples/README.md for where each was seen.
_GPU_OOM_RE = re.compile(
    r"CUDA out of memory"  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError
    r"|OutOfMemoryError: CUDA"
    r"|CUDA error: out of memory"  # torch.AcceleratorError / RuntimeError, c10::Error
    r"|cudaErrorMemoryAllocation"
    r"|CUDA_ERROR_OUT_OF_MEMORY"
    r"|Cuda failure (?:\d+ )?'out of memory'"  # NCCL
    r"|Not enough memory\. Please try to increase --mem-fraction-static"  # SGLang KV pool
)
_ARCH_RE = re.compile(
    r"FlashInfer requires sm75\+"  # 0.2.x
    r"|FlashInfer requires GPUs with sm75 or higher"  # 0.5.x, 0.7.x (with "Detected ...")
    r"|SM 12[.\dx+]* requires CUDA >="  # FlashInfer arch normalisation
    r"|No supported CUDA architectures found for major versions"  # FlashInfer nvcc flags
    r"|Unknown CUDA arch \([^)]*\) or GPU not supported"  # torch _get_cuda_arch_flags
    r"|no kernel image is available for execution on the device"
    r"|CUDA error: no kernel image"
    r"|cudaErrorNoKernelImageForDevice"
    r"|CUDA_ERROR_NO_BINARY_FOR_GPU"
)
_INDEX_ERROR_RE = re.compile(r"\bIndexError: list index out of range")


@dataclass(frozen=True)
class _OutputHit:
    cause: ExitCause
    index: int
    lines: tuple[str, ...]


def _arch_index_error(output_lines: Sequence[str], index: int) -> tuple[str, ...] | None:
    """The IndexError torch raises in ``_get_cuda_arch_flags`` when it has no arch
    list, counted only inside a FlashInfer JIT traceback (it is generic otherwise)."""
    window = output_lines[max(0, index - _TRACEBACK_LOOKBACK) : index]
    arch_frames = [ln for ln in window if "_get_cuda_arch_flags" in ln]
    flashinfer_frames = [ln for ln in window if "flashinfer" in ln]
    if not arch_frames or not flashinfer_frames:
        return None
    return (flashinfer_frames[-1], arch_frames[0], output_lines[index])


def _find_output_cause(output_lines: Sequence[str]) -> _OutputHit | None:
    gpu: list[tuple[int, str]] = []
    arch: list[tuple[int, str]] = []
    for index, line in enumerate(output_lines):
        if _GPU_OOM_RE.search(line):
            gpu.append((index, line))
        elif _ARCH_RE.search(line):
            arch.append((index, line))
        elif _INDEX_ERROR_RE.search(line):
            frames = _arch_index_error(output_lines, index)
            if frames is not None:
                arch.extend((index, ln) for ln in frames)
    candidates = [
        _OutputHit(cause, hits[-1][0], tuple(_dedupe(ln for _, ln in hits)))
        for cause, hits in ((ExitCause.GPU_OOM, gpu), (ExitCause.FLASHINFER_ARCH, arch))
        if hits
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda hit: hit.index)


# --- verdict --------------------------------------------------------------------


def _signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _trim(line: str) -> str:
    line = line.strip()
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…"


def _dedupe(lines: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for line in lines:
        trimmed = _trim(line)
        if trimmed and trimmed not in seen:
            seen.add(trimmed)
            out.append(trimmed)
    return out


def _systemd_line(s: ExitSnapshot) -> str:
    return (
        f"systemd: Result={s.result} ExecMainCode={s.exec_main_code} "
        f"ExecMainStatus={s.exec_main_status}"
    )


def _last_line(lines: tuple[str, ...]) -> str:
    text = lines[-1] if lines else ""
    return text if len(text) <= 200 else text[:199] + "…"


def classify(
    snapshot: ExitSnapshot,
    kernel_lines: Sequence[str],
    output_lines: Sequence[str],
) -> Verdict:
    """Explain one exit. ``kernel_lines`` are kernel-log messages (no ``/dev/kmsg``
    header) and ``output_lines`` the unit's output, both from this run only."""
    code, status, result = snapshot.exec_main_code, snapshot.exec_main_status, snapshot.result
    exit_code = status if code == CLD_EXITED else None
    signal = status if code in (CLD_KILLED, CLD_DUMPED) else None
    clean = code == CLD_EXITED and status == 0 and result == "success"
    head = _systemd_line(snapshot)

    def verdict(cause: ExitCause, summary: str, lines: Sequence[str] = ()) -> Verdict:
        # Keep the last lines: they are the ones nearest the death.
        evidence = (head, *_dedupe(lines)[-(MAX_EVIDENCE_LINES - 1) :])
        return Verdict(cause, summary, evidence, exit_code, signal)

    if result == "start-limit-hit":
        return verdict(
            ExitCause.START_LIMIT,
            "systemd refused to start it again: start rate limit hit (StartLimitBurst)",
        )

    oom = None if clean else _find_kernel_oom(snapshot, kernel_lines)
    if result == "oom-kill" or oom is not None:
        if oom is None:
            summary = "systemd reports Result=oom-kill (no matching kernel OOM record was seen)"
        else:
            who = (
                f"{oom.first.task} (pid {oom.first.pid})"
                if oom.first is not None
                else f"pid {snapshot.main_pid}"
            )
            where = oom.first.task_memcg if oom.first is not None else snapshot.control_group
            scope = "main process" if oom.main_pid_killed else "a process of the unit"
            summary = f"kernel OOM killer killed the {scope}, {who}, in memory cgroup {where}"
            if not oom.main_pid_killed and code == CLD_EXITED:
                summary += f"; the main process then exited with status {status}"
        return verdict(ExitCause.OOM_KILL, summary, oom.lines if oom else ())

    if result == "watchdog":
        how = f", then killed it with {_signal_name(status)}" if signal else ""
        return verdict(
            ExitCause.WATCHDOG, f"watchdog timeout: no WATCHDOG=1 within WatchdogSec{how}"
        )
    if result == "timeout":
        return verdict(ExitCause.TIMEOUT, "systemd timed out waiting for it to start or stop")

    if not clean:
        hit = _find_output_cause(output_lines)
        if hit is not None:
            if hit.cause is ExitCause.GPU_OOM:
                summary = f"GPU out of memory: {_last_line(hit.lines)}"
            else:
                summary = f"GPU architecture rejected (FlashInfer/CUDA): {_last_line(hit.lines)}"
            return verdict(hit.cause, summary, hit.lines)

    if result == "core-dump" or code == CLD_DUMPED:
        what = _signal_name(status) if code == CLD_DUMPED else "a signal"
        return verdict(ExitCause.CORE_DUMP, f"dumped core on {what}")
    if code == CLD_KILLED:
        if status == _signal.SIGKILL:
            return verdict(
                ExitCause.SIGKILL, "killed by SIGKILL; no OOM-kill record names its cgroup or pid"
            )
        return verdict(ExitCause.SIGNAL, f"killed by {_signal_name(status)}")
    if clean:
        return verdict(ExitCause.CLEAN, "exited cleanly with status 0")
    if code == CLD_EXITED:
        return verdict(ExitCause.EXIT_CODE, f"exited with status {status} (Result={result})")
    return verdict(ExitCause.EXIT_CODE, f"failed with Result={result} and no exit status")
