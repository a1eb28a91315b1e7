"""Shared test plumbing.

SIGTERM becomes KeyboardInterrupt so an interrupted run still tears its
systemd sandboxes down (pytest runs fixture finalizers on KeyboardInterrupt).
The tool binaries scripts/tools.sh unpacked (promtool, prometheus,
alertmanager) go first on PATH, so tests find them without any install.
What tests recorded in ``tests.measured`` is printed at the end of the run.
A run that leaves anything new in the user's own JIT caches (each library's
default directory, as ``supervisor.core.jit_caches`` knows them) fails.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from types import FrameType

import pytest

from k26dev import ports, shared_cache
from supervisor.core import jit_caches
from tests.measured import MEASURED


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def user_jit_caches() -> list[Path]:
    """The JIT caches a library writes when nothing pins them: the user's own."""
    home = os.environ.get("HOME") or str(Path.home())
    found = jit_caches.locate(
        {"TMPDIR": os.environ.get("TMPDIR", "")}, home=home, user=getpass.getuser()
    )
    return [Path(str(where.path)) for where in found]


def _entries(top: Path, depth: int = 3) -> set[str]:
    """What is in ``top``, ``depth`` levels down (the top itself included)."""
    if not top.exists():
        return set()
    seen = {str(top)}
    for directory, dirs, files in os.walk(top):
        level = Path(directory).relative_to(top).parts
        if len(level) >= depth:
            dirs[:] = []
        seen.update(os.path.join(directory, name) for name in (*dirs, *files))
    return seen


_BEFORE: dict[Path, set[str]] = {}


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    if not hasattr(config, "workerinput"):
        _BEFORE.update({top: _entries(top) for top in user_jit_caches()})
    # One claims directory for the whole session, so that free_port never hands the
    # same port to two xdist workers (they inherit the controller's environment).
    if not hasattr(config, "workerinput") and ports.CLAIMS_ENV not in os.environ:
        claims = tempfile.mkdtemp(prefix="k26-ports-")
        os.environ[ports.CLAIMS_ENV] = claims
        config.add_cleanup(lambda: shutil.rmtree(claims, ignore_errors=True))
    tools_bin = shared_cache.tools_dir() / "bin"
    if tools_bin.is_dir():
        os.environ["PATH"] = f"{tools_bin}{os.pathsep}{os.environ.get('PATH', '')}"


# Tests that need the session's FlashInfer builds (tests/integration/builds.py).
BUILD_FIXTURES = frozenset({"sampling_build", "small_build"})
# The serving venvs with a CUDA torch (about 6 GB each): a fresh machine is still
# downloading them when the integration tests begin (scripts/dev.sh waits only for
# serving-0.7), so the tests that need one go last, and no worker sits waiting for
# a download while there are others it could run.
LATE_FIXTURES = frozenset({"serving_02", "serving_070_cu128"})
# The order of the groups' first tests, which (with --no-loadscope-reorder) is the
# order xdist hands them out. Each worker starts with one unit and takes another
# while it has at most two tests pending: the demo's one long test goes to the first
# worker, which then takes the third group; the other two workers start on booted
# and nvcc-own. The ungrouped tests follow, for whichever worker runs low. At W6
# (xdist's default order, by test count) the demo was handed out only once a group
# drained, and its worker ended 250 s after the others.
GROUP_ORDER = ("demo", "booted", "nvcc-own", "nvcc")


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark is not None and mark.args else None


def _schedule_rank(item: pytest.Item) -> tuple[bool, int]:
    group = _group(item)
    rank = GROUP_ORDER.index(group) if group in GROUP_ORDER else (-1 if group else len(GROUP_ORDER))
    return bool(LATE_FIXTURES & _fixtures(item)), rank


def _fixtures(item: pytest.Item) -> frozenset[str]:
    return frozenset(getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under integration/ is marked ``integration`` (a pytestmark in a
    conftest marks nothing). Under ``--dist loadgroup`` each group runs on one worker:
    ``booted`` shares the session's booted host, ``nvcc`` the session's builds;
    ``nvcc-own`` holds the tests that build a module of their own (staleness, overlap,
    a SIGKILLed warm-up), so that at most one of theirs runs beside the session's.
    A test that names its own group keeps it: the demo boots its own host and builds
    its own module, shares nothing, and so runs beside the ``booted`` group instead
    of adding its 460 s to that one worker.
    Groups and the ungrouped rest on three workers: the busiest worker ends
    the run, and while one group held every build, its worker was busy 1424 s of the
    phase's 1435."""
    here = Path(__file__).parent / "integration"
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("xdist_group"):
            pass
        elif item.get_closest_marker("booted"):
            item.add_marker(pytest.mark.xdist_group("booted"))
        elif BUILD_FIXTURES & _fixtures(item):
            item.add_marker(pytest.mark.xdist_group("nvcc"))
        elif item.get_closest_marker("precompile"):
            item.add_marker(pytest.mark.xdist_group("nvcc-own"))
    items.sort(key=_schedule_rank)


# Seconds each xdist worker and each group spent in tests (set-up, call and teardown):
# the busiest worker is the run's critical path, the number to cut.
BUSY: dict[str, dict[str, float]] = {"worker": {}, "group": {}}
_GROUP_SUFFIX = re.compile(r"@([\w-]+)$")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set by xdist on the controller
    gateway = getattr(node, "gateway", None)
    if gateway is None:
        return
    grouped = _GROUP_SUFFIX.search(report.nodeid)  # xdist's "@group", not an "@" in a param id
    group = grouped.group(1) if grouped else "(no group)"
    for kind, key in (("worker", str(gateway.id)), ("group", group)):
        BUSY[kind][key] = BUSY[kind].get(key, 0.0) + report.duration


def left_in_user_caches() -> list[str]:
    """What appeared in the user's own JIT caches since the run began."""
    return sorted(path for top, before in _BEFORE.items() for path in _entries(top) - before)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput") or not _BEFORE:
        return
    left = left_in_user_caches()
    if left:
        session.config.stash[_LEFT] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_LEFT = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(_LEFT, [])
    if left:
        terminalreporter.section("the run wrote into the user's own JIT caches", red=True)
        terminalreporter.write_line(
            "A test ran a library with its cache unpinned; pin it under the test's own "
            "directory (tests/unit/conftest.py, pinned_caches in tests/integration/conftest.py):"
        )
        for path in left[:20]:
            terminalreporter.write_line(f"  {path}")
    if BUSY["worker"]:
        terminalreporter.section("busy seconds per worker and per group")
        for kind, table in BUSY.items():
            for key, secs in sorted(table.items(), key=lambda kv: -kv[1]):
                terminalreporter.write_line(f"{kind} {key}: {secs:.0f} s")
    if not MEASURED:
        return
    terminalreporter.section("measured on the way")
    for what, values in MEASURED.items():
        terminalreporter.write_line(f"{what}: {', '.join(values)}")
