"""The shipped unit files: `systemd-analyze verify`, and the design they encode.

Each unit is the shipped template followed by the drop-in that
`k26-supervisor units configure` renders for it (``core/unit_values``: only the
documented @PLACEHOLDER@s are filled in, after a reset of each Exec*= line), as
systemd reads the two together, in a scratch root that also holds a copy of the
host's vendor units and stand-ins for the two executables, so `verify --root`
checks the ExecStart paths as well as the syntax. Unknown keys are only warnings
to systemd, so any stderr line that names our unit counts as a failure too.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.core import unit_values

SOURCE = Path(__file__).resolve().parents[3]
UNITS = ("k26-supervisor.service", "sglang-k26.service", "sglang-k26-eagle3.service")
VALUES = {
    "SERVING_VENV": "/srv/serving-venv",
    "MODEL_PATH": "/srv/models/k26",
    "DRAFT_MODEL_PATH": "/srv/models/k26-eagle3",
    "CUDA_ARCH": "12.0",
}


UNIT_DIR = "/lib/systemd/system"  # where the Debian package installs them
VENV = "/opt/k26-supervisor/venv"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is needed by these tests (Debian: apt install systemd)")
    return path


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values in order (keys may repeat), continuations joined; an
    empty value resets the key's list, as systemd does."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        if value.strip():
            current.setdefault(key.strip(), []).append(value.strip())
        else:
            current[key.strip()] = []
    return sections


def dropin(name: str, values: dict[str, str] = VALUES) -> str:
    """What `k26-supervisor units configure` writes for ``name`` ("" when nothing)."""
    template = (SOURCE / "units" / name).read_text()
    if not unit_values.placeholders_in(template):
        return ""
    return unit_values.render_dropin(name, template, values, f"{UNIT_DIR}/{name}")


def rendered(name: str, values: dict[str, str] = VALUES) -> str:
    """The unit as systemd reads it: the template, then the drop-in's [Service]."""
    return (SOURCE / "units" / name).read_text().rstrip("\n") + "\n\n" + dropin(name, values)


def make_root(path: Path, units: dict[str, str]) -> Path:
    """A tree `systemd-analyze verify --root` can load our units from."""
    shutil.copytree("/usr/lib/systemd/system", path / "usr/lib/systemd/system", symlinks=True)
    unit_dir = path / UNIT_DIR.lstrip("/")
    unit_dir.mkdir(parents=True)
    for name, text in units.items():
        (unit_dir / name).write_text(text)
    for executable in (
        f"{VENV}/bin/k26-supervisor",
        f"{VALUES['SERVING_VENV']}/bin/python",
    ):
        stub = path / executable.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return path


def verify_problems(root: Path, unit: str) -> list[str]:
    done = subprocess.run(
        [
            tool("systemd-analyze"),
            "verify",
            "--man=no",
            "--recursive-errors=no",
            f"--root={root}",
            unit,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [line for line in done.stderr.splitlines() if unit in line]
    if done.returncode != 0:
        problems.append(f"exit status {done.returncode}: {done.stderr.strip()}")
    return problems


@pytest.fixture(scope="module")
def shipped_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_root(tmp_path_factory.mktemp("root"), {name: rendered(name) for name in UNITS})


@pytest.mark.parametrize("unit", UNITS)
def test_shipped_unit_passes_systemd_analyze_verify(shipped_root: Path, unit: str) -> None:
    assert verify_problems(shipped_root, unit) == []


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (lambda text: text.replace("[Service]", "[Service]\nRestartt=no"), "Unknown key"),
        (lambda text: text.replace("/srv/serving-venv/bin/python", "/srv/nowhere/python"), "exit"),
        (lambda text: text.replace("Type=exec", "Type=sometimes"), "sometimes"),
    ],
    ids=["unknown-key", "missing-executable", "bad-value"],
)
def test_verify_catches_a_broken_unit(
    tmp_path: Path, breakage: Callable[[str], str], expected: str
) -> None:
    broken = breakage(rendered("sglang-k26.service"))
    root = make_root(tmp_path, {"sglang-k26.service": broken})
    problems = verify_problems(root, "sglang-k26.service")
    assert any(expected in problem for problem in problems), problems


