"""A pulled bundle proves it was used, or says which cache rebuilt (issue 39, part 4).

Through the real registry: a build host's bundle (FlashInfer's real build, no Triton
cache) is pulled by the daemon's warm-up into a wiped node. At READY the warm-up
lists the caches again (``Warmup.check_bundle``). First nothing was built since the
pull: ``effective`` true. Then the stand-in SGLang server, started as a process with
the node's ``TRITON_CACHE_DIR``, serves a batch whose Triton kernel the bundle lacks,
and compiles it as SGLang would: ``effective`` false on /status and in the metrics,
naming triton and the kernel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fleet_registry import RegistryProcess
from k26dev.ports import free_port
from supervisor.adapters.metrics import build_registry
from tests.waiting import wait_until

from .test_registry import Node, warmup

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def standin(node: Node, tmp_path: Path) -> Iterator[str]:
    """The stand-in SGLang server, a process compiling into the node's Triton cache."""
    port = free_port()
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(node.triton),
        "PYTHONPATH": f"{ROOT / 'devtools'}:{ROOT}",
    }
    log = (tmp_path / "standin.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "k26dev.standin", "--port", str(port),
         "--triton-compile-seconds", "0", "--load-seconds", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(f"{url}/health") == 200 or None, 30, "the stand-in's /health")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except OSError:
        return None


def _generate(url: str, prompts: list[list[int]]) -> None:
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 2, "temperature": 0.7}}
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def _metrics(board: object) -> str:
    from prometheus_client import generate_latest

    return generate_latest(build_registry(board)).decode()  # type: ignore[arg-type]


async def test_a_bundle_that_did_not_prevent_builds_is_reported_not_effective(
    node: Node, registry_proc: RegistryProcess, standin: str
) -> None:
    node.build.restore()  # the build host's FlashInfer cache; no Triton cache at all
    pushed = node.push(registry_proc.url)
    node.wipe()
    warm, board = warmup(node, registry_proc.url)
    outcome = await warm.ensure(recheck=False, patch_allowed=False)
    assert outcome.ok and outcome.built == (), outcome.error  # pulled: nothing built
    use = board.bundle
    assert use is not None and use.digest == pushed["digest"] and use.effective is None
    text = _metrics(board)
    verdicts = [
        ln
        for ln in text.splitlines()
        if ln.startswith(("k26_bundle_effective", "k26_bundle_rebuilt"))
    ]
    assert verdicts == []  # no verdict before a READY
    assert 'k26_bundle_pulls_total{result="installed"} 1.0' in text
    assert 'k26_bundle_pulls_total{result="refused"} 0.0' in text
    # Pushed moments ago: the real bundle's created_at gives its age at the pull.
    age = re.search(
        rf'^k26_bundle_age_at_pull_seconds{{digest="{pushed["digest"]}"}} (\S+)$', text, re.M
    )
    assert age is not None and 0.0 <= float(age.group(1)) < 600, text

    # READY with nothing built since the pull: the bundle was used.
    judged = await warm.check_bundle("sglang-k26.service")
    assert judged is not None and judged.effective is True and judged.rebuilt == ()
    assert f'k26_bundle_effective{{digest="{pushed["digest"]}"}} 1.0' in _metrics(board)

    # The server compiles a Triton kernel the bundle does not carry (a batch of 3).
    _generate(standin, [[101, 352, 352], [102, 352, 352], [103, 352, 352]])
    wait_until(lambda: any(node.triton.rglob("*.cubin")) or None, 30, "a Triton compile")
    judged = await warm.check_bundle("sglang-k26-eagle3.service")
    assert judged is not None and judged.effective is False
    (rebuilt,) = judged.rebuilt
    assert rebuilt.cache == "triton" and rebuilt.files > 0, judged
    assert any(k.startswith("get_num_kv_splits_triton") for k in rebuilt.kernels), rebuilt
    shown = board.snapshot().to_json()["bundle"]
    assert shown["effective"] is False and shown["rebuilt"][0]["cache"] == "triton"
    assert shown["checked_units"] == ["sglang-k26.service", "sglang-k26-eagle3.service"]
    text = _metrics(board)
    assert f'k26_bundle_effective{{digest="{pushed["digest"]}"}} 0.0' in text
    assert f'k26_bundle_rebuilt_files{{cache="triton",digest="{pushed["digest"]}"}}' in text
    # It never turns back: a later READY that finds nothing new keeps it false.
    again = await warm.check_bundle("sglang-k26.service")
    assert again is not None and again.effective is False
