"""The exit classifier: why did a unit's main process die, and what should be done?

Pure: it reads an ``ExitSnapshot`` (what systemd said, and whether a stop job was
running) plus kernel-log and unit-output lines (gathered by ``evidence``, this run
only) and returns a ``Verdict`` whose one-line summary says what happened and what to
do. No I/O happens here. Tested on real crash logs: tests/unit/samples/corpus/.

Order of the rules, first match wins:

1. ``Result=start-limit-hit`` → ``start-limit`` (systemd refused to start it again).
2. ``Result=oom-kill`` → ``oom-kill`` (a cgroup2 host, or systemd-oomd).
   A kernel OOM-kill record for this unit → ``oom-kill``. A record counts when its
   ``oom_memcg``/``task_memcg`` is the unit's control group (kernel paths are seen
   from the root cgroup, ``/k26sbx-1/app.slice/x.service``, so they are matched by
   suffix, or by the unit name as the last path component), or when a
   ``Killed process PID`` line names the main PID. This catches the hybrid-cgroup
   host where systemd only reports ``Result=signal`` with status 9, and a child of
   the unit (an SGLang scheduler) being killed, after which the main process exits.
3. An NVIDIA Xid in the kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, ...``, or
   ``GPU has fallen off the bus``) → ``gpu-xid``, naming the Xid and the GPU. The
   kernel lines are this run's, and an Xid explains the CUDA error the program then
   prints, so it beats the output. Xid 45 (the driver cleaning up a killed process's
   channels: it follows any SIGKILL of a GPU process), 63 (a page-retirement record)
   and 92 (a high single-bit ECC rate warning) are evidence, never the cause. Not
   applied to a clean exit (nor is rule 2).
4. ``Result=watchdog`` → ``watchdog``; ``Result=timeout`` → ``timeout``, except when a
   stop job timed out (TimeoutStopSec ran out, systemd SIGKILLed it): that is read as
   a stop, rules 5-6.
5. Output evidence → ``gpu-oom``, ``flashinfer-arch`` (any GPU-architecture
   rejection: FlashInfer's gates, SGLang's tables, DeepGEMM, flash-attn, torch's arch
   list, "no kernel image"), ``flashinfer-jit`` (FlashInfer's JIT cannot build or run
   inside the server: ``ninja`` or ``nvcc`` not found, ``Ninja build failed``, a
   missing header), ``gpu-driver`` (the host's driver stack is unusable and no restart
   heals it: "CUDA driver version is insufficient for CUDA runtime version" (35),
   "system not yet initialized" (802: on an NVSwitch host nvidia-fabricmanager is not
   running or not of the driver's version), 803, 804, torch's "Found no NVIDIA driver"
   and "The NVIDIA driver on your system is too old", "no CUDA-capable device is
   detected", NVML's "Driver/library version mismatch"; a warning that names one, such
   as torch's ``UserWarning: CUDA initialization: ...``, decides nothing),
   ``cuda-error``, ``nccl``, ``port-in-use``, ``model-load``.
   Evidence is anchored on error shapes (``torch.OutOfMemoryError:``, ``RuntimeError:
   CUDA error: ...``, ``OSError: [Errno 98]``, SGLang's, vLLM's, FlashInfer's and
   NCCL's own error texts), never on a bare word: ``avail mem=``, ``alloc_req_slots
   runs out of memory``, ``NCCL_...`` settings, ``CUDA warning:`` lines and "CUDA
   kernel errors might be asynchronously reported" decide nothing. Where a
   traceback's last line was cut, its innermost frames decide (FlashInfer's
   ``check_cuda_arch``, torch's ``_get_cuda_arch_flags``, vLLM's
   ``check_enough_kv_cache_memory``), only inside a traceback. A line naming two
   causes takes the first of gpu-oom, flashinfer-arch, flashinfer-jit, port-in-use,
   model-load, gpu-driver, cuda-error, nccl: NCCL's ``Cuda failure 'out of memory'`` is
   ``gpu-oom``, torch's ``CUDA error: system not yet initialized`` is ``gpu-driver``, a
   CUDA error caught by the ProcessGroupNCCL watchdog is ``cuda-error``. Between causes,
   the one whose deciding line comes **last** wins: the last error printed is the one
   that ended the process, an earlier one may have been caught and survived. ``nccl``
   decides only when no other cause is printed: a collective that fails or times out
   is most often the echo of a peer rank's OOM, CUDA fault or load failure.
   These override ``exit-code``, ``signal``, ``sigkill`` and ``core-dump``, because
   they explain them: SGLang's main process SIGKILLs itself (``kill_process_tree``)
   after "Received sigquit from a child process", so a scheduler's CUDA OOM reaches
   systemd as ``Result=signal`` / status 9.
   The exception: when the process ended the way a stop ends (exit 0, SIGTERM or
   SIGKILL, or 143/137 from a wrapper) and rule 6 finds a stop, only evidence printed
   **after the stop began** (SGLang's "SIGTERM received ... Draining requests") counts:
   a CUDA error during the drain keeps its cause, an error printed before it was
   survived, and the summary of the ``stopped`` verdict mentions it. NCCL errors
   after the stop began are the teardown's echo (peer ranks going away), and
   "CUDA error: driver shutting down" is never a fault.
6. ``stopped``: (a) ``stop_requested`` (a stop job, an operator's or the
   supervisor's, was running when the main process ended) and it ended as a stop
   ends; or (b) without a stop job, SGLang's graceful-stop lines ("SIGTERM received.
   ... Draining requests and shutting down..." followed by "Gracefully exiting...",
   a "Force exiting" line, or "kill_process_tree called: ..., include_parent=True")
   and SIGKILL or SIGTERM. The stop begins at SGLang's "SIGTERM received" line. With
   a stop job and no such line: a process that died of the SIGTERM, exited 0 or hung
   until TimeoutStopSec was alive when the stop came, so all it printed came before
   it; a SIGKILL with ``Result=signal`` is not systemd's (its stop timeout reads
   ``Result=timeout``) but the program's own, so all it printed counts (rule 5).
   SGLang's child-failure lines ("Received sigquit from a child process", "SIGQUIT
   received ... one child failed", "Subprocess ... crashed with exit code", "Sleeping
   5 seconds before crash diagnostics", "Scheduler hit an exception", ...) mean a
   child died: printed before the stop began they mean it was already dying, so no
   ``stopped`` (rules 5, 8); printed after it with no error text, the verdict is the
   generic one (rule 8), not ``stopped``.
7. ``Result=core-dump`` or ``ExecMainCode=3`` → ``core-dump``.
8. ``ExecMainCode=2``: status 9 → ``sigkill``, any other signal → ``signal``.
9. Exit status 0 with ``Result=success`` → ``clean`` (``stopped`` during a stop job);
   anything else → ``exit-code``.

When the evidence is ambiguous the verdict falls back to the generic cause (rules 7-9)
rather than risk a wrong specific one.
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
    FLASHINFER_JIT = "flashinfer-jit"
    SIGNAL = "signal"
    CORE_DUMP = "core-dump"
    WATCHDOG = "watchdog"
    TIMEOUT = "timeout"
    START_LIMIT = "start-limit"
    CUDA_ERROR = "cuda-error"
    NCCL = "nccl"
    GPU_XID = "gpu-xid"
    GPU_DRIVER = "gpu-driver"
    PORT_IN_USE = "port-in-use"
    MODEL_LOAD = "model-load"
    STOPPED = "stopped"


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


# --- kernel Xid records -----------------------------------------------------------

_PCI = r"(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
# "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus." (newer drivers put
# "pid=..., name=..., " before the text).
_XID_RE = re.compile(r"\bNVRM: Xid \((?:PCI:)?" + _PCI + r"\): (?P<xid>\d+)\b,?\s*(?P<text>.*)")
# "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus." (no Xid on that line)
_OFF_THE_BUS_RE = re.compile(
    r"\bNVRM: GPU (?:at )?(?:PCI:)?" + _PCI + r":? .*\bGPU has fallen off the bus"
)
_GPU_AT_RE = re.compile(r"\bNVRM: GPU at PCI:" + _PCI + r": GPU-[0-9a-fA-F-]+")
# Newer drivers name the process first: "pid=1234, name=python3, Ch 00000008, ".
_XID_PROCESS_RE = re.compile(r"^pid=[^,]*, name=[^,]*, (?:Ch [0-9a-fA-F]+,? )?")
_SXID_RE = re.compile(r"\bSXid \(PCI:[^)]*\): \d+")
# NVIDIA's Xid catalog, for the summary.
_XID_NAMES: dict[int, str] = {
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing",
    45: "preemptive cleanup after earlier errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    69: "Graphics Engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    154: "GPU recovery action changed (reset or reboot required)",
}
# Evidence, never the cause: 45 follows any kill of a process with GPU work in flight
# (SGLang's own kill_process_tree does that), 63 records a page retirement, 92 warns.
_XID_NOT_DECIDING = frozenset({45, 63, 92})
# Usually raised by a faulty kernel of the program (an illegal address), not the board.
_XID_PROGRAM_FAULT = frozenset({13, 31, 43})


@dataclass(frozen=True)
class _Xid:
    number: int
    pci: str
    description: str
    others: tuple[int, ...]
    lines: tuple[str, ...]


def _find_xid(kernel_lines: Sequence[str]) -> _Xid | None:
    found: list[tuple[int, str, str]] = []  # (xid, pci, line)
    evidence: list[str] = []
    for line in kernel_lines:
        match = _XID_RE.search(line)
        if match is not None:
            found.append((int(match.group("xid")), match.group("pci"), line))
            evidence.append(line)
            continue
        off = _OFF_THE_BUS_RE.search(line)
        if off is not None:
            found.append((79, off.group("pci"), line))
            evidence.append(line)
        elif _SXID_RE.search(line):
            evidence.append(line)
    deciding = [f for f in found if f[0] not in _XID_NOT_DECIDING]
    if not deciding:
        return None
    number, pci, line = deciding[0]
    text = _XID_NAMES.get(number)
    if text is None:
        match = _XID_RE.search(line)
        text = (match.group("text") if match else "").strip().rstrip(".")
        text = _XID_PROCESS_RE.sub("", text) or "unknown Xid"
        text = text if len(text) <= 60 else text[:59] + "…"
    others = tuple(dict.fromkeys(n for n, _, _ in found if n != number))
    uuid_lines = [
        ln
        for ln in kernel_lines
        if (m := _GPU_AT_RE.search(ln)) is not None and m.group("pci") == pci
    ]
    return _Xid(number, pci, text, others, (*uuid_lines[:1], *evidence))


# --- output evidence ------------------------------------------------------------
#
# Real texts; tests/unit/samples/README.md and tests/unit/samples/corpus/README.md say
# where each was seen. Each rule names a cause and a kind (the kind picks the advice).


@dataclass(frozen=True)
class _Rule:
    cause: ExitCause
    kind: str
    needle: str  # a plain substring every match contains: a cheap first test
    pattern: re.Pattern[str]


def _rules(cause: ExitCause, kind: str, *rules: tuple[str, str]) -> tuple[_Rule, ...]:
    return tuple(_Rule(cause, kind, needle, re.compile(pattern)) for needle, pattern in rules)


# Checked in this order on each line; the first rule that matches names the line.
_LINE_RULES: tuple[_Rule, ...] = (
    *_rules(
        ExitCause.GPU_OOM,
        "cuda-oom",
        # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError / RuntimeError (old torch);
        # SGLang's "Capture cuda graph failed: CUDA out of memory. Tried to allocate ..."
        ("out of memory", r"CUDA out of memory\. Tried to allocate"),
        ("out of memory", r"(?:Error|Exception|failed): CUDA out of memory\b"),
        ("OutOfMemoryError", r"OutOfMemoryError: CUDA"),
        # torch.AcceleratorError / RuntimeError, c10::Error; FlashInfer's "CUDA Error:"
        ("out of memory", r"CUDA [Ee]rror: out of memory"),
        ("MemoryAllocation", r"cudaErrorMemoryAllocation"),
        ("OUT_OF_MEMORY", r"CUDA_ERROR_OUT_OF_MEMORY"),
        ("_STATUS_ALLOC_FAILED", r"(?:CUBLAS|CUDNN)_STATUS_ALLOC_FAILED"),
        ("out of memory", r"Cuda failure (?:\d+ )?'out of memory'"),  # NCCL
        ("out of memory", r"CUDA runtime error in .*: out of memory\b"),  # TensorRT-LLM
        ("out of memory", r"Triton Error \[CUDA\]: out of memory"),
    ),
    *_rules(
        ExitCause.GPU_OOM,
        "kv-pool",
        # SGLang 0.3-0.5.x KV pool; 0.5.17+ KV budget; 0.4.x profiled a negative pool
        # (init_memory_pool then raises "Not enough memory").
        ("Not enough memory", r"Not enough memory\. Please try to increase --mem-fraction-static"),
        ("leave no GPU memory", r"Loaded weights leave no GPU memory for the KV cache"),
        (
            "profiled value",
            r"is larger than the profiled value (?:-\d+|0)\. Use the profiled value instead",
        ),
        # vLLM
        ("No available memory", r"No available memory for the cache blocks"),
        (
            "stored in KV cache",
            r"larger than the maximum number of tokens that can be stored in KV cache",
        ),
        (
            "available KV cache memory",
            r"KV cache is needed, which is larger than the available KV cache memory",
        ),
    ),
    *_rules(
        ExitCause.GPU_OOM,
        "free-memory",
        (
            "Free memory on device",
            r"Free memory on device .* on startup is less than desired GPU memory",
        ),
        ("memory capacity is unbalanced", r"Error: The memory capacity is unbalanced"),  # SGLang
    ),
    *_rules(
        ExitCause.FLASHINFER_ARCH,
        "arch",
        ("FlashInfer requires", r"FlashInfer requires sm75\+"),  # 0.2.x
        ("FlashInfer requires", r"FlashInfer requires GPUs with sm75"),  # 0.5.x, 0.7.x
        ("requires CUDA >=", r"SM 12[.\dx+]* requires CUDA >="),  # FlashInfer arch normalisation
        ("No supported CUDA architectures", r"No supported CUDA architectures found for major"),
        ("Unknown CUDA arch", r"Unknown CUDA arch \([^)]*\) or GPU not supported"),  # torch
        (
            "CUDA capability",
            r"with CUDA capability sm_\d+ is not compatible with the current PyTorch",
        ),
        ("no kernel image", r"no kernel image is available for execution on the device"),
        ("no kernel image", r"CUDA error: no kernel image"),
        ("cudaErrorNoKernelImage", r"cudaErrorNoKernelImageForDevice"),
        ("CUDA_ERROR_NO_BINARY", r"CUDA_ERROR_NO_BINARY_FOR_GPU"),
        ("Unsupported gpu architecture", r"Unsupported gpu architecture 'compute_\d+\w*'"),  # nvcc
        ("Unsupported compute capability", r"Unsupported compute capability: \d+\.\d+"),  # pdmux
        ("SGLang only supports sm75", r"SGLang only supports sm75 and above"),
        ("only supports Ampere", r"FlashAttention only supports Ampere GPUs or newer"),
        # DeepGEMM "Assertion error (.../attention.hpp:219): Unsupported architecture",
        # FlashInfer/TRT-LLM runners ".../fmhaRunner.cuh:30: Unsupported architecture";
        # NOT "Unsupported architectures: ChatGLMForConditionalGeneration" (a model class).
        (
            "Unsupported architecture",
            r"\.(?:hpp|cuh?|h|cpp|cc):\d+\)?:? ?Unsupported architecture\b(?!s)",
        ),
        ("requires SM", r"(?:Error|Exception): .*\brequires SM ?\d{2,3}\b"),  # "requires SM90+."
        (
            "compute capability of at least",
            r"only supported on GPUs with compute capability of at least",
        ),
        ("Minimum capability", r"is not supported for the current GPU\. Minimum capability: \d+"),
    ),
    *_rules(
        ExitCause.FLASHINFER_JIT,
        "jit",
        # FlashInfer 0.6 runs ninja on every module load, warm cache or not: a unit
        # without ninja on its PATH dies in the first forward (seen on the H200).
        (
            "Errno 2] No such file or directory: 'ninja'",
            r"\[Errno 2\] No such file or directory: 'ninja'",
        ),
        ("Error: Ninja build failed", r"RuntimeError: Ninja build failed"),  # flashinfer cpp_ext
        (
            "Errno 2] No such file or directory: '",
            r"\[Errno 2\] No such file or directory: '[^']*nvcc'",
        ),
        ("fatal error: ", r"fatal error: [\w./+-]+\.(?:h|hpp|cuh): No such file or directory"),
    ),
    *_rules(
        ExitCause.PORT_IN_USE,
        "port",
        ("Errno 98", r"\[Errno 98\]"),  # OSError EADDRINUSE; uvicorn's bind error
        ("errno: 98", r"errno: 98\b"),  # torch TCPStore
        ("EADDRINUSE", r"EADDRINUSE\b"),
        ("ddress already in use", r"(?:Error|error)\b.{0,120}\b[Aa]ddress already in use"),  # zmq
        ("bind: address already in use", r"bind: address already in use"),
        ("is not available in", r"port at \d+ is not available in \d+ seconds"),  # SGLang
    ),
    *_rules(
        ExitCause.MODEL_LOAD,
        "model",
        (
            "does not appear to have a file named",
            r"(?:OSError|EnvironmentError): .*\bdoes not appear to have a file named\b",
        ),
        (
            "is not a valid model",
            r"(?:OSError|EnvironmentError): .*\bis not a local folder and is not a valid model",
        ),
        ("gated repo", r"You are trying to access a gated repo\b"),
        ("GatedRepoError", r"GatedRepoError\b"),
        ("NotFoundError", r"(?:Repository|Revision|Entry)NotFoundError\b"),
        ("HFValidationError", r"HFValidationError\b"),
        ("Repository Not Found", r"Repository Not Found for url\b"),
        (
            "Can't load",
            r"(?:OSError|ValueError|EnvironmentError): Can't load (?:tokenizer|the configuration|config|the model|weights)\b",
        ),
        ("path_or_model_id", r"Incorrect path_or_model_id\b"),
        ("Unrecognized model in", r"Unrecognized model in\b"),
        ("has model type", r"The checkpoint you are trying to load has model type\b"),
        ("SafetensorError", r"SafetensorError\b"),  # safetensors_rust.SafetensorError
        ("in loading state_dict", r"Error\(s\) in loading state_dict for\b"),
        ("are not supported for now", r"Model architectures \[[^\]]*\] are not supported for now"),
        (
            "Unsupported architectures",
            r"Unsupported architectures: [A-Z]\w*(?:For|Model)",
        ),  # old SGLang
        ("has no vLLM implementation", r"has no vLLM implementation\b"),
        ("Cannot find any model weights", r"Cannot find any model weights with\b"),  # SGLang, vLLM
        ("No model weights found", r"No model weights found in\b"),
        ("No supported config format", r"No supported config format found in\b"),  # vLLM
        ("No tokenizer file found", r"No tokenizer file found in directory\b"),  # vLLM
    ),
    *_rules(
        ExitCause.GPU_DRIVER,
        "driver",
        # cudaErrorInsufficientDriver (35): cudart's own text, in torch's "CUDA error: ...",
        # THCudaCheck's "error=35 : ...", onnxruntime's "CUDA failure 35: ...".
        (
            "CUDA driver version is insufficient",
            r"CUDA driver version is insufficient for CUDA runtime version",
        ),
        ("cudaErrorInsufficientDriver", r"cudaErrorInsufficientDriver\b"),
        # 802 (an NVSwitch host whose nvidia-fabricmanager is not running, or not of the
        # driver's version): torch's "Error 802: ...", "CUDA error: ..." and "CUDA driver
        # error: ...", old torch's "(802) : ...", NCCL's "Cuda failure 802 '...'"; 804; 803.
        (
            "system not yet initialized",
            r"(?:\b802\b\W{1,4}|[Ee]rror: |')system not yet initialized\b",
        ),
        ("non supported HW", r"forward compatibility was attempted on non supported HW"),
        (
            "unsupported display driver",
            r"system has unsupported display driver / cuda driver combination",
        ),
        (
            "cudaError",
            r"cudaError(?:SystemNotReady|SystemDriverMismatch|CompatNotSupportedOnDevice"
            r"|NoDevice)\b",
        ),
        (
            "CUDA_ERROR_",
            r"CUDA_ERROR_(?:SYSTEM_NOT_READY|SYSTEM_DRIVER_MISMATCH"
            r"|COMPAT_NOT_SUPPORTED_ON_DEVICE|NO_DEVICE)\b",
        ),
        # torch's _cuda_init (RuntimeError, or AssertionError in old torch)
        ("Found no NVIDIA driver", r"Found no NVIDIA driver on your system"),
        ("NVIDIA driver on your system is too old", r"The NVIDIA driver on your system is too old"),
        ("no CUDA-capable device", r"no CUDA-capable device is detected"),  # cudaErrorNoDevice
        # NVML after a driver upgrade without a reboot: nvidia-smi's "Failed to initialize
        # NVML: Driver/library version mismatch", pynvml's NVMLError_LibRmVersionMismatch.
        (
            "Driver/library version mismatch",
            r"(?:NVML|[Ee]rror)\w*: Driver/library version mismatch",
        ),
        ("NVMLError_LibRmVersionMismatch", r"NVMLError_LibRmVersionMismatch\b"),
        ("LIB_RM_VERSION_MISMATCH", r"NVML_ERROR_LIB_RM_VERSION_MISMATCH\b"),
        ("NVML/RM version mismatch", r"RM has detected an NVML/RM version mismatch"),
    ),
    *_rules(
        ExitCause.CUDA_ERROR,
        "cuda",
        # RuntimeError / torch.AcceleratorError / c10::Error what() / "thread terminated
        # with exception: CUDA error: ..." / vLLM's "Worker failed with error 'CUDA error:"
        # ("driver shutting down" is interpreter teardown, not a fault).
        (
            "CUDA error: ",
            r"(?:Error|Exception|exception|what\(\)): +CUDA error: (?!driver shutting down)",
        ),
        ("CUDA error: ", r"\berror ['\"]CUDA error: (?!driver shutting down)"),
        ("CUDA Error: ", r"CUDA Error: \w"),  # FlashInfer's own check
        ("CUDA runtime error in ", r"CUDA runtime error in .*: \w"),  # TensorRT-LLM
        ("Triton Error [CUDA]: ", r"Triton Error \[CUDA\]: \w"),
        ("an illegal memory access", r"an illegal memory access was encountered"),
        ("an illegal instruction", r"an illegal instruction was encountered"),
        ("device-side assert triggered", r"device-side assert triggered"),
        ("unspecified launch failure", r"unspecified launch failure"),
        ("CUBLAS_STATUS_", r"CUBLAS_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR)\b"),
        ("CUDNN_STATUS_", r"CUDNN_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR|MAPPING_ERROR)\b"),
        (
            "cudaError",
            r"cudaError(?:IllegalAddress|LaunchFailure|Assert|MisalignedAddress"
            r"|IllegalInstruction|HardwareStackError|ECCUncorrectable)\b",
        ),
        (
            "CUDA_ERROR_",
            r"CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|ASSERT|MISALIGNED_ADDRESS"
            r"|ILLEGAL_INSTRUCTION|HARDWARE_STACK_ERROR|ECC_UNCORRECTABLE|UNKNOWN)\b",
        ),
    ),
    *_rules(
        ExitCause.NCCL,
        "nccl",
        # "RuntimeError: NCCL error: ...", "init_device: NCCL error: ...", torch's
        # "DistBackendError: NCCL error in: .../ProcessGroupNCCL.cpp:1970, ..."
        ("NCCL error", r"(?:[:('\"] *|^\s*)NCCL error\b"),
        ("NCCL Error", r"(?:[:('\"] *|^\s*)NCCL Error\b"),  # old torch "NCCL Error 1: ..."
        (
            "nccl",
            r"nccl(?:InternalError|SystemError|RemoteError|UnhandledCudaError|InvalidUsage"
            r"|InvalidArgument)\b",
        ),
        ("Watchdog caught", r"Watchdog caught collective operation timeout"),
        ("NCCL communicator", r"NCCL communicator was aborted"),
    ),
)
# Warnings do not end processes ("Warning: CUDA warning: unspecified launch failure").
_WARNING_TEXT = "CUDA warning: "
# Nor does a warning that names a driver failure: torch's "UserWarning: CUDA
# initialization: Found no NVIDIA driver on your system" (torch.cuda.is_available()),
# a logger's WARNING line. NCCL's "NCCL WARN Cuda failure ..." is an error report.
_DRIVER_WARNING_RE = re.compile(r"Warning: |\bWARNING\b|(?<!NCCL )\bWARN\b")

_INDEX_ERROR_RE = re.compile(r"IndexError: list index out of range")
_FRAME_RE = re.compile(r'File \\?"(?P<path>[^"\\]*)\\?", line \d+, in (?P<func>[\w<>.]+)')
# The last line of a traceback: "RuntimeError: ...", "torch.AcceleratorError: ...",
# "safetensors_rust.SafetensorError: ...", "KeyError: 'x'" (a "raise X(" source line is not).
_EXCEPTION_LINE_RE = re.compile(
    r"(?:^|[\s|\]>)'\"])(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::|\s*$)"
)
# Innermost frames that decide a traceback whose exception line was cut off:
# (path suffix, function, cause, kind). A leading "_" of the function is ignored.
_CUT_FRAMES: tuple[tuple[str, str, ExitCause, str], ...] = (
    ("flashinfer/jit/core.py", "check_cuda_arch", ExitCause.FLASHINFER_ARCH, "arch"),
    ("torch/utils/cpp_extension.py", "_get_cuda_arch_flags", ExitCause.FLASHINFER_ARCH, "arch"),
    (
        "vllm/v1/core/kv_cache_utils.py",
        "check_enough_kv_cache_memory",
        ExitCause.GPU_OOM,
        "kv-pool",
    ),
)
# How far below an innermost frame its cut-off exception line would have been.
_CUT_LOOKAHEAD = 12
_KEY_ERROR_RE = re.compile(r"KeyError: '[^']+'")
_LOAD_WEIGHTS_FRAME_RE = re.compile(r", in (?:load_weights|weight_loader)\b")

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


def _is_crash(line: str) -> bool:
    return any(n in line for n in _CRASH_NEEDLES) and _CRASH_RE.search(line) is not None


# SGLang: SIGTERM reached the tokenizer manager (0.3.6-0.5.x).
_STOP_BEGIN_RE = re.compile(r"SIGTERM received\. .*Draining requests and shutting down")
# ... and it went on to stop: drain, force exit, or kill its own tree (0.5.17+).
_STOP_FOLLOW_RE = re.compile(
    r"Gracefully exiting\.\.\. [Rr]emaining number of requests"
    r"|Signal SIGTERM received while .*(?:Force exiting|Exiting\.\.\.)"
    r"|kill_process_tree called: parent_pid=\d+, include_parent=True"
)
# Plain substrings that the traceback, child-failure and stop checks need.
_OTHER_NEEDLES: tuple[str, ...] = (
    *("IndexError", "KeyError", 'File "', 'File \\"'),
    *("sigquit", "SIGQUIT", "crashed with exit code", "Sleeping 5 seconds"),
    *("scheduler is dead", "hit an exception", "Exception in ", "warmup error"),
    *("SIGTERM received", "Gracefully exiting", "kill_process_tree called"),
)
# Every rule needle and every _OTHER_NEEDLES item contains one of these words (a test
# checks it), so a line with none of them (the bulk of a healthy log) is skipped by one
# search. Few words keep that search cheap: about 5 ms for a 2000-line tail.
_PREFILTER_WORDS: tuple[str, ...] = (
    *("rror", "xception", "emory", "MEMORY", "CUDA", "cuda", "NCCL", "nccl", "_STATUS_"),
    *("rrno", "EADDRINUSE", "in use", "is not available in"),
    *("not yet initialized", "NVIDIA driver", "version mismatch", "VERSION_MISMATCH"),
    *("upport", "apabilit", "kernel image", "FlashInfer", "requires SM"),
    *("profiled value", "KV cache", "odel", "implementation", "file named", "gated repo"),
    *(
        "Not Found",
        "file found",
        "Can't load",
        "state_dict",
        "illegal",
        "device-side",
        "launch failure",
    ),
    *("Watchdog caught", "sigquit", "SIGQUIT", "crashed with", "Sleeping 5", "is dead"),
    *("SIGTERM", "Gracefully exiting", "kill_process_tree", "File "),
)
_CANDIDATE_RE = re.compile("|".join(map(re.escape, _PREFILTER_WORDS)))


@dataclass(frozen=True)
class _OutputHit:
    cause: ExitCause
    index: int
    lines: tuple[str, ...]
    kind: str


def _candidates(output_lines: Sequence[str]) -> tuple[int, ...]:
    """The indexes of the lines worth a closer look (``_CANDIDATE_RE``)."""
    search = _CANDIDATE_RE.search
    return tuple(i for i, line in enumerate(output_lines) if search(line))


def _line_rule(line: str) -> _Rule | None:
    if _WARNING_TEXT in line:
        return None
    for rule in _LINE_RULES:
        if rule.needle in line and rule.pattern.search(line):
            if rule.cause is ExitCause.GPU_DRIVER and _DRIVER_WARNING_RE.search(line):
                return None
            return rule
    return None


def _arch_index_error(output_lines: Sequence[str], index: int) -> tuple[str, ...] | None:
    """The IndexError torch raises in ``_get_cuda_arch_flags`` when it has no arch
    list, counted only inside a FlashInfer JIT traceback (it is generic otherwise)."""
    window = output_lines[max(0, index - _TRACEBACK_LOOKBACK) : index]
    arch_frames = [ln for ln in window if "_get_cuda_arch_flags" in ln]
    flashinfer_frames = [ln for ln in window if "flashinfer" in ln]
    if not arch_frames or not flashinfer_frames:
        return None
    return (flashinfer_frames[-1], arch_frames[0], output_lines[index])


def _cut_frame(output_lines: Sequence[str], index: int) -> tuple[ExitCause, str] | None:
    """A frame that decides when it is the innermost frame of a traceback whose
    exception line was cut off (the output ends, or a child-failure line follows,
    before any exception line or another frame)."""
    frame = _FRAME_RE.search(output_lines[index])
    if frame is None:
        return None
    path, func = frame.group("path"), frame.group("func").lstrip("_")
    rule = next((r for r in _CUT_FRAMES if path.endswith(r[0]) and func == r[1].lstrip("_")), None)
    if rule is None:
        return None
    for line in output_lines[index + 1 : index + 1 + _CUT_LOOKAHEAD]:
        if _FRAME_RE.search(line) or _EXCEPTION_LINE_RE.search(line):
            return None
        if _is_crash(line):
            break
    else:
        if len(output_lines) - index - 1 > _CUT_LOOKAHEAD:
            return None  # neither cut off nor ended: nothing to say
    return rule[2], rule[3]


def _load_weights_key_error(output_lines: Sequence[str], index: int) -> tuple[str, ...] | None:
    """``KeyError: 'lm_head.weight'`` raised in a model's ``load_weights``: the
    checkpoint and the model class do not match (a KeyError elsewhere is generic)."""
    window = output_lines[max(0, index - 8) : index]
    frames = [ln for ln in window if _FRAME_RE.search(ln)]
    if not frames or not _LOAD_WEIGHTS_FRAME_RE.search(frames[-1]):
        return None
    return (frames[-1], output_lines[index])


def _find_output_cause(
    output_lines: Sequence[str],
    candidates: Sequence[int],
    start: int = 0,
    end: int | None = None,
    ignore: frozenset[ExitCause] = frozenset(),
) -> _OutputHit | None:
    """The deciding output evidence among ``output_lines[start:end]`` (``candidates``:
    from ``_candidates``), leaving out the causes in ``ignore``."""
    hits: dict[ExitCause, list[tuple[int, str, str]]] = {}  # cause → (index, line, kind)

    def add(cause: ExitCause, kind: str, index: int, *lines: str) -> None:
        hits.setdefault(cause, []).extend((index, ln, kind) for ln in lines)

    stop = len(output_lines) if end is None else end
    for index in candidates:
        if not start <= index < stop:
            continue
        line = output_lines[index]
        rule = _line_rule(line)
        if rule is not None:
            add(rule.cause, rule.kind, index, line)
        elif _INDEX_ERROR_RE.search(line):
            frames = _arch_index_error(output_lines, index)
            if frames is not None:
                add(ExitCause.FLASHINFER_ARCH, "arch", index, *frames)
        elif _KEY_ERROR_RE.search(line):
            frames = _load_weights_key_error(output_lines, index)
            if frames is not None:
                add(ExitCause.MODEL_LOAD, "model", index, *frames)
        else:
            cut = _cut_frame(output_lines, index)
            if cut is not None:
                add(cut[0], cut[1], index, line)
    for cause in ignore:
        hits.pop(cause, None)
    if not hits:
        return None
    if len(hits) > 1:
        hits.pop(ExitCause.NCCL, None)  # an echo of the other cause (module docstring)
    cause, found = max(hits.items(), key=lambda item: item[1][-1][0])
    return _OutputHit(cause, found[-1][0], tuple(_dedupe(ln for _, ln, _ in found)), found[-1][2])


# --- stops ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stop:
    lines: tuple[str, ...]  # SGLang's stop lines (evidence)
    graceful: bool  # SGLang drained and killed its own tree after the SIGTERM
    after: _OutputHit | None  # evidence printed after the stop began
    before: _OutputHit | None  # evidence printed before it (survived)
    crash_after: bool  # a child failed after the stop began


def _find_stop(
    snapshot: ExitSnapshot,
    output_lines: Sequence[str],
    candidates: Sequence[int],
    *,
    self_kill: bool,
) -> _Stop | None:
    """Rule 6, for a process that ended by SIGTERM or SIGKILL: did a stop end it?
    ``self_kill``: SIGKILL that was not systemd's stop timeout (that is Result=timeout)."""
    begin = next((i for i in candidates if _STOP_BEGIN_RE.search(output_lines[i])), None)
    follow = (
        [i for i in candidates if i > begin and _STOP_FOLLOW_RE.search(output_lines[i])]
        if begin is not None
        else []
    )
    crashes = [i for i in candidates if _is_crash(output_lines[i])]
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
        start = len(output_lines)
    if any(i < start for i in crashes):
        return None  # a child had failed before the stop: it was dying anyway
    stop_lines: list[str] = []
    if begin is not None:
        stop_lines.append(output_lines[begin])
        gracefully = [i for i in follow if "Gracefully exiting" in output_lines[i]]
        others = [i for i in follow if i not in gracefully]
        stop_lines.extend(output_lines[i] for i in sorted(gracefully[-1:] + others))
    return _Stop(
        lines=tuple(stop_lines),
        graceful=bool(follow),
        # NCCL errors while it stops are the teardown's echo (peer ranks going away).
        after=_find_output_cause(
            output_lines,
            candidates,
            start,
            ignore=frozenset({ExitCause.NCCL}) if begin is not None else frozenset(),
        ),
        before=_find_output_cause(output_lines, candidates, end=start),
        crash_after=any(i >= start for i in crashes),
    )


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


