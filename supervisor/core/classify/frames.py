"""Where an error came from: Python tracebacks and C++ frames, parsed from output lines.

A Python traceback is read as its frames (file and function, innermost last), its
exception line (``pkg.mod.SomeError: message``) and the chain that led to it (``The
above exception was the direct cause of the following exception``, ``During handling
of the above exception, another exception occurred``). A traceback whose exception
line never came (the paste or the tail was cut) is kept as a cut traceback. C++ is
read as c10's ``Exception raised from FUNC at FILE:LINE`` with the frames under it
(torch's ``frame #N: FUNC + 0x...`` and gdb's ``#N 0x... in FUNC (...) at FILE:LINE``
shapes), and as glog's severity prefix (``[E429 13:55:49.38 ProcessGroupNCCL.cpp:1743]``,
``E0801 13:23:20.0 32974 file.py:874]``), which names the file that logged the line. A
native backtrace on its own decides nothing: it says where a process crashed, not why.

Lines may carry any prefix (a timestamp, ``(EngineCore_DP0 pid=68)``, Ray's
``(SGLangEngine pid=1)``, ``vllm  | ``): the shapes are searched, not anchored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

PY_FRAME_RE = re.compile(r'File \\?"(?P<path>[^"\\]*)\\?", line \d+, in (?P<func>[\w<>.]+)')
# The last line of a traceback: "RuntimeError: ...", "torch.AcceleratorError: ...",
# "safetensors_rust.SafetensorError: ...", "KeyError: 'x'" (a "raise X(" source line is not).
EXCEPTION_RE = re.compile(
    r"(?:^|[\s|\]>)'\"])(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt))"
    r"(?::\s?(?P<message>.*)|\s*$)"
)
TRACEBACK_HEAD = "Traceback (most recent call last)"
CAUSE_TEXT = "The above exception was the direct cause"
CONTEXT_TEXT = "During handling of the above exception"
# c10: "Exception raised from c10_cuda_check_implementation at .../CUDAException.cpp:43"
CPP_RAISE_RE = re.compile(r"\bException raised from (?P<func>\S+) at (?P<file>[^\s:]+):\d+")
# torch: "frame #3: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(...) + 0x1d2 (0x7f in ...)"
# gdb: "#0  0x00007f3b in ncclCommInitRank (comm=...) at init.cc:1306", "#4 foo () at x.cpp:9"
CPP_FRAME_RE = re.compile(
    r"(?:\bframe #\d+: (?P<func>.+?)(?: \+ 0x[0-9a-f]+)? \(0x[0-9a-f]+ in (?P<lib>[^)]*)\)"
    r"|(?:^|\s)#\d+ +(?:0x[0-9a-f]+ in )?(?P<gfunc>[\w:~<>]+) ?\(.*?\)(?: at (?P<file>\S+?):\d+)?$)"
)
# glog: "[rank6]:[F429 14:03:49.385 ProcessGroupNCCL.cpp:1554]", "[E ProcessGroupNCCL.cpp:475]",
# "E0801 13:23:20.000000 32974 torch/distributed/elastic/multiprocessing/api.py:874]".
GLOG_RE = re.compile(
    r"(?:\[|^|\s)(?P<sev>[IWEF])(?:\d{3,4} [\d:.]+(?: +\d+)? +| )(?P<file>[\w./-]+\.\w+):\d+\]"
)
# How far below its last frame a traceback's exception line may be (source lines, a
# caret line, a log prefix's continuation) before the frames count as cut.
EXCEPTION_WITHIN = 12


@dataclass(frozen=True)
class PyFrame:
    index: int
    path: str
    func: str

    def is_(self, path_suffix: str, *funcs: str) -> bool:
        """In a file ending with ``path_suffix`` and, if given, one of ``funcs`` (a
        leading ``_`` ignored)."""
        return self.path.endswith(path_suffix) and (
            not funcs or self.func.lstrip("_") in {f.lstrip("_") for f in funcs}
        )


@dataclass(frozen=True)
class PyError:
    """One exception line, with the frames above it and the one it was raised from."""

    index: int
    type: str  # as printed: "torch.OutOfMemoryError"
    message: str
    frames: tuple[PyFrame, ...]  # outermost first
    cause: PyError | None  # the exception above it in the chain

    @property
    def name(self) -> str:
        return self.type.rsplit(".", 1)[-1]

    def chain(self) -> Iterator[PyError]:
        """This exception, then the ones it was raised from or during."""
        error: PyError | None = self
        while error is not None:
            yield error
            error = error.cause


@dataclass(frozen=True)
class CppFrame:
    index: int
    func: str
    where: str  # the source file or the library


@dataclass(frozen=True)
class CppRaise:
    """c10's ``Exception raised from FUNC at FILE``, with the frames printed under it."""

    index: int
    func: str
    file: str
    frames: tuple[CppFrame, ...]


