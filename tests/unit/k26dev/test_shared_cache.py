"""The Debian package's wheelhouse: its dependencies, never an in-place build of the clone."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from k26dev import shared_cache


def test_the_wheelhouse_wheels_the_dependencies_and_never_builds_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("K26_SERVING_CACHE", str(tmp_path / "cache"))
    calls: list[list[str]] = []
    monkeypatch.setattr(shared_cache, "_pip", calls.append)
    made = shared_cache.wheelhouse()
    assert made.parent == tmp_path / "cache" and made.is_dir()
    with open(shared_cache.REPO / "pyproject.toml", "rb") as f:
        wanted = tomllib.load(f)["project"]["dependencies"]
    wheels = [argv for argv in calls if argv[3] == "wheel"]  # pip [options] wheel ...
    assert len(wheels) == 1, calls
    wheel = wheels[0]
    assert wheel[wheel.index("--wheel-dir") + 2 :] == wanted
    # pip given the checkout builds it in place: build/ and an egg-info whose metadata
    # would shadow the editable install's (k26-dev's entry point) in later runs.
    repo = str(shared_cache.REPO)
    assert not [arg for argv in calls for arg in argv if arg.rstrip("/") == repo], calls
    ran = len(calls)
    assert shared_cache.wheelhouse() == made  # made once: the second call runs no pip
    assert len(calls) == ran
