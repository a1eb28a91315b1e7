"""The product as deployed, on a booted host: the installer, the system manager, polkit, journald.

``Product`` wraps a booted container (``k26dev.bootedhost``) and
does there only what an operator does on a GPU server: make a serving venv,
``apt install`` the Debian package (``scripts/deb.sh`` builds it from the checkout),
run ``k26-supervisor units configure``, edit ``/etc/k26-supervisor/config.toml``,
and use ``systemctl``. Everything else is the package's and systemd's. The
booted-host tests and the demo's production act both use it.

The booted host gets what a production install has, wherever the checkout lies
(``/tmp`` is the container's own tmpfs, and the hardened units' ``ProtectHome=``
hides ``/root`` and ``/home``):

- the package at ``/opt/k26-test/debs/`` and a copy of the checkout at
  ``/opt/k26-test/src`` (the stand-in, nothing else is used from it);
- the shared cache's serving venv bound read-only at ``/opt/k26-test/serving``
  (``boot_binds``), never a path into the clone or a home directory;
- the serving venv ``/opt/sglang/venv``: a venv of the host's Debian Python 3.11
  whose ``.pth`` adds that bound venv's FlashInfer 0.7.4 and torch and the copied
  stand-in under SGLang's name (``devtools/k26dev/standin/sglang_shim``), so the
  shipped units run the stand-in with their real ``ExecStart=`` and the warm-up is
  a real nvcc build.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from k26dev.bootedhost import HostInfo
from k26dev.errors import SandboxError

ROOT = Path(__file__).resolve().parents[2]  # devtools/k26dev/deployed.py
# Inside the booted host, outside every path the hardened units hide.
SRC = "/opt/k26-test/src"
DEBS = "/opt/k26-test/debs"
SERVING_BIND = "/opt/k26-test/serving"
SERVING = "/opt/sglang/venv"
CONFIG = "/etc/k26-supervisor/config.toml"
WORKSPACE = "/var/cache/sglang-k26/flashinfer"
AR = "sglang-k26.service"
EAGLE = "sglang-k26-eagle3.service"
SUPERVISOR = "k26-supervisor.service"
# The copied development tools (k26dev, a distribution of its own: devtools/).
DEVTOOLS = f"{SRC}/devtools"
SHIM = f"{DEVTOOLS}/k26dev/standin/sglang_shim"
_CLONE_NEWNS = 0x00020000
# The mount namespace this process left (enter_private_mount_namespace), recorded
# before unshare: PID 1's may not be readable (some VMs hide it even from root).
_OUTER_MNT: str | None = None
# What a copy of the checkout leaves out: history, venvs, caches, build output.
NOT_COPIED = (".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", "*.pyc")
# The stand-in's SIGTERM poll and crash pause, shortened from SGLang's 5 s.
QUICK = "--sigterm-poll-seconds 0.2 --crash-diagnostics-seconds 0.2"


def deb_package() -> Path:
    """The Debian package of this checkout, as ``scripts/deb.sh`` builds it (once: a
    build whose inputs are unchanged is reused, and concurrent callers wait on its
    lock). Raises SandboxError with the script's output when the build or lintian
    fails."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "deb.sh")], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SandboxError(f"scripts/deb.sh failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def boot_binds(serving_venv: Path) -> list[str]:
    """``binds_ro`` for ``bootedhost.up``: the serving venv, where the units can read it."""
    return [f"{serving_venv}:{SERVING_BIND}"]


def inside_env(serving_venv: Path, build_env: Mapping[str, str]) -> dict[str, str]:
    """The serving venv's build environment (its stub libcuda, its headers) as seen
    where the venv is bound at ``SERVING_BIND``."""
    return {key: value.replace(str(serving_venv), SERVING_BIND) for key, value in build_env.items()}


