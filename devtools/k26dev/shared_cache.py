"""The shared cache outside the clone, for what the tests, the demo and the benches need.

Serving venvs with real FlashInfer releases, Debian's Prometheus and Alertmanager
binaries, the Debian package's wheelhouse and the staleness tests' toolkits are big and
slow to fetch, and no clone should fetch them twice. They live in one directory
outside any clone, each entry keyed by the exact versions it holds:
``$K26_SERVING_CACHE``, else ``$XDG_CACHE_HOME/k26-supervisor``, else
``~/.cache/k26-supervisor`` (``scripts/cache-dir.sh`` is the same rule for the
shell scripts, which make the entries).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

from k26dev.errors import SandboxError

REPO = Path(__file__).resolve().parents[2]  # devtools/k26dev/shared_cache.py
SCRIPTS = REPO / "scripts"


def root() -> Path:
    """The cache directory (not created here)."""
    explicit = os.environ.get("K26_SERVING_CACHE")
    if explicit:
        return Path(explicit).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "k26-supervisor"


def _script_path(*argv: str) -> Path:
    done = subprocess.run(
        ["bash", str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SandboxError(f"scripts/{' '.join(argv)}: {done.stderr.strip()}")
    return Path(done.stdout.strip())


def tools_dir() -> Path:
    """Where ``scripts/tools.sh`` unpacks Debian's prometheus and alertmanager packages;
    its ``bin/`` holds prometheus, promtool, alertmanager and amtool."""
    return _script_path("tools.sh", "path")


def serving_venv(name: str, *, make: bool = True) -> Path:
    """The serving venv ``name`` (``0.7``, ``0.2``, ``0.7.0-cu128``): made or checked by
    ``scripts/serving-venv.sh`` first unless ``make`` is false. Raises SandboxError with
    the script's output when it fails."""
    script = str(SCRIPTS / "serving-venv.sh")
    if make:
        done = subprocess.run(["bash", script, name], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxError(
                f"scripts/serving-venv.sh {name} failed:\n{done.stdout}\n{done.stderr}"
            )
    return _script_path("serving-venv.sh", "path", name)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One maker of ``path`` at a time, across processes (test workers, a CI run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# The build backends the package's build needs offline: the product's own, and Cython
# for the dependencies kept as source (pystemd). pip is carried in the package: its
# postinst installs the venv with it, offline, from the package's own wheels.
BUILD_REQUIREMENTS = ("setuptools>=77", "wheel", "cython", "pip")
# The glibc the carried wheels may need at most: every supported distribution has it
# (Debian 12: 2.36, Ubuntu 24.04: 2.39, Debian 13: 2.41); debian/control's libc6 bound.
# pip takes a platform tag literally: every manylinux tag up to that glibc is named,
# newest first (the order is the preference).
MANYLINUX_GLIBC = 28
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(MANYLINUX_GLIBC, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
]  # fmt: skip


def python_versions() -> list[str]:
    """The CPython minor versions the package carries wheels for (debian/python-versions)."""
    text = (REPO / "debian" / "python-versions").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def wheelhouse() -> Path:
    """What the Debian package's build needs offline: every dependency as a wheel, but
    as its source archive where the wheel would be one built here (``*-linux_*.whl``:
    pystemd, which PyPI has no wheel of; the package compiles it once, for CPython's
    stable ABI, with Debian's build flags); the same versions' wheels for every other
    CPython the package supports (``python_versions``: the binary ones differ); and
    the build backends and pip. Never the product itself (debian/rules builds it
    from the checkout). Keyed by pyproject.toml and the supported versions; made with
    the project venv's pip (network) the first time only."""
    key = (REPO / "pyproject.toml").read_bytes() + " ".join(python_versions()).encode()
    digest = hashlib.sha256(key).hexdigest()
    wheels = root() / f"wheelhouse-{digest[:10]}"
    marker = wheels / ".k26-wheelhouse-3"  # 3: a wheel set per CPython version
    with _locked(wheels):
        if marker.exists() and marker.read_text() == digest:
            return wheels
        staging = wheels.with_name(wheels.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        pip = [str(REPO / ".venv" / "bin" / "pip"), "--disable-pip-version-check", "-q"]
        # The dependencies as pyproject.toml names them: the product itself is never
        # built here (an in-tree build would leave build/ and an egg-info in the clone,
        # whose metadata then shadows the editable install's).
        _pip([*pip, "wheel", "--wheel-dir", str(staging), *dependencies()])
        sources = []
        for local in staging.glob("*-linux_*.whl"):
            name, version = local.name.split("-")[:2]
            _pip([*pip, "download", "--no-deps", "--no-binary", name, "--dest", str(staging),
                  f"{name}=={version}"])  # fmt: skip
            sources.append(name)
            local.unlink()
        # Every other supported CPython: the same versions (pinned to what was just
        # resolved), binary wheels only; the dependencies kept as source bring their
        # own requirements in by name.
        pins = staging / "pins.txt"
        pins.write_text("".join(f"{n}=={v}\n" for n, v in _wheel_versions(staging)))
        wanted = [d for d in dependencies() if _name(d) not in {_name(s) for s in sources}]
        wanted += _source_requirements(staging)
        for version in python_versions():
            abi = "cp" + version.replace(".", "")
            _pip([*pip, "download", "--only-binary", ":all:", "--python-version", version,
                  "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
                  *(a for p in PLATFORMS for a in ("--platform", p)),
                  "--dest", str(staging), "-c", str(pins), *wanted])  # fmt: skip
        pins.unlink()
        _pip([*pip, "download", "--dest", str(staging), *BUILD_REQUIREMENTS])
        (staging / marker.name).write_text(digest)
        shutil.rmtree(wheels, ignore_errors=True)
        staging.rename(wheels)
    return wheels


def _name(requirement: str) -> str:
    """A requirement's or a file name's project name, normalized (PEP 503)."""
    import re

    head = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", head).lower()


def _wheel_versions(directory: Path) -> list[tuple[str, str]]:
    return sorted({(w.name.split("-")[0], w.name.split("-")[1]) for w in directory.glob("*.whl")})


def _source_requirements(directory: Path) -> list[str]:
    """The runtime requirements of the source archives in ``directory`` (pystemd's:
    lxml, psutil), read from their PKG-INFO."""
    import email.parser
    import tarfile

    out: list[str] = []
    for sdist in directory.glob("*.tar.gz"):
        with tarfile.open(sdist) as tar:
            info = next(m for m in tar.getmembers() if m.name.count("/") == 1
                        and m.name.endswith("/PKG-INFO"))  # fmt: skip
            data = tar.extractfile(info)
            assert data is not None
            meta = email.parser.Parser().parsestr(data.read().decode())
        out += [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return out


# A release's root for the package's install test: what booting it and installing the
# package need (polkitd's dependencies: a system bus and logind), and curl, with which
# the test reads the daemon's /status inside.
DEBIAN_ROOT_PACKAGES = (
    "python3", "systemd", "dbus", "polkitd", "libpam-systemd", "libsystemd0", "curl",
)  # fmt: skip
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def debian_root(release: str) -> Path:
    """A minimal root of Debian ``release`` (``debootstrap --variant=minbase`` from
    Debian's mirror, with ``DEBIAN_ROOT_PACKAGES``), made once and never written
    afterwards: tests boot an overlay of it (``bootedhost.running(lower=...)``)."""
    key = hashlib.sha256(f"{release} {' '.join(DEBIAN_ROOT_PACKAGES)}".encode()).hexdigest()
    entry = root() / f"debian-{release}-{key[:10]}"
    marker = entry / ".k26-debian-root"
    with _locked(entry):
        if marker.exists():
            return entry / "root"
        if shutil.which("debootstrap") is None:
            raise SandboxError("debootstrap not found: run scripts/dev.sh setup (it installs it)")
        staging = entry.with_name(entry.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        argv = ["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_ROOT_PACKAGES)}",
                release, str(staging / "root"), DEBIAN_MIRROR]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxError(f"debootstrap {release} failed: {done.stdout[-2000:]}{done.stderr}")
        (staging / marker.name).write_text(release + "\n")
        shutil.rmtree(entry, ignore_errors=True)
        staging.rename(entry)
    return entry / "root"


def dependencies() -> list[str]:
    """The product's runtime requirements, as pyproject.toml states them."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def _pip(argv: list[str]) -> None:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SandboxError(f"{' '.join(argv[3:5])} failed: {done.stderr.strip()}")


def main() -> int:
    """``python -m k26dev.shared_cache wheelhouse``: print the wheelhouse, made if needed
    (``scripts/deb.sh`` passes it to the package build)."""
    import sys

    if sys.argv[1:] != ["wheelhouse"]:
        print("usage: python -m k26dev.shared_cache wheelhouse", file=sys.stderr)
        return 64
    try:
        print(wheelhouse())
    except SandboxError as exc:
        print(f"k26dev.shared_cache: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
