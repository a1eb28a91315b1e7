"""The verdict chain: the rules of the package docstring, in its order."""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence

from .evidence import OutputHit, Scan, deciding, scan
from .kernel import (
    XID_CONTAINED,
    KernelDriver,
    KernelOom,
    Xid,
    find_kernel_driver,
    find_kernel_oom,
    find_xid,
)
from .model import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    MAX_EVIDENCE_LINES,
    ExitCause,
    ExitSnapshot,
    Verdict,
    dedupe,
    trim,
)
from .rules import NO_RESTART, OUTPUT_SUMMARY
from .stops import Stop, crash_lines, find_stop, is_crash

# Output causes that need no GPU: they keep their say over a broken driver stack.
_NOT_THE_GPUS = frozenset({ExitCause.PORT_IN_USE, ExitCause.MODEL_LOAD})


def _signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(lines: Sequence[str]) -> str:
    text = lines[-1] if lines else ""
    return text if len(text) <= 200 else text[:199] + "…"


def _output_summary(hit: OutputHit) -> str:
    prefix, advice = OUTPUT_SUMMARY[hit.kind]
    return f"{prefix}: {_last_line(hit.lines)}; {advice}"


def _xid_head(xid: Xid) -> str:
    also = f", then Xid {', '.join(map(str, xid.others))}" if xid.others else ""
    return f"NVIDIA Xid {xid.number} on GPU {xid.pci} ({xid.description}{also})"


def _xid_summary(xid: Xid) -> str:
    if xid.gpus_own:
        todo = "needs a person (reset or drain the node)"
    elif xid.number in XID_CONTAINED:
        todo = (
            "the driver contained it to this process and the GPU goes on: restarted; reset "
            "the GPU when convenient so the row is remapped (nvidia-smi -q -d ROW_REMAPPER)"
        )
    else:
        todo = (
            "an application fault in NVIDIA's catalog (often a faulty kernel or a bad "
            "request in the program), though the program printed no error of its own: "
            "restarted under backoff; if it repeats on this GPU, have a person check it"
        )
    return f"{_xid_head(xid)}: {todo}"


def gpus_own_fault(kernel_lines: Sequence[str]) -> str | None:
    """A hardware or driver Xid among ``kernel_lines`` (the GPUs' own fault, which
    ``needs_person``), in words ("NVIDIA Xid 48 on GPU ... (double-bit ECC error)"),
    else None. The daemon reads each Xid that names a unit's process as it arrives,
    before any death, so that the unit is failed and its fallback kept off at once."""
    xid = find_xid(kernel_lines)
    return _xid_head(xid) if xid is not None and xid.gpus_own else None


def _oom_summary(oom: KernelOom | None, snapshot: ExitSnapshot) -> str:
    if oom is None:
        summary = "systemd reports Result=oom-kill (no matching kernel OOM record was seen)"
    else:
        who = (
            f"{oom.first.task} (pid {oom.first.pid})"
            if oom.first is not None
            else f"pid {snapshot.main_pid}"
        )
        where = oom.first.task_memcg if oom.first is not None else snapshot.control_group
        scope = "the main process" if oom.main_pid_killed else "a process of the unit"
        summary = f"kernel OOM killer killed {scope}, {who}, in memory cgroup {where}"
        if not oom.main_pid_killed and snapshot.exec_main_code == CLD_EXITED:
            summary += f"; the main process then exited with status {snapshot.exec_main_status}"
    return summary + "; host memory ran out: lower its memory use or raise the limit"


def _driver_summary(driver: KernelDriver) -> str:
    return (
        f"GPU driver stack unusable: the kernel says {driver.what}; reboot, or reload the "
        f"driver so that all its parts are one version, then reset the unit (SIGUSR1) — "
        + NO_RESTART
    )


class _Verdicts:
    """Builds the verdicts of one exit: its systemd line first, then the evidence."""

    def __init__(self, snapshot: ExitSnapshot) -> None:
        s = snapshot
        self.head = (
            f"systemd: Result={s.result} ExecMainCode={s.exec_main_code} "
            f"ExecMainStatus={s.exec_main_status}"
        )
        self.exit_code = s.exec_main_status if s.exec_main_code == CLD_EXITED else None
        self.signal = s.exec_main_status if s.exec_main_code in (CLD_KILLED, CLD_DUMPED) else None

    def __call__(
        self,
        cause: ExitCause,
        summary: str,
        lines: Sequence[str] = (),
        *,
        needs_person: bool = False,
        kept: Sequence[str] = (),
    ) -> Verdict:
        # ``kept`` (the lines the summary cites, e.g. an Xid beside the program's own
        # error) always stay; of the rest the last, nearest the death.
        first = dedupe(kept)[: MAX_EVIDENCE_LINES - 2]
        rest = [line for line in dedupe(lines) if line not in first]
        room = MAX_EVIDENCE_LINES - 1 - len(first)
        evidence = (self.head, *first, *rest[len(rest) - room :])
        # The host's driver stack is the GPUs' own, whichever record named it.
        needs_person = needs_person or cause is ExitCause.GPU_DRIVER
        return Verdict(cause, summary, evidence, self.exit_code, self.signal, needs_person)

    def output(self, hit: OutputHit, note: str = "", kept: Sequence[str] = ()) -> Verdict:
        return self(hit.cause, _output_summary(hit) + note, hit.lines, kept=kept)

    def stopped(self, stop: Stop, how: str, todo: str = "not a failure, nothing to do") -> Verdict:
        summary = f"stopped: {how}; {todo}"
        lines = list(stop.lines)
        if stop.before is not None:
            summary += (
                f" (it had printed an error before the stop: {_last_line(stop.before.lines)})"
            )
            lines = [*stop.before.lines[-3:], *lines]
        return self(ExitCause.STOPPED, summary, lines)