def env_file_text(env: Mapping[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in env.items())


def thin_serving_venv(
    run: Callable[[list[str]], str],
    write: Callable[[str, str], None],
    *,
    python: str = "/usr/bin/python3.11",
) -> None:
    """``/opt/sglang/venv``: Debian's Python 3.11 with a ``.pth`` onto the bound serving
    venv's packages and the copied stand-in under SGLang's name. ``run`` returns a
    command's stdout and ``write`` writes a file, wherever the layout is made. With
    another ``python`` (another release's, whose ABI the bound packages do not
    match), the stand-in alone: it needs only the standard library, so a unit with
    the FlashInfer warm-up off serves from it."""
    run([python, "-m", "venv", "--without-pip", SERVING])
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = run([f"{SERVING}/bin/python", "-c", code]).strip()
    bound_site = f"{SERVING_BIND}/lib/python3.11/site-packages\n"
    paths = (bound_site if python.endswith("python3.11") else "") + f"{SHIM}\n{SRC}\n{DEVTOOLS}\n"
    write(f"{site}/k26-test-serving.pth", paths)


def mirror_booted_paths(serving_venv: Path, build_env: Mapping[str, str]) -> dict[str, str]:
    """This process's own view of the booted host's serving paths: ``/opt`` and
    ``/var/cache`` on tmpfs, the serving venv bound read-only at ``SERVING_BIND``, the
    checkout copied to ``SRC``, ``/opt/sglang/venv`` and an empty ``WORKSPACE``. A
    build made here is one the booted host takes as its own (bundles name their
    paths). Only in a private mount namespace (``enter_private_mount_namespace``),
    so nothing of it reaches this machine; returns the build environment to use."""
    mine = os.readlink("/proc/self/ns/mnt")
    try:
        pid1 = os.readlink("/proc/1/ns/mnt")
    except OSError:
        pid1 = ""  # PID 1's namespaces may be hidden from us; the launcher check holds
    if _OUTER_MNT is None or mine in (_OUTER_MNT, pid1):
        raise SandboxError("mirror_booted_paths: not in a private mount namespace")

    def run(argv: list[str]) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def write(path: str, text: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)

    for top in ("/opt", "/var/cache"):
        run(["mount", "-t", "tmpfs", "-o", "mode=0755", "k26-demo", top])
    Path(SERVING_BIND).mkdir(parents=True)
    run(["mount", "--bind", str(serving_venv), SERVING_BIND])
    run(["mount", "-o", "remount,bind,ro", SERVING_BIND])
    shutil.copytree(ROOT, SRC, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    thin_serving_venv(run, write)
    Path(WORKSPACE).mkdir(parents=True)
    return inside_env(serving_venv, build_env)


def enter_private_mount_namespace() -> None:
    """Leave the machine's mount namespace for one of this process's own: mounts made
    afterwards (by it and by its children) never reach the machine, and vanish with
    the last process in it. Needs root and a single-threaded process."""
    global _OUTER_MNT
    if threading.active_count() != 1:
        raise SandboxError("a private mount namespace needs a single-threaded process")
    outer = os.readlink("/proc/self/ns/mnt")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"unshare(CLONE_NEWNS): {os.strerror(err)} (root is needed)")
    _OUTER_MNT = outer
    done = subprocess.run(
        ["mount", "--make-rprivate", "/"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SandboxError(f"mount --make-rprivate /: {done.stderr.strip()}")


class Product:
    """k26-supervisor on a booted host, driven as an operator would."""

    def __init__(self, host: HostInfo, serving_venv: Path, build_env: dict[str, str]) -> None:
        """``serving_venv``: the host's venv that ``boot_binds`` bound into ``host``;
        ``build_env``: its k26-build.env, with host paths."""
        self.host = host
        self.serving_venv = serving_venv
        self.build_env = inside_env(serving_venv, build_env)

    # --- set-up an operator does by hand ---------------------------------------------

    def stage(self, source: Path = ROOT, at: str = SRC) -> None:
        """A copy of the checkout ``source`` at ``at`` in the container, as a release
        tarball unpacked on a server would be."""
        self._copy_in(source, at, shutil.ignore_patterns(*NOT_COPIED))

    def _copy_in(self, origin: Path, inside: str, ignore: Any = None) -> None:
        target = self.host.path(inside)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(origin, target, ignore=ignore, symlinks=True)

    def make_serving_venv(
        self, source: Path = ROOT, *, python: str = "/usr/bin/python3.11"
    ) -> None:
        """The checkout ``source`` copied in, the wheel mirror, /opt/sglang/venv (of
        ``python``: ``thin_serving_venv``), the models and the build environment."""
        h = self.host
        if not h.path(f"{SERVING_BIND}/bin").is_dir():
            raise SandboxError(
                f"the booted host has no serving venv at {SERVING_BIND}: boot it with "
                "binds_ro=deployed.boot_binds(venv)"
            )
        self.stage(source)
        thin_serving_venv(lambda argv: h.run(*argv).stdout, h.write, python=python)
        for model in ("/models/k26", "/models/k26-eagle3"):
            h.write(f"{model}/config.json", json.dumps({"architectures": ["LlamaForCausalLM"]}))
        # The build host's toolkit gaps (curand.h, cublasLt.h, -lcuda): see
        # scripts/serving-venv.sh. A GPU server needs none of this.
        h.write("/etc/k26-supervisor/build.env", env_file_text(self.build_env))

    def install(
        self, deb: Path | None = None, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``apt install ./k26-supervisor_*.deb`` (``deb``, else this checkout's build),
        then ``k26-supervisor units configure`` with the test's serving venv and models.
        Returns apt's run; its output and the configure's are in ``.stdout``."""
        deb = deb or deb_package()
        inside = f"{DEBS}/{deb.name}"
        self.host.path(DEBS).mkdir(parents=True, exist_ok=True)
        shutil.copy(deb, self.host.path(inside))
        done = self.apt("install", inside, check=check)
        if done.returncode != 0:
            return done
        units = self.configure_units(check=check)
        done.stdout += units.stdout
        done.returncode = units.returncode
        return done

    def apt(self, verb: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``apt-get -y VERB ARGS`` inside, as an operator's unattended run (no network:
        the package's dependencies are the host's own installed packages)."""
        return self.host.run(
            "apt-get", "-y", "-q", "--no-install-recommends", "-o", "APT::Sandbox::User=root",
            verb, *args,
            env={"DEBIAN_FRONTEND": "noninteractive"}, timeout_s=600, check=check,
        )  # fmt: skip

    def configure_units(self, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The operator's one step after the install: this host's values in the SGLang units."""
        return self.host.run(
            "k26-supervisor", "units", "configure",
            "--serving-venv", SERVING, "--model-path", "/models/k26",
            "--draft-model-path", "/models/k26-eagle3", "--arch", "12.0", *extra,
            check=check,
        )  # fmt: skip

    def configure(
        self,
        *,
        flashinfer: str | None = None,
        units: str | None = None,
        extra: str = "",
        startup_silence_s: float = 120,
    ) -> None:
        """Write the operator's config: the installed example's layout, test intervals."""
        fi = flashinfer or textwrap.dedent(
            f"""\
            [flashinfer]
            enabled = true
            python = "{SERVING}/bin/python"
            arch = "12.0"
            workspace = "{WORKSPACE}"
            env_file = "/etc/k26-supervisor/build.env"
            timeout_s = 900
            """
        )
        body = textwrap.dedent(
            """\
            [supervisor]
            bus = "system"
            listen = "127.0.0.1:9436"
            job_timeout_s = 60
            resync_interval_s = 5
            startup_silence_s = {silence}

            [probe]
            timeout_s = 10
            startup_deadline_s = 120
            interval_s = 1
            failures_to_fail = 2

            [restart]
            backoff_initial_s = 0.5
            backoff_max_s = 2
            max_failures = 4
            failure_window_s = 60
            """
        ).format(silence=startup_silence_s)
        unit_tables = units or textwrap.dedent(
            f"""\
            [[units]]
            name = "{EAGLE}"
            role = "eagle3"
            url = "http://127.0.0.1:30000"
            fallback = "{AR}"

            [[units]]
            name = "{AR}"
            role = "autoregressive"
            url = "http://127.0.0.1:30000"
            """
        )
        self.host.write(CONFIG, f"{body}\n{fi}\n{extra}\n{unit_tables}")  # as installed: 0644

    def standin_args(self, unit: str, args: str = QUICK) -> None:
        """A drop-in with the stand-in's own flags (faults, timings) for ``unit``."""
        self.host.write(
            f"/etc/systemd/system/{unit}.d/k26-test.conf",
            f'[Service]\nEnvironment="K26_STANDIN_ARGS={args}"\n',
        )
        self.host.systemctl("daemon-reload")

    # --- looking at it ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out = self.host.run("curl", "-sf", "http://127.0.0.1:9436/status", check=False)
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout else {}

    def wait_status(
        self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 120, what: str = "/status"
    ) -> dict[str, Any]:
        """The first /status for which ``pred`` holds; AssertionError naming ``what`` at the
        deadline (polled: the daemon's /status is the only window into the container)."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while True:
            last = self.status() or last
            if last and pred(last):
                return last
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {last})")
            time.sleep(0.1)

    def unit(self, status: dict[str, Any], name: str) -> dict[str, Any]:
        return status["units"][name]  # type: ignore[no-any-return]

    def log(self, since: str = "") -> str:
        args = (f"--since={since}",) if since else ()
        return self.host.journal(SUPERVISOR, *args)

    def reset(self) -> None:
        """Between tests: supervisor and both units down, holds and stale results cleared."""
        h = self.host
        h.systemctl("stop", SUPERVISOR, check=False)
        h.systemctl("stop", EAGLE, AR, check=False)
        h.systemctl("reset-failed", SUPERVISOR, EAGLE, AR, check=False)
        h.run("rm", "-f", "/run/k26-supervisor/state.json")

    def start_supervisor(
        self, timeout_s: float = 900
    ) -> tuple[subprocess.CompletedProcess[str], float]:
        started = time.monotonic()
        done = self.host.run("systemctl", "start", SUPERVISOR, timeout_s=timeout_s, check=False)
        return done, time.monotonic() - started