_NO_RESTART = "restarting will not help"
# (prefix, advice) per output kind: the summary is "<prefix>: <last line>; <advice>".
_OUTPUT_SUMMARY: dict[str, tuple[str, str]] = {
    "cuda-oom": ("GPU out of memory", "lower --mem-fraction-static or free the GPU"),
    "kv-pool": (
        "GPU out of memory",
        "the weights leave no room for the KV cache: raise --mem-fraction-static "
        "(vLLM: --gpu-memory-utilization), shorten the context or add GPUs; " + _NO_RESTART,
    ),
    "free-memory": (
        "GPU out of memory",
        "another process holds GPU memory: free the GPU or lower the memory fraction",
    ),
    "arch": (
        "GPU architecture rejected",
        "this build has no kernels for this GPU: use a build for its architecture "
        "or another backend; " + _NO_RESTART,
    ),
    "cuda": (
        "CUDA failure",
        "a kernel fault or a bad GPU state: one restart may clear it; if it repeats, "
        "report it (CUDA_LAUNCH_BLOCKING=1) or check the GPU",
    ),
    "nccl": (
        "NCCL failure",
        "a collective failed between ranks: check the peers and the interconnect "
        "(NCCL_DEBUG=INFO); a restart helps only once the cause is gone",
    ),
    "jit": (
        "FlashInfer's JIT build failed in the server",
        "a build tool or header it needs is missing from the unit's environment (FlashInfer "
        "0.6 runs ninja on every module load, even warm: put the serving venv's bin on the "
        "unit's PATH) — " + _NO_RESTART,
    ),
    "driver": (
        "GPU driver stack unusable",
        "fix the host's driver stack (a driver older than the CUDA runtime: upgrade the "
        "driver or use a build for it; 802: start nvidia-fabricmanager with the driver's "
        "exact version; a version mismatch: reboot or reload the driver), then reset the "
        "unit (SIGUSR1) — " + _NO_RESTART,
    ),
    "port": ("port already in use", "another process holds it — " + _NO_RESTART),
    "model": (
        "model failed to load",
        "fix the model path/weights/config (or the access token) — " + _NO_RESTART,
    ),
}


