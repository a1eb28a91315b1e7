"""Real systemd for integration tests: the project's own confined sandbox.

Every sandbox made here is torn down by its fixture, even when the test fails
or the run is interrupted; the session also checks that none is left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench.fleet_registry import RegistryProcess
from k26dev import sandbox, shared_cache
from k26dev.errors import SandboxError
from k26dev.ports import free_port
from supervisor.core.jit_caches import CACHE_ENV
from supervisor.flashinfer import read_env_file
from tests.measured import record
from tests.waiting import wait_for_text

from .builds import SMALL_MODULE, SessionBuild, build_once

if TYPE_CHECKING:
    from .test_registry import Node

_OURS: list[Path] = []


@pytest.fixture(scope="session")
def sbx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sandbox.SandboxInfo]:
    """One confined systemd user manager for the session (units are per test)."""
    directory = tmp_path_factory.mktemp("sandbox")
    _OURS.append(directory)
    with sandbox.running(directory) as info:
        yield info


@pytest.fixture
def fresh_sbx(tmp_path: Path) -> Iterator[sandbox.SandboxInfo]:
    """A sandbox of this test's own, for tests that restart the bus or manager."""
    directory = tmp_path / "sandbox"
    _OURS.append(directory)
    with sandbox.running(directory) as info:
        yield info


@pytest.fixture
def bus_env(sbx: sandbox.SandboxInfo, monkeypatch: pytest.MonkeyPatch) -> sandbox.SandboxInfo:
    for key, value in sbx.env.items():
        monkeypatch.setenv(key, value)
    return sbx


# SGLang polls for a SIGTERM every 5 s and pauses 5 s after a failed child, and a
# Triton or inductor compile under traffic takes 0.5-2.8 s; tests shorten all of it
# unless they ask for SGLang's timing.
QUICK = (
    "--sigterm-poll-seconds", "0.2", "--crash-diagnostics-seconds", "0.2",
    "--triton-compile-seconds", "0.05", "--inductor-compile-seconds", "0.1",
)  # fmt: skip
# The JIT caches a test unit writes: pinned under its own directory, as the shipped
# units pin them under their CacheDirectory= (never a developer's ~/.triton or /tmp).
CACHE_VARS = tuple(CACHE_ENV.values())


def pinned_caches(base: Path) -> str:
    """``Environment=`` lines pinning every JIT cache under ``base``."""
    return "".join(f"Environment={var}={base / var.lower()}\n" for var in CACHE_VARS)


@dataclass
class StandinUnit:
    name: str
    port: int
    output: Path
    info: sandbox.SandboxInfo

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, **self.info.env)
        return subprocess.run(
            ["systemctl", "--user", *args], env=env, capture_output=True, text=True, check=check
        )

    def show(self, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", self.name).stdout.strip()

    def main_pid(self) -> int:
        return int(self.show("MainPID") or 0)

    def wait_output(self, needle: str, timeout_s: float = 20.0) -> str:
        """Wait for the unit to print ``needle``; the unit's output so far."""
        return wait_for_text(self.output, needle, timeout_s)

    @property
    def caches(self) -> Path:
        """Where its JIT caches are pinned (``pinned_caches``)."""
        return self.output.with_suffix(".caches")

    def cache(self, var: str) -> Path:
        return self.caches / var.lower()


def write_unit(
    info: sandbox.SandboxInfo,
    name: str,
    exec_start: str,
    output: Path,
    extra: str = "",
) -> None:
    unit = textwrap.dedent(
        f"""\
        [Unit]
        Description=k26 test unit {name}

        [Service]
        Type=simple
        ExecStart={exec_start}
        StandardOutput=append:{output}
        StandardError=inherit
        Restart=no
        KillMode=mixed
        TimeoutStopSec=10
        """
    )
    # Every JIT cache pinned beside its output; the test's own Environment= lines come
    # after, and systemd lets the last one win.
    pins = pinned_caches(output.with_suffix(".caches"))
    (info.unit_dir / name).write_text(unit + pins + extra)
    env = dict(os.environ, **info.env)
    subprocess.run(["systemctl", "--user", "daemon-reload"], env=env, check=True, timeout=30)


@pytest.fixture
def standin_unit(
    bus_env: sandbox.SandboxInfo, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., StandinUnit]]:
    """Factory: a real unit running the stand-in SGLang server in the sandbox."""
    made: list[StandinUnit] = []

    def make(
        *flags: str, extra: str = "", name: str | None = None, sglang_timing: bool = False
    ) -> StandinUnit:
        """``sglang_timing``: SGLang's own 5 s SIGTERM poll and crash pause; by default
        tests shorten both (QUICK) and keep everything else as SGLang does it."""
        base = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40]
        unit = name or f"k26t-{base}-{len(made)}.service"
        port = free_port()
        output = tmp_path / f"{unit}.out"
        timing = () if sglang_timing else QUICK
        module = "k26dev.standin"
        cmd = " ".join([sys.executable, "-m", module, "--port", str(port), *timing, *flags])
        write_unit(bus_env, unit, cmd, output, extra)
        made.append(StandinUnit(unit, port, output, bus_env))
        return made[-1]

    yield make
    for u in made:
        u.systemctl("stop", u.name, check=False)
        u.systemctl("reset-failed", u.name, check=False)
        (bus_env.unit_dir / u.name).unlink(missing_ok=True)


