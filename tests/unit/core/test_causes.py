"""Adding an exit cause touches one place, supervisor/core/causes.py, and these tests
say so: a member without its row (or a row without a member) fails here, and every
other list of causes is derived from the enum or checked against it."""

from __future__ import annotations

import re
from pathlib import Path

from supervisor.core import causes, status
from supervisor.core.causes import CAUSES, ExitCause, gpus_own_reason
from supervisor.core.classify import ExitCause as ClassifierCause

ROOT = Path(__file__).resolve().parents[3]


def test_every_cause_has_exactly_one_row() -> None:
    assert list(CAUSES) == list(ExitCause)  # the same members, in the enum's order


def test_the_classifier_the_board_and_the_metrics_use_the_one_enum() -> None:
    assert ClassifierCause is ExitCause
    assert tuple(ExitCause) == status.EXIT_CAUSES


def test_the_documented_spellings_are_the_enum_s() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = text.split("## Exit causes", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"`([a-z-]+)`", listed) == [c.value for c in ExitCause]
    table = text.split("| cause | means | what to do |", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"^\| `([a-z-]+)` \|", table, re.M)) == sorted(ExitCause)


def test_the_rows_say_what_the_machine_and_the_pair_policy_do() -> None:
    unhealable = {c for c, p in CAUSES.items() if p.unhealable}
    assert unhealable == {ExitCause.PORT_IN_USE, ExitCause.FLASHINFER_JIT, ExitCause.MODEL_LOAD}
    for cause in unhealable:
        assert "SIGUSR1" in (CAUSES[cause].unhealable or "")
    assert {c for c, p in CAUSES.items() if p.oom} == {ExitCause.OOM_KILL, ExitCause.GPU_OOM}
    assert {c for c, p in CAUSES.items() if p.recheck_arch} == {ExitCause.FLASHINFER_ARCH}
    assert "fabricmanager" in gpus_own_reason(ExitCause.GPU_DRIVER)
    # A cause with no text of its own (a death whose verdict needs a person) gets gpu-xid's.
    assert gpus_own_reason(ExitCause.SIGKILL) == causes.CAUSES[ExitCause.GPU_XID].gpus_own
