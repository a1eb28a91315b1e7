"""The kernel's records: OOM kills, NVIDIA Xids and GPU faults, driver-stack failures.

Kernel lines are messages without the ``/dev/kmsg`` or ``dmesg`` header. rsyslog may
write a multi-line message as one line with ``#012`` for each newline; the NVIDIA
driver prints some messages over several ``NVRM:`` lines (an API mismatch, a GPU that
fell off the bus): both are put back together before they are read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .model import ExitSnapshot


def kernel_messages(lines: Sequence[str]) -> list[str]:
    """The lines, with syslog's ``#012`` escapes split back into lines."""
    out: list[str] = []
    for line in lines:
        out.extend(line.split("#012") if "#012" in line else (line,))
    return out


_NVRM = "NVRM: "
_NVRM_RECORD_LINES = 6


def nvrm_records(messages: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """NVRM messages joined across their continuation lines: ``(text, lines)``. A line
    continues the one above when that one did not end a sentence (``.`` or ``!``)."""
    records: list[tuple[str, tuple[str, ...]]] = []
    texts: list[str] = []
    lines: list[str] = []
    for line in messages:
        at = line.find(_NVRM)
        if at < 0:
            if lines:
                records.append((" ".join(texts), tuple(lines)))
                texts, lines = [], []
            continue
        text = line[at + len(_NVRM) :].strip()
        if lines and (texts[-1].endswith((".", "!")) or len(lines) >= _NVRM_RECORD_LINES):
            records.append((" ".join(texts), tuple(lines)))
            texts, lines = [], []
        texts.append(text)
        lines.append(line)
    if lines:
        records.append((" ".join(texts), tuple(lines)))
    return records


# --- OOM kills -----------------------------------------------------------------------

_OOM_KILL_RE = re.compile(r"\boom-kill:(?P<fields>\S+)")
KILLED_PROCESS_RE = re.compile(r"\bKilled process (?P<pid>\d+) \((?P<comm>[^)]*)\)")


@dataclass(frozen=True)
class OomRecord:
    line: str
    pid: int | None
    task: str
    oom_memcg: str
    task_memcg: str


def _parse_oom_kill(line: str) -> OomRecord | None:
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
    return OomRecord(
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
class KernelOom:
    lines: tuple[str, ...]
    main_pid_killed: bool
    first: OomRecord | None


def find_kernel_oom(snapshot: ExitSnapshot, kernel_lines: Sequence[str]) -> KernelOom | None:
    """The OOM-kill records for this unit: its memory cgroup, or its main PID."""
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
        killed = KILLED_PROCESS_RE.search(line)
        if killed is not None and int(killed.group("pid")) in unit_pids:
            matched.append(line)
            main_killed = main_killed or int(killed.group("pid")) == snapshot.main_pid
    if not matched:
        return None
    return KernelOom(tuple(matched), main_killed, unit_records[0] if unit_records else None)


# --- Xids and GPU faults -------------------------------------------------------------

_PCI = r"(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
# "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus." (newer drivers put
# "pid=..., name=..., " before the text).
_XID_RE = re.compile(r"\bNVRM: Xid \((?:PCI:)?" + _PCI + r"\): (?P<xid>\d+)\b,?\s*(?P<text>.*)")
# Xid 45 names the Xid it cleans up after: "..., Ch 00000001 caused by previous Xid 149".
_CAUSED_BY_RE = re.compile(r"\bcaused by previous Xid (?P<xid>\d+)\b")
_PCI_IN_RE = re.compile(r"\b(?:GPU|PCI)[: ]*(?:at )?(?:PCI:)?" + _PCI)
_GPU_AT_RE = re.compile(r"\bNVRM: GPU at PCI:" + _PCI + r": GPU-[0-9a-fA-F-]+")
# Newer drivers name the process first: "pid=1234, name=python3, Ch 00000008, ".
_XID_PROCESS_RE = re.compile(r"^pid=[^,]*, name=[^,]*, (?:Ch [0-9a-fA-F]+,? )?")
_SXID_RE = re.compile(r"\bSXid \(PCI:[^)]*\): \d+")
# Faults the driver reports without an Xid number, read from whole NVRM records:
# (pattern, the Xid it stands for).
_FAULTS: tuple[tuple[re.Pattern[str], int], ...] = (
    # "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.", and the two-line form
    # "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1b80)" / "NVRM: installed in
    # this system has fallen off the bus and is not responding to commands."
    (re.compile(r"\bfallen off the bus\b"), 79),
    # The GSP firmware stopped answering (open-gpu-kernel-modules, kernel_gsp.c): the RPC
    # poll timing out ("NVRM: _kgspRpcRecvPoll: Timeout waiting for RPC from GSP0!
    # Expected function 76", "Timeout after 6s of waiting for RPC response from GPU1
    # GSP!", "GPU0 sanity check failed 0x.. waiting for RPC response from GSP", "Back to
    # back GSP RPC timeout detected! GPU marked for reset"), the banner its Xid 119
    # report starts with (_kgspLogXid119, _kgspLogRpcTimeout, _kgspLogGspTimeout:
    # "***** GSP Timeout *****", "***** GSP Failure *****" in 525-535), and its
    # heartbeat check (_kgspIsHeartbeatTimedOut: "Heartbeat timed out, currentTimeMs
    # ...", "GSP-RM heartbeat timed out", _kgspRpcRecvPoll: "GSP RM heartbeat timed
    # out"). Read from NVRM records only.
    (
        re.compile(
            r"(?i)\btime ?out\b[^.!]{0,40}\bRPC\b[^.!]{0,40}\bGSP\d*\b|\bGSP RPC time ?out\b"
            r"|\bwaiting for RPC (?:response )?from (?:GPU\d+ )?GSP\d*\b"
            r"|\*{3,} ?GSP (?:Timeout|Failure) ?\*{3,}|\bheartbeat timed out\b"
        ),
        119,
    ),
)
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
    **{n: "NVLink error" for n in range(144, 151)},
    154: "GPU recovery action changed (reset or reboot required)",
}
# Evidence, never the cause: 45 follows any kill of a process with GPU work in flight
# (SGLang's own kill_process_tree does that), 63 records a page retirement, 92 warns.
_XID_NOT_DECIDING = frozenset({45, 63, 92})
# Application faults in NVIDIA's Xid catalog: the driver's record of the program's own
# device-side assert, illegal address or bad instruction, not of a broken board.
XID_PROGRAM_FAULT = frozenset({13, 31, 43})
# A contained ECC error: the driver ended only the process that touched the bad row, and
# the GPU goes on serving; the row is remapped at the GPU's next reset. A restart helps.
XID_CONTAINED = frozenset({94})
# Every other deciding Xid (48, 74, 79, 95, 119, 120, ...) is the GPU's or the driver's own.
XID_RESTARTABLE = XID_PROGRAM_FAULT | XID_CONTAINED


@dataclass(frozen=True)
class Xid:
    number: int
    pci: str
    description: str
    others: tuple[int, ...]
    lines: tuple[str, ...]
    # Some deciding Xid of this run is the hardware's or the driver's (not restartable).
    gpus_own: bool = True


def _xid_text(number: int, line: str) -> str:
    text = _XID_NAMES.get(number)
    if text is not None:
        return text
    match = _XID_RE.search(line)
    text = (match.group("text") if match else "").strip().rstrip(".")
    text = _CAUSED_BY_RE.sub("", _XID_PROCESS_RE.sub("", text)).strip(" ,") or "unknown Xid"
    return text if len(text) <= 60 else text[:59] + "…"


def find_xid(kernel_lines: Sequence[str]) -> Xid | None:
    """The deciding Xid (or Xid-less GPU fault) of this run, with its GPU: the first
    hardware one if any, else the first program fault."""
    messages = kernel_messages(kernel_lines)
    found: list[tuple[int, str, str]] = []  # (xid, pci, line)
    evidence: list[str] = []
    for line in messages:
        match = _XID_RE.search(line)
        if match is not None:
            number, pci = int(match.group("xid")), match.group("pci")
            found.append((number, pci, line))
            evidence.append(line)
            earlier = _CAUSED_BY_RE.search(line)
            if earlier is not None:
                found.append((int(earlier.group("xid")), pci, line))
        elif _SXID_RE.search(line):
            evidence.append(line)
    for text, lines in nvrm_records(messages):
        if any(_XID_RE.search(ln) for ln in lines):
            continue
        for pattern, number in _FAULTS:
            if pattern.search(text):
                pci = _PCI_IN_RE.search(text)
                found.append((number, pci.group("pci") if pci else "?", lines[-1]))
                evidence.extend(lines)
                break
    deciding = [f for f in found if f[0] not in _XID_NOT_DECIDING]
    if not deciding:
        return None
    # A hardware Xid anywhere in the run outranks a program fault beside it.
    hardware = [f for f in deciding if f[0] not in XID_RESTARTABLE]
    number, pci, line = (hardware or deciding)[0]
    others = tuple(dict.fromkeys(n for n, _, _ in found if n != number))
    uuid_lines = [
        ln for ln in messages if (m := _GPU_AT_RE.search(ln)) is not None and m.group("pci") == pci
    ]
    return Xid(
        number,
        pci,
        _xid_text(number, line),
        others,
        (*uuid_lines[:1], *dict.fromkeys(evidence)),
        gpus_own=bool(hardware),
    )


# --- the driver stack ----------------------------------------------------------------

# Read from whole NVRM records (and plain kernel lines): the driver itself cannot run.
_DRIVER_RECORDS: tuple[tuple[re.Pattern[str], str], ...] = (
    # "NVRM: API mismatch: the client has the version 570.153.02, but" / "NVRM: this
    # kernel module has the version 570.144.  Please make sure that this kernel module
    # and all NVIDIA driver components have the same version."
    (
        re.compile(
            r"\bAPI mismatch: the client has the version (?P<a>\S+?),? but .*?"
            r"\bkernel module has the version (?P<b>\S+?)\.?(?:\s|$)"
        ),
        "the driver's user-space ({a}) and kernel module ({b}) differ",
    ),
    (
        re.compile(r"\binstalled in this system is not supported by the .{0,40}\bdriver release"),
        "the installed driver does not support this GPU",
    ),
    (
        re.compile(r"^nvidia\w*: (?:disagrees about version of symbol|Unknown symbol)\b"),
        "the kernel module does not match the running kernel",
    ),
)


@dataclass(frozen=True)
class KernelDriver:
    what: str
    lines: tuple[str, ...]


def find_kernel_driver(kernel_lines: Sequence[str]) -> KernelDriver | None:
    """The first kernel record that says the NVIDIA driver stack cannot work."""
    messages = kernel_messages(kernel_lines)
    records = [*nvrm_records(messages), *((m, (m,)) for m in messages if _NVRM not in m)]
    for text, lines in records:
        for pattern, what in _DRIVER_RECORDS:
            match = pattern.search(text)
            if match is not None:
                return KernelDriver(what.format(**match.groupdict()), lines)
    return None
