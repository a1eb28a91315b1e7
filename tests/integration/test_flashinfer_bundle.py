"""Cache bundles with the real serving venv: build here, import elsewhere, no rebuild.

The session's real nvcc build of FlashInfer 0.7.4's ``sampling`` for 12.0
(``sampling_build``, restored at its own path for each test), exported with the
real CLI, imported into a second workspace at the same path (what a node is:
another disk, the same path), then doctor, warm and FlashInfer's own loader
(which runs ninja on every load) must build nothing. Refusals with another
serving venv; an importer SIGKILLed at each step; and the booted host's own cold
build exported and imported again with the installed command.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.flashinfer import cache, unit_environment
from supervisor.fleet import bundle
from tests.waiting import wait_until

from .builds import ARCH, SessionBuild

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]

ROOT = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).with_name("k26-supervisor"))]
STEPS = ("verified", "locked", "staging", "staged", "swapped", "cleaned")
# The library's import (what `flashinfer bundle import` runs), stopped at one of its
# steps through its own ``on_step``: it says where (in the file named by argv[2]) and
# waits there to be killed. argv[3:]: python, arch, workspace, env file, archive.
PAUSED_IMPORT = """\
import asyncio, os, sys, time
from pathlib import Path
from supervisor.flashinfer import read_env_file
from supervisor.fleet import bundle
step, ready = sys.argv[1], Path(sys.argv[2])
python, arch, workspace, env_file, archive = sys.argv[3:8]
def pause(name):
    if name == step:
        part = ready.with_name(ready.name + ".part")
        part.write_text(f"{name} {os.getpid()}\\n")
        part.rename(ready)  # whole or absent: the test reads it the moment it exists
        while True:
            time.sleep(3600)
env = read_env_file(Path(env_file))
asyncio.run(bundle.import_bundle(
    Path(python), arch, Path(workspace), Path(archive), env=env, on_step=pause))
"""


def paused_import(built: Built, step: str, ready: Path) -> subprocess.Popen[str]:
    values = [str(built.python), ARCH, str(built.workspace), str(built.env_file)]
    return subprocess.Popen(
        [sys.executable, "-c", PAUSED_IMPORT, step, str(ready), *values, str(built.archive)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def k26(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Each file under ``directory``: sha256 and mtime (ns)."""
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }  # fmt: skip


class Built:
    """A workspace warmed by the real build, its bundle, and the commands around them."""

    def __init__(self, build: SessionBuild, out: Path) -> None:
        self.build = build
        self.python = build.python
        # As the shipped units run: the serving venv's bin (its ninja) first on PATH.
        self.env = build.env
        self.workspace = build.workspace
        self.dir = build.dir
        self.archive = out / "sampling.k26bundle.tar.gz"
        self.env_file = out / "build.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))

    def args(self, workspace: Path | None = None, python: Path | None = None) -> list[str]:
        return [
            "--python", str(python or self.python), "--arch", ARCH,
            "--workspace", str(workspace or self.workspace), "--env-file", str(self.env_file),
        ]  # fmt: skip

    def doctor(self) -> dict[str, Any]:
        done = k26("flashinfer", "doctor", *self.args(), "--json")
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def warm(self) -> tuple[subprocess.CompletedProcess[str], float]:
        started = time.monotonic()
        done = k26("flashinfer", "warm", *self.args())
        return done, time.monotonic() - started


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory, sampling_build: SessionBuild
) -> tuple[Path, Path]:
    """The session's sampling build exported once with the real CLI: (archive, as-built)."""
    sampling_build.restore()
    base = tmp_path_factory.mktemp("bundle")
    made = Built(sampling_build, base)
    started = time.monotonic()
    done = k26("flashinfer", "bundle", "export", *made.args(), "--out", str(made.archive), "--json")
    assert done.returncode == 0, done.stderr
    exported = json.loads(done.stdout)
    print(
        f"\nexport {time.monotonic() - started:.2f} s (CLI), {exported['duration_s']:.2f} s "
        f"(library); bundle {exported['size_bytes']} bytes"
    )
    assert sampling_build.kept is not None
    return made.archive, sampling_build.kept


@pytest.fixture
def built(sampling_build: SessionBuild, exported: tuple[Path, Path]) -> Built:
    """The build host's workspace as built (restored for this test), and its bundle."""
    sampling_build.restore()
    return Built(sampling_build, exported[0].parent)