def classify(
    snapshot: ExitSnapshot,
    kernel_lines: Sequence[str],
    output_lines: Sequence[str],
) -> Verdict:
    """Explain one exit. ``kernel_lines`` are kernel-log messages (no ``/dev/kmsg``
    header) and ``output_lines`` the unit's output, both from this run only."""
    code, status, result = snapshot.exec_main_code, snapshot.exec_main_status, snapshot.result
    clean = code == CLD_EXITED and status == 0 and result == "success"
    verdict = _Verdicts(snapshot)
    found = scan(output_lines, is_crash)

    if result == "start-limit-hit":
        return verdict(
            ExitCause.START_LIMIT,
            "systemd refused to start it again: start rate limit hit (StartLimitBurst)",
        )
    # A clean exit that a stop job asked for is a stop, whatever else the kernel logged.
    # One nobody asked for may be a crash: SGLang and vLLM can exit 0 after a fatal
    # engine error (sglang #29284, vllm #48966), so its records are read like any other.
    asked = clean and snapshot.stop_requested
    oom = None if asked else find_kernel_oom(snapshot, kernel_lines)
    if result == "oom-kill" or oom is not None:
        return verdict(ExitCause.OOM_KILL, _oom_summary(oom, snapshot), oom.lines if oom else ())
    xid = None if asked else find_xid(kernel_lines)
    if xid is not None:
        return _xid_verdict(xid, deciding(found), verdict, _EXIT_0 if clean else "")
    driver = None if asked else find_kernel_driver(kernel_lines)
    if driver is not None:
        program = deciding(found)
        if program is None or program.cause not in _NOT_THE_GPUS:
            lines = (*driver.lines, *(program.lines[-3:] if program else ()))
            return verdict(ExitCause.GPU_DRIVER, _driver_summary(driver), lines)

    if result == "watchdog":
        how = f", then killed it with {_signal_name(status)}" if verdict.signal else ""
        return verdict(
            ExitCause.WATCHDOG, f"watchdog timeout: no WATCHDOG=1 within WatchdogSec{how}"
        )
    if result == "timeout":
        stop = find_stop(snapshot, found, self_kill=False) if snapshot.stop_requested else None
        if stop is not None:
            if stop.after is not None:
                return verdict.output(stop.after, " (while it was stopping)")
            return verdict.stopped(
                stop,
                "it ignored SIGTERM for TimeoutStopSec, so systemd SIGKILLed it",
                "not a failure, but check why it hangs on stop",
            )
        return verdict(ExitCause.TIMEOUT, "systemd timed out waiting for it to start or stop")

    if clean:
        if snapshot.stop_requested:
            return verdict(ExitCause.STOPPED, "stopped on request: exited cleanly; nothing to do")
        return _unasked_exit_0(snapshot, found, verdict)
    return _ending(snapshot, found, verdict)


_EXIT_0 = " (then it exited with status 0, unasked)"


# The last line of a Python traceback: the exception, unindented ("AssertionError:
# captured 1 of 3 aux hidden states", "torch.OutOfMemoryError: ...").
_EXCEPTION_LINE_RE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Failure|Interrupt)(?::\s.*)?$"
)


def _last_exception(lines: Sequence[str]) -> str | None:
    """The exception a traceback in ``lines`` ended with, the last one printed."""
    for line in reversed(lines):
        text = line.rstrip()
        if _EXCEPTION_LINE_RE.match(text):
            return trim(text)
    return None


# SGLang's own advice after a failure it foresaw (0.5.17: its CUDA-graph runners'
# CUDA_GRAPH_CAPTURE_FAILED_MSG and PREFILL_CUDA_GRAPH_CAPTURE_FAILED_MSG,
# model_executor/runner_backend_utils): "Possible solutions:" or "Possible
# suggestions:", then numbered items.
_ADVICE_HEAD_RE = re.compile(r"^Possible (?:solutions|suggestions):$")
_ADVICE_ITEM_RE = re.compile(r"^\d{1,2}\.\s+(?P<item>\S.*)$")
MAX_ADVICE_ITEMS = 4


def sglang_advice(lines: Sequence[str]) -> tuple[str, ...]:
    """The numbered items of the last advice block SGLang printed in ``lines`` (its
    lines as printed, ``1. ...``), or () where it printed none."""
    for at in range(len(lines) - 1, -1, -1):
        if _ADVICE_HEAD_RE.match(lines[at].strip()):
            items: list[str] = []
            for line in lines[at + 1 : at + 1 + MAX_ADVICE_ITEMS]:
                if not _ADVICE_ITEM_RE.match(line.strip()):
                    break
                items.append(trim(line))
            return tuple(items)
    return ()


