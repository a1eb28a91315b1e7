"""The daemon's wiring where it needs no systemd: what ``_feed`` lets through.

An event the core refuses (``IllegalEvent``) changed nothing and is logged; any
other exception out of the core is a bug and must not be swallowed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from supervisor.adapters.config_file import load_config
from supervisor.core.events import Event, IllegalEvent, UnitActive, UnitState
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
