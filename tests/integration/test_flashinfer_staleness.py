"""Each upstream FlashInfer staleness case, reproduced with a real release, and caught.

FlashInfer trusts a cached module when its ``.so`` exists and ninja's mtime
scan finds nothing newer. Users hit the gaps (flashinfer-ai/flashinfer):

- #3229: ``CUDA_HOME`` switched to another toolkit (13.0 -> 13.2);
- #5145: a module built by the host's CUDA 13 nvcc reused by workers whose
  CUDA runtime is 12.9;
- #972: a build lock that a stuck or killed builder left hangs the next load;
- #4489: a reinstall of the same version left ninja relinking a half-stale
  ``.so``;
- #4884: another spelling of the same toolkit's path rebuilt everything (here
  a change too, on purpose); and a cache copied elsewhere with a cut module.

Each test rebuilds that situation with FlashInfer's real code and a real
nvcc build, then runs the operator's commands (``flashinfer doctor`` and
``flashinfer warm``, ``--json``): doctor must flag it, warm must repair it,
and afterwards the fingerprint may vouch only for what the venv builds now.

The module is ``api_log_stats`` (two translation units, a real kernel),
much cheaper than ``sampling``. One warmed workspace is shared; each test
works on its own ``cp -a`` copy. Run with ``-s`` to see the timings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from k26dev import shared_cache
from supervisor.flashinfer.venv import SCRIPT
from tests.waiting import wait_for_text, wait_until

from .staleness import (
    LayeredVenv,
    cuda_12_9_runtime,
    cuda_13_2_home,
    download_wheel,
    flashinfer_says,
    k26,
    needed,
    rebuilt_wheel,
    sha256,
    unit_env,
    write_env_file,
)

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]

MODULE = "api_log_stats"
# the empty libcuda.so.1 (no GPU here)
STUB = shared_cache.serving_venv("0.7", make=False) / "k26-stub"


@dataclass(frozen=True)
class Warmed:
    python: Path
    env: dict[str, str]
    env_file: Path
    workspace: Path


def library(workspace: Path) -> Path:
    (found,) = workspace.glob(f".cache/flashinfer/*/*/cached_ops/{MODULE}/{MODULE}.so")
    return found


def fingerprint_of(workspace: Path) -> dict[str, Any]:
    path = library(workspace).parents[2] / "k26-fingerprint.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def problem(report: dict[str, Any], start: str) -> str:
    problems = report.get("problems")
    assert isinstance(problems, list)
    lines = [p for p in problems if isinstance(p, str) and p.startswith(start)]
    assert lines, f"no problem starting {start!r}: {problems}"
    return lines[0]


@pytest.fixture(scope="module")
def warmed(
    serving_07: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Warmed:
    python, env = serving_07
    base = tmp_path_factory.mktemp("staleness")
    env_file = write_env_file(base / "build.env", env)
    workspace = base / "ws"
    out = k26("warm", python, workspace, env_file, MODULE)
    assert out.rc == 0, out.stderr[-4000:]
    assert out.report["built"] == [MODULE]
    print(f"\ncold warm of {MODULE} for 12.0 (nvcc 13.0): {out.seconds:.1f} s")
    assert k26("doctor", python, workspace, env_file, MODULE).rc == 0
    return Warmed(python, env, env_file, workspace)


def copy_of(warmed: Warmed, tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    subprocess.run(["cp", "-a", str(warmed.workspace), str(workspace)], check=True)
    return workspace


def test_3229_changed_cuda_home_is_flagged_and_rebuilt(warmed: Warmed, tmp_path: Path) -> None:
    """#3229: CUDA_HOME moves from the 13.0 toolkit to a real 13.2 one."""
    toolkit = cuda_13_2_home()
    workspace = copy_of(warmed, tmp_path)
    so = library(workspace)
    built_by_13_0 = sha256(so)
    env = {**warmed.env, "CUDA_HOME": str(toolkit)}
    env_file = write_env_file(tmp_path / "cuda-13.2.env", env)

    # FlashInfer's own verdict under the new CUDA_HOME: compiled, the 13.0 file.
    assert flashinfer_says(warmed.python, workspace, env, MODULE) == {
        "compiled": True,
        "path": str(so),
    }

    doctor = k26("doctor", warmed.python, workspace, env_file, MODULE)
    assert doctor.rc == 2 and doctor.report["status"] == "needs-warmup", doctor.report
    differences = doctor.report["fingerprint"]["differences"]
    assert "nvcc.release: '13.0' -> '13.2'" in differences, differences
    assert f"nvcc.cuda_home: '/usr/local/cuda' -> '{toolkit}'" in differences, differences
    said = problem(doctor.report, "fingerprint mismatch")

    warm = k26("warm", warmed.python, workspace, env_file, MODULE)
    assert warm.rc == 0, warm.stderr[-4000:]
    assert warm.report["built"] == [MODULE]
    assert warm.report["quarantined"], "the 13.0 build must be moved aside"
    assert f"{toolkit}/bin/nvcc " in warm.stderr, "nvcc 13.2 did not build it"
    assert sha256(so) != built_by_13_0
    fingerprint = fingerprint_of(workspace)
    assert fingerprint["identity"]["nvcc"]["release"] == "13.2"
    assert fingerprint["modules"][MODULE]["sha256"] == sha256(so)
    assert k26("doctor", warmed.python, workspace, env_file, MODULE).rc == 0
    print(f"\n#3229 doctor: {said}\n#3229 warm: rebuilt with nvcc 13.2 in {warm.seconds:.1f} s")