def test_every_placeholder_is_documented_and_rendered() -> None:
    docs = (SOURCE / "docs/units.md").read_text()
    for name in UNITS:
        template = (SOURCE / "units" / name).read_text()
        for placeholder in re.findall(r"@([A-Z][A-Z0-9_]*)@", template):
            assert placeholder in unit_values.PLACEHOLDERS, f"{name}: unknown @{placeholder}@"
            assert f"@{placeholder}@" in docs, f"docs/units.md does not explain @{placeholder}@"
        assert not re.search(r"@[A-Z][A-Z0-9_]*@", dropin(name)), name
        # What systemd runs names no placeholder: the drop-in overrides every line that does.
        for section in parse_unit(rendered(name)).values():
            for key, lines in section.items():
                if key == "Environment":
                    env = dict(line.split("=", 1) for line in lines)
                    lines = list(env.values())
                assert not any(re.search(r"@[A-Z][A-Z0-9_]*@", v) for v in lines), (name, key)


def test_supervisor_hardening_scores_ok(shipped_root: Path) -> None:
    """`systemd-analyze security` exposure at most 2.5 (it is 1.9 as shipped)."""
    unit = shipped_root / UNIT_DIR.lstrip("/") / "k26-supervisor.service"
    done = subprocess.run(
        [
            tool("systemd-analyze"),
            "security",
            "--offline=yes",
            "--threshold=25",
            f"--root={shipped_root}",
            f"/{unit.relative_to(shipped_root)}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout.splitlines()[-1:]


# --- the design the units encode ---------------------------------------------------


def units() -> dict[str, dict[str, dict[str, list[str]]]]:
    return {name: parse_unit(rendered(name)) for name in UNITS}


def test_sglang_units_leave_restarts_to_the_supervisor_and_exclude_each_other() -> None:
    parsed = units()
    autoregressive, eagle = parsed["sglang-k26.service"], parsed["sglang-k26-eagle3.service"]
    for unit in (autoregressive, eagle):
        assert unit["Service"]["Restart"] == ["no"]
        assert "Install" not in unit  # started by the supervisor only
        assert unit["Service"]["OOMPolicy"] == ["stop"]
    assert "sglang-k26-eagle3.service" in autoregressive["Unit"]["Conflicts"][0].split()
    assert "sglang-k26.service" in eagle["Unit"]["Conflicts"][0].split()
    # Conflicts= alone does not order the stop before the start (GPUs still busy).
    orderings = " ".join(eagle["Unit"].get("After", []) + autoregressive["Unit"].get("After", []))
    assert "sglang-k26.service" in orderings.split() or "sglang-k26-eagle3.service" in orderings


def test_sglang_exec_start_lines() -> None:
    parsed = units()
    for name in ("sglang-k26.service", "sglang-k26-eagle3.service"):
        argv = parsed[name]["Service"]["ExecStart"][0].split()
        assert argv[:3] == [f"{VALUES['SERVING_VENV']}/bin/python", "-m", "sglang.launch_server"]
        assert argv[argv.index("--tp-size") + 1] == "8"
        assert "--attention-backend" in argv
        assert argv[argv.index("--sampling-backend") + 1] == "${SGLANG_SAMPLING_BACKEND}"
        assert argv[argv.index("--model-path") + 1] == VALUES["MODEL_PATH"]
        # FlashInfer 0.6 runs ninja on every module load, warm or not (the H200 run):
        # the serving venv's bin, where pip puts it, comes first on the unit's PATH.
        env = dict(line.split("=", 1) for line in parsed[name]["Service"]["Environment"])
        assert env["PATH"].split(":")[0] == f"{VALUES['SERVING_VENV']}/bin"
        assert "/usr/bin" in env["PATH"].split(":")
    eagle = parsed["sglang-k26-eagle3.service"]["Service"]["ExecStart"][0].split()
    assert eagle[eagle.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert eagle[eagle.index("--speculative-draft-model-path") + 1] == VALUES["DRAFT_MODEL_PATH"]


def test_supervisor_can_write_exactly_the_units_flashinfer_cache() -> None:
    parsed = units()
    supervisor = parsed["k26-supervisor.service"]["Service"]
    writable = {path.lstrip("-") for line in supervisor["ReadWritePaths"] for path in line.split()}
    for name in ("sglang-k26.service", "sglang-k26-eagle3.service"):
        service = parsed[name]["Service"]
        env = dict(line.split("=", 1) for line in service["Environment"])
        workspace = env["FLASHINFER_WORKSPACE_BASE"].replace("%C", "/var/cache")
        assert writable == {workspace} == {unit_values.WORKSPACE}
        assert workspace.startswith(f"/var/cache/{service['CacheDirectory'][0]}/")
        assert env["FLASHINFER_CUDA_ARCH_LIST"] == VALUES["CUDA_ARCH"]
        # The supervisor reaches the cache through the units' group.
        assert service["Group"][0] in supervisor["SupplementaryGroups"][0].split()
        assert service["UMask"] == supervisor["UMask"] == ["0007"]
    tmpfiles = (SOURCE / "deploy/tmpfiles.d/k26-supervisor.conf").read_text()
    assert re.search(rf"^d {re.escape(workspace)}\s+2770 ", tmpfiles, re.MULTILINE)


def test_pytorch_fallback_file_is_where_the_supervisor_may_write() -> None:
    parsed = units()
    runtime = parsed["k26-supervisor.service"]["Service"]["RuntimeDirectory"][0].split()
    for name in ("sglang-k26.service", "sglang-k26-eagle3.service"):
        (env_file,) = parsed[name]["Service"]["EnvironmentFile"]
        assert env_file.startswith("-/run/")  # optional: absent means flashinfer
        assert str(Path(env_file.lstrip("-")).parent).removeprefix("/run/") in runtime


def test_supervisor_lifecycle_settings() -> None:
    service = units()["k26-supervisor.service"]["Service"]
    assert service["Type"] == ["notify"]
    assert service["Restart"] == ["on-failure"]
    assert service["WatchdogSec"] and service["TimeoutStartSec"] == ["15min"]
    assert service["User"] == ["k26-supervisor"]
    assert service["CapabilityBoundingSet"] == ["CAP_SYSLOG"]
    assert service["DeviceAllow"] == ["/dev/kmsg r"]
    # Each user's HOME is its unit's CacheDirectory=, the one place it may write.
    sysusers = (SOURCE / "deploy/sysusers.d/k26-supervisor.conf").read_text()
    for name, user in (
        ("k26-supervisor.service", "k26-supervisor"),
        ("sglang-k26.service", "sglang-k26"),
    ):
        (row,) = [
            shlex.split(line) for line in sysusers.splitlines() if line.startswith(f"u {user} ")
        ]
        cache = units()[name]["Service"]["CacheDirectory"][0]
        assert row[4] == f"/var/cache/{cache}", user


# --- the polkit rule -----------------------------------------------------------------

# Its decisions are proven against the real polkitd on a booted host
# (tests/integration/test_booted_host.py); here, only its text.


def test_polkit_rule_names_the_shipped_units_and_stays_es5() -> None:
    rule = (SOURCE / "deploy/polkit/50-k26-supervisor.rules").read_text()
    code = "\n".join(line for line in rule.splitlines() if not line.lstrip().startswith("//"))
    named = set(re.findall(r'"([\w.-]+\.service)"', code))
    assert named == {"sglang-k26.service", "sglang-k26-eagle3.service"}
    # polkit's duktape interpreter is ES5: no let/const/arrow functions.
    assert not re.search(r"\b(let|const)\b|=>", code)
