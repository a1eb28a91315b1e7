"""deploy/install.py against a temporary root.

The installer runs from a scratch copy of the source tree, so the example config
can be stood in for when config/k26-supervisor.toml is not there, and as a real
subprocess, the way an operator runs it. systemd-sysusers and systemd-tmpfiles
really run (with --root); systemctl never does: the live-host test swaps the
command runner for a recorder.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
FLAGS = [
    "--skip-venv",
    "--serving-venv=/srv/serving-venv",
    "--model-path=/srv/models/k26",
    "--draft-model-path=/srv/models/k26-eagle3",
]
UNIT_DIR = "usr/local/lib/systemd/system"
INSTALLED_FILES = {
    f"{UNIT_DIR}/k26-supervisor.service": 0o644,
    f"{UNIT_DIR}/sglang-k26.service": 0o644,
    f"{UNIT_DIR}/sglang-k26-eagle3.service": 0o644,
    "usr/local/lib/sysusers.d/k26-supervisor.conf": 0o644,
    "usr/local/lib/tmpfiles.d/k26-supervisor.conf": 0o644,
    "etc/polkit-1/rules.d/50-k26-supervisor.rules": 0o644,
    "etc/k26-supervisor/config.toml": 0o644,
    "etc/k26-supervisor/install.conf": 0o644,
    "opt/k26-supervisor/share/doc/units.md": 0o644,
    "opt/k26-supervisor/share/config.example.toml": 0o644,
}
ACCOUNT_FILES = {"etc/passwd", "etc/group", "etc/shadow", "etc/gshadow", "etc/.pwd.lock"}
CACHE_DIRS = {"var/cache/sglang-k26": 0o750, "var/cache/sglang-k26/flashinfer": 0o2770}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """The parts of the tree the installer reads, with an example config."""
    src = tmp_path / "src"
    for name in ("units", "deploy"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "docs").mkdir()
    shutil.copy(REPO / "docs/units.md", src / "docs/units.md")
    shutil.copy(REPO / "pyproject.toml", src / "pyproject.toml")
    (src / "config").mkdir()
    example = REPO / "config/k26-supervisor.toml"
    config = example.read_text() if example.is_file() else "# stand-in example config\n"
    (src / "config/k26-supervisor.toml").write_text(config)
    return src


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


def run_installer(source: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(source / "deploy/install.py"), f"--root={root}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def installed(source: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = run_installer(source, root, *FLAGS, *extra)
    assert done.returncode == 0, done.stderr
    return done


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a write would change: type, mode, owner, mtime, content."""
    shot: dict[str, tuple[object, ...]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        content = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        shot[str(path.relative_to(root))] = (
            st.st_mode,
            st.st_uid,
            st.st_gid,
            st.st_mtime_ns,
            content,
        )
    return shot


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


def ids(path: Path) -> dict[str, int]:
    return {line.split(":")[0]: int(line.split(":")[2]) for line in path.read_text().splitlines()}


def test_fresh_install_puts_everything_in_place(source: Path, root: Path) -> None:
    done = installed(source, root)

    for relative, mode in INSTALLED_FILES.items():
        assert stat.S_IMODE((root / relative).stat().st_mode) == mode, relative
    units = (root / UNIT_DIR / "sglang-k26-eagle3.service").read_text()
    assert "--speculative-draft-model-path /srv/models/k26-eagle3" in units
    assert "ExecStart=/srv/serving-venv/bin/python -m sglang.launch_server" in units
    assert not re.search(r"@[A-Z_]+@", units)
    assert (root / "etc/k26-supervisor/config.toml").read_bytes() == (
        source / "config/k26-supervisor.toml"
    ).read_bytes()

    users, groups = ids(root / "etc/passwd"), ids(root / "etc/group")
    assert {"k26-supervisor", "sglang-k26"} <= users.keys()
    for relative, mode in CACHE_DIRS.items():
        st = (root / relative).stat()
        assert stat.S_IMODE(st.st_mode) == mode, relative
        assert (st.st_uid, st.st_gid) == (users["sglang-k26"], groups["sglang-k26"])

    assert "create  /usr/local/lib/systemd/system/k26-supervisor.service" in done.stdout
    assert "skipped systemctl daemon-reload: --root is" in done.stdout
    assert not (root / "opt/k26-supervisor/venv").exists()  # --skip-venv


def test_second_run_changes_nothing_and_says_so(source: Path, root: Path) -> None:
    installed(source, root)
    before = snapshot(root)

    # No placeholder flags: the values recorded by the first run are reused.
    done = run_installer(source, root, "--skip-venv")

    assert done.returncode == 0, done.stderr
    assert snapshot(root) == before
    assert "nothing to do, install already complete" in done.stdout
    assert "create" not in done.stdout and "update" not in done.stdout


def test_dry_run_writes_nothing(source: Path, root: Path) -> None:
    done = run_installer(source, root, *FLAGS, "--dry-run")

    assert done.returncode == 0, done.stderr
    assert list(root.iterdir()) == []
    assert "would create  /etc/polkit-1/rules.d/50-k26-supervisor.rules" in done.stdout
    assert "would create  system users sglang-k26, k26-supervisor" in done.stdout
    assert "none made" in done.stdout


def test_dry_run_of_a_change_names_it_and_writes_nothing(source: Path, root: Path) -> None:
    installed(source, root)
    before = snapshot(root)

    done = run_installer(
        source, root, "--skip-venv", "--model-path=/srv/models/k26-v2", "--dry-run"
    )

    assert done.returncode == 0, done.stderr
    assert snapshot(root) == before
    changed = sorted(
        line.split()[-1] for line in done.stdout.splitlines() if line.startswith("would ")
    )
    assert changed == [
        "/etc/k26-supervisor/install.conf",
        "/usr/local/lib/systemd/system/sglang-k26-eagle3.service",
        "/usr/local/lib/systemd/system/sglang-k26.service",
    ]


def test_uninstall_removes_everything_but_the_cache_and_the_users(source: Path, root: Path) -> None:
    installed(source, root)
    module = root / "var/cache/sglang-k26/flashinfer/.cache/flashinfer/0.7.4/120f/sampling.so"
    module.parent.mkdir(parents=True)
    module.write_bytes(b"\x7fELF")
    (root / "run/k26-supervisor/sampling").mkdir(parents=True)
    (root / "run/k26-supervisor/sampling/sglang-k26.service.env").write_text("X=pytorch\n")

    done = run_installer(source, root, "--uninstall")

    assert done.returncode == 0, done.stderr
    assert files(root) == ACCOUNT_FILES | {str(module.relative_to(root))}
    assert "kept /var/cache/sglang-k26 (the FlashInfer JIT cache)" in done.stdout
    assert not (root / "opt/k26-supervisor").exists()
    assert not (root / "etc/k26-supervisor").exists()

    again = run_installer(source, root, "--uninstall")
    assert again.returncode == 0 and "nothing to do, uninstall already complete" in again.stdout


def test_uninstall_keeps_a_config_the_operator_changed(source: Path, root: Path) -> None:
    installed(source, root)
    config = root / "etc/k26-supervisor/config.toml"
    config.write_text(config.read_text() + "# tuned by hand\n")

    done = run_installer(source, root, "--uninstall")

    assert done.returncode == 0, done.stderr
    assert config.is_file()
    assert "kept /etc/k26-supervisor/config.toml" in done.stdout


def test_purge_cache_removes_the_cache(source: Path, root: Path) -> None:
    installed(source, root)

    done = run_installer(source, root, "--uninstall", "--purge-cache")

    assert done.returncode == 0, done.stderr
    assert not (root / "var/cache/sglang-k26").exists()
    assert files(root) == ACCOUNT_FILES


def test_serving_venv_in_a_home_gets_a_read_only_home_drop_in(source: Path, root: Path) -> None:
    dropin = root / UNIT_DIR / "k26-supervisor.service.d/50-serving-venv-in-home.conf"
    installed(source, root, "--serving-venv=/home/ml/sglang-venv")
    assert "ProtectHome=read-only" in dropin.read_text()

    installed(source, root)  # moved to /srv: the drop-in goes away again
    assert not dropin.parent.exists()


def test_a_serving_interpreter_in_a_home_also_gets_the_drop_in(source: Path) -> None:
    install = load_installer(source)
    values = {"SERVING_VENV": "/opt/sglang/venv"}
    assert install.home_dropin(values, "/usr/bin/python3.12") is None
    dropin = install.home_dropin(values, "/root/.pyenv/versions/3.12.4/bin/python3.12")
    assert "ProtectHome=read-only" in dropin
    assert "/root/.pyenv/versions/3.12.4/bin/python3.12" in dropin


def test_a_config_that_contradicts_the_units_is_pointed_out(source: Path, root: Path) -> None:
    (root / "etc/k26-supervisor").mkdir(parents=True)
    (root / "etc/k26-supervisor/config.toml").write_text(
        '[flashinfer]\nworkspace = "/var/cache/k26/flashinfer"\narch = "12.0"\n'
        'python = "/srv/serving-venv/bin/python"\n'
    )
    done = installed(source, root)
    assert (
        "note: /etc/k26-supervisor/config.toml: flashinfer.workspace is "
        "'/var/cache/k26/flashinfer', the units use '/var/cache/sglang-k26/flashinfer'"
    ) in done.stdout
    assert "flashinfer.arch" not in done.stdout and "flashinfer.python" not in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-path=/models/my model"], "--model-path '/models/my model'"),
        (["--model-path=/models/%i"], "meaning of their own"),
        (["--model-path=models/k26"], "expected an absolute path"),
        (["--cuda-arch=sm_120"], "expected an arch such as 12.0"),
        (["--purge-cache"], "only goes with --uninstall"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    source: Path, root: Path, args: list[str], message: str
) -> None:
    done = run_installer(source, root, *FLAGS, *args)

    assert done.returncode == 64
    assert message in done.stderr
    assert list(root.iterdir()) == []


def test_first_install_needs_the_placeholder_values(source: Path, root: Path) -> None:
    done = run_installer(source, root, "--skip-venv")
    assert done.returncode == 64
    assert "--serving-venv is required" in done.stderr


def test_a_venv_is_not_built_for_another_root(source: Path, root: Path) -> None:
    done = run_installer(source, root, *[flag for flag in FLAGS if flag != "--skip-venv"])
    assert done.returncode == 64
    assert "pass --skip-venv" in done.stderr


# --- a live host, with systemctl recorded instead of run ------------------------------


def load_installer(source: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("k26_install_copy", source / "deploy/install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_live_host_reloads_systemd_only_when_units_change(source: Path, root: Path) -> None:
    install = load_installer(source)
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> None:
        calls.append(list(argv))
        if argv[0] != "systemctl":
            install.run_command(argv)

    assert install.main([f"--root={root}", *FLAGS], run=run, live=True) == 0
    assert ["systemctl", "daemon-reload"] in calls
    assert [c[0] for c in calls] == ["systemd-sysusers", "systemd-tmpfiles", "systemctl"]

    calls.clear()
    assert install.main([f"--root={root}", "--skip-venv"], run=run, live=True) == 0
    assert calls == []

    assert install.main([f"--root={root}", "--uninstall"], run=run, live=True) == 0
    assert calls == [
        ["systemctl", "disable", "--now", "k26-supervisor.service"],
        ["systemctl", "stop", "sglang-k26.service"],
        ["systemctl", "stop", "sglang-k26-eagle3.service"],
        ["systemctl", "daemon-reload"],
    ]