def _output_summary(hit: _OutputHit) -> str:
    prefix, advice = _OUTPUT_SUMMARY[hit.kind]
    return f"{prefix}: {_last_line(hit.lines)}; {advice}"


def _xid_summary(xid: _Xid) -> str:
    also = f", then Xid {', '.join(map(str, xid.others))}" if xid.others else ""
    if xid.number in _XID_PROGRAM_FAULT:
        todo = (
            "often a faulty kernel in the program; if it repeats on this GPU, "
            "have a person check it"
        )
    else:
        todo = "needs a person (reset or drain the node)"
    return f"NVIDIA Xid {xid.number} on GPU {xid.pci} ({xid.description}{also}): {todo}"


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
    candidates = _candidates(output_lines)

    def verdict(cause: ExitCause, summary: str, lines: Sequence[str] = ()) -> Verdict:
        # Keep the last lines: they are the ones nearest the death.
        evidence = (head, *_dedupe(lines)[-(MAX_EVIDENCE_LINES - 1) :])
        return Verdict(cause, summary, evidence, exit_code, signal)

    def output_verdict(hit: _OutputHit, note: str = "") -> Verdict:
        return verdict(hit.cause, _output_summary(hit) + note, hit.lines)

    def stopped_verdict(
        stop: _Stop, how: str, todo: str = "not a failure, nothing to do"
    ) -> Verdict:
        summary = f"stopped: {how}; {todo}"
        lines = list(stop.lines)
        if stop.before is not None:
            summary += (
                f" (it had printed an error before the stop: {_last_line(stop.before.lines)})"
            )
            lines = [*stop.before.lines[-3:], *lines]
        return verdict(ExitCause.STOPPED, summary, lines)

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
            scope = "the main process" if oom.main_pid_killed else "a process of the unit"
            summary = f"kernel OOM killer killed {scope}, {who}, in memory cgroup {where}"
            if not oom.main_pid_killed and code == CLD_EXITED:
                summary += f"; the main process then exited with status {status}"
        summary += "; host memory ran out: lower its memory use or raise the limit"
        return verdict(ExitCause.OOM_KILL, summary, oom.lines if oom else ())

    xid = None if clean else _find_xid(kernel_lines)
    if xid is not None:
        program = _find_output_cause(output_lines, candidates)
        return verdict(
            ExitCause.GPU_XID,
            _xid_summary(xid),
            (*xid.lines, *(program.lines[-3:] if program else ())),
        )

    if result == "watchdog":
        how = f", then killed it with {_signal_name(status)}" if signal else ""
        return verdict(
            ExitCause.WATCHDOG, f"watchdog timeout: no WATCHDOG=1 within WatchdogSec{how}"
        )
    if result == "timeout":
        stop = (
            _find_stop(snapshot, output_lines, candidates, self_kill=False)
            if snapshot.stop_requested
            else None
        )
        if stop is not None:
            if stop.after is not None:
                return output_verdict(stop.after, " (while it was stopping)")
            return stopped_verdict(
                stop,
                "it ignored SIGTERM for TimeoutStopSec, so systemd SIGKILLed it",
                "not a failure, but check why it hangs on stop",
            )
        return verdict(ExitCause.TIMEOUT, "systemd timed out waiting for it to start or stop")

    if clean:
        if snapshot.stop_requested:
            return verdict(ExitCause.STOPPED, "stopped on request: exited cleanly; nothing to do")
        return verdict(ExitCause.CLEAN, "exited cleanly with status 0")

    by_sigkill = (code == CLD_KILLED and status == _signal.SIGKILL) or (
        code == CLD_EXITED and status == 128 + _signal.SIGKILL
    )
    by_sigterm = (code == CLD_KILLED and status == _signal.SIGTERM) or (
        code == CLD_EXITED and status == 128 + _signal.SIGTERM
    )
    stop = (
        _find_stop(snapshot, output_lines, candidates, self_kill=by_sigkill)
        if by_sigkill or by_sigterm
        else None
    )
    if stop is not None:
        if stop.after is not None:
            return output_verdict(stop.after, " (while it was stopping)")
        if not stop.crash_after:
            if stop.graceful and by_sigkill:
                how = "SIGTERM, then SGLang's own SIGKILL after draining"
            elif by_sigkill:
                how = "SIGKILL while its stop job ran"
            else:
                how = "SIGTERM"
            if not snapshot.stop_requested:
                how += " (the SIGTERM did not come from a stop job)"
            return stopped_verdict(stop, how)
    else:
        hit = _find_output_cause(output_lines, candidates)
        if hit is not None:
            return output_verdict(hit)

    during_stop = (
        "; a child failed while it was stopping" if stop is not None and stop.crash_after else ""
    )
    if result == "core-dump" or code == CLD_DUMPED:
        what = _signal_name(status) if code == CLD_DUMPED else "a signal"
        return verdict(ExitCause.CORE_DUMP, f"dumped core on {what}; see the core dump")
    if code == CLD_KILLED:
        if status == _signal.SIGKILL:
            crashes = [output_lines[i] for i in candidates if _is_crash(output_lines[i])]
            if crashes and not during_stop:
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