def test_copied_workspace_is_judged_by_its_own_files(warmed: Warmed, tmp_path: Path) -> None:
    """A cache copied elsewhere (``cp -a``, a restored backup) with a broken module:
    warm's fast path must check the files in this workspace, not the paths the
    fingerprint recorded where it was built."""
    workspace = copy_of(warmed, tmp_path)
    so = library(workspace)
    recorded = fingerprint_of(workspace)["modules"][MODULE]["path"]
    assert recorded != str(so) and Path(recorded).exists(), recorded
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])  # what a kill mid-copy leaves
    doctor = k26("doctor", warmed.python, workspace, warmed.env_file, MODULE)
    assert doctor.rc == 2
    said = problem(doctor.report, f"{MODULE}: {so.name} is corrupt or truncated")
    warm = k26("warm", warmed.python, workspace, warmed.env_file, MODULE)
    print(
        f"\ncopied workspace doctor: {said}\ncopied workspace warm: exit {warm.rc}, {warm.report}"
    )
    assert warm.report.get("built") == [MODULE], (
        "warm's fast path vouched for the truncated copy: it checked the module file at the "
        f"path the fingerprint recorded ({recorded}), not the one in this workspace ({so})"
    )
    assert k26("doctor", warmed.python, workspace, warmed.env_file, MODULE).rc == 0


def test_4884_another_spelling_of_the_same_toolkit_reads_as_a_change(
    warmed: Warmed, tmp_path: Path
) -> None:
    """#4884: ``/usr/local/cuda`` and ``/usr/local/cuda-13.0`` are one toolkit, but
    FlashInfer writes the string into build.ninja, so its ninja would rebuild
    what it would build; the fingerprint sees the same difference."""
    workspace = copy_of(warmed, tmp_path)
    spelled = os.path.realpath("/usr/local/cuda")
    assert spelled != "/usr/local/cuda"
    # One process per spelling: FlashInfer resolves cuda_home once (functools.cache).
    code = (
        f"from flashinfer.jit.{MODULE} import gen_{MODULE}_module as gen\n"
        "spec = gen()\n"
        "spec.write_ninja()\n"
        "print(spec.ninja_path.read_text())\n"
    )
    texts = []
    for home in ("/usr/local/cuda", spelled):
        done = subprocess.run(
            [str(warmed.python), "-c", code],
            env=unit_env(workspace, {**warmed.env, "CUDA_HOME": home}),
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        )
        texts.append(set(done.stdout.splitlines()))
    assert texts[0] ^ texts[1] == {"cuda_home = /usr/local/cuda", f"cuda_home = {spelled}"}
    env_file = write_env_file(tmp_path / "spelled.env", {**warmed.env, "CUDA_HOME": spelled})
    doctor = k26("doctor", warmed.python, workspace, env_file, MODULE)
    assert doctor.rc == 2, doctor.report
    differences = doctor.report["fingerprint"]["differences"]
    assert f"nvcc.cuda_home: '/usr/local/cuda' -> '{spelled}'" in differences, differences
    assert not any(
        d.startswith(("nvcc.realpath", "nvcc.release", "nvcc.version")) for d in differences
    )
    said = problem(doctor.report, "fingerprint mismatch")
    # Treated as a change, as FlashInfer's ninja would: rebuilt now, not in a request.
    warm = k26("warm", warmed.python, workspace, env_file, MODULE)
    assert warm.rc == 0 and warm.report["built"] == [MODULE], warm.stderr[-4000:]
    assert k26("doctor", warmed.python, workspace, env_file, MODULE).rc == 0
    print(f"\n#4884 doctor: {said}\n#4884 warm: rebuilt in {warm.seconds:.1f} s")


