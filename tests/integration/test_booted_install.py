"""The Debian package on a booted host: install, start, upgrade, remove, purge.

On Debian 12 (the machine's own root) and on Debian 13 (a debootstrapped trixie
root: systemd 257, python3.13), each a fresh container of its own (the one in test_booted_host.py serves the other
tests), driven with apt-get and systemctl as an operator would, and checked with
systemctl, dpkg and ``systemd-analyze verify``, not by looking at files alone. The
package is this checkout's ``scripts/deb.sh`` build (one per session, reused while
its inputs are unchanged); the "newer build" of the upgrade is that same package
repacked with a higher version and a changed supervisor unit (``dpkg-deb``), which
is what dpkg sees of any newer build.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from k26dev import bootedhost, shared_cache
from k26dev.deployed import NOT_COPIED
from tests.measured import record

from .booted import (
    AR,
    CONFIG,
    DEBS,
    EAGLE,
    ROOT,
    SERVING,
    SUPERVISOR,
    WORKSPACE,
    Product,
    boot_binds,
    deb_package,
)

pytestmark = [pytest.mark.integration, pytest.mark.booted]

UNIT_DIR = "/lib/systemd/system"
UNITS = (SUPERVISOR, AR, EAGLE)
PACKAGE = "k26-supervisor"
NO_WARMUP = "[flashinfer]\nenabled = false\n"


@pytest.fixture(scope="session")
def deb() -> Path:
    started = time.monotonic()
    path = deb_package()
    record(
        "deb: scripts/deb.sh (build and lintian, or reuse), s", f"{time.monotonic() - started:.1f}"
    )
    return path


@pytest.fixture(scope="module")
def newer_deb(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``deb`` as version ``<v>+k26test1`` whose supervisor unit has TimeoutStopSec=45s."""
    work = tmp_path_factory.mktemp("newer-deb")
    tree = work / "tree"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    text = control.read_text()
    version = re.search(r"^Version: (\S+)$", text, re.M)
    assert version, text
    newer = f"{version.group(1)}+k26test1"
    control.write_text(text.replace(version.group(0), f"Version: {newer}"))
    unit_rel = f"lib/systemd/system/{SUPERVISOR}"
    unit = tree / unit_rel
    unit.write_text(unit.read_text().replace("TimeoutStopSec=30s", "TimeoutStopSec=45s"))
    md5 = subprocess.run(["md5sum", unit_rel], cwd=tree, capture_output=True, text=True, check=True)
    sums = tree / "DEBIAN" / "md5sums"
    sums.write_text(
        "".join(
            md5.stdout if line.endswith(f"  {unit_rel}\n") else line
            for line in sums.read_text().splitlines(keepends=True)
        )
    )
    out = work / deb.name.replace(f"_{version.group(1)}_", f"_{newer}_")
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(out)], check=True,
                   capture_output=True)  # fmt: skip
    return out


# Where the package is installed: the release, its root (None: this machine's own,
# Debian 12), and the python3 the package's postinst builds the venv with.
RELEASES = {"debian12": (None, "3.11"), "debian13": ("trixie", "3.13")}
# systemd 256 and later boot on cgroup v1 (this machine's layout) only when asked to.
LEGACY_CGROUPS = ["systemd.unified_cgroup_hierarchy=0", "SYSTEMD_CGROUP_ENABLE_LEGACY_FORCE=1"]


@pytest.fixture(scope="module", params=sorted(RELEASES))
def fresh(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    serving_07: tuple[Path, dict[str, str]],
) -> Iterator[Product]:
    python, env = serving_07
    venv = python.parent.parent
    release, _ = RELEASES[request.param]
    lower = shared_cache.debian_root(release) if release else None
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    with bootedhost.running(
        tmp_path_factory.mktemp(f"fresh-{request.param}"),
        binds_ro=boot_binds(venv),
        lower=lower,
        boot_args=LEGACY_CGROUPS if lower and not unified else (),
    ) as host:
        product = Product(host, venv, env)
        # Another release's python cannot load the bound serving venv's packages:
        # the stand-in alone, from that python (the test runs without the warm-up).
        product.make_serving_venv(
            python="/usr/bin/python3.11" if not release else "/usr/bin/python3"
        )
        yield product