# --- the real daemon ---------------------------------------------------------


@pytest.fixture
def supervise(bus_env: sandbox.SandboxInfo, tmp_path: Path) -> Iterator[Callable[[Path], Any]]:
    """Factory: ``k26-supervisor run --config FILE`` as a real process; stopped after."""
    from .daemon_harness import Supervisor

    made: list[Supervisor] = []

    def start(config: Path) -> Supervisor:
        made.append(Supervisor(bus_env, config, tmp_path))
        return made[-1]

    yield start
    for s in made:
        s.stop()


# --- serving venvs with real FlashInfer releases -------------------------------

ROOT = Path(__file__).resolve().parents[2]


def serving_venv(name: str) -> tuple[Path, dict[str, str]]:
    """The shared cache's serving venv ``name``, made or checked first: its python, its
    build environment. That pins tvm-ffi's cache to the venv's own, where its import
    check built the torch DLPack addon that importing FlashInfer 0.7 with torch 2.8
    needs (half a minute to build; never in the user's ~/.cache/tvm-ffi)."""
    try:
        venv = shared_cache.serving_venv(name)
    except SandboxError as exc:
        pytest.fail(str(exc))
    env = read_env_file(venv / "k26-build.env")
    env.setdefault("TVM_FFI_CACHE_DIR", str(venv / "k26-import-check" / "tvm-ffi"))
    return venv / "bin" / "python", env


@pytest.fixture(scope="session")
def serving_07() -> tuple[Path, dict[str, str]]:
    return serving_venv("0.7")


@pytest.fixture(scope="session")
def serving_02() -> tuple[Path, dict[str, str]]:
    return serving_venv("0.2")


@pytest.fixture(scope="session")
def serving_070_cu128() -> tuple[Path, dict[str, str]]:
    return serving_venv("0.7.0-cu128")


@pytest.fixture(scope="session")
def sampling_build(
    tmp_path_factory: pytest.TempPathFactory, serving_07: tuple[Path, dict[str, str]]
) -> SessionBuild:
    """The session's one cold build of FlashInfer's sampling for 12.0 (see builds.py)."""
    python, env = serving_07
    return build_once(python, env, tmp_path_factory.mktemp("sampling-12.0"), "sampling")


@pytest.fixture(scope="session")
def small_build(
    tmp_path_factory: pytest.TempPathFactory, serving_07: tuple[Path, dict[str, str]]
) -> SessionBuild:
    """The session's one cold build of a small module, where any real build would do."""
    python, env = serving_07
    return build_once(python, env, tmp_path_factory.mktemp("small-12.0"), SMALL_MODULE)


