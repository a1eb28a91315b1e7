"""The alert rules: promtool's own checks, plus proof that the tests cover every alert.

`promtool test rules` only checks what a test file asks for, so an alert nobody
tests passes silently. Coverage is therefore shown by mutation: with every alert
made unable to fire, promtool must report a failed "fires" check for each alert;
with every alert latched on for hours once it fired, it must report a failed
"quiet" check for each (some test expects it resolved afterwards).

The project venv has no YAML library; the rules file is read with a small
scanner for the layout it uses (`- alert:` items with `expr`, `labels`,
`annotations`), and the count it finds is checked against promtool's.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

SOURCE = Path(__file__).resolve().parents[3]
PROMETHEUS = SOURCE / "deploy/prometheus"
RULES = PROMETHEUS / "k26-supervisor.rules.yml"
TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
BLOCK_SCALAR = {"|", "|-", ">", ">-"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is needed by these tests: scripts/tools.sh puts it in the shared cache (scripts/cache-dir.sh)"
        )
    return subprocess.run(
        [path, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )


@dataclass
class Alert:
    name: str
    expr: str
    expr_lines: tuple[int, int]  # [start, end) in the file, the `expr:` line included
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def _mapping(lines: list[str]) -> dict[str, str]:
    """The keys of a nested block mapping (its first line sets the indentation); a
    block scalar's value is its lines joined with spaces."""
    if not lines:
        return {}
    indent = len(lines[0]) - len(lines[0].lstrip())
    found: dict[str, str] = {}
    key = None
    for line in lines:
        match = re.match(rf"^ {{{indent}}}([\w.-]+):\s*(.*)$", line)
        if match:
            key, value = match.group(1), match.group(2).strip()
            found[key] = "" if value in BLOCK_SCALAR else value.strip('"')
        elif key is not None and len(line) - len(line.lstrip()) > indent:
            found[key] = f"{found[key]} {line.strip()}".strip()
    return found


def _block(lines: list[str], key_line: int, end: int, key_indent: int) -> tuple[int, list[str]]:
    """The lines nested under the key on key_line, and where they stop."""
    stop = key_line + 1
    while stop < end and (
        not lines[stop].strip() or len(lines[stop]) - len(lines[stop].lstrip()) > key_indent
    ):
        stop += 1
    return stop, [line for line in lines[key_line + 1 : stop] if line.strip()]


def parse_alerts(text: str) -> list[Alert]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"^\s*- alert: \S+\s*$", line)]
    alerts = []
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        key_indent = lines[start].index("-") + 2
        keys: dict[str, tuple[int, str]] = {}
        for i in range(start + 1, end):
            match = re.match(rf"^ {{{key_indent}}}(\w+):\s*(.*)$", lines[i])
            if match:
                keys[match.group(1)] = (i, match.group(2))
        nested = {key: _block(lines, i, end, key_indent) for key, (i, _) in keys.items()}
        inline = keys["expr"][1]
        expr_end, expr_body = nested["expr"]
        alerts.append(
            Alert(
                name=lines[start].split("alert:")[1].strip(),
                expr=" ".join(line.strip() for line in expr_body)
                if inline in BLOCK_SCALAR
                else inline,
                expr_lines=(keys["expr"][0], expr_end),
                labels=_mapping(nested.get("labels", (0, []))[1]),
                annotations=_mapping(nested.get("annotations", (0, []))[1]),
            )
        )
    return alerts


ALERTS = parse_alerts(RULES.read_text())


def with_exprs(replacements: dict[str, str]) -> str:
    """The rules file with some alerts' expressions (by alert name) replaced."""
    lines = RULES.read_text().splitlines()
    # Bottom up, so the line numbers of the alerts still to do stay valid.
    for alert in sorted(ALERTS, key=lambda a: a.expr_lines, reverse=True):
        if alert.name in replacements:
            start, end = alert.expr_lines
            indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
            quoted = replacements[alert.name].replace("'", "''")  # YAML single-quoted
            lines[start:end] = [f"{indent}expr: '{quoted}'"]
    return "\n".join(lines) + "\n"


def failed_checks(done: subprocess.CompletedProcess[str]) -> set[tuple[str, str]]:
    """(alertname, "fire" or "quiet") for each alert check promtool reports failed."""
    found = re.findall(
        r"alertname: (\S+), time: \S+,\s*\n\s*exp:(\[\]|\[)", done.stdout + done.stderr
    )
    return {(name, "quiet" if exp == "[]" else "fire") for name, exp in found}


