#!/usr/bin/env python3
"""Install, update or remove k26-supervisor: venv, units, config, polkit rule.

    sudo deploy/install.py --serving-venv /opt/sglang/venv \\
        --model-path /models/k26 --draft-model-path /models/k26-eagle3
    sudo deploy/install.py --uninstall [--purge-cache]

Idempotent (a second run changes nothing and says so), --dry-run writes
nothing, --root DIR installs into another tree, and systemctl runs only when
the root is / and systemd is PID 1. What goes where, and why: docs/units.md.
Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

SOURCE = Path(__file__).resolve().parent.parent

PREFIX = "/opt/k26-supervisor"
VENV = f"{PREFIX}/venv"
VENV_STAMP = f"{VENV}/.k26-source.sha256"
UNIT_DIR = "/usr/local/lib/systemd/system"
SUPERVISOR_UNIT = "k26-supervisor.service"
SGLANG_UNITS = ("sglang-k26.service", "sglang-k26-eagle3.service")
HOME_DROPIN_DIR = f"{UNIT_DIR}/{SUPERVISOR_UNIT}.d"
HOME_DROPIN = f"{HOME_DROPIN_DIR}/50-serving-venv-in-home.conf"
CONFIG_DIR = "/etc/k26-supervisor"
CONFIG = f"{CONFIG_DIR}/config.toml"
RECORD = f"{CONFIG_DIR}/install.conf"
SYSUSERS = "/usr/local/lib/sysusers.d/k26-supervisor.conf"
TMPFILES = "/usr/local/lib/tmpfiles.d/k26-supervisor.conf"
CACHE = "/var/cache/sglang-k26"
WORKSPACE = f"{CACHE}/flashinfer"  # FLASHINFER_WORKSPACE_BASE of both SGLang units
RUNTIME = "/run/k26-supervisor"
SCRATCH = "/var/cache/k26-supervisor"  # the supervisor's HOME, not the FlashInfer cache
HOME_ROOTS = ("/home/", "/root/", "/run/user/")

# Shipped file -> installed path. Units are rendered separately.
STATIC_FILES = (
    ("docs/units.md", f"{PREFIX}/share/doc/units.md"),
    ("config/k26-supervisor.toml", f"{PREFIX}/share/config.example.toml"),
    ("deploy/polkit/50-k26-supervisor.rules", "/etc/polkit-1/rules.d/50-k26-supervisor.rules"),
    ("deploy/sysusers.d/k26-supervisor.conf", SYSUSERS),
    ("deploy/tmpfiles.d/k26-supervisor.conf", TMPFILES),
)

# Placeholder -> the flag that sets it (and default). Documented in docs/units.md.
PLACEHOLDERS = {
    "SERVING_VENV": "--serving-venv",
    "MODEL_PATH": "--model-path",
    "DRAFT_MODEL_PATH": "--draft-model-path",
    "CUDA_ARCH": "--cuda-arch",
}
DEFAULTS = {"CUDA_ARCH": "12.0"}
_PLACEHOLDER_RE = re.compile(r"@([A-Z][A-Z0-9_]*)@")
# Characters systemd treats specially in ExecStart=/Environment= (%, $, quotes,
# backslash, whitespace) are refused rather than escaped: paths with them are rare.
_SAFE_PATH_RE = re.compile(r"/[A-Za-z0-9._+,:=/-]*")
_ARCH_RE = re.compile(r"[0-9]+\.[0-9]+[a-z]?")


class InstallError(Exception):
    """A failure the user can act on: one line on stderr, then this exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_command(argv: Sequence[str]) -> None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except OSError as exc:
        raise InstallError(f"cannot run {argv[0]}: {exc.strerror}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise InstallError(
            f"{shlex.join(argv)} failed with status {done.returncode}"
            + (f": {detail[-1]}" if detail else "")
        )


