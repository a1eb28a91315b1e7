"""The last-resort pytorch sampling switch: a file the units read, present exactly when asked."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from supervisor.adapters import sampling_env
from supervisor.core.events import SamplingBackend

UNIT = "sglang-k26.service"


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "k26-supervisor" / "sampling"


async def test_the_file_exists_exactly_while_pytorch_is_wanted(runtime: Path) -> None:
    path = runtime / f"{UNIT}.env"
    assert sampling_env.env_path("user", UNIT) == path
    assert await sampling_env.current_backend("user", UNIT) is SamplingBackend.FLASHINFER
    assert await sampling_env.apply("user", UNIT, True) is True
    assert "SGLANG_SAMPLING_BACKEND=pytorch\n" in path.read_text()
    assert await sampling_env.current_backend("user", UNIT) is SamplingBackend.PYTORCH
    assert await sampling_env.apply("user", UNIT, True) is False  # already so: no write
    assert await sampling_env.apply("user", UNIT, False) is True
    assert not path.exists()
    assert await sampling_env.apply("user", UNIT, False) is False


def test_a_changed_file_is_rewritten(runtime: Path) -> None:
    runtime.mkdir(parents=True)
    (runtime / f"{UNIT}.env").write_text("SGLANG_SAMPLING_BACKEND=flashinfer\n")
    assert asyncio.run(sampling_env.apply("user", UNIT, True)) is True
    assert (runtime / f"{UNIT}.env").read_text() == sampling_env.ENV_TEXT


async def test_an_unwritable_directory_raises_oserror_for_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "k26-supervisor").write_text("a file where the directory should be")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(OSError):
        await sampling_env.apply("user", UNIT, True)


def test_the_system_bus_uses_the_units_runtime_directory() -> None:
    assert sampling_env.env_path("system", UNIT) == Path(f"/run/k26-supervisor/sampling/{UNIT}.env")