@dataclass(frozen=True)
class Parsed:
    errors: tuple[PyError, ...]
    cut: tuple[tuple[PyFrame, ...], ...]  # tracebacks without their exception line
    raises: tuple[CppRaise, ...]


def exception_line(line: str) -> tuple[str, str] | None:
    match = EXCEPTION_RE.search(line)
    if match is None or "raise " in line[: match.start() + 1]:
        return None
    return match.group("type"), (match.group("message") or "").strip()


def _cpp_frame(index: int, line: str) -> CppFrame | None:
    match = CPP_FRAME_RE.search(line)
    if match is None:
        return None
    if match.group("func") is not None:
        return CppFrame(index, match.group("func"), match.group("lib") or "")
    return CppFrame(index, match.group("gfunc"), match.group("file") or "")


def _is_cut(lines: Sequence[str], last: int, is_crash: Callable[[str], bool]) -> bool:
    """Frames end at ``last`` and no exception line came: cut if the output ends, or
    a child-failure line comes, before anything else could have been the exception."""
    for line in lines[last + 1 : last + 1 + EXCEPTION_WITHIN]:
        if PY_FRAME_RE.search(line) or exception_line(line) is not None:
            return False
        if is_crash(line):
            return True
    return len(lines) - last - 1 <= EXCEPTION_WITHIN


def parse(lines: Sequence[str], indexes: Sequence[int], is_crash: Callable[[str], bool]) -> Parsed:
    """Tracebacks and C++ raises among ``lines[i] for i in indexes`` (the candidate
    lines: every frame, exception and chain line is one). ``is_crash``: a line that
    ends a traceback cut short (a child-failure line)."""
    errors: list[PyError] = []
    cut: list[tuple[PyFrame, ...]] = []
    raises: list[CppRaise] = []
    frames: list[PyFrame] = []
    chained = False
    last: PyError | None = None
    raising: tuple[int, str, str] | None = None
    raise_frames: list[CppFrame] = []

    def close_frames() -> None:
        if frames and _is_cut(lines, frames[-1].index, is_crash):
            cut.append(tuple(frames))
        frames.clear()

    def close_raise() -> None:
        nonlocal raising
        if raising is not None:
            raises.append(CppRaise(*raising, tuple(raise_frames)))
        raising = None
        raise_frames.clear()

    for i in indexes:
        line = lines[i]
        if frames and i - frames[-1].index > EXCEPTION_WITHIN:
            close_frames()
        frame = PY_FRAME_RE.search(line)
        if frame is not None:
            frames.append(PyFrame(i, frame.group("path"), frame.group("func")))
            continue
        if TRACEBACK_HEAD in line or CAUSE_TEXT in line or CONTEXT_TEXT in line:
            close_frames()
            chained = chained or TRACEBACK_HEAD not in line
            continue
        cpp = CPP_RAISE_RE.search(line)
        if cpp is not None:
            close_raise()
            raising = (i, cpp.group("func"), cpp.group("file"))
            continue
        if raising is not None and "#" in line:
            cpp_frame = _cpp_frame(i, line)
            if cpp_frame is not None:
                raise_frames.append(cpp_frame)
                continue
        found = exception_line(line)
        if found is None:
            continue
        error = PyError(i, found[0], found[1], tuple(frames), last if chained else None)
        errors.append(error)
        last, chained = error, False
        frames.clear()
    close_frames()
    close_raise()
    return Parsed(tuple(errors), tuple(cut), tuple(raises))


def glog(line: str) -> tuple[str, str] | None:
    """``(severity, file)`` of a glog-style line: ``("F", "ProcessGroupNCCL.cpp")``."""
    match = GLOG_RE.search(line)
    return None if match is None else (match.group("sev"), match.group("file"))