@dataclass
class Host:
    """The tree being changed, and how changes are carried out and reported."""

    root: Path
    dry_run: bool
    live: bool  # root is / and systemd runs: systemctl may be called
    run: Callable[[Sequence[str]], None] = run_command
    changes: int = 0
    checked: int = 0
    units_changed: bool = False
    notes: list[str] = field(default_factory=list)

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def change(self, verb: str, what: str) -> bool:
        """Report a change; True when it should really be made now."""
        self.changes += 1
        print(f"{'would ' if self.dry_run else ''}{verb:<7} {what}")
        return not self.dry_run

    def unchanged(self) -> None:
        self.checked += 1

    def note(self, text: str) -> None:
        self.notes.append(text)


def systemd_running(root: Path) -> tuple[bool, str]:
    """Whether systemctl may act on this host, and if not, why (for the report)."""
    if root != Path("/"):
        return False, f"--root is {root}, not /"
    if not Path("/run/systemd/system").is_dir():  # sd_booted()
        return False, "systemd is not running here (no /run/systemd/system)"
    return True, ""


# --- rendering --------------------------------------------------------------------


def validate_placeholder(name: str, value: str) -> str:
    flag = PLACEHOLDERS[name]
    if name == "CUDA_ARCH":
        if not _ARCH_RE.fullmatch(value):
            raise InstallError(f"{flag} {value!r}: expected an arch such as 12.0 or 9.0a", 64)
    elif not _SAFE_PATH_RE.fullmatch(value) or "/../" in f"{value}/":
        raise InstallError(
            f"{flag} {value!r}: expected an absolute path of letters, digits and ._+,:=/- "
            "(systemd gives %, $, quotes, backslashes and spaces a meaning of their own)",
            64,
        )
    return value.rstrip("/") or "/"


def render(template: str, values: dict[str, str], *, name: str = "template") -> str:
    """Fill in @NAME@ placeholders; every one must be known and given."""
    missing = sorted({m for m in _PLACEHOLDER_RE.findall(template) if m not in values})
    if missing:
        raise InstallError(f"{name}: no value for placeholder(s) {', '.join(missing)}")
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def in_a_home(path: str) -> bool:
    return f"{path}/".startswith(HOME_ROOTS)


def home_dropin(values: dict[str, str], interpreter: str) -> str | None:
    """The supervisor drop-in needed when the serving venv, or the interpreter its
    python links to, sits in a home directory (ProtectHome=yes would hide it)."""
    where = [p for p in (values["SERVING_VENV"], interpreter) if in_a_home(p)]
    if not where:
        return None
    return (
        f"# Written by deploy/install.py: the serving venv needs {where[0]},\n"
        "# which ProtectHome=yes would hide from the warm-up.\n"
        "[Service]\nProtectHome=read-only\n"
    )


def config_disagreements(config: str, values: dict[str, str]) -> list[str]:
    """Where the supervisor's config contradicts the units (a cold or unwritable cache)."""
    try:
        flashinfer = tomllib.loads(config).get("flashinfer", {})
    except tomllib.TOMLDecodeError as exc:
        return [f"{CONFIG} is not valid TOML ({exc})"]
    units_use = {
        "workspace": WORKSPACE,
        "arch": values["CUDA_ARCH"],
        "python": f"{values['SERVING_VENV']}/bin/python",
    }
    return [
        f"{CONFIG}: flashinfer.{key} is {flashinfer[key]!r}, the units use {want!r}"
        for key, want in units_use.items()
        if key in flashinfer and str(flashinfer[key]) != want
    ]


