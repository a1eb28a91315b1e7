"""The two steps that run as the sandbox's own processes (see ``sandbox``).

``launch``: put this very process into the ``k26sbx-*`` cgroups, prove it is
there, then exec ``unshare`` into new cgroup and mount namespaces.

``inner``: inside the namespaces, prove the confinement (new cgroup namespace,
every hierarchy's root is our subtree, ``/run/systemd`` is a private tmpfs),
mount what systemd needs and exec ``systemd --user``.

Run as a file (``python -I .../sandbox_inner.py``), so that it needs neither the
package installed nor a PYTHONPATH: on a GPU host the daemon's code is a checkout.

Two layouts: ``hybrid`` (these CPU machines: cgroup v1 controllers plus a
controller-less cgroup2 at ``/sys/fs/cgroup/unified``) and ``unified`` (one
cgroup2 hierarchy at ``/sys/fs/cgroup`` with the controllers, as on most GPU
servers). In the unified one the namespace sees only cgroup2, so systemd runs in
its full unified mode and can enforce ``MemoryMax=``.

Any check that fails exits non-zero *before* systemd runs: the manager never
starts unconfined. Stdlib only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
HIERARCHIES = ("systemd", "unified", "cpu", "memory", "pids")
V1_MOUNT_OPTS = {"cpu": "cpu", "memory": "memory", "pids": "pids", "systemd": "none,name=systemd"}
# A systemd of one's own (the GPU kit's, on a host without systemd) may replace it.
SYSTEMD_BINARY = os.environ.get("K26_SYSTEMD_BINARY") or "/usr/lib/systemd/systemd"


def _die(message: str) -> None:
    print(f"k26sbx: refusing: {message}", file=sys.stderr, flush=True)
    raise SystemExit(70)


def _own_cgroups() -> dict[str, str]:
    """Map hierarchy name ('systemd', 'memory', ..., '' for cgroup2) to our path."""
    found: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found["unified"] = path
        for ctrl in controllers.split(","):
            found[ctrl.removeprefix("name=")] = path
    return found


def _hierarchies(layout: str) -> tuple[str, ...]:
    return ("unified",) if layout == "unified" else HIERARCHIES


def _cgroup_dir(layout: str, hierarchy: str, name: str) -> Path:
    return CGROUP_ROOT / name if layout == "unified" else CGROUP_ROOT / hierarchy / name


def launch(name: str, runtime: str, layout: str) -> None:
    if not name.startswith("k26sbx-") or "/" in name:
        _die(f"bad sandbox name {name!r}")
    for hierarchy in _hierarchies(layout):
        procs = _cgroup_dir(layout, hierarchy, name) / "cgroup.procs"
        try:
            procs.write_text(f"{os.getpid()}\n")
        except OSError as exc:
            _die(f"cannot enter {procs}: {exc}")
    own = _own_cgroups()
    for hierarchy in _hierarchies(layout):
        if own.get(hierarchy) != f"/{name}":
            _die(f"not inside /{name} in hierarchy {hierarchy} (in {own.get(hierarchy)!r})")
    argv = [
        "unshare",
        "--cgroup",
        "--mount",
        "--propagation",
        "private",
        "--",
        sys.executable,
        "-I",
        os.path.abspath(__file__),
        "inner",
        "--name",
        name,
        "--runtime",
        runtime,
        "--layout",
        layout,
        "--outer-ns",
        ",".join(os.readlink(f"/proc/self/ns/{ns}") for ns in ("cgroup", "mnt")),
    ]
    os.execvp("unshare", argv)


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        _die(f"mount {' '.join(args)}: {result.stderr.strip()}")


def _mount_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        parts = left.split()
        table[parts[4]] = right.split()[0]
    return table


def _root_holds_only_us(root: Path) -> None:
    """Seen through our namespace, the root cgroup must hold exactly this process."""
    procs = (root / "cgroup.procs").read_text().split()
    if procs != [str(os.getpid())]:
        _die(f"{root} root holds {procs}, expected only this process")


def _mount_unified() -> None:
    """Only cgroup2, our subtree as its root, on ``/sys/fs/cgroup``. The host's own
    cgroup2 mount is detached first (in this private mount namespace only: mounting
    the same hierarchy again on top of it fails with "already mounted")."""
    result = subprocess.run(
        ["umount", "-l", str(CGROUP_ROOT)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        _die(f"umount -l {CGROUP_ROOT}: {result.stderr.strip()}")
    _mount("-t", "cgroup2", "-o", "nosuid,nodev,noexec", "cgroup2", str(CGROUP_ROOT))
    _root_holds_only_us(CGROUP_ROOT)


def _mount_hybrid() -> None:
    _mount("-t", "tmpfs", "-o", "mode=755", "k26sbx", str(CGROUP_ROOT))
    for hierarchy in HIERARCHIES:
        target = CGROUP_ROOT / hierarchy
        target.mkdir()
        if hierarchy == "unified":
            _mount("-t", "cgroup2", "cgroup2", str(target))
        else:
            _mount("-t", "cgroup", "-o", V1_MOUNT_OPTS[hierarchy], "cgroup", str(target))
            _root_holds_only_us(target)


def inner(name: str, runtime: str, outer_ns: str, layout: str) -> None:
    # 1. We must be in a cgroup and a mount namespace of our own: not the
    #    launcher's (recorded before unshare), and not PID 1's where readable.
    outer = dict(zip(("cgroup", "mnt"), outer_ns.split(","), strict=True))
    for ns in ("cgroup", "mnt"):
        mine = os.readlink(f"/proc/self/ns/{ns}")
        if mine == outer[ns]:
            _die(f"still in the launcher's {ns} namespace")
        try:
            if mine == os.readlink(f"/proc/1/ns/{ns}"):
                _die(f"still in PID 1's {ns} namespace")
        except OSError:
            pass  # PID 1's namespaces may be hidden from us; the launcher check holds.
    # 2. Through the new cgroup namespace, our subtree is every hierarchy's root.
    own = _own_cgroups()
    for hierarchy in _hierarchies(layout):
        if own.get(hierarchy) != "/":
            _die(
                f"hierarchy {hierarchy} root is not the sandbox (we are at {own.get(hierarchy)!r})"
            )
    # 3. Re-mount the hierarchies so systemd sees only the subtree.
    if layout == "unified":
        _mount_unified()
    else:
        _mount_hybrid()
    # 4. /run/systemd/system on a private tmpfs, never on the real filesystem (a host
    #    without systemd may lack the empty mount point).
    Path("/run/systemd").mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", "mode=755", "k26sbx", "/run/systemd")
    Path("/run/systemd/system").mkdir()
    table = _mount_table()
    cgroup_fs = "cgroup2" if layout == "unified" else "tmpfs"
    if table.get("/run/systemd") != "tmpfs" or table.get(str(CGROUP_ROOT)) != cgroup_fs:
        _die("private mounts are not in place")
    # 5. The manager. The session bus is its own dbus.socket/dbus.service, as on
    #    a real host: a restart of dbus.service is then what it is there, and
    #    only one bus ever listens on the path.
    bus = Path(runtime) / "bus"
    bus.unlink(missing_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = runtime
    os.environ["DBUS_SESSION_BUS_ADDRESS"] = f"unix:path={bus}"
    os.environ.setdefault("SYSTEMD_LOG_TARGET", "console")
    os.execv(SYSTEMD_BINARY, [SYSTEMD_BINARY, "--user"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="k26dev.sandbox_inner")
    parser.add_argument("step", choices=["launch", "inner"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--layout", choices=["hybrid", "unified"], default="hybrid")
    parser.add_argument("--outer-ns", default="")
    args = parser.parse_args(argv)
    if args.step == "launch":
        launch(args.name, args.runtime, args.layout)
    else:
        if not args.outer_ns:
            _die("inner step needs --outer-ns (run it through 'launch')")
        inner(args.name, args.runtime, args.outer_ns, args.layout)


if __name__ == "__main__":
    main()
