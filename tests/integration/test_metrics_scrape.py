"""The real daemon's /metrics, as Prometheus would scrape it, and ``status`` against it.

The daemon runs against the sandboxed systemd with a real stand-in unit; the
scrape goes through ``promtool check metrics`` and is compared with the metric
table in docs/architecture.md (names, types and labels), so the doc, the code
and what Prometheus accepts cannot drift apart.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from k26dev import sandbox

from .conftest import StandinUnit
from .daemon_harness import Supervisor, unit_status, write_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Families keyed by arch have samples only once a warm-up ran; these tests disable it.
# Those keyed by a bundle's digest, only once a pull got a bundle (its age) or a
# pulled bundle met a READY (its verdict): no registry here.
ARCH_LABELLED = "arch"
DIGEST_LABELLED = "digest"
REGISTRY_PULLS = "k26_bundle_pulls_total"


def documented_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) from the 'Metric names' table of docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Metric names", 1)[1].split("\n## ", 1)[0]
    metrics: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"k26_[a-z0-9_]+", cells[0]):
            continue
        labels = tuple(label.strip() for label in cells[2].split(",") if label.strip())
        metrics[cells[0]] = (cells[1], labels)
    assert len(metrics) >= 15, f"metric table not found in {ARCHITECTURE}: {sorted(metrics)}"
    return metrics


@pytest.fixture
def ready_supervisor(
    bus_env: sandbox.SandboxInfo,
    standin_unit: Callable[..., StandinUnit],
    tmp_path: Path,
) -> Iterator[tuple[Supervisor, StandinUnit]]:
    unit = standin_unit()
    sup = Supervisor(bus_env, write_config(tmp_path, [(unit, "autoregressive", None)]), tmp_path)
    try:
        sup.notify.wait_for("READY=1", 90)
        # The start's timeline (k26_start_phase_seconds) follows READY: the daemon reads
        # the server's own account of the start off its loop, then records it.
        sup.wait_status(lambda s: unit_status(s, unit.name)["last_start"] is not None, 60)
        yield sup, unit
    finally:
        sup.stop()


def test_metrics_pass_promtool_and_match_the_documented_table(
    ready_supervisor: tuple[Supervisor, StandinUnit],
) -> None:
    sup, unit = ready_supervisor
    response = httpx.get(f"http://127.0.0.1:{sup.port}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text

    promtool = shutil.which("promtool")
    assert promtool, (
        "promtool is needed: scripts/tools.sh puts it in the shared cache (scripts/cache-dir.sh)"
    )
    checked = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert checked.returncode == 0, (
        f"promtool check metrics exited {checked.returncode}:\n"
        f"{checked.stdout}{checked.stderr}\n--- scraped /metrics ---\n{text}"
    )

    families: dict[str, Metric] = {f.name: f for f in text_string_to_metric_families(text)}

    def family(name: str) -> Metric:
        # The parser names a counter family without its _total suffix.
        found = families.get(name) or families.get(name.removesuffix("_total"))
        assert found is not None, f"{name} missing from /metrics:\n{text}"
        return found

    documented = documented_metrics()
    problems = []
    for name, (kind, labels) in documented.items():
        if f"# TYPE {name} " not in text and f"# TYPE {name.removesuffix('_total')} " not in text:
            problems.append(f"{name}: no '# TYPE' line")
            continue
        fam = family(name)
        if fam.type != kind:
            problems.append(f"{name}: type {fam.type}, documented {kind}")
        samples = fam.samples
        if ARCH_LABELLED in labels and not samples:
            continue  # no warm-up ran (flashinfer disabled): declared, no series yet
        if DIGEST_LABELLED in labels and not samples:
            continue  # no bundle was pulled: declared, no series (tests/integration/test_bundle_effective.py has them)
        if name == REGISTRY_PULLS and not samples:
            continue  # no registry configured: declared, no series (test_bundle_effective.py has them)
        if not samples:
            problems.append(f"{name}: no samples")
        for sample in samples:
            got = set(sample.labels) - {"le"}
            if got != set(labels):
                problems.append(f"{name}: sample {sample.name} labels {sorted(got)}, not {labels}")
                break
    assert not problems, "\n".join(problems) + f"\n--- scraped /metrics ---\n{text}"
    assert any(name.startswith("process_") for name in families), "no process_* metrics"

    # And the values say what READY=1 said.
    def value(name: str, **labels: str) -> float:
        for fam in families.values():
            for sample in fam.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        raise AssertionError(f"no sample {name}{labels}")

    assert value("k26_supervisor_ready") == 1.0
    assert value("k26_unit_ready", unit=unit.name) == 1.0
    assert value("k26_unit_state", unit=unit.name, state="ready") == 1.0
    assert value("k26_unit_state", unit=unit.name, state="loading") == 0.0
    assert value("k26_unit_not_ready_seconds", unit=unit.name) == 0.0
    assert value("k26_probe_latency_seconds_count", unit=unit.name) >= 1.0
    assert value("k26_build_info", version=sup.status()["supervisor"]["version"]) == 1.0


def test_status_command_against_the_running_daemon(
    ready_supervisor: tuple[Supervisor, StandinUnit],
) -> None:
    sup, unit = ready_supervisor
    url = f"http://127.0.0.1:{sup.port}"
    proc = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stderr == ""
    assert proc.stdout.startswith("supervisor: READY; warm-up: none")
    rows = [line for line in proc.stdout.splitlines() if line.startswith(unit.name + " ")]
    assert len(rows) == 1, proc.stdout
    assert rows[0].split()[:4] == [unit.name, "autoregressive", "ready", "yes"]
    assert re.search(r" ok \d+\.\d ms ", rows[0]), rows[0]

    as_json = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert as_json.returncode == 0, as_json.stderr
    assert '"ready":true' in as_json.stdout.replace(" ", "")