def loader_builds(made: Built) -> tuple[str, float]:
    """FlashInfer's own load path (write_ninja, ninja, load), as a server's first use runs it."""
    code = (
        "from flashinfer.jit.sampling import gen_sampling_module as g\n"
        "m = g().build_and_load()\nprint('K26-LOADED', type(m).__name__)\n"
    )
    # Not FLASHINFER_JIT_VERBOSE: in 0.7.4 it also means a debug build (-O0 -g
    # --device-debug), other commands, so ninja rightly rebuilds everything.
    env = {**os.environ, **made.env, **unit_environment(ARCH, made.workspace)}
    started = time.monotonic()
    done = subprocess.run(
        [str(made.python), "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    assert "K26-LOADED" in done.stdout, done.stdout + done.stderr
    return done.stdout + done.stderr, time.monotonic() - started


def test_import_on_a_second_workspace_is_trusted_and_builds_nothing(built: Built) -> None:
    aside = built.workspace.with_name("ws-build-host")
    built.workspace.rename(aside)  # a fresh disk at the same path: what a node has
    try:
        started = time.monotonic()
        done = k26("flashinfer", "bundle", "import", *built.args(), str(built.archive), "--json")
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["replaced"] is False and result["modules"] == ["sampling"]
        print(f"\nimport {took:.2f} s (CLI), {result['duration_s']:.2f} s (library)")
        report = built.doctor()
        assert report["status"] == "warm", report["problems"]
        assert report["modules"][0]["fingerprint_ok"] is True
        before = snapshot(built.dir / "cached_ops")
        warmed, seconds = built.warm()
        assert warmed.returncode == 0 and "built nothing" in warmed.stdout, warmed.stdout
        assert "nvcc" not in warmed.stdout
        print(f"warm after import: {seconds:.2f} s (CLI process)")
        assert snapshot(built.dir / "cached_ops") == before
        # The server's own path: FlashInfer regenerates build.ninja and runs ninja,
        # which rebuilds (new objects, new log lines) unless its state says up to date.
        output, seconds = loader_builds(built)
        after = snapshot(built.dir / "cached_ops")
        for name, recorded in before.items():
            if name.endswith((".o", ".so", ".ninja_log", ".ninja_deps")):
                assert after.get(name) == recorded, f"loader rebuilt {name}: {output[-1500:]}"
        assert not [k for k in after if k.endswith(".o.d")], "ninja ran a compile"
        print(f"FlashInfer build_and_load after import: {seconds:.2f} s, nothing rebuilt")
    finally:
        if not built.workspace.exists():
            aside.rename(built.workspace)
        else:
            shutil.rmtree(aside)


def test_the_module_files_match_the_build_hosts_exactly(built: Built) -> None:
    """What an import into an empty workspace writes is, byte for byte and mtime for
    mtime, what the build host built (ninja's state would otherwise rebuild)."""
    shutil.rmtree(cache.cache_root(built.workspace))  # a node's empty disk, the same path
    done = k26("flashinfer", "bundle", "import", *built.args(), str(built.archive), "--json")
    assert done.returncode == 0, done.stderr
    assert built.build.kept is not None
    as_built = snapshot(built.build.kept / "cached_ops" / "sampling")
    here = snapshot(built.dir / "cached_ops" / "sampling")
    for name in ("sampling.so", "csrc_sampling.cuda.o", "build.ninja", ".ninja_deps"):
        assert here[name] == as_built[name], name


def test_another_serving_venv_is_refused_naming_the_fields(
    built: Built, serving_070_cu128: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, _ = serving_070_cu128
    done = k26("flashinfer", "bundle", "import", *built.args(python=python), str(built.archive))
    assert done.returncode == 65, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "flashinfer.version: bundle 0.7.4, this host 0.7.0" in done.stderr
    assert "torch.cuda: bundle none, this host 12.8: build the bundle with the same" in done.stderr
    before = snapshot(built.dir)
    other = k26("flashinfer", "bundle", "import", *built.args(tmp_path / "w"), str(built.archive))
    assert other.returncode == 65 and "workspace: bundle" in other.stderr, other.stderr
    assert not (tmp_path / "w").exists()
    assert snapshot(built.dir) == before


def _state(built: Built, old: dict[str, tuple[str, int]], digest: str) -> str:
    if not built.dir.exists():
        return "none"
    now = snapshot(built.dir)
    if now == old:
        return "old"
    fingerprint = json.loads((built.dir / cache.FINGERPRINT_NAME).read_text())
    manifest = bundle.read_manifest(built.archive)
    files = {f"{e.name}": (e.sha256, e.mtime_ns) for e in manifest.files}
    now.pop(cache.FINGERPRINT_NAME)
    if now == files and fingerprint.get("bundle", {}).get("sha256") == digest:
        return "new"
    return f"mixed: {sorted(set(now) ^ set(files))}"


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_step_leaves_old_or_new_and_both_are_trusted(
    built: Built, step: str, tmp_path: Path
) -> None:
    old = snapshot(built.dir)
    digest = hashlib.sha256(built.archive.read_bytes()).hexdigest()
    ready = tmp_path / "paused"
    proc = paused_import(built, step, ready)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 120, f"pause at {step}")
        assert ready.exists(), proc.communicate()[0]
        assert ready.read_text().split()[0] == step
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    state = _state(built, old, digest)
    assert state == ("new" if step in ("swapped", "cleaned") else "old"), state
    # Whatever a kill leaves beside the cache, no fingerprint there is found.
    assert [f.path.parent for f in cache.find_fingerprints(built.workspace)] == [built.dir]
    warmed, _ = built.warm()
    assert warmed.returncode == 0 and "built nothing" in warmed.stdout, warmed.stdout
    report = built.doctor()
    assert report["status"] == "warm", report["problems"]
    # The next import finishes the job and sweeps what the killed one left.
    done = k26("flashinfer", "bundle", "import", *built.args(), str(built.archive), "--json")
    assert done.returncode == 0, done.stderr
    assert _state(built, old, digest) == "new"
    assert not (cache.cache_root(built.workspace) / bundle.WORK_NAME).exists()


def test_sigkill_of_a_first_install_leaves_no_cache_at_all(built: Built, tmp_path: Path) -> None:
    shutil.rmtree(cache.cache_root(built.workspace))
    ready = tmp_path / "paused"
    proc = paused_import(built, "staged", ready)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 120, "pause at staged")
        assert ready.exists(), proc.communicate()[0]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert not built.dir.exists()
    assert list(cache.find_fingerprints(built.workspace)) == []
    report = built.doctor()
    assert report["status"] == "needs-warmup"


# --- the booted host: the installed product exports and imports a bundle --------------

BOOTED_SERVING = "/opt/sglang/venv"
BOOTED_WORKSPACE = "/var/cache/sglang-k26/flashinfer"


@pytest.mark.booted
def test_import_into_the_booted_host_with_the_installed_command(
    booted_bundle: Path, booted: Any
) -> None:
    """The cache the booted host's cold start built, exported with the installed command
    (``booted_bundle``), imported into an empty workspace as a new node would."""
    h = booted.host
    installed = "/opt/k26-supervisor/venv/bin/k26-supervisor"
    common = [
        "--python", f"{BOOTED_SERVING}/bin/python", "--arch", ARCH,
        "--workspace", BOOTED_WORKSPACE, "--env-file", "/etc/k26-supervisor/build.env",
    ]  # fmt: skip
    booted.reset()
    shutil.copy(booted_bundle, h.path("/root/sampling.k26bundle.tar.gz"))
    h.run("sh", "-c", f"rm -rf {BOOTED_WORKSPACE}/.cache")  # a new node's empty cache
    done = h.run(
        installed, "flashinfer", "bundle", "import", *common,
        "/root/sampling.k26bundle.tar.gz", "--json", check=False, timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    print(f"\nbooted host import: {result['duration_s']:.2f} s into {result['cache_dir']}")
    # The units' user owns what was installed, so FlashInfer can take its locks there.
    ops = result["cache_dir"] + "/cached_ops"
    owner = h.run("stat", "-c", "%U %G %a", ops).stdout.split()
    assert owner == ["sglang-k26", "sglang-k26", "2770"], owner
    probe = f"mkdir {ops}/tmp && touch {ops}/tmp/sampling.lock && rm -r {ops}/tmp"
    h.run("runuser", "-u", "sglang-k26", "--", "sh", "-c", probe)
    doctor = h.run(installed, "flashinfer", "doctor", *common, "--json", check=False)
    report = json.loads(doctor.stdout)
    assert report["status"] == "warm", report["problems"]
    assert report["modules"][0]["fingerprint_ok"] is True
    warmed = h.run(installed, "flashinfer", "warm", *common, check=False)
    assert warmed.returncode == 0 and "built nothing" in warmed.stdout, warmed.stdout
    # doctor and warm ran as root, and FlashInfer's loader made its lock files: they
    # were handed to the units' user, who must be able to take that lock next.
    root_owned = h.run(
        "find", f"{BOOTED_WORKSPACE}/.cache", "-uid", "0", check=False
    ).stdout.split()
    assert root_owned == [], root_owned
    probe_lock = f"exec 9>>{ops}/tmp/sampling.lock && flock -n 9"
    h.run("runuser", "-u", "sglang-k26", "--", "sh", "-c", probe_lock)
