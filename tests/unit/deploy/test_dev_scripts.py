"""The set-up scripts change only what they say: no package service, no stub over a driver.

``scripts/tools.sh`` must give the tests Debian's promtool, prometheus,
alertmanager and docker-registry (the OCI registry of the bundle tests) without
installing a package (so no service can be enabled or
started); ``scripts/serving-venv.sh`` must put its stub libcuda on a library path
only where no NVIDIA driver is installed; ``scripts/dev.sh`` must not kill
anything by name.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until

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


@pytest.fixture(autouse=True)
def _not_this_runs_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's record of checked venvs (K26_SERVING_CHECKED, when scripts/dev.sh runs
    these tests) is for its real venvs: the fakes here never write into it."""
    monkeypatch.delenv("K26_SERVING_CHECKED", raising=False)


def _script(name: str, *args: str, cache: Path, timeout: float = 600, **env: str) -> Any:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "K26_SERVING_CACHE": str(cache), **env},
    )


def test_tools_come_without_a_package_or_a_service(tmp_path: Path) -> None:
    packages = ("prometheus", "prometheus-alertmanager", "docker-registry")
    before = {p: _dpkg_status(p) for p in packages}
    running = {n: _processes_named(n) for n in packages}
    cache = tmp_path / "cache"
    done = _script("tools.sh", cache=cache)
    assert done.returncode == 0, done.stderr
    tools = Path(_script("tools.sh", "path", cache=cache).stdout.strip())
    assert tools.parent == cache and tools.name.startswith("tools-")  # keyed by its versions
    for tool in ("promtool", "prometheus", "alertmanager", "amtool", "docker-registry"):
        version = subprocess.run(
            [str(tools / "bin" / tool), "--version"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert version.returncode == 0, (tool, version.stderr)
    assert {p: _dpkg_status(p) for p in packages} == before
    assert {n: _processes_named(n) for n in running} == running
    again = _script("tools.sh", cache=cache, timeout=60)
    assert again.returncode == 0 and "ready" in again.stdout
    # A tool that no longer runs is not trusted: the next run unpacks them again.
    (tools / "bin" / "promtool").unlink()
    (tools / "bin" / "promtool").symlink_to("/bin/false")
    mended = _script("tools.sh", cache=cache)
    assert mended.returncode == 0, mended.stderr
    assert (
        subprocess.run([str(tools / "bin" / "promtool"), "--version"], check=False).returncode == 0
    )


def _venv_path(cache: Path, **env: str) -> Path:
    done = _script("serving-venv.sh", "path", "0.7", cache=cache, **env)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def _fake_venv(cache: Path) -> None:
    bin_dir = _venv_path(cache) / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)


def test_each_serving_venv_is_keyed_by_its_exact_versions_outside_the_clone(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    venvs = {name: _script("serving-venv.sh", "path", name, cache=cache) for name in
             ("0.7", "0.2", "0.7.0-cu128")}  # fmt: skip
    paths = {name: Path(done.stdout.strip()) for name, done in venvs.items()}
    assert all(p.parent == cache for p in paths.values()), paths
    assert len({p.name for p in paths.values()}) == 3
    assert all(p.name.startswith(f"serving-{n}-") for n, p in paths.items()), paths
    # Another base Python (another exact version) is another venv, never the same one.
    other = tmp_path / "python3.11"
    other.write_text("#!/bin/sh\necho 3.11.99\n")
    other.chmod(0o755)
    assert _venv_path(cache, K26_BASE_PYTHON=str(other)) != paths["0.7"]
    # With no K26_SERVING_CACHE, the XDG cache or ~/.cache: never inside the clone.
    env = {k: v for k, v in os.environ.items() if k != "K26_SERVING_CACHE"}
    default = subprocess.run(
        ["bash", str(ROOT / "scripts" / "cache-dir.sh")],
        capture_output=True, text=True, check=True, env={**env, "XDG_CACHE_HOME": str(tmp_path)},
    ).stdout.strip()  # fmt: skip
    assert default == str(tmp_path / "k26-supervisor")


def test_a_venv_that_fails_its_import_check_is_rebuilt_never_trusted(tmp_path: Path) -> None:
    """A venv whose marker says it is complete but whose FlashInfer does not import."""
    cache = tmp_path / "cache"
    base = tmp_path / "python3.11"  # a base Python whose new venvs get a failing pip
    base.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -c ]; then echo 3.11.98; exit 0; fi\n'
        'mkdir -p "$3/bin" && ln -sf /bin/false "$3/bin/python"\n'
        'printf \'#!/bin/sh\\necho pip ran >&2\\nexit 3\\n\' > "$3/bin/pip"; chmod +x "$3/bin/pip"\n'
    )
    base.chmod(0o755)
    venv = _venv_path(cache, K26_BASE_PYTHON=str(base))
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # no torch, no flashinfer
    (venv / ".k26-serving-venv").write_text("whatever the spec was\n")
    done = _script("serving-venv.sh", "0.7", cache=cache, K26_BASE_PYTHON=str(base))
    assert "fails its import check; rebuilding it" in done.stderr, done.stderr
    assert "pip ran" in done.stderr  # it really began again
    assert done.returncode != 0 and "ready" not in done.stdout
    assert not (venv / ".k26-serving-venv").exists()  # and nothing vouches for the wreck