def test_5145_cuda13_module_is_not_vouched_for_cuda12_9_workers(
    serving_070_cu128: tuple[Path, dict[str, str]],
    serving_07: tuple[Path, dict[str, str]],  # its k26-stub: the libcuda.so.1 to link
    tmp_path: Path,
) -> None:
    """#5145: FlashInfer on the host built the module with the host's nvcc (CUDA 13);
    the workers run torch built for CUDA 12 with the CUDA 12.9 runtime first on
    their library path. (FlashInfer 0.7.0 with torch 2.8.0+cu128.)"""
    python, serving = serving_070_cu128
    site = python.parent.parent / "lib" / "python3.11" / "site-packages"
    host = {
        # The venv's own tvm-ffi cache, where its import check built the DLPack addon.
        "TVM_FFI_CACHE_DIR": serving["TVM_FFI_CACHE_DIR"],
        "CUDA_HOME": "/usr/local/cuda",
        "LIBRARY_PATH": f"/usr/local/cuda/lib64:{STUB}",
        "LD_LIBRARY_PATH": f"/usr/local/cuda/lib64:{STUB}",
    }
    runtime_12_9 = cuda_12_9_runtime()
    workers = {
        **host,
        "LD_LIBRARY_PATH": f"{runtime_12_9}:{site / 'nvidia/cuda_runtime/lib'}:{STUB}",
    }
    workers_file = write_env_file(tmp_path / "workers.env", workers)
    workspace = tmp_path / "ws"

    # The host process JIT-builds it, as vLLM's did: FlashInfer's own build_and_load.
    code = (
        "from flashinfer.jit.api_log_stats import gen_api_log_stats_module as gen\n"
        "gen().build_and_load()\n"
    )
    subprocess.run(
        [str(python), "-c", code], env=unit_env(workspace, host), check=True, cwd="/", timeout=900
    )
    so = library(workspace)
    assert "libcudart.so.13" in needed(so)
    assert flashinfer_says(python, workspace, workers, MODULE)["compiled"] is True

    doctor = k26("doctor", python, workspace, workers_file, MODULE)
    assert doctor.rc == 2 and doctor.report["status"] == "needs-warmup", doctor.report
    said = problem(doctor.report, "no fingerprint")

    warm = k26("warm", python, workspace, workers_file, MODULE)
    after = k26("doctor", python, workspace, workers_file, MODULE)
    print(
        f"\n#5145 doctor: {said}\n#5145 warm: exit {warm.rc} in {warm.seconds:.1f} s, "
        f"built {warm.report.get('built')}, error {warm.report.get('error')}; "
        f"then doctor exit {after.rc}; module needs {needed(so) if so.exists() else 'nothing'}"
    )
    vouched_cuda13 = after.rc == 0 and so.exists() and "libcudart.so.13" in needed(so)
    assert not vouched_cuda13, (
        "warm vouched for a module linked against libcudart.so.13 (CUDA 13) for workers whose "
        f"CUDA runtime is 12.9 ({runtime_12_9} first on LD_LIBRARY_PATH) and whose torch is "
        "built for CUDA 12.8: on a host whose driver supports only 12.9 its first call fails "
        "with cudaErrorInsufficientDriver (#5145). Warm must refuse (exit 74) or build with a "
        "CUDA 12 nvcc; doctor must flag the libcudart major."
    )


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started in their own sessions; their groups end with it."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_972_stuck_then_killed_builder_lock(
    warmed: Warmed, tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    """#972: a builder stops holding the build lock; the next load waits forever.

    Here the builder is a rebuild over a module the fingerprint vouches for (the
    copy's new path makes FlashInfer's ninja recompile): once it is killed, the
    vouched ``.so`` is untouched and its unheld lock is no problem, only litter
    that warm clears without a build.
    (``test_flashinfer_precompile.py::test_sigkilled_builder_then_clean_rebuild``
    covers a first build SIGKILLed mid-way: no module, so the stale lock counts.)"""
    workspace = copy_of(warmed, tmp_path)
    so = library(workspace)
    vouched_sha = sha256(so)
    lock = so.parent.parent / "tmp" / f"{MODULE}.lock"
    env = unit_env(workspace, warmed.env)

    builder = subprocess.Popen(
        [str(warmed.python), str(SCRIPT), "build", "--module", MODULE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    processes.append(builder)
    assert builder.stdout is not None
    for line in builder.stdout:
        if line.startswith("[1/"):  # nvcc is running: FlashInfer holds the lock
            break
    else:
        pytest.fail("the builder ended before nvcc started")
    os.killpg(builder.pid, signal.SIGSTOP)  # stuck, as a hung builder or a frozen node
    # FlashInfer's own loader, with filelock's debug log on: each failed try says so.
    code = (
        "import logging, sys\n"
        "log = logging.getLogger('filelock')\n"
        "log.addHandler(logging.StreamHandler(sys.stderr))\n"
        "log.setLevel(logging.DEBUG)\n"
        f"from flashinfer.jit.{MODULE} import gen_{MODULE}_module as gen\n"
        "gen().build_and_load()\n"
    )
    loader_log = tmp_path / "loader.log"
    with loader_log.open("w") as sink:
        loader = subprocess.Popen(
            [str(warmed.python), "-c", code],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd="/",
        )
    processes.append(loader)
    waiting = f"not acquired on {lock}, waiting"
    try:
        wait_for_text(loader_log, waiting, 120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the loader said: {loader_log.read_text()[-3000:]}") from None

    doctor = k26("doctor", warmed.python, workspace, warmed.env_file, MODULE)
    assert doctor.rc == 2, doctor.report
    held = problem(doctor.report, "build in progress")
    assert str(lock) in held and f"pid {builder.pid}" in held, held
    warm = k26("warm", warmed.python, workspace, warmed.env_file, MODULE, timeout_s=120)
    assert warm.rc == 69, warm.report
    assert f"a live build holds {lock}" in str(warm.report["error"]), warm.report
    tries = loader_log.read_text().count(waiting)
    assert loader.poll() is None, "FlashInfer's own loader is still waiting on the lock"
    wait_until(lambda: loader_log.read_text().count(waiting) > tries, 60, "the loader to try again")

    os.killpg(loader.pid, signal.SIGKILL)
    loader.wait()
    os.killpg(builder.pid, signal.SIGKILL)  # the operator's way out of the hang
    builder.wait()
    builder.stdout.close()
    assert lock.exists(), "a killed builder leaves its lock file"
    # The rebuild died before its link step: the module the fingerprint vouches for
    # is the same file, so the cache stays warm and the unheld lock blocks nothing.
    assert sha256(so) == vouched_sha
    stale_doctor = k26("doctor", warmed.python, workspace, warmed.env_file, MODULE)
    assert stale_doctor.rc == 0 and stale_doctor.report["status"] == "warm", stale_doctor.report
    [seen] = [lk for lk in stale_doctor.report["locks"] if lk["path"] == str(lock)]
    assert seen["state"] == "stale", seen
    assert not any("lock" in p for p in stale_doctor.report["problems"]), stale_doctor.report

    tidy = k26("warm", warmed.python, workspace, warmed.env_file, MODULE)
    assert tidy.rc == 0, tidy.stderr[-4000:]
    assert tidy.report["built"] == [], "a vouched module is never rebuilt for a stale lock"
    assert str(lock) in tidy.report["removed_locks"] and not lock.exists()
    assert sha256(so) == vouched_sha
    assert k26("doctor", warmed.python, workspace, warmed.env_file, MODULE).rc == 0
    print(
        f"\n#972 doctor (stuck): {held}\n#972 warm (stuck): exit 69 in {warm.seconds:.1f} s: "
        f"{warm.report['error']}\n#972 doctor (killed): warm, lock {seen['state']}\n"
        f"#972 warm (killed): removed the lock, built nothing, in {tidy.seconds:.1f} s"
    )


API_SOURCE = "flashinfer/data/csrc/api_log_stats.cu"
BINDING_SOURCE = "flashinfer/data/csrc/flashinfer_api_log_stats_binding.cu"
MARK_API = b"k26-rebuilt-wheel-api-log-stats"
MARK_BINDING = b"k26-rebuilt-wheel-binding"


def _marker(symbol: str, text: bytes) -> bytes:
    return (
        f'\nextern "C" __attribute__((used, visibility("default"))) '
        f'const char {symbol}[] = "{text.decode()}";\n'
    ).encode()


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, emptied afterwards: the venv and two wheels come to about 1 GB."""
    yield tmp_path
    for child in tmp_path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def test_4489_reinstall_leaves_half_stale_module(
    serving_07: tuple[Path, dict[str, str]], scratch: Path
) -> None:
    """#4489: a different build of the same version reinstalled; the file times
    it carries leave api_log_stats.cu older than its cached object, so
    FlashInfer's ninja relinks the new binding with the old kernel object."""
    python07, env = serving_07
    venv = LayeredVenv(scratch / "venv", python07.parent.parent)
    original = download_wheel("flashinfer-python==0.7.4", scratch / "wheel")
    venv.install(original)
    env_file = write_env_file(scratch / "build.env", env)
    workspace = scratch / "ws"
    first = k26("warm", venv.python, workspace, env_file, MODULE)
    assert first.rc == 0, first.stderr[-4000:]
    so = library(workspace)
    objects = {p.name: p.stat().st_mtime_ns for p in so.parent.glob("*.o")}
    assert len(objects) == 2, objects

    rebuilt = rebuilt_wheel(
        original,
        scratch / "rebuilt" / original.name,
        {
            # changed, but carrying the old build's time: older than its object
            API_SOURCE: (_marker("k26_mark_api", MARK_API), False),
            # changed, with the rebuild's time: newer than its object
            BINDING_SOURCE: (_marker("k26_mark_binding", MARK_BINDING), True),
        },
    )
    venv.install(rebuilt)
    venv.keep_wheel_times(rebuilt)
    assert MARK_API in (venv.site / API_SOURCE).read_bytes()

    # A server's first load: FlashInfer's own build_and_load, ninja decides.
    code = (
        f"from flashinfer.jit.{MODULE} import gen_{MODULE}_module as gen\ngen().build_and_load()\n"
    )
    subprocess.run(
        [str(venv.python), "-c", code], env=unit_env(workspace, env), check=True, cwd="/"
    )
    now = {p.name: p.stat().st_mtime_ns for p in so.parent.glob("*.o")}
    recompiled = sorted(name for name in objects if now[name] != objects[name])
    assert len(recompiled) == 1 and "binding" in recompiled[0], (objects, now)
    relinked = so.read_bytes()
    assert MARK_BINDING in relinked and MARK_API not in relinked, "expected a half-stale .so"

    doctor = k26("doctor", venv.python, workspace, env_file, MODULE)
    assert doctor.rc == 2, doctor.report
    differences = doctor.report["fingerprint"]["differences"]
    assert any(d.startswith("flashinfer.record_sha256: ") for d in differences), differences
    said = problem(doctor.report, "fingerprint mismatch")

    warm = k26("warm", venv.python, workspace, env_file, MODULE)
    assert warm.rc == 0, warm.stderr[-4000:]
    assert warm.report["built"] == [MODULE] and warm.report["quarantined"]
    repaired = so.read_bytes()
    assert MARK_API in repaired and MARK_BINDING in repaired
    assert fingerprint_of(workspace)["modules"][MODULE]["sha256"] == sha256(so)
    assert k26("doctor", venv.python, workspace, env_file, MODULE).rc == 0
    print(
        f"\n#4489 ninja recompiled {recompiled} and relinked\n#4489 doctor: {said}\n"
        f"#4489 warm: quarantined the half-stale build, rebuilt in {warm.seconds:.1f} s"
    )
