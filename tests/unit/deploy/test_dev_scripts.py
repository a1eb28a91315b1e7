"""The set-up scripts change only what they say: no package service, no stub over a driver.

``scripts/tools.sh`` must give the tests Debian's promtool, prometheus and
alertmanager without installing a package (so no service can be enabled or
started); ``scripts/serving-venv.sh`` must put its stub libcuda on a library path
only where no NVIDIA driver is installed; ``scripts/dev.sh`` must not kill
anything by name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _dpkg_status(package: str) -> str:
    done = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status} ${Version}", package],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout if done.returncode == 0 else "not known to dpkg"


def _processes_named(name: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def test_tools_come_without_a_package_or_a_service(tmp_path: Path) -> None:
    packages = ("prometheus", "prometheus-alertmanager")
    before = {p: _dpkg_status(p) for p in packages}
    running = {n: _processes_named(n) for n in ("prometheus", "prometheus-alertmanager")}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "tools.sh"), str(tmp_path / "tools")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for tool in ("promtool", "prometheus", "alertmanager", "amtool"):
        version = subprocess.run(
            [str(tmp_path / "tools" / "bin" / tool), "--version"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert version.returncode == 0, (tool, version.stderr)
    assert {p: _dpkg_status(p) for p in packages} == before
    assert {n: _processes_named(n) for n in running} == running
    again = subprocess.run(
        ["bash", str(ROOT / "scripts" / "tools.sh"), str(tmp_path / "tools")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0 and "ready" in again.stdout


def _fake_venv(cache: Path) -> None:
    bin_dir = cache / "serving-0.7" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)


def _build_env(cache: Path, fake_bin: Path) -> dict[str, str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serving-venv.sh"), "env", "0.7"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **os.environ,
            "K26_SERVING_CACHE": str(cache),
            "PATH": f"{fake_bin}:{os.environ['PATH']}",
        },
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "no-driver"])
def test_the_stub_libcuda_is_only_for_a_host_without_a_driver(tmp_path: Path, driver: bool) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    listing = (
        "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
        if driver
        else ""
    )
    (fake_bin / "ldconfig").write_text(f"#!/bin/sh\nprintf '%b' '{listing}'\n")
    (fake_bin / "ldconfig").chmod(0o755)
    cache = tmp_path / "cache"
    _fake_venv(cache)
    env = _build_env(cache, fake_bin)
    for key in ("LIBRARY_PATH", "LD_LIBRARY_PATH"):
        assert ("k26-stub" in env[key]) is not driver, env
    assert env["CUDA_HOME"]


def test_dev_sh_kills_nothing_by_name_and_sweeps_only_its_own() -> None:
    text = (ROOT / "scripts" / "dev.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(pkill|killall)\b", code)
    assert "sandbox sweep" in code and "--registry" in code
    assert not re.search(r"apt-get install[^\n]*prometheus", code)
