"""deploy/install.py on a booted host: install, re-install, upgrade, uninstall.

A fresh container of its own (the one in test_booted_host.py serves the other
tests), checked after each step with systemctl and ``systemd-analyze verify``
as an operator would, not by looking at files alone.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from k26dev import bootedhost
from k26dev.deployed import NOT_COPIED
from tests.measured import record

from .booted import (
    AR,
    CONFIG,
    EAGLE,
    INSTALL,
    ROOT,
    SERVING,
    SUPERVISOR,
    WHEELS,
    WORKSPACE,
    Product,
    boot_binds,
)

pytestmark = [pytest.mark.integration, pytest.mark.booted]

UNIT_DIR = "/usr/local/lib/systemd/system"
UNITS = (SUPERVISOR, AR, EAGLE)


@pytest.fixture(scope="module")
def fresh(
    tmp_path_factory: pytest.TempPathFactory, serving_07: tuple[Path, dict[str, str]]
) -> Iterator[Product]:
    python, env = serving_07
    venv = python.parent.parent
    with bootedhost.running(tmp_path_factory.mktemp("fresh"), binds_ro=boot_binds(venv)) as host:
        product = Product(host, venv, env)
        product.make_serving_venv()
        yield product


def verify(product: Product) -> str:
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
    return done.stderr


def test_install_reinstall_upgrade_and_uninstall(fresh: Product) -> None:
    product = fresh
    h = product.host
    assert h.systemctl("cat", SUPERVISOR, check=False) == ""  # nothing yet

    # 1. Install: units the booted manager loads, users, the cache, the polkit rule.
    done = product.install()
    assert "install done" in done.stdout, done.stdout
    for unit in UNITS:
        assert h.show(unit, "LoadState") == "loaded", unit
        assert h.show(unit, "FragmentPath") == f"{UNIT_DIR}/{unit}"
    verify(product)
    for user in ("k26-supervisor", "sglang-k26"):
        h.run("id", user)
    cache = h.run("stat", "-c", "%a %U %G", "/var/cache/sglang-k26/flashinfer").stdout.split()
    assert cache == ["2770", "sglang-k26", "sglang-k26"]
    assert h.path("/etc/polkit-1/rules.d/50-k26-supervisor.rules").is_file()
    assert h.show(SUPERVISOR, "UnitFileState") == "disabled"  # enabling is the operator's call
    # The venv runs: the installed command answers.
    version = h.run("/opt/k26-supervisor/venv/bin/k26-supervisor", "--version").stdout
    assert "k26-supervisor" in version

    # 2. Re-install: nothing to do.
    again = product.install()
    assert "nothing to do" in again.stdout, again.stdout

    # 3. Upgrade: a new release of the source with a changed unit, an edited config.
    product.configure()  # the operator's own config
    operator_config = h.path(CONFIG).read_text()
    product.stage(ROOT, "/opt/k26-release")  # written into the container, not the host
    unit = h.path("/opt/k26-release") / "units" / SUPERVISOR
    unit.write_text(unit.read_text().replace("TimeoutStopSec=30s", "TimeoutStopSec=45s"))
    upgrade = h.run(
        "/usr/bin/python3.11",
        "/opt/k26-release/deploy/install.py",
        "--wheels",
        WHEELS,
        "--python",
        "/usr/bin/python3.11",
        timeout_s=600,
    )
    assert f"update  {UNIT_DIR}/{SUPERVISOR}" in upgrade.stdout, upgrade.stdout
    assert "systemctl daemon-reload" in upgrade.stdout
    assert h.show(SUPERVISOR, "TimeoutStopUSec") == "45s"  # the manager has the new unit
    assert h.path(CONFIG).read_text() == operator_config  # kept
    assert "kept your /etc/k26-supervisor/config.toml" in upgrade.stdout
    verify(product)

    # 4. Uninstall: the units go, the FlashInfer cache and the users stay.
    h.path("/var/cache/sglang-k26/flashinfer/marker").write_text("a warmed cache\n")
    gone = h.run("/usr/bin/python3.11", INSTALL, "--uninstall")
    assert "uninstall done" in gone.stdout, gone.stdout
    for unit_name in UNITS:
        assert h.show(unit_name, "LoadState") == "not-found", unit_name
    assert h.path("/var/cache/sglang-k26/flashinfer/marker").is_file()
    assert not h.path("/opt/k26-supervisor").exists()
    assert not h.path("/etc/polkit-1/rules.d/50-k26-supervisor.rules").exists()
    h.run("id", "k26-supervisor")  # kept: files may still be theirs
    # And once more: nothing left to do.
    assert "nothing to do" in h.run("/usr/bin/python3.11", INSTALL, "--uninstall").stdout


def test_a_bad_flag_changes_nothing_on_the_booted_host(fresh: Product) -> None:
    h = fresh.host
    before = h.run("find", "/etc", "/usr/local/lib", "-newer", "/etc/machine-id").stdout
    done = h.run(
        "/usr/bin/python3.11",
        INSTALL,
        "--serving-venv",
        "/opt/sglang/venv",
        "--model-path",
        "relative/path",
        "--draft-model-path",
        "/models/x",
        check=False,
    )
    assert done.returncode == 64 and "--model-path" in done.stderr
    assert "Traceback" not in done.stderr
    assert h.run("find", "/etc", "/usr/local/lib", "-newer", "/etc/machine-id").stdout == before


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
            assert "install done" in done.stdout, done.stdout
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
