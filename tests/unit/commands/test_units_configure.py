"""``k26-supervisor units configure`` against a temporary root.

The root holds the SGLang units where the Debian package puts them
(``/lib/systemd/system``); the command runs as a real subprocess, the way an
operator runs it, with ``--root`` (so systemctl never runs: the booted-host test
runs it for real, tests/integration/test_booted_install.py).
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.core import unit_values

REPO = Path(__file__).resolve().parents[3]
UNIT_DIR = "lib/systemd/system"
SGLANG = ("sglang-k26.service", "sglang-k26-eagle3.service")
FLAGS = [
    "--serving-venv=/srv/serving-venv",
    "--model-path=/srv/models/k26",
    "--draft-model-path=/srv/models/k26-eagle3",
]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A tree with the shipped units installed, the serving venv and the models."""
    path = tmp_path / "root"
    (path / UNIT_DIR).mkdir(parents=True)
    for name in (*SGLANG, "k26-supervisor.service"):
        shutil.copy(REPO / "units" / name, path / UNIT_DIR / name)
    for made in ("srv/serving-venv/bin", "srv/models/k26", "srv/models/k26-eagle3"):
        (path / made).mkdir(parents=True)
    (path / "srv/serving-venv/bin/python").write_text("")
    return path


def configure(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "units", "configure", f"--root={root}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def configured(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = configure(root, *args)
    assert done.returncode == 0, done.stderr
    return done


def dropin(root: Path, unit: str, name: str = unit_values.DROPIN) -> Path:
    return root / "etc/systemd/system" / f"{unit}.d" / name


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a write would change: type, mode, mtime, content."""
    shot: dict[str, tuple[object, ...]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        content = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        shot[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, content)
    return shot


def test_first_run_writes_one_drop_in_per_sglang_unit(root: Path) -> None:
    before = {p: (root / UNIT_DIR / p).read_text() for p in SGLANG}
    done = configured(root, *FLAGS)
    for unit in SGLANG:
        assert f"create  /etc/systemd/system/{unit}.d/{unit_values.DROPIN}" in done.stdout
        text = dropin(root, unit).read_text()
        assert "ExecStart=\nExecStart=/srv/serving-venv/bin/python -m sglang.launch_server" in text
        assert "--model-path /srv/models/k26" in text
        assert "Environment=FLASHINFER_CUDA_ARCH_LIST=12.0" in text
        assert "@" not in text.replace("--speculative", "")  # no placeholder left
        assert dropin(root, unit).stat().st_mode & 0o777 == 0o644
    assert "--speculative-draft-model-path /srv/models/k26-eagle3" in (
        dropin(root, "sglang-k26-eagle3.service").read_text()
    )
    # The package's files are never edited; the supervisor needs no drop-in here.
    assert {p: (root / UNIT_DIR / p).read_text() for p in SGLANG} == before
    assert not dropin(root, "k26-supervisor.service").exists()
    notes = [ln for ln in done.stdout.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: skipped systemctl daemon-reload: --root is {root}, not /"]


def test_second_run_changes_nothing_and_re_renders_from_the_record(root: Path) -> None:
    configured(root, *FLAGS, "--arch=9.0a")
    shot = snapshot(root)
    done = configured(root)  # no flags: the recorded values (as the package's upgrade runs it)
    assert "nothing to do" in done.stdout
    assert snapshot(root) == shot
    # A changed shipped unit: the drop-in follows, with the recorded values.
    unit = root / UNIT_DIR / "sglang-k26.service"
    unit.write_text(unit.read_text().replace("--tp-size 8", "--tp-size 4"))
    done = configured(root)
    assert f"update  /etc/systemd/system/sglang-k26.service.d/{unit_values.DROPIN}" in done.stdout
    text = dropin(root, "sglang-k26.service").read_text()
    assert "--tp-size 4" in text and "FLASHINFER_CUDA_ARCH_LIST=9.0a" in text


def test_one_flag_changes_one_value(root: Path) -> None:
    configured(root, *FLAGS)
    (root / "models/other").mkdir(parents=True)
    configured(root, "--model-path=/models/other")
    for unit in SGLANG:
        text = dropin(root, unit).read_text()
        assert "--model-path /models/other" in text and "/srv/serving-venv/bin/python" in text


def test_dry_run_writes_nothing(root: Path) -> None:
    shot = snapshot(root)
    done = configured(root, *FLAGS, "--dry-run")
    assert "would create  /etc/systemd/system/sglang-k26.service.d/" in done.stdout
    assert "none made" in done.stdout
    assert snapshot(root) == shot


def test_serving_venv_in_a_home_gets_a_read_only_home_drop_in(root: Path) -> None:
    supervisor = dropin(root, "k26-supervisor.service")
    configured(root, *FLAGS, "--serving-venv=/home/ml/sglang-venv")
    assert "ProtectHome=read-only" in supervisor.read_text()
    configured(root, "--serving-venv=/srv/serving-venv")  # moved: the drop-in goes again
    assert not supervisor.exists()


def test_a_serving_interpreter_in_a_home_also_gets_the_drop_in() -> None:
    values = {"SERVING_VENV": "/opt/sglang/venv"}
    assert unit_values.home_dropin(values, "/usr/bin/python3.12") is None
    text = unit_values.home_dropin(values, "/root/.pyenv/versions/3.12.4/bin/python3.12")
    assert text is not None and "ProtectHome=read-only" in text
    assert "/root/.pyenv/versions/3.12.4/bin/python3.12" in text


def test_a_config_that_contradicts_the_units_is_pointed_out(root: Path) -> None:
    (root / "etc/k26-supervisor").mkdir(parents=True)
    (root / "etc/k26-supervisor/config.toml").write_text(
        '[flashinfer]\nworkspace = "/var/cache/k26/flashinfer"\narch = "12.0"\n'
        'python = "/srv/serving-venv/bin/python"\n'
    )
    done = configured(root, *FLAGS)
    assert (
        "note: /etc/k26-supervisor/config.toml: flashinfer.workspace is "
        "'/var/cache/k26/flashinfer', the units use '/var/cache/sglang-k26/flashinfer'"
    ) in done.stdout
    assert "flashinfer.arch" not in done.stdout and "flashinfer.python" not in done.stdout


def test_missing_paths_are_noted_not_refused(root: Path) -> None:
    done = configured(root, *FLAGS, "--model-path=/models/not-yet")
    assert "note: --model-path /models/not-yet does not exist (yet)" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-path=/models/my model"], "--model-path '/models/my model'"),
        (["--model-path=/models/%i"], "meaning of their own"),
        (["--model-path=models/k26"], "expected an absolute path"),
        (["--arch=sm_120"], "expected an arch such as 12.0"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    root: Path, args: list[str], message: str
) -> None:
    shot = snapshot(root)
    done = configure(root, *FLAGS, *args)
    assert done.returncode == 64, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert snapshot(root) == shot


def test_first_run_needs_the_values(root: Path) -> None:
    done = configure(root)
    assert done.returncode == 64
    assert "--serving-venv" in done.stderr
    assert not (root / "etc").exists()


def test_without_the_package_it_says_so(tmp_path: Path) -> None:
    done = configure(tmp_path, *FLAGS)
    assert done.returncode == 69, done.stderr
    assert "install the k26-supervisor package first" in done.stderr
