"""The daemon's wiring where it needs no systemd: what ``_feed`` lets through, and
which event an exit becomes.

An event the core refuses (``IllegalEvent``) changed nothing and is logged; any
other exception out of the core is a bug and must not be swallowed. An exit under
a stop job is the operator's or the supervisor's own doing, never a failure.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.adapters.config_file import load_config
from supervisor.adapters.exit_watch import ExplainedExit
from supervisor.core.classify import ExitCause, Verdict
from supervisor.core.events import (
    Event,
    IllegalEvent,
    UnitActive,
    UnitExited,
    UnitState,
    UnitStoppedByOperator,
    UnitStoppedBySupervisor,
)
from supervisor.core.exits import ExitObserved, StopBy
from supervisor.daemon import Daemon

CONFIG = """\
[supervisor]
bus = "user"
listen = "127.0.0.1:9436"  # never bound: the daemon is not started

[flashinfer]
enabled = false

[[units]]
name = "sglang-k26.service"
role = "autoregressive"
url = "http://127.0.0.1:30000"
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Daemon:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG)
    return Daemon(load_config(path), path)


class _Refusing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.seen: list[Event] = []

    def handle(self, unit: str, event: Event, now: float) -> tuple[()]:
        self.seen.append(event)
        raise self.exc


async def test_an_event_the_core_refuses_is_logged_and_changes_nothing(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    refusing = _Refusing(IllegalEvent(UnitState.STOPPED, UnitActive()))
    daemon.policy = refusing  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="k26.daemon"):
        await daemon._feed("sglang-k26.service", UnitActive())
    assert refusing.seen == [UnitActive()]
    assert "ignored UnitActive: UnitActive is not accepted in state stopped" in caplog.text
    assert daemon._ops == {} and daemon._timers == {}


@pytest.mark.parametrize("exc", [KeyError("state"), ValueError("bad"), RuntimeError("bug")])
async def test_any_other_exception_from_the_core_is_not_swallowed(
    daemon: Daemon, exc: Exception
) -> None:
    daemon.policy = _Refusing(exc)  # type: ignore[assignment]
    with pytest.raises(type(exc)):
        await daemon._feed("sglang-k26.service", UnitActive())


@pytest.mark.parametrize(
    ("stop_by", "expected"),
    [
        (None, UnitExited("sigkill")),
        ("operator", UnitStoppedByOperator("sigkill")),
        # Its own stop or restart: never counted as a failure, even when the news of
        # the exit comes after the next start was issued (seen in CI).
        ("supervisor", UnitStoppedBySupervisor("sigkill")),
    ],
)
async def test_an_exit_becomes_the_event_of_whoever_stopped_it(
    daemon: Daemon, stop_by: StopBy | None, expected: Event
) -> None:
    seen: list[Event] = []
    real = daemon.policy.handle

    def recording(unit: str, event: Event, now: float) -> Any:
        seen.append(event)
        return real(unit, event, now)

    daemon.policy.handle = recording  # type: ignore[method-assign]
    exit_ = ExitObserved(
        unit="sglang-k26.service",
        result="signal",
        exec_main_code=2,
        exec_main_status=9,
        exec_main_pid=4242,
        exited_at=datetime.now(UTC),
        control_group="/system.slice/sglang-k26.service",
        output_path="",
        output_offset=0,
        observed_at=1.0,
        stop_by=stop_by,
    )
    verdict = Verdict(ExitCause.SIGKILL, "killed by SIGKILL", (), None, 9)
    await daemon._on_exit(ExplainedExit(exit_, verdict))
    assert seen == [expected]


def test_the_record_of_accepted_bundles_is_in_the_state_dir_not_the_workspace(
    tmp_path: Path,
) -> None:
    """The warm-up's pulls keep rollback protection's record beside the learned shapes,
    in the daemon's state directory: the units' group can write the workspace."""
    path = tmp_path / "config.toml"
    workspace, state = tmp_path / "ws", tmp_path / "state"
    path.write_text(
        CONFIG.replace('bus = "user"', f'bus = "user"\nstate_dir = "{state}"').replace(
            "enabled = false", f'enabled = false\nworkspace = "{workspace}"'
        )
    )
    made = Daemon(load_config(path), path)
    assert made.config.flashinfer.workspace == workspace
    assert made.warmup.accepted_record == state / "k26-accepted-bundles.json"
    assert made.learned.path.parent == state
