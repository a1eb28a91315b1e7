"""The operator holds file: atomic, survives a restart, bad content loses nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from supervisor.adapters.state_file import OperatorHolds

UNIT = "sglang-k26.service"
RUN = "ab" * 16


async def test_a_hold_is_saved_and_read_back_by_the_next_daemon(tmp_path: Path) -> None:
    path = tmp_path / "run" / "state.json"
    first = OperatorHolds(path)
    await first.load()
    await first.set(UNIT, RUN)
    assert json.loads(path.read_text()) == {"schema": 1, "operator_stopped": {UNIT: RUN}}
    second = OperatorHolds(path)
    assert await second.load() == {UNIT: RUN}
    assert second.holds(UNIT, RUN)
    assert not second.holds(UNIT, "cd" * 16)  # started again since: void
    await second.set(UNIT, None)
    assert json.loads(path.read_text())["operator_stopped"] == {}
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "content", ["{not json", '{"schema": 9, "operator_stopped": {}}', "[]", "\x00\x01"]
)
async def test_a_corrupt_file_holds_nothing_and_says_so(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    path.write_text(content)
    holds = OperatorHolds(path)
    with caplog.at_level(logging.ERROR, logger="k26.state"):
        assert await holds.load() == {}
    assert str(path) in caplog.text
    assert not holds.holds(UNIT, RUN)


async def test_an_unwritable_directory_keeps_the_hold_in_memory_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    holds = OperatorHolds(blocker / "state.json")
    with caplog.at_level(logging.ERROR, logger="k26.state"):
        await holds.set(UNIT, RUN)
    assert holds.holds(UNIT, RUN)
    assert "a supervisor restart would forget it" in caplog.text
