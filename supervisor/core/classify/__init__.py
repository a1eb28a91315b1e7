"""The exit classifier: why did a unit's main process die, and what should be done?

Pure: it reads an ``ExitSnapshot`` (what systemd said, and whether a stop job was
running) plus kernel-log and unit-output lines (this run only) and returns a
``Verdict`` whose one-line summary says what happened and what to do. No I/O happens
here. Tested on real crash logs: tests/unit/samples/corpus/.

The package: ``model`` (the public types), ``kernel`` (the kernel's records),
``frames`` (tracebacks and C++ frames), ``texts`` (the line-rule table), ``rules``
(matching a line, warnings, each kind's advice), ``origins`` (rules keyed to where an
error came from), ``evidence`` (which output line decides), ``stops`` (a stop or a
crash) and ``verdict`` (the chain below).

Order of the rules, first match wins:

1. ``Result=start-limit-hit`` → ``start-limit``.
2. ``Result=oom-kill``, or a kernel OOM-kill record for this unit (its memory cgroup,
   matched by suffix or by the unit's name, or a ``Killed process PID`` of the main
   PID or of a process in that cgroup) → ``oom-kill``.
3. An NVIDIA Xid in the kernel log, or a GPU fault the driver reports without one (a
   GPU that fell off the bus, a GSP that stops answering: an RPC timeout, its timeout
   banner, its heartbeat) → ``gpu-xid``. Xid 45, 63 and 92 are evidence, never the
   cause, but an Xid 45 "caused by previous Xid N" names N. A hardware or driver Xid
   (48, 74, 79, 95, 119, ...) anywhere in the run decides and ``needs_person``. A
   program fault (13, 31, 43: NVIDIA's application faults) or a contained ECC error
   (94) whose process printed its own error (a device-side assert, an illegal memory
   access, a cuBLAS failure) gets the cause that error names (rule 8), the Xid kept as
   evidence; printed nothing, it stays ``gpu-xid``, restarted like ``cuda-error``.
4. A kernel record that says the driver stack cannot work (``NVRM: API mismatch``,
   its firmware missing) → ``gpu-driver``, unless the output names a cause that needs
   no GPU (``port-in-use``, ``model-load``). ``gpu-driver`` always ``needs_person``.
   Rules 2-4 are not applied to a clean exit that a stop job asked for.
5. ``Result=watchdog`` → ``watchdog``; ``Result=timeout`` → ``timeout``, except when a
   stop job timed out (TimeoutStopSec ran out): that is read as a stop, rule 7.
6. Exit status 0 with ``Result=success`` → ``stopped`` during a stop job. Unasked, it
   may be a crash (SGLang exits 0 after some fatal engine errors, sglang #29284): the
   output's evidence decides (rule 8); a failed-child line alone → ``exit-code``;
   nothing → ``clean``, "exited with status 0 unasked".
7. A stop (stops.py): with a stop job, or SGLang's own graceful-stop lines, a process
   that ended as a stop ends (SIGTERM, SIGKILL, 143/137) is ``stopped``, unless an
   error was printed after the stop began (it keeps its cause); NCCL errors after
   the stop began are the teardown's echo. A child-failure line before the stop
   means it was dying anyway: no stop.
8. Output evidence (evidence.py): the line rules (rules.py) and the origin rules
   (origins.py) name ``gpu-oom``, ``flashinfer-arch``, ``flashinfer-jit``,
   ``port-in-use``, ``model-load``, ``gpu-driver``, ``cuda-error`` or ``nccl``; the
   last one printed wins, ``nccl`` only when alone, ``flashinfer-jit`` gives way to
   ``flashinfer-arch``, a loader's error chained to a GPU failure is that failure's; a
   warning never decides, nor a line that only says a model failed to load. These
   override ``exit-code``, ``signal``, ``sigkill`` and ``core-dump``, because they
   explain them: SGLang's main process SIGKILLs itself after a child fails.
9. ``Result=core-dump`` or ``ExecMainCode=3`` → ``core-dump``; ``ExecMainCode=2``:
   status 9 → ``sigkill``, any other signal → ``signal``; anything else →
   ``exit-code``.

When the evidence is ambiguous the verdict falls back to the generic cause (rule 9)
rather than risk a wrong specific one.
"""

from __future__ import annotations

from .model import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    MAX_EVIDENCE_LINES,
    MAX_LINE_CHARS,
    ExitCause,
    ExitSnapshot,
    Verdict,
)
from .verdict import classify, gpus_own_fault

__all__ = [
    "CLD_DUMPED",
    "CLD_EXITED",
    "CLD_KILLED",
    "MAX_EVIDENCE_LINES",
    "MAX_LINE_CHARS",
    "ExitCause",
    "ExitSnapshot",
    "Verdict",
    "classify",
    "gpus_own_fault",
]