def run_tests_against(rules_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` with the shipped tests, against other rules."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / RULES.name).write_text(rules_text)
    for test in TESTS:
        shutil.copy(test, tmp_path / "tests" / test.name)
    return promtool("test", "rules", *[f"tests/{t.name}" for t in TESTS], cwd=tmp_path)


def load_lint() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "k26_metrics_lint", SOURCE / "deploy/metrics_lint.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lint = load_lint()


# --- promtool -----------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    (count,) = re.findall(r"SUCCESS: (\d+) rules found", done.stdout)
    assert int(count) == len(ALERTS), "the scanner missed rules that promtool sees"


def test_promtool_unit_tests_pass() -> None:
    assert TESTS, "no promtool test files in deploy/prometheus/tests/"
    done = promtool("test", "rules", *map(str, TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


# --- what every alert must carry --------------------------------------------------------


def test_the_issue_s_alerts_are_all_there() -> None:
    exprs = " ".join(alert.expr for alert in ALERTS)
    for wanted in (
        "oom-kill",
        "gpu-oom",
        "flashinfer-arch",
        "k26_unit_not_ready_seconds",
        "k26_unit_restarts_total",
        "k26_unit_failed",
        "k26_warmup_total",
        "k26_fallback_engaged",
        "k26_sampling_backend_pytorch",
        'up{job="k26-supervisor"}',
        'absent(up{job="k26-supervisor"})',
        "k26_unit_failure_info",
        "k26_jit_after_ready_total",
    ):
        assert wanted in exprs, wanted


# --- per cause (issue 13.3): what restarting heals, and what it does not ---------------


def _alert(name: str) -> Alert:
    (found,) = [alert for alert in ALERTS if alert.name == name]
    return found


def _causes_in(expr: str, label_op: str) -> set[str]:
    """The causes a ``cause<label_op>"a|b"`` matcher in ``expr`` lists."""
    (listed,) = re.findall(rf'cause{re.escape(label_op)}"([^"]+)"', expr)
    return set(listed.split("|"))


def test_each_cause_no_restart_heals_has_its_own_critical_alert() -> None:
    from supervisor.core.causes import CAUSES

    UNHEALABLE_CAUSES = {str(c) for c, p in CAUSES.items() if p.unhealable}
    GPUS_OWN = {str(c) for c, p in CAUSES.items() if p.gpus_own}

    will_not_heal = _alert("K26UnitWillNotHeal")
    needs_person = _alert("K26GpuXidNeedsPerson")
    healing, xid = _causes_in(will_not_heal.expr, "=~"), _causes_in(needs_person.expr, "=")
    assert healing | xid == set(UNHEALABLE_CAUSES) | set(GPUS_OWN) and not healing & xid
    # The Xid alert is the GPU's, and only for a hardware or driver Xid (needs_person):
    # a program fault's gpu-xid is restarted. gpu-driver (the host's driver stack) also
    # keeps the fallback off the GPUs, and K26UnitWillNotHeal says what to run for it.
    assert xid == {"gpu-xid"} and "k26_unit_needs_person == 1" in needs_person.expr
    assert "gpu-driver" in GPUS_OWN and "gpu-driver" in healing
    assert "nvidia-fabricmanager" in will_not_heal.annotations["description"]
    assert "needs a person" in needs_person.annotations["summary"]
    for alert in (will_not_heal, needs_person):
        assert alert.labels["severity"] == "critical"
        assert "SIGUSR1" in alert.annotations["description"]
        assert "$labels.summary" in alert.annotations["description"]


def test_the_failed_alert_leaves_exactly_those_causes_to_them() -> None:
    from supervisor.core.causes import CAUSES

    UNHEALABLE_CAUSES = {str(c) for c, p in CAUSES.items() if p.unhealable}

    failed = _alert("K26UnitFailed")
    assert _causes_in(failed.expr, "!~") == set(UNHEALABLE_CAUSES) | {"gpu-driver"}
    assert "unless on (job, instance, unit) k26_unit_needs_person == 1" in failed.expr
    assert "$labels.cause" in failed.annotations["summary"]
    assert "$labels.summary" in failed.annotations["description"]
    # The reset is SIGUSR1 to the daemon alone (its warm-up children must not get it).
    assert "--kill-whom=main --signal=SIGUSR1" in " ".join(
        failed.annotations["description"].split()
    )


def test_the_restart_loop_alert_names_what_restarts_heal() -> None:
    text = " ".join(_alert("K26UnitRestartLoop").annotations["description"].split())
    for cause in ("sigkill", "oom-kill", "gpu-oom", "nccl", "cuda-error"):
        assert cause in text, cause


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_alert_says_what_to_do(alert: Alert) -> None:
    assert alert.labels.get("severity") in {"critical", "warning"}
    assert alert.annotations.get("summary"), "no summary"
    assert alert.annotations.get("description"), "no description"


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_alert_queries_only_exported_metrics(alert: Alert) -> None:
    documented = lint.documented_metrics((SOURCE / "docs/architecture.md").read_text())
    unknown = {
        name for name in lint.metric_names(alert.expr) if not lint.is_known(name, documented)
    }
    assert unknown == set()


# --- coverage, by mutation ----------------------------------------------------------------
# Alerts do not read each other, so every alert is mutated at once and promtool's
# report says which checks failed, per alert.


@pytest.fixture(scope="module")
def never_firing(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    rules = with_exprs({alert.name: "vector(1) == 0" for alert in ALERTS})
    return failed_checks(run_tests_against(rules, tmp_path_factory.mktemp("never")))


@pytest.fixture(scope="module")
def latched(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    """Each alert, once it fired, stays on for 3 hours (longer than any test runs)."""
    rules = with_exprs({a.name: f"max_over_time(({a.expr})[3h:1m])" for a in ALERTS})
    return failed_checks(run_tests_against(rules, tmp_path_factory.mktemp("latched")))


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_some_test_expects_the_alert_to_fire(
    alert: Alert, never_firing: set[tuple[str, str]]
) -> None:
    assert (alert.name, "fire") in never_firing, "it may never fire and the tests still pass"


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_some_test_expects_the_alert_to_resolve(
    alert: Alert, latched: set[tuple[str, str]]
) -> None:
    assert (alert.name, "quiet") in latched, "it may stay firing and the tests still pass"


def test_the_rewriting_itself_changes_nothing(tmp_path: Path) -> None:
    done = run_tests_against(with_exprs({a.name: a.expr for a in ALERTS}), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_not_ready_alert_stays_quiet_for_standby_only_because_of_its_guard(tmp_path: Path) -> None:
    (not_ready,) = [alert for alert in ALERTS if alert.name == "K26UnitNotReady"]
    unguarded = not_ready.expr.split(" unless ")[0]
    assert unguarded != not_ready.expr
    done = run_tests_against(with_exprs({not_ready.name: unguarded}), tmp_path)
    assert ("K26UnitNotReady", "fire") in failed_checks(done)
    assert "sglang-k26-eagle3.service" in done.stderr  # the standby unit now alerts
