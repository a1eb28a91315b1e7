"""The integration tests' xdist groups reach xdist: one worker per group.

``scripts/dev.sh test`` runs the integration tests with ``--dist loadgroup``; the
groups (tests/conftest.py) keep one booted host and one set of session builds per
run. If xdist ever stops honouring them, every worker boots and builds its own,
and the suite's time multiplies without a single failure: this test fails instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import GROUP_ORDER

ROOT = Path(__file__).resolve().parents[2]


def test_tests_of_one_group_run_on_one_worker(tmp_path: Path) -> None:
    seen = tmp_path / "seen.txt"
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    )
    (tmp_path / "test_groups.py").write_text(
        textwrap.dedent(
            f"""\
            import os
            import pytest

            def _note(request):
                worker = os.environ.get("PYTEST_XDIST_WORKER")
                with open({str(seen)!r}, "a") as f:
                    f.write(f"{{request.node.nodeid}} {{worker}}\\n")

            @pytest.mark.booted
            @pytest.mark.parametrize("i", range(6))
            def test_booted(i, request):
                _note(request)

            @pytest.fixture
            def sampling_build():
                return None

            @pytest.mark.precompile
            @pytest.mark.parametrize("i", range(6))
            def test_nvcc(i, request, sampling_build):
                _note(request)

            @pytest.mark.precompile
            @pytest.mark.parametrize("i", range(6))
            def test_nvcc_own(i, request):
                _note(request)

            @pytest.mark.booted
            @pytest.mark.precompile
            @pytest.mark.xdist_group("demo")
            @pytest.mark.parametrize("i", range(1))
            def test_demo(i, request, sampling_build):
                _note(request)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *_integration_flags(),
         "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore::pytest.PytestUnknownMarkWarning",
         str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in seen.read_text().splitlines()]
    assert len(rows) == 19, rows
    for group, count in (("booted", 6), ("nvcc", 6), ("nvcc-own", 6), ("demo", 1)):
        test = f"test_{group.replace('-', '_')}["
        mine = [(nodeid, worker) for nodeid, worker in rows if test in nodeid]
        assert len(mine) == count, rows
        assert all(nodeid.endswith(f"@{group}") for nodeid, _ in mine), mine
        assert len({worker for _, worker in mine}) == 1, mine
    # The schedule (tests/conftest.py GROUP_ORDER): the demo's worker takes nvcc too;
    # booted and nvcc-own each start on a worker of their own.
    worker = {g: next(w for n, w in rows if n.endswith(f"@{g}")) for g in GROUP_ORDER}
    assert worker["demo"] == worker["nvcc"], rows
    # Handed out at the start, not once some group has drained.
    assert next(n for n, w in rows if w == worker["demo"]).endswith("@demo"), rows
    assert len({worker["demo"], worker["booted"], worker["nvcc-own"]}) == 3, rows


def _integration_flags() -> list[str]:
    """The xdist flags scripts/dev.sh runs the integration tests with."""
    text = (ROOT / "scripts" / "dev.sh").read_text()
    match = re.search(r'run_pytest -m integration (.*) "\$@"', text)
    assert match is not None, "scripts/dev.sh: no integration pytest line"
    return match.group(1).split()


def test_tests_that_need_a_downloading_venv_come_last(tmp_path: Path) -> None:
    """On a fresh machine serving-0.2 and serving-0.7.0-cu128 are still downloading
    when the integration tests start: the tests that need them are collected last."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    )
    (tmp_path / "test_order.py").write_text(
        textwrap.dedent(
            """\
            import pytest

            @pytest.fixture
            def serving_02():
                return None

            @pytest.fixture
            def serving_070_cu128():
                return None

            def test_a(serving_02):
                pass

            def test_b():
                pass

            def test_c(serving_070_cu128):
                pass

            def test_d():
                pass
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.rpartition("::")[2] for line in done.stdout.splitlines() if "::" in line]
    assert order == ["test_b", "test_d", "test_a", "test_c"], done.stdout
