"""The serving script's replies are checked where they are read."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.errors import UnavailableError
from supervisor.flashinfer import doctor, warm
from supervisor.flashinfer.protocol import Build, Identity, Probe, parse

from .conftest import IDENTITY, FakeCache


def test_a_probe_round_trips_to_the_json_the_script_sent(fake_cache: FakeCache) -> None:
    raw = fake_cache.raw()
    assert fake_cache.probe().recorded() == json.loads(json.dumps(raw))
    assert Identity.model_validate(IDENTITY).recorded() == IDENTITY


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda r: r.pop("identity"), "identity: Field required"),
        (lambda r: r["gate"].update(verdict="maybe"), "gate.verdict"),
        (lambda r: r["identity"]["nvcc"].update(size="big"), "identity.nvcc.size"),
        (lambda r: r.update(modules={"sampling": {"path": 3}}), "modules.sampling.path"),
        (lambda r: r.update(surprise=1), "surprise: Extra inputs are not permitted"),
        (lambda r: r["loads"].update({"/x.so": {"error": "no ok"}}), "loads./x.so.ok"),
    ],
)
def test_a_reply_out_of_step_is_unavailable_naming_the_field(
    fake_cache: FakeCache, edit: Any, named: str
) -> None:
    raw = fake_cache.raw()
    edit(raw)
    with pytest.raises(UnavailableError) as caught:
        parse(Probe, "probe", raw)
    message = str(caught.value)
    assert "k26_serving.py probe" in message and named in message
    assert "reinstall k26-supervisor" in message


def test_a_reply_that_is_not_an_object(fake_cache: FakeCache) -> None:
    with pytest.raises(UnavailableError, match=r"k26_serving.py build .*\(reply\)"):
        parse(Build, "build", ["ok"])


def fake_serving(tmp_path: Path, reply: object) -> Path:
    """An interpreter that answers every question with one fixed reply."""
    python = tmp_path / "python"
    line = "K26-RESULT " + json.dumps(reply)
    python.write_text(f"#!/bin/sh\necho '{line}'\n")
    python.chmod(0o755)
    return python


def test_doctor_on_a_reply_out_of_step_is_unknown_not_a_traceback(tmp_path: Path) -> None:
    python = fake_serving(tmp_path, {"identity": {"python": 1}})
    report = asyncio.run(doctor(python, "12.0", tmp_path / "ws"))
    assert report.status == "unknown"
    assert "k26_serving.py probe answered something" in report.problems[0]
    assert "identity.python" in report.problems[0]


def test_warm_on_a_reply_out_of_step_fails_clearly(tmp_path: Path) -> None:
    python = fake_serving(tmp_path, {"python": "/usr/bin/python3"})
    result = asyncio.run(warm(python, "12.0", tmp_path / "ws"))
    assert not result.ok
    assert "k26_serving.py identity answered something" in str(result.error)
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").rglob("*.so"))


def test_a_builds_own_verifying_probe_is_read_and_checked_as_a_probe(
    fake_cache: FakeCache,
) -> None:
    raw = fake_cache.raw()
    reply = parse(Build, "build", {"ok": True, "built": ["sampling"], "probe": raw})
    assert reply.probe is not None and reply.probe.recorded() == json.loads(json.dumps(raw))
    assert parse(Build, "build", {"ok": True, "built": []}).probe is None
    raw["gate"]["verdict"] = "maybe"
    with pytest.raises(UnavailableError, match=r"k26_serving.py build .*probe\.gate\.verdict"):
        parse(Build, "build", {"ok": True, "built": ["sampling"], "probe": raw})