def read_record(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key in PLACEHOLDERS:
            values[key] = value
    return values


def format_record(values: dict[str, str]) -> str:
    lines = ["# Placeholder values deploy/install.py rendered the units with; reused next time."]
    lines += [f"{key}={values[key]}" for key in PLACEHOLDERS]
    return "\n".join(lines) + "\n"


# --- primitive steps ---------------------------------------------------------------------


def put_file(host: Host, dest: str, content: bytes, mode: int = 0o644) -> bool:
    """Make dest hold content with mode. Returns True when it changed."""
    target = host.path(dest)
    if (
        target.is_file()
        and target.read_bytes() == content
        and stat.S_IMODE(target.stat().st_mode) == mode
    ):
        host.unchanged()
        return False
    if host.change("update" if target.exists() else "create", dest):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(content)
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return True


def remove(host: Host, dest: str) -> bool:
    target = host.path(dest)
    if not target.exists() and not target.is_symlink():
        host.unchanged()
        return False
    if host.change("remove", dest):
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    return True


def _ids(path: Path) -> dict[str, int]:
    """name -> id from a passwd(5) or group(5) file."""
    if not path.is_file():
        return {}
    ids = {}
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdigit():
            ids[fields[0]] = int(fields[2])
    return ids


def _conf_lines(relative: str, kind: str) -> list[list[str]]:
    """The `kind` lines of a shipped sysusers.d/tmpfiles.d file, split into fields."""
    text = (SOURCE / relative).read_text()
    rows = [shlex.split(line, comments=True) for line in text.splitlines()]
    return [row for row in rows if row and row[0] == kind]


def ensure_accounts(host: Host) -> None:
    users = [row[1] for row in _conf_lines("deploy/sysusers.d/k26-supervisor.conf", "u")]
    passwd = _ids(host.path("/etc/passwd"))
    missing = [user for user in users if user not in passwd]
    if not missing:
        host.unchanged()
        return
    if host.change("create", f"system users {', '.join(missing)} (systemd-sysusers)"):
        host.run(["systemd-sysusers", f"--root={host.root}", Path(SYSUSERS).name])


def ensure_cache_dirs(host: Host) -> None:
    users, groups = _ids(host.path("/etc/passwd")), _ids(host.path("/etc/group"))
    wrong = []
    for _, path, mode, user, group, *_ in _conf_lines("deploy/tmpfiles.d/k26-supervisor.conf", "d"):
        try:
            st = host.path(path).stat()
        except FileNotFoundError:
            wrong.append(path)
            continue
        if not (
            stat.S_ISDIR(st.st_mode)
            and stat.S_IMODE(st.st_mode) == int(mode, 8)
            and st.st_uid == users.get(user)
            and st.st_gid == groups.get(group)
        ):
            wrong.append(path)
    if not wrong:
        host.unchanged()
        return
    if host.change("create", f"{', '.join(wrong)} (systemd-tmpfiles)"):
        host.run(["systemd-tmpfiles", f"--root={host.root}", "--create", Path(TMPFILES).name])


def source_digest() -> str:
    """What the venv was built from: pyproject.toml and the package sources."""
    digest = hashlib.sha256()
    files = [SOURCE / "pyproject.toml", *sorted((SOURCE / "supervisor").rglob("*"))]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(SOURCE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def ensure_venv(host: Host, python: str, wheels: Path | None = None) -> None:
    digest = source_digest()
    stamp = host.path(VENV_STAMP)
    if stamp.is_file() and stamp.read_text().strip() == digest:
        host.unchanged()
        return
    verb = "update" if host.path(VENV).exists() else "create"
    # Offline (an air-gapped GPU server): every dependency, and the build backend,
    # from a wheelhouse made elsewhere with `pip wheel --wheel-dir DIR .`.
    offline = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    if host.change(
        verb, f"{VENV} (pip install {SOURCE}{' from ' + str(wheels) if wheels else ''})"
    ):
        if not host.path(f"{VENV}/bin/python").exists():
            host.run([python, "-m", "venv", str(host.path(VENV))])
        pip = str(host.path(f"{VENV}/bin/pip"))
        host.run([pip, "install", "--quiet", *offline, "--upgrade", str(SOURCE)])
        stamp.write_text(digest + "\n")


# --- install / uninstall -----------------------------------------------------------


def install(
    host: Host,
    values: dict[str, str],
    *,
    skip_venv: bool,
    python: str,
    wheels: Path | None = None,
) -> None:
    units = {  # rendered before anything is written, so a bad template changes nothing
        name: render((SOURCE / "units" / name).read_text(), values, name=f"units/{name}")
        for name in (SUPERVISOR_UNIT, *SGLANG_UNITS)
    }
    if not skip_venv:
        ensure_venv(host, python, wheels)
    for name, text in units.items():
        host.units_changed |= put_file(host, f"{UNIT_DIR}/{name}", text.encode())
    serving_python = host.path(f"{values['SERVING_VENV']}/bin/python")
    # Symlinks resolve on this host only: for another root, trust the path as given.
    interpreter = str(serving_python.resolve()) if host.root == Path("/") else ""
    dropin = home_dropin(values, interpreter)
    if dropin is not None:
        host.units_changed |= put_file(host, HOME_DROPIN, dropin.encode())
    else:
        host.units_changed |= remove(host, HOME_DROPIN_DIR)
    for relative, dest in STATIC_FILES:
        put_file(host, dest, (SOURCE / relative).read_bytes())
    put_file(host, RECORD, format_record(values).encode())
    config = host.path(CONFIG)
    if config.exists():
        host.unchanged()
        if config.read_bytes() != (SOURCE / "config/k26-supervisor.toml").read_bytes():
            host.note(
                f"kept your {CONFIG}; the shipped example is {PREFIX}/share/config.example.toml"
            )
    else:
        put_file(host, CONFIG, (SOURCE / "config/k26-supervisor.toml").read_bytes())
    ensure_accounts(host)
    ensure_cache_dirs(host)
    installed_config = config if config.exists() else SOURCE / "config/k26-supervisor.toml"
    for text in config_disagreements(installed_config.read_text(), values):
        host.note(text)
    if not serving_python.exists():
        host.note(
            f"{values['SERVING_VENV']}/bin/python does not exist (yet): "
            "the SGLang units cannot start until it does"
        )


def uninstall(host: Host, *, purge_cache: bool) -> None:
    if host.live:
        if host.path(f"{UNIT_DIR}/{SUPERVISOR_UNIT}").exists() and host.change(
            "stop", f"{SUPERVISOR_UNIT} and disable it"
        ):
            host.run(["systemctl", "disable", "--now", SUPERVISOR_UNIT])
        for unit in SGLANG_UNITS:
            if host.path(f"{UNIT_DIR}/{unit}").exists() and host.change("stop", unit):
                host.run(["systemctl", "stop", unit])
    config = host.path(CONFIG)
    examples = (
        SOURCE / "config/k26-supervisor.toml",
        host.path(f"{PREFIX}/share/config.example.toml"),
    )
    if config.is_file() and not any(
        ex.is_file() and ex.read_bytes() == config.read_bytes() for ex in examples
    ):
        host.note(f"kept {CONFIG}: it differs from the shipped example; remove it yourself")
    else:
        remove(host, CONFIG)
    for name in (SUPERVISOR_UNIT, *SGLANG_UNITS):
        host.units_changed |= remove(host, f"{UNIT_DIR}/{name}")
    host.units_changed |= remove(host, HOME_DROPIN_DIR)
    outside_prefix = [dest for _, dest in STATIC_FILES if not dest.startswith(f"{PREFIX}/")]
    for dest in (*outside_prefix, RECORD, PREFIX, RUNTIME, SCRATCH):
        remove(host, dest)
    config_dir = host.path(CONFIG_DIR)
    if config_dir.is_dir() and not any(config_dir.iterdir()):
        remove(host, CONFIG_DIR)
    if purge_cache:
        remove(host, CACHE)
    elif host.path(CACHE).exists():
        host.note(f"kept {CACHE} (the FlashInfer JIT cache); --purge-cache removes it")
    host.note("kept the system users sglang-k26 and k26-supervisor (files may still be theirs)")


def reload_systemd(host: Host, why_not: str) -> None:
    if not host.units_changed:
        return
    if not host.live:
        host.note(f"skipped systemctl daemon-reload: {why_not}")
    elif host.change("run", "systemctl daemon-reload"):
        host.run(["systemctl", "daemon-reload"])


# --- command line -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise InstallError(f"{message} (see --help)", 64)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _Parser(
        prog="install.py",
        description="Install, update or remove k26-supervisor (see docs/units.md).",
    )
    parser.add_argument("--root", type=Path, default=Path("/"), help="tree to install into")
    parser.add_argument(
        "--dry-run", action="store_true", help="say what would change; write nothing"
    )
    parser.add_argument("--uninstall", action="store_true", help="remove what install put in place")
    parser.add_argument(
        "--purge-cache", action="store_true", help=f"with --uninstall: also remove {CACHE}"
    )
    parser.add_argument(
        "--skip-venv", action="store_true", help="leave the venv alone (tests, images)"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the venv (3.11+)")
    parser.add_argument(
        "--wheels",
        type=Path,
        metavar="DIR",
        help="install the venv offline from this wheelhouse (pip wheel --wheel-dir DIR .)",
    )
    for name, flag in PLACEHOLDERS.items():
        parser.add_argument(flag, dest=name, metavar="VALUE", help=f"fills @{name}@ in the units")
    args = parser.parse_args(argv)
    if args.purge_cache and not args.uninstall:
        parser.error("--purge-cache only goes with --uninstall")
    return args


def resolve_values(args: argparse.Namespace, record: dict[str, str]) -> dict[str, str]:
    """Flags win, then the values recorded by the last install, then defaults."""
    values = {}
    for name, flag in PLACEHOLDERS.items():
        value = getattr(args, name) or record.get(name) or DEFAULTS.get(name)
        if value is None:
            raise InstallError(f"{flag} is required (no earlier install recorded it)", 64)
        values[name] = validate_placeholder(name, value)
    return values


def main(
    argv: Sequence[str] | None = None,
    *,
    run: Callable[[Sequence[str]], None] = run_command,
    live: bool | None = None,
) -> int:
    """``run`` and ``live`` let tests record systemctl calls instead of making them."""
    try:
        args = parse_args(argv)
        root = args.root.resolve()
        if not root.is_dir():
            raise InstallError(f"--root {args.root}: no such directory", 64)
        if root == Path("/") and not args.dry_run and os.geteuid() != 0:
            raise InstallError("installing into / needs root (try --dry-run, or --root DIR)", 77)
        if not args.uninstall and not args.skip_venv:
            if root != Path("/"):
                raise InstallError(
                    "a venv only works where it was built (its scripts name their absolute "
                    "path): pass --skip-venv with --root, and build the venv inside the target",
                    64,
                )
            if in_a_home(str(Path(args.python).resolve())):
                raise InstallError(
                    f"--python {args.python} lives in a home directory, which the supervisor's "
                    "ProtectHome=yes hides: use a system python such as /usr/bin/python3.11",
                    64,
                )
        is_live, why_not = systemd_running(root)
        host = Host(
            root=root, dry_run=args.dry_run, live=is_live if live is None else live, run=run
        )
        if args.uninstall:
            uninstall(host, purge_cache=args.purge_cache)
        else:
            for relative in ("config/k26-supervisor.toml", *[rel for rel, _ in STATIC_FILES]):
                if not (SOURCE / relative).is_file():
                    raise InstallError(f"{SOURCE / relative} is missing from this source tree")
            for tool in ("systemd-sysusers", "systemd-tmpfiles"):
                if shutil.which(tool) is None:
                    raise InstallError(f"{tool} not found: install systemd first")
            values = resolve_values(args, read_record(host.path(RECORD)))
            if args.wheels is not None and not args.wheels.is_dir():
                raise InstallError(f"--wheels {args.wheels}: no such directory", 64)
            install(host, values, skip_venv=args.skip_venv, python=args.python, wheels=args.wheels)
        reload_systemd(host, why_not)
    except InstallError as exc:
        print(f"install.py: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for text in host.notes:
        print(f"note: {text}")
    action = "uninstall" if args.uninstall else "install"
    if host.changes == 0:
        print(f"k26-supervisor: nothing to do, {action} already complete ({host.checked} checked)")
    elif args.dry_run:
        print(f"k26-supervisor: dry run, {host.changes} change(s) would be made, none made")
    else:
        print(f"k26-supervisor: {action} done, {host.changes} change(s)")
        if not args.uninstall and host.live:
            print(
                f"next: systemctl enable --now {SUPERVISOR_UNIT} (its first start loads the model)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
