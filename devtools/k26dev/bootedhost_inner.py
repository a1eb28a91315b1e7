"""The two steps that run as the booted host's own process (see ``bootedhost``).

``launch``: put this very process into the ``k26host-*`` child of every cgroup
hierarchy, prove it is there, then exec ``unshare -m --propagation private``.

``inner``: inside the private mount namespace, prove it is private, put a tmpfs
on ``/run/systemd`` (so systemd-nspawn never writes the host's /run), build the
container's root as an overlay of the machine's own root on a tmpfs (its writes
vanish with it), give it a machine-id of its own, mask the host's enabled units
that have nothing to do with the test and drop a container image's policy-rc.d,
then exec ``systemd-nspawn -b``.

The same process is the launcher, ``unshare``, the inner step and finally
systemd-nspawn (each execs the next), so its PID is the one the host side waits
for and kills. Any check that fails exits 70 *before* nspawn runs. Stdlib only;
run with ``python -I -m``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NSPAWN = "systemd-nspawn"
# The host's enabled units that a test host does not want booting (timers that
# run apt, a database, a getty): masked in the container only.
_QUIET = ("getty@tty1.service", "systemd-timesyncd.service", "systemd-pstore.service")


def _die(message: str) -> None:
    print(f"k26host: refusing: {message}", file=sys.stderr, flush=True)
    raise SystemExit(70)


def hierarchies() -> list[Path]:
    """Every hierarchy that takes processes (cpuset refuses an empty child: skipped)."""
    return sorted(
        h for h in CGROUP_ROOT.iterdir() if (h / "cgroup.procs").exists() and h.name != "cpuset"
    )


def _own_cgroups() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        found["unified" if controllers == "" else controllers] = path
    return found


def launch(
    name: str,
    directory: str,
    binds: list[str],
    binds_ro: list[str],
    layer_size: str,
    lower: str = "/",
    boot_args: list[str] | None = None,
) -> None:
    if not name.startswith("k26host-") or "/" in name:
        _die(f"bad host name {name!r}")
    for hierarchy in hierarchies():
        procs = hierarchy / name / "cgroup.procs"
        try:
            procs.write_text(f"{os.getpid()}\n")
        except OSError as exc:
            _die(f"cannot enter {procs}: {exc}")
    for key, path in _own_cgroups().items():
        if key.startswith("cpuset"):
            continue
        if path != f"/{name}":
            _die(f"not inside /{name} in hierarchy {key} (in {path!r})")
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        sys.executable,
        "-I",
        "-m",
        "k26dev.bootedhost_inner",
        "inner",
        "--name",
        name,
        "--dir",
        directory,
        "--outer-mnt",
        os.readlink("/proc/self/ns/mnt"),
        "--layer-size",
        layer_size,
        "--lower",
        lower,
        *(f"--bind={b}" for b in binds),
        *(f"--bind-ro={b}" for b in binds_ro),
        *(f"--boot-arg={a}" for a in boot_args or ()),
    ]
    os.execvp("unshare", argv)


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        _die(f"mount {' '.join(args)}: {result.stderr.strip()}")


def _mount_types() -> dict[str, str]:
    table: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        table[left.split()[4]] = right.split()[0]
    return table


def _host_enabled_units() -> list[str]:
    """The units the host's /etc enables, which the container would boot too."""
    found = set(_QUIET)
    for wants in Path("/etc/systemd/system").glob("*.wants"):
        found.update(p.name for p in wants.iterdir() if not p.name.endswith(".target"))
    return sorted(found)


def inner(
    name: str,
    directory: str,
    outer_mnt: str,
    binds: list[str],
    binds_ro: list[str],
    layer_size: str,
    lower: str = "/",
    boot_args: list[str] | None = None,
) -> None:
    # 1. A mount namespace of our own: nothing below may reach the host's mounts.
    if os.readlink("/proc/self/ns/mnt") == outer_mnt:
        _die("still in the launcher's mount namespace")
    try:
        if os.readlink("/proc/self/ns/mnt") == os.readlink("/proc/1/ns/mnt"):
            _die("still in PID 1's mount namespace")
    except OSError:
        pass
    base = Path(directory)
    # 2. /run/systemd on a private tmpfs: nspawn writes /run/systemd/nspawn there.
    _mount("-t", "tmpfs", "-o", "mode=755", "k26host", "/run/systemd")
    # 3. The root: the machine's own (or ``lower``, another distribution's root made
    # for a test), with every write going to a tmpfs.
    layers, root = base / "layers", base / "root"
    layers.mkdir(exist_ok=True)
    root.mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={layer_size},mode=755", "k26host", str(layers))
    (layers / "upper").mkdir()
    (layers / "work").mkdir()
    _mount(
        "-t",
        "overlay",
        "overlay",
        "-o",
        f"lowerdir={lower},upperdir={layers / 'upper'},workdir={layers / 'work'}",
        str(root),
    )
    types = _mount_types()
    if types.get("/run/systemd") != "tmpfs" or types.get(str(root)) != "overlay":
        _die("private mounts are not in place")
    # 4. Its own identity, and a quiet boot.
    (root / "etc" / "machine-id").write_text(secrets.token_hex(16) + "\n")
    masks = root / "etc" / "systemd" / "system"
    for unit in _host_enabled_units():
        link = masks / unit
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("/dev/null")
    for stale in ("nologin", "run/nologin"):
        (root / stale).unlink(missing_ok=True)
    # A container image's "no service may start" (policy-rc.d(8), exit 101): a server
    # has none, and with it a package's maintainer scripts could restart nothing.
    # Gone from the container only (an overlay whiteout).
    (root / "usr" / "sbin" / "policy-rc.d").unlink(missing_ok=True)
    (base / "ready-to-boot").write_text(str(os.getpid()))
    argv = [
        NSPAWN,
        "-D",
        str(root),
        "-b",
        "--private-network",
        "--register=no",
        "--keep-unit",
        "-q",
        *(f"--bind={b}" for b in binds),
        *(f"--bind-ro={b}" for b in binds_ro),
        *(["--", *boot_args] if boot_args else []),
    ]
    os.execvp(NSPAWN, argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="k26dev.bootedhost_inner")
    parser.add_argument("step", choices=["launch", "inner"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--outer-mnt", default="")
    parser.add_argument("--bind", action="append", default=[])
    parser.add_argument("--bind-ro", action="append", default=[])
    parser.add_argument("--layer-size", default="6G")
    parser.add_argument("--lower", default="/")
    parser.add_argument("--boot-arg", action="append", default=[])
    args = parser.parse_args(argv)
    if args.step == "launch":
        launch(
            args.name, args.dir, args.bind, args.bind_ro, args.layer_size, args.lower, args.boot_arg
        )
    else:
        if not args.outer_mnt:
            _die("inner step needs --outer-mnt (run it through 'launch')")
        inner(
            args.name, args.dir, args.outer_mnt, args.bind, args.bind_ro, args.layer_size,
            args.lower, args.boot_arg,
        )  # fmt: skip


if __name__ == "__main__":
    main()