def _xid_verdict(
    xid: Xid, program: OutputHit | None, verdict: _Verdicts, exit_0: str = ""
) -> Verdict:
    """An Xid of this run. The GPU's own (hardware, driver) decides and needs a person. A
    program fault (13, 31, 43) or a contained ECC error (94) whose process printed its own
    error gets the verdict that error supports, the Xid kept as its evidence."""
    if not xid.gpus_own and program is not None:
        note = f"; the driver logged it as {_xid_head(xid)}{exit_0}"
        return verdict.output(program, note, xid.lines)
    lines = (*xid.lines, *(program.lines[-3:] if program else ()))
    return verdict(ExitCause.GPU_XID, _xid_summary(xid), lines, needs_person=xid.gpus_own)


def _unasked_exit_0(snapshot: ExitSnapshot, found: Scan, verdict: _Verdicts) -> Verdict:
    """Status 0 with no stop job: the output says whether it was a stop or a crash."""
    stop = find_stop(snapshot, found, self_kill=False)
    if stop is not None and stop.after is None and not stop.crash_after:
        return verdict.stopped(stop, "SIGTERM that did not come from a stop job, then exit 0")
    hit = deciding(found)
    if hit is not None:
        return verdict.output(hit, _EXIT_0)
    crashes = crash_lines(found)
    if crashes:
        return verdict(
            ExitCause.EXIT_CODE,
            "exited with status 0 after SGLang reported a failed child, and no error text "
            "it printed names the cause: a crash, not a stop; read the unit's output",
            crashes[-3:],
        )
    return verdict(
        ExitCause.CLEAN,
        "exited with status 0 unasked: no stop job ran and its output names no error "
        "(SGLang can exit 0 after a fatal engine error, sglang #29284); restarted",
    )


def _ending(snapshot: ExitSnapshot, found: Scan, verdict: _Verdicts) -> Verdict:
    """Rules 5-9: a stop, the output's evidence, or how the process ended."""
    code, status, result = snapshot.exec_main_code, snapshot.exec_main_status, snapshot.result
    by_sigkill = (code == CLD_KILLED and status == _signal.SIGKILL) or (
        code == CLD_EXITED and status == 128 + _signal.SIGKILL
    )
    by_sigterm = (code == CLD_KILLED and status == _signal.SIGTERM) or (
        code == CLD_EXITED and status == 128 + _signal.SIGTERM
    )
    stop = find_stop(snapshot, found, self_kill=by_sigkill) if by_sigkill or by_sigterm else None
    if stop is not None:
        if stop.after is not None:
            return verdict.output(stop.after, " (while it was stopping)")
        if not stop.crash_after:
            if stop.graceful and by_sigkill:
                how = "SIGTERM, then SGLang's own SIGKILL after draining"
            elif by_sigkill:
                how = "SIGKILL while its stop job ran"
            else:
                how = "SIGTERM"
            if not snapshot.stop_requested:
                how += " (the SIGTERM did not come from a stop job)"
            return verdict.stopped(stop, how)
    else:
        hit = deciding(found)
        if hit is not None:
            return verdict.output(hit)

    during_stop = (
        "; a child failed while it was stopping" if stop is not None and stop.crash_after else ""
    )
    if result == "core-dump" or code == CLD_DUMPED:
        what = _signal_name(status) if code == CLD_DUMPED else "a signal"
        return verdict(ExitCause.CORE_DUMP, f"dumped core on {what}; see the core dump")
    if code == CLD_KILLED:
        if status == _signal.SIGKILL:
            crashes = crash_lines(found)
            if crashes and not during_stop:
                raised = _last_exception(found.lines)
                if raised is not None:
                    advice = sglang_advice(found.lines)
                    said = (
                        f"; SGLang's own advice: {' '.join(advice)}"
                        if advice
                        else "; no rule here names that error's cause: read the unit's output"
                    )
                    return verdict(
                        ExitCause.SIGKILL,
                        "killed by SIGKILL: SGLang killed its own tree after a child "
                        f"failed with {raised}{said}",
                        crashes[-3:],
                        kept=(raised, *advice),
                    )
                return verdict(
                    ExitCause.SIGKILL,
                    "killed by SIGKILL: SGLang killed its own tree after a child failed, "
                    "and no error text it printed names the cause; read the unit's output",
                    crashes[-3:],
                )
            return verdict(
                ExitCause.SIGKILL,
                "killed by SIGKILL; no OOM-kill record names its cgroup or pid" + during_stop,
                (*(stop.lines if stop is not None else ()), *crashes[-3:]),
            )
        return verdict(ExitCause.SIGNAL, f"killed by {_signal_name(status)}{during_stop}")
    if code == CLD_EXITED:
        return verdict(
            ExitCause.EXIT_CODE, f"exited with status {status} (Result={result}){during_stop}"
        )
    return verdict(ExitCause.EXIT_CODE, f"failed with Result={result} and no exit status")