def _ready_venv(cache: Path, name: str, seen: Path | None = None) -> Path:
    """A venv ``name`` whose import check passes: its python accepts the check (a
    script on stdin), noting the caches it was pointed at in ``seen``, and is the real
    interpreter for anything else."""
    done = _script("serving-venv.sh", "path", name, cache=cache)
    venv = Path(done.stdout.strip())
    (venv / "bin").mkdir(parents=True)
    note = f'echo "$FLASHINFER_WORKSPACE_BASE $TVM_FFI_CACHE_DIR" >>{seen}; ' if seen else ""
    fake = venv / "bin" / "python"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = - ]; then cat >/dev/null; {note}exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    (venv / ".k26-serving-venv").write_text("the spec\n")
    return venv


def test_the_import_check_writes_into_the_venv_never_the_users_caches(tmp_path: Path) -> None:
    """Importing FlashInfer writes its JIT log, and torch 2.8 makes tvm-ffi build an
    addon: the check that vouches for a venv points both into that venv."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    seen = tmp_path / "seen"
    venv = _ready_venv(cache, "0.7", seen)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FLASHINFER_WORKSPACE_BASE", "TVM_FFI_CACHE_DIR")
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serving-venv.sh"), "0.7"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**env, "K26_SERVING_CACHE": str(cache), "HOME": str(home)},
    )  # fmt: skip
    assert done.returncode == 0 and "ready" in done.stdout, done.stderr
    flashinfer_base, tvm_ffi = seen.read_text().split()
    assert Path(flashinfer_base).is_relative_to(venv), flashinfer_base
    assert Path(tvm_ffi).is_relative_to(venv), tvm_ffi


def test_one_run_checks_each_venv_once_and_a_rebuilt_one_again(tmp_path: Path) -> None:
    """Each test worker and each demo asks for serving-0.7, and each check imports torch
    and FlashInfer: within one run (K26_SERVING_CHECKED, made by scripts/dev.sh) the
    first passed check is trusted while the venv's marker is the same file."""
    cache, seen, run = tmp_path / "cache", tmp_path / "seen", tmp_path / "run"
    run.mkdir()
    venv = _ready_venv(cache, "0.7", seen)

    def checks() -> int:
        return len(seen.read_text().splitlines()) if seen.exists() else 0

    for _ in range(3):
        done = _script("serving-venv.sh", "0.7", cache=cache, K26_SERVING_CHECKED=str(run))
        assert done.returncode == 0 and "serving-0.7: ready" in done.stdout, done.stderr
    assert checks() == 1
    # A rebuild writes a new marker (another file, another time): checked again.
    marker = venv / ".k26-serving-venv"
    marker.rename(tmp_path / "old-marker")
    marker.write_text("the spec\n")
    stamp = marker.stat().st_mtime_ns + 1_000_000_000
    os.utime(marker, ns=(stamp, stamp))
    assert (
        _script("serving-venv.sh", "0.7", cache=cache, K26_SERVING_CHECKED=str(run)).returncode == 0
    )
    assert checks() == 2
    # Outside a run (no K26_SERVING_CHECKED), every call checks.
    env = {k: v for k, v in os.environ.items() if k != "K26_SERVING_CHECKED"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serving-venv.sh"), "0.7"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**env, "K26_SERVING_CACHE": str(cache)},
    )  # fmt: skip
    assert done.returncode == 0 and checks() == 3, done.stderr


def _descendants(pid: int) -> list[str]:
    """The command names of ``pid``'s descendants (the processes still there)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        children.setdefault(int(rest.split()[1]), []).append(int(entry.name))
        names[int(entry.name)] = name
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(names[child])
        todo.extend(children.get(child, []))
    return found


def test_each_serving_venv_has_a_lock_of_its_own(tmp_path: Path) -> None:
    """CI starts the integration tests once serving-0.7 is ready, while serving-0.2
    is still being made: making one venv never waits on another's maker, and a second
    maker of the same venv waits for the first, then finds it ready."""
    cache = tmp_path / "cache"
    _ready_venv(cache, "0.7")
    _ready_venv(cache, "0.2")
    with open(cache / ".serving-0.2.lock", "w") as held:  # another maker of serving-0.2
        fcntl.flock(held, fcntl.LOCK_EX)
        done = _script("serving-venv.sh", "0.7", cache=cache, timeout=60)
        assert done.returncode == 0 and "serving-0.7: ready" in done.stdout, done.stderr
        second = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "serving-venv.sh"), "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "K26_SERVING_CACHE": str(cache)},
        )  # fmt: skip
        try:
            wait_until(lambda: "flock" in _descendants(second.pid), 30, "serving-0.2 to wait")
            assert second.poll() is None  # still waiting while the first maker works
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0 and "serving-0.2: ready" in out, err


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