@pytest.fixture
def tiny_mount(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs for the full/read-only workspace tests needs root")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Belt and braces: a sandbox of ours that is still up is taken down now.
    for directory in _OURS:
        if (directory / sandbox.STATE_FILE).exists():
            try:
                sandbox.down(directory)
            except Exception as exc:  # report, but keep tearing down the rest
                print(f"sandbox teardown failed for {directory}: {exc}", file=sys.stderr)


# --- a booted host, with the product installed as on a GPU server -------------------


@pytest.fixture(scope="session")
def booted(
    tmp_path_factory: pytest.TempPathFactory, serving_07: tuple[Path, dict[str, str]]
) -> Iterator[Any]:
    """One booted host for the session: serving venv, the .deb, the operator's config."""
    from k26dev import bootedhost

    from .booted import AR, EAGLE, Product, boot_binds

    python, env = serving_07
    venv = python.parent.parent
    directory = tmp_path_factory.mktemp("booted")
    with bootedhost.running(directory, binds_ro=boot_binds(venv)) as host:
        record("booted host: boot (systemd PID 1 to running), s", f"{host.boot_s:.1f}")
        product = Product(host, venv, env)
        product.make_serving_venv()
        product.install()
        product.configure()
        for unit in (EAGLE, AR):
            product.standin_args(unit)
        yield product


@dataclass
class ColdStart:
    """``systemctl start k26-supervisor`` on the booted host, from an empty cache."""

    done: subprocess.CompletedProcess[str]
    took_s: float
    timeout_start_s: float
    status: dict[str, Any]
    log: str
    systemctl_status: str
    active_state: str
    written_by_supervisor: list[str]


def files_owned_by_supervisor(product: Any) -> list[str]:
    """Every path of the booted host's writable layer that belongs to k26-supervisor."""
    h = product.host
    uid = int(h.run("id", "-u", "k26-supervisor").stdout)
    upper = Path(f"/proc/{h.launcher_pid}/root") / h.dir.lstrip("/") / "layers" / "upper"
    return sorted(
        "/" + str(p.relative_to(upper)) for p in upper.rglob("*") if p.lstat().st_uid == uid
    )


@pytest.fixture(scope="session")
def booted_cold_start(booted: Any) -> ColdStart:
    """The booted host's one cold start (a real nvcc build under the hardened unit),
    shorter TimeoutStartSec than the build, so only EXTEND_TIMEOUT_USEC gets it through.
    Its test asserts on it; the tests that need the cache warm depend on it, so the
    session builds there once, whatever the order."""
    from .booted import SUPERVISOR, WORKSPACE

    product = booted
    h = product.host
    product.reset()
    product.configure()  # the installed example's layout, whatever ran before
    h.run("rm", "-rf", f"{WORKSPACE}/.cache")  # cold, whatever ran before
    timeout_start_s = 45.0
    dropin = f"/etc/systemd/system/{SUPERVISOR}.d/k26-cold-start.conf"
    h.write(dropin, f"[Service]\nTimeoutStartSec={timeout_start_s:g}s\n")
    h.systemctl("daemon-reload")
    try:
        done, took = product.start_supervisor(timeout_s=1200)
        started = ColdStart(
            done=done,
            took_s=took,
            timeout_start_s=timeout_start_s,
            status=product.status(),
            log=product.log(),
            systemctl_status=h.systemctl("status", SUPERVISOR, "--no-pager", check=False),
            active_state=h.show(SUPERVISOR, "ActiveState"),
            written_by_supervisor=files_owned_by_supervisor(product),
        )
    finally:
        h.run("rm", "-f", dropin)
        h.systemctl("daemon-reload")
    record("booted host: systemctl start k26-supervisor, cold build, s", f"{took:.1f}")
    return started


@pytest.fixture(scope="session")
def booted_bundle(
    booted_cold_start: ColdStart, booted: Any, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The booted host's cold build, exported with the installed command: a bundle any
    booted host of this session (same paths, same serving venv) imports as its own."""
    from .booted import SERVING, WORKSPACE

    assert booted_cold_start.done.returncode == 0, "the booted host's cold start failed"
    inside = "/root/session.k26bundle.tar.gz"
    done = booted.host.run(
        "/opt/k26-supervisor/venv/bin/k26-supervisor", "flashinfer", "bundle", "export",
        "--python", f"{SERVING}/bin/python", "--arch", "12.0", "--workspace", WORKSPACE,
        "--env-file", "/etc/k26-supervisor/build.env", "--out", inside, "--json",
        check=False, timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = tmp_path_factory.mktemp("booted-bundle") / "session.k26bundle.tar.gz"
    shutil.copy(booted.host.path(inside), out)
    return out


# --- the fleet tests' registry and node (test_registry.py and the files beside it) ---


@pytest.fixture
def registry_proc(tmp_path: Path) -> Iterator[RegistryProcess]:
    """Debian's docker-registry on a free port with its own storage; a machine
    without it fails here, it does not skip."""
    try:
        with RegistryProcess(tmp_path / "registry") as reg:
            yield reg
    except RuntimeError as exc:  # not installed, or would not start: a failure
        pytest.fail(str(exc))


@pytest.fixture
def node(small_build: SessionBuild, tmp_path: Path) -> Iterator[Node]:
    """A host's caches (test_registry.Node), wiped before and after."""
    from .test_registry import Node

    made = Node(small_build, tmp_path / "node")
    made.wipe()
    yield made
    made.wipe()