def verify(product: Product) -> None:
    """``systemd-analyze verify`` of the installed units, as the booted system loads them."""
    done = product.host.run(
        "systemd-analyze",
        "verify",
        "--man=no",
        "--recursive-errors=no",
        *(f"{UNIT_DIR}/{u}" for u in UNITS),
        check=False,
    )
    ours = [ln for ln in done.stderr.splitlines() if any(u in ln for u in UNITS)]
    assert done.returncode == 0 and not ours, done.stderr


def dpkg_status(product: Product) -> str:
    done = product.host.run("dpkg-query", "-W", "-f=${Status} ${Version}", PACKAGE, check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def upper_layer(product: Product) -> Path:
    """The booted host's writable layer: everything written in it since boot."""
    h = product.host
    return Path(f"/proc/{h.launcher_pid}/root") / h.dir.lstrip("/") / "layers" / "upper"


def test_apt_install_start_upgrade_remove_and_purge(
    fresh: Product, deb: Path, newer_deb: Path, request: pytest.FixtureRequest
) -> None:
    product = fresh
    h = product.host
    release = request.node.callspec.params["fresh"]
    _, python_version = RELEASES[release]
    assert h.systemctl("cat", SUPERVISOR, check=False) == ""  # nothing yet
    steps: dict[str, float] = {}

    # 1. apt install ./k26-supervisor_*.deb: units loaded, nothing started or enabled.
    started = time.monotonic()
    done = product.install(deb)
    steps["install"] = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Setting up {PACKAGE}" in done.stdout, done.stdout
    assert dpkg_status(product).startswith("install ok installed")
    for unit in UNITS:
        assert h.show(unit, "LoadState") == "loaded", unit
        # Debian 13's /lib is /usr/lib (merged /usr): systemd names the real path.
        assert h.show(unit, "FragmentPath") in (f"{UNIT_DIR}/{unit}", f"/usr{UNIT_DIR}/{unit}")
        assert h.show(unit, "ActiveState") == "inactive", unit  # the package started nothing
    assert h.show(SUPERVISOR, "UnitFileState") == "disabled"  # enabling is the operator's call
    for unit in (AR, EAGLE):  # no [Install]: only the supervisor starts them
        assert h.show(unit, "UnitFileState") == "static", unit
        assert h.show(unit, "DropInPaths").endswith(f"{unit}.d/50-k26-units.conf"), unit
    assert h.show(EAGLE, "ExecStart").startswith(f"{{ path={SERVING}/bin/python ;")
    verify(product)
    for user in ("k26-supervisor", "sglang-k26"):
        h.run("id", user)
    cache = h.run("stat", "-c", "%a %U %G", WORKSPACE).stdout.split()
    assert cache == ["2770", "sglang-k26", "sglang-k26"]
    assert h.path("/usr/share/polkit-1/rules.d/50-k26-supervisor.rules").is_file()
    conffiles = h.run("dpkg-query", "-W", "-f=${Conffiles}", PACKAGE).stdout
    assert CONFIG in conffiles, conffiles
    assert "k26-supervisor" in h.run("k26-supervisor", "--version").stdout
    # The venv the postinst built: this release's python3, every wheel hash-checked.
    venv_python = h.run("/opt/k26-supervisor/venv/bin/python", "-c",
                        "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()  # fmt: skip
    assert venv_python == python_version, (release, venv_python)
    assert f"built with /usr/bin/python{python_version}" in done.stdout, done.stdout
    # A python3 upgrade fires the package's trigger: the venv is rebuilt when what it
    # was built with differs (here: its stamp says so), and left alone otherwise.
    stamp = h.path("/opt/k26-supervisor/venv/.k26-venv")
    built = stamp.read_text()
    h.run("dpkg-trigger", "--no-await", "/usr/bin/python3")
    h.run("dpkg", "--triggers-only", "--pending")
    assert stamp.read_text() == built  # unchanged: not rebuilt
    stamp.write_text("/usr/bin/python3.10 3.10 0\n")
    h.run("dpkg-trigger", "--no-await", "/usr/bin/python3")
    rebuilt = h.run("dpkg", "--triggers-only", "--pending")
    assert "its venv /opt/k26-supervisor/venv is built" in rebuilt.stdout + rebuilt.stderr
    assert stamp.read_text() == built
    assert dpkg_status(product).startswith("install ok installed")
    # A bad value is refused before anything is written.
    before = h.run("find", "/etc/systemd", "-newer", "/etc/machine-id").stdout
    bad = product.configure_units("--model-path", "relative/path", check=False)
    assert bad.returncode == 64 and "--model-path" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    assert h.run("find", "/etc/systemd", "-newer", "/etc/machine-id").stdout == before

    # 2. The operator's config, then systemctl start: READY after the sampled probe.
    product.configure(flashinfer=NO_WARMUP)
    operator_config = h.path(CONFIG).read_text()
    for unit in (EAGLE, AR):
        product.standin_args(unit)
    started_ok, took = product.start_supervisor(timeout_s=300)
    assert started_ok.returncode == 0, (started_ok.stderr, product.log()[-3000:])
    steps["systemctl start"] = took
    status = product.status()
    assert status["ready"] is True, status
    assert product.unit(status, EAGLE)["last_probe"]["ok"] is True
    # Its state directory (StateDirectory=): private, where the learned shapes live.
    state = h.run("stat", "-c", "%a %U", "/var/lib/k26-supervisor").stdout.split()
    assert state == ["700", "k26-supervisor"], state
    learned = product.unit(status, EAGLE)["learned_shapes"]
    assert learned["path"] == "/var/lib/k26-supervisor/k26-learned-shapes.json", learned
    eagle = {p: h.show(EAGLE, p) for p in ("InvocationID", "MainPID", "ActiveState")}
    assert eagle["ActiveState"] == "active"
    daemon_pid = h.show(SUPERVISOR, "MainPID")

    # 3. Upgrade to a newer build: the edited config kept, the daemon restarted (with
    # the new unit), the ready SGLang unit untouched.
    started = time.monotonic()
    shutil.copy(newer_deb, h.path(f"{DEBS}/{newer_deb.name}"))
    up = product.apt("install", f"{DEBS}/{newer_deb.name}")
    steps["upgrade"] = time.monotonic() - started
    assert "+k26test1" in dpkg_status(product), up.stdout
    assert h.path(CONFIG).read_text() == operator_config
    assert not h.path(f"{CONFIG}.dpkg-dist").exists() and not h.path(f"{CONFIG}.dpkg-old").exists()
    assert h.show(SUPERVISOR, "ActiveState") == "active"
    assert h.show(SUPERVISOR, "MainPID") != daemon_pid  # restarted
    assert h.show(SUPERVISOR, "TimeoutStopUSec") == "45s"  # by the new unit
    assert {p: h.show(EAGLE, p) for p in eagle} == eagle  # the same run of the same process
    status = product.wait_status(lambda s: s.get("ready") is True, 120, "READY after the upgrade")
    assert product.unit(status, EAGLE)["last_probe"]["ok"] is True
    assert {p: h.show(EAGLE, p) for p in eagle} == eagle

    # 4. apt remove: the daemon stops; the SGLang unit, the config, the caches and the
    # users stay.
    h.path(f"{WORKSPACE}/marker").write_text("a warmed cache\n")
    started = time.monotonic()
    product.apt("remove", PACKAGE)
    steps["remove"] = time.monotonic() - started
    assert dpkg_status(product).startswith("deinstall ok config-files")
    assert h.show(SUPERVISOR, "ActiveState") == "inactive"
    assert {p: h.show(EAGLE, p) for p in eagle} == eagle  # still serving, same process
    assert h.path(CONFIG).read_text() == operator_config
    assert h.path(f"{WORKSPACE}/marker").is_file()
    for user in ("k26-supervisor", "sglang-k26"):
        h.run("id", user)
    assert not h.path("/opt/k26-supervisor").exists()
    assert not h.path("/usr/bin/k26-supervisor").exists()

    # 5. apt purge: nothing the package (or its `units configure`) made is left.
    started = time.monotonic()
    product.apt("purge", PACKAGE)
    steps["purge"] = time.monotonic() - started
    assert dpkg_status(product) == "unknown" or "not-installed" in dpkg_status(product)
    for unit in (AR, EAGLE):
        assert h.show(unit, "ActiveState") == "inactive", unit  # stopped, not failed
    for path in ("/var/cache/sglang-k26", "/var/cache/k26-supervisor", "/run/k26-supervisor",
                 "/var/lib/k26-supervisor", "/opt/k26-supervisor", CONFIG):  # fmt: skip
        assert not h.path(path).exists(), path
    for user in ("k26-supervisor", "sglang-k26"):
        assert h.run("getent", "passwd", user, check=False).returncode == 2, user
        assert h.run("getent", "group", user, check=False).returncode == 2, user
    # Whatever is left in the writable layer under the package's names is the test's
    # own: its build.env, its stand-in drop-ins, its serving venv and the .debs.
    ours = re.compile(r"/(k26-supervisor|sglang-k26)")
    test_own = re.compile(
        r"^/(opt/k26-test|opt/sglang)(/|$)"
        r"|^/etc/k26-supervisor(/build\.env)?$"
        r"|^/etc/systemd/system/sglang-k26(-eagle3)?\.service\.d(/k26-test\.conf)?$"
    )
    upper = upper_layer(product)
    left = sorted(
        path
        for path in ("/" + str(p.relative_to(upper)) for p in upper.rglob("*"))
        if ours.search(path) and not test_own.search(path)
    )
    assert left == [], left
    for step, seconds in steps.items():
        record(f"booted host ({release}): the .deb, {step}, s", f"{seconds:.1f}")


@pytest.mark.parametrize("where", ["/tmp", "home"])
def test_install_and_start_from_a_checkout_under(
    where: str,
    booted_bundle: Path,
    serving_07: tuple[Path, dict[str, str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A clone under /tmp (the container's /tmp is its own) or a home directory (the
    hardened units' ProtectHome= hides it): the booted host gets a copy of the
    checkout and the serving venv bound outside the protected paths, never a path
    into the clone, so the install and `systemctl start` work from either."""
    parent = Path("/tmp") if where == "/tmp" else Path.home()
    base = Path(tempfile.mkdtemp(prefix="k26-clone-", dir=parent))
    try:
        checkout = base / "k26-supervisor"
        shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
        python, env = serving_07
        venv = python.parent.parent
        with bootedhost.running(
            tmp_path_factory.mktemp(f"clone-{where.strip('/')}"), binds_ro=boot_binds(venv)
        ) as host:
            product = Product(host, venv, env)
            product.make_serving_venv(source=checkout)
            pth = host.run("sh", "-c", f"cat {SERVING}/lib/python3.11/site-packages/*.pth").stdout
            assert str(checkout) not in pth and str(parent) not in pth, pth
            done = product.install()
            assert f"Setting up {PACKAGE}" in done.stdout, done.stdout
            product.configure()
            for unit in (EAGLE, AR):
                product.standin_args(unit)
            # The session's build, as a node pulls it: the start then verifies it as the
            # hardened daemon (reading the serving venv under ProtectHome=), no build.
            shutil.copy(booted_bundle, host.path("/root/b.k26bundle.tar.gz"))
            host.run(
                "/opt/k26-supervisor/venv/bin/k26-supervisor", "flashinfer", "bundle",
                "import", "--python", f"{SERVING}/bin/python", "--arch", "12.0",
                "--workspace", WORKSPACE, "--env-file", "/etc/k26-supervisor/build.env",
                "/root/b.k26bundle.tar.gz", timeout_s=300,
            )  # fmt: skip
            started, took = product.start_supervisor(timeout_s=600)
            assert started.returncode == 0, (started.stderr, product.log()[-3000:])
            status = product.status()
            assert status["ready"] is True, status
            assert product.unit(status, EAGLE)["last_probe"]["ok"] is True
            assert "building" not in product.log()
            record(
                f"booted host: install and start from a checkout under {where}, s", f"{took:.1f}"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
