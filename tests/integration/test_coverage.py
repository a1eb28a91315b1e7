"""READY means the traffic works: the coverage warm-up before it, the JIT watch after it.

Real systemd (the sandbox), the real daemon, the stand-in compiling as SGLang 0.5.17
does on a real GPU (Triton- and inductor-like artifacts written on the first request
of a new shape: penalties, a new batch size, a prefix-cache hit), every JIT cache
pinned under the test's own directory. Each claim is shown both ways: without the
coverage warm-up a client's request compiles after READY and the watch says so;
with it, the same requests compile nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.adapters.coverage import play
from supervisor.core.coverage import CustomShape, ShapeContext, builtin_names, expand
from tests.measured import record

from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

DEADLINE_S = 60.0
# What clients send every day (the issue's list), played by the test as a client,
# plus bodies the coverage set does not send: other values, other batch sizes (as on
# the H200, where a batch of 12 compiled the EAGLE-3 draft kernels again after a
# ramp of powers of two had played 16).
CLIENT_SHAPES = ["default", "client-batch-12", "client-n6", "client-penalties",
                 "client-batch-3", "client-n3-top-logprobs"]  # fmt: skip


def _client(text: str | list[str], **params: Any) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": 4, **params}}


CLIENT_EXTRA = [
    CustomShape("client-batch-12", "/generate",
                _client([f"Lisbon weather {i}" for i in range(12)], temperature=0.9, top_p=0.7)),
    CustomShape("client-n6", "/generate", _client("Tell me a story", temperature=1.1, n=6)),
    CustomShape("client-penalties", "/generate", _client(
        "Repeat after me", temperature=0.6, repetition_penalty=1.3, frequency_penalty=0.4,
        presence_penalty=0.2)),
    CustomShape("client-batch-3", "/generate",
                _client("Three at once", temperature=0.5, top_k=3), concurrent=3),
    CustomShape("client-n3-top-logprobs", "/generate", {
        **_client("Why is the sky blue", temperature=0.8, n=3), "return_logprob": True,
        "top_logprobs_num": 3}),
]  # fmt: skip


def coverage_config(tmp: Path, unit: StandinUnit, section: str) -> Path:
    return write_config(
        tmp, [(unit, "autoregressive", None)], extra=f"\n{section}\n", coverage=None
    )


def files_in(unit: StandinUnit) -> set[Path]:
    return {p for p in unit.caches.rglob("*") if p.is_file()}


def client_matrix(url: str, prompt: str = "The capital of France is") -> Any:
    """Every default shape, sent as a client would after READY."""
    ctx = ShapeContext(prompt=prompt, long_prompt_tokens=1900)
    shapes = expand(CLIENT_SHAPES, CLIENT_EXTRA, ctx)
    return asyncio.run(play(url, shapes, timeout_s=60))


def jit_count(sup: Supervisor, unit: str) -> int:
    return int(unit_status(sup.status(), unit)["jit_after_ready"]["count"])


def metric(sup: Supervisor, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{want}}} in /metrics")


@pytest.mark.parametrize("server", ["autoregressive", "eagle3"])
def test_ready_only_after_every_shape_and_nothing_compiles_after_it(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
    server: str,
) -> None:
    eagle = ("--eagle3",) if server == "eagle3" else ()
    unit = standin_unit("--grammar-backend", "none", *eagle)
    sup = supervise(coverage_config(tmp_path, unit, "[coverage]\nenabled = true\n"))
    status = sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    sup.notify.wait_for("READY=1", 10)
    coverage = unit_status(status, unit.name)["coverage"]
    assert coverage["ok"] is True
    results = {s["name"]: s["result"] for s in coverage["shapes"]}
    assert set(results) == set(builtin_names())  # every shape of the default set
    # Refused by the server's own configuration: reported, not a failure.
    assert results.pop("json-schema") == "refused"
    refused = next(s for s in coverage["shapes"] if s["name"] == "json-schema")
    assert "--grammar-backend none" in refused["detail"]
    assert set(results.values()) == {"ok"}
    assert all(s["duration_ms"] > 0 for s in coverage["shapes"])
    log = sup.log.read_text()
    assert "coverage: unit=" in log and f"{len(builtin_names()) - 1} ok, 1 refused" in log
    # The warm-up compiled what the shapes need, before READY...
    before = files_in(unit)
    assert any(p.suffix == ".py" for p in before), before  # inductor (penalties)
    assert any("get_num_kv_splits_triton" in p.name for p in before), before
    assert any("write_req_to_token_pool_triton" in p.name for p in before), before
    if eagle:  # the draft path's kernels, one per batch-size variant the ramp played
        drafts = {p.parent for p in before if p.name == "assign_req_to_token_pool.json"}
        assert len(drafts) >= 5, drafts
    # Each shape says what it compiled (the probe before it compiled some too).
    compiled = {s["name"]: s["compiled"] for s in coverage["shapes"]}
    assert compiled["repetition-penalty"].get("inductor", 0) >= 1, compiled
    variants = [p for p in unit.cache("TRITON_CACHE_DIR").iterdir() if p.is_dir()]
    assert 0 < sum(c.get("triton", 0) for c in compiled.values()) <= len(variants), compiled
    assert compiled["json-schema"] == {}  # refused before it reached a forward
    assert "compiled: " in log
    penalty = {"unit": unit.name, "shape": "repetition-penalty", "cache": "inductor"}
    assert metric(sup, "k26_coverage_shape_compiled_entries", **penalty) >= 1
    # ...so the client's whole matrix after it compiles nothing, and the watch saw nothing.
    watched = unit_status(sup.status(), unit.name)["jit_after_ready"]["watched"]
    assert str(unit.cache("TRITON_CACHE_DIR")) in watched, watched
    report = client_matrix(unit.url)
    assert report.ok, report.summary()
    assert files_in(unit) == before
    assert jit_count(sup, unit.name) == 0
    assert metric(sup, "k26_jit_after_ready_total", unit=unit.name, cache="triton") == 0
    shape = metric(sup, "k26_coverage_shape_result", unit=unit.name, shape="json-schema",
                   result="refused")  # fmt: skip
    assert shape == 1.0
    assert metric(sup, "k26_coverage_duration_seconds", unit=unit.name) > 0
    # Its share of a start: the coverage warm-up against the rest (warm caches now).
    took = coverage["duration_s"]
    record(
        f"coverage warm-up, stand-in {server}, cold caches ({len(results) + 1} shapes), s",
        f"{took:.2f}",
    )


def test_without_the_coverage_warm_up_traffic_compiles_after_ready_and_is_reported(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    unit = standin_unit()
    sup = supervise(coverage_config(tmp_path, unit, "[coverage]\nenabled = false\n"))
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    assert unit_status(sup.status(), unit.name)["coverage"] is None
    sup.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)
    report = client_matrix(unit.url)
    assert report.ok, report.summary()  # the requests work; they compiled on the way
    status = sup.wait_status(lambda s: unit_status(s, unit.name)["jit_after_ready"]["count"] > 0)
    seen = unit_status(status, unit.name)["jit_after_ready"]
    caches = {a["cache"] for a in seen["latest"]}
    assert {"triton", "inductor"} <= caches, seen
    kernels = {a["kernel"] for a in seen["latest"]}
    assert "apply_scaling_penalties" in kernels or "apply_additive_penalties" in kernels, kernels
    log = sup.log.read_text()
    assert "JIT after READY: unit=" in log and "cache=inductor" in log
    assert metric(sup, "k26_jit_after_ready_total", unit=unit.name, cache="inductor") >= 1
    assert unit_status(sup.status(), unit.name)["state"] == "ready"  # reported, not failed


def test_a_cache_emptied_after_ready_is_reported_within_a_second(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
) -> None:
    """The forced case: READY with every cache warm, then the Triton cache emptied and
    one request of a covered shape: its kernel is compiled again, under traffic."""
    unit = standin_unit()
    sup = supervise(coverage_config(tmp_path, unit, "[coverage]\nenabled = true\n"))
    sup.wait_status(lambda s: unit_status(s, unit.name)["state"] == "ready", DEADLINE_S)
    sup.wait_status(lambda s: bool(unit_status(s, unit.name)["jit_after_ready"]["watched"]), 10)
    triton = unit.cache("TRITON_CACHE_DIR")
    shutil.rmtree(triton)
    body = {"text": "The capital of France is", "sampling_params": {"n": 4, "temperature": 0.8}}
    answer = httpx.post(f"{unit.url}/generate", json=body, timeout=30)
    assert answer.status_code == 200
    status = sup.wait_status(
        lambda s: unit_status(s, unit.name)["jit_after_ready"]["count"] > 0, timeout_s=5
    )
    first = unit_status(status, unit.name)["jit_after_ready"]["latest"][0]
    assert first["cache"] == "triton" and first["path"].startswith(str(triton)), first
    written = os.stat(first["path"]).st_mtime
    reported = datetime.fromisoformat(first["at"].replace("Z", "+00:00")).timestamp()
    lag = reported - written
    record("JIT watch: a Triton file written after READY to its /status entry, s", f"{lag:.3f}")
    assert lag < 1.0, lag
    # A restart of the unit is a new start: the watch stops, the coverage runs again.
    restarts = unit_status(status, unit.name)["restarts"]
    unit.systemctl("kill", "--signal=SIGKILL", unit.name)
    sup.wait_status(
        lambda s: (
            unit_status(s, unit.name)["state"] == "ready"
            and unit_status(s, unit.name)["restarts"] > restarts
        ),
        DEADLINE_S,
    )


@pytest.mark.parametrize(
    ("custom", "fails"),
    [
        # A shape of the operator's own, at an endpoint this server lacks (404).
        ('[[coverage.custom]]\nname = "chat"\nendpoint = "/v1/chat/completions"\n'
         'body = {model = "x", messages = [{role = "user", content = "hi"}]}\n', "chat"),
    ],
)  # fmt: skip
def test_a_shape_that_fails_keeps_the_unit_not_ready_naming_the_shape(
    standin_unit: Callable[..., StandinUnit],
    supervise: Callable[[Path], Supervisor],
    tmp_path: Path,
    custom: str,
    fails: str,
) -> None:
    well = standin_unit()  # serves, so start-up ends degraded and the daemon stays up
    unit = standin_unit()
    section = f'[coverage]\nshapes = ["greedy", "{fails}"]\n{custom}'
    config = write_config(
        tmp_path,
        [(unit, "autoregressive", None), (well, "autoregressive", None)],
        f"\n{section}",
        coverage=None,
    )
    config.write_text(
        config.read_text().replace(
            f'url = "{well.url}"\n', f'url = "{well.url}"\ncoverage = ["greedy"]\n'
        )
    )
    sup = supervise(config)
    status = sup.wait_status(
        lambda s: (
            unit_status(s, unit.name)["coverage"] is not None
            and unit_status(s, unit.name)["coverage"]["ok"] is False
        ),
        DEADLINE_S,
    )
    u = unit_status(status, unit.name)
    assert u["state"] != "ready" and u["ready"] is False
    failed = [s for s in u["coverage"]["shapes"] if s["result"] == "failed"]
    assert [s["name"] for s in failed] == [fails]
    assert "HTTP 404" in failed[0]["detail"], failed
    # The machine's reason says which shape and what the server answered.
    status = sup.wait_status(
        lambda s: f"coverage shape {fails} failed" in (unit_status(s, unit.name)["reason"] or ""),
        DEADLINE_S,
    )
    assert unit_status(status, well.name)["state"] == "ready"
