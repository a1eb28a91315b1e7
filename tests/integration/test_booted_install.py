"""deploy/install.py on a booted host: install, re-install, upgrade, uninstall.

A fresh container of its own (the one in test_booted_host.py serves the other
tests), checked after each step with systemctl and ``systemd-analyze verify``
as an operator would, not by looking at files alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.devtools import bootedhost

from .booted import AR, CONFIG, EAGLE, INSTALL, ROOT, SUPERVISOR, WHEELS, Product, boot_binds

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
