"""Test helpers for the booted host, on top of ``k26dev.deployed``."""

from __future__ import annotations

import subprocess

from k26dev.deployed import (
    AR,
    CONFIG,
    DEBS,
    EAGLE,
    QUICK,
    ROOT,
    SERVING,
    SUPERVISOR,
    WORKSPACE,
    Product,
    boot_binds,
    deb_package,
)

__all__ = [
    "AR",
    "CONFIG",
    "DEBS",
    "EAGLE",
    "QUICK",
    "ROOT",
    "SERVING",
    "SUPERVISOR",
    "WORKSPACE",
    "Product",
    "as_the_supervisor",
    "boot_binds",
    "confinement",
    "deb_package",
]


# [Service] keys that say how to run, not what confines: left out of a transient copy.
_RUN_KEYS = {
    "Type", "NotifyAccess", "ExecStart", "ExecReload", "TimeoutStartSec", "WatchdogSec",
    "TimeoutStopSec", "KillMode", "Restart", "RestartSec", "RestartPreventExitStatus",
    "RuntimeDirectory", "RuntimeDirectoryMode", "RuntimeDirectoryPreserve",
}  # fmt: skip


def confinement(product: Product, unit: str = SUPERVISOR) -> list[str]:
    """``-p KEY=VALUE`` for every confining [Service] setting of the installed ``unit``
    and its drop-ins, to run a command exactly as confined as the daemon is."""
    text = product.host.systemctl("cat", unit)
    props: list[str] = []
    section = ""
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if logical:
            line, logical = logical + " " + line, ""
        if line.endswith("\\"):
            logical = line[:-1]
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key, sep, value = line.partition("=")
        if section == "[Service]" and sep and key not in _RUN_KEYS:
            props += ["-p", f"{key}={value}"]
    return props


def as_the_supervisor(
    product: Product, *argv: str, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the installed unit runs the daemon: its user, its sandbox."""
    return product.host.run(
        "systemd-run", "--wait", "--pipe", "--collect", "--quiet",
        *confinement(product), "--", *argv,
        timeout_s=timeout_s, check=False,
    )  # fmt: skip
