"""The SGLang units' per-host values, and the drop-ins that carry them. Pure: text only.

The shipped units (``units/sglang-*.service``; the package installs them under
``/lib/systemd/system``) hold ``@NAME@`` placeholders where a host's own values go:
the serving venv, the model paths, the GPU arch. ``k26-supervisor units configure``
validates those values once and renders every ``[Service]`` line of the shipped unit
that names one into a drop-in (``DROPIN``), after an empty ``Exec*=`` line that
resets the template's; the values themselves are recorded in the drop-in as
``K26_*`` environment lines, which is where a later run (or the package's upgrade)
reads them back. The shipped unit asserts that its drop-in exists, so an
unconfigured unit fails its start at once and says which file is missing.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.core.errors import UsageError

# Placeholder -> the flag that sets it. docs/units.md explains each.
PLACEHOLDERS = {
    "SERVING_VENV": "--serving-venv",
    "MODEL_PATH": "--model-path",
    "DRAFT_MODEL_PATH": "--draft-model-path",
    "CUDA_ARCH": "--arch",
}
DEFAULTS = {"CUDA_ARCH": "12.0"}
SGLANG_UNITS = ("sglang-k26.service", "sglang-k26-eagle3.service")
SUPERVISOR_UNIT = "k26-supervisor.service"
DROPIN = "50-k26-units.conf"  # in /etc/systemd/system/<unit>.d/
RECORD_PREFIX = "K26_"  # Environment=K26_SERVING_VENV=... records the value
WORKSPACE = "/var/cache/sglang-k26/flashinfer"  # FLASHINFER_WORKSPACE_BASE of both units
HOME_ROOTS = ("/home/", "/root/", "/run/user/")

_PLACEHOLDER_RE = re.compile(r"@([A-Z][A-Z0-9_]*)@")
# A path placeholder written "/@NAME@" (ExecStart='s executable: systemd refuses to
# load a unit whose executable path is not absolute, the unconfigured one included)
# renders as the absolute value itself, without the doubled slash.
_RENDER_RE = re.compile(r"(/?)@([A-Z][A-Z0-9_]*)@")
# Characters systemd treats specially in ExecStart=/Environment= (%, $, quotes,
# backslash, whitespace) are refused rather than escaped: paths with them are rare.
_SAFE_PATH_RE = re.compile(r"/[A-Za-z0-9._+,:=/-]*")
_ARCH_RE = re.compile(r"[0-9]+\.[0-9]+[a-z]?")


def validate(name: str, value: str) -> str:
    """The value for placeholder ``name``, normalised; UsageError naming the flag."""
    flag = PLACEHOLDERS[name]
    if name == "CUDA_ARCH":
        if not _ARCH_RE.fullmatch(value):
            raise UsageError(f"{flag} {value!r}: expected an arch such as 12.0 or 9.0a")
        return value
    if not _SAFE_PATH_RE.fullmatch(value) or "/../" in f"{value}/" or "/./" in f"{value}/":
        raise UsageError(
            f"{flag} {value!r}: expected an absolute path of letters, digits and ._+,:=/- "
            "(systemd gives %, $, quotes, backslashes and spaces a meaning of their own)"
        )
    return value.rstrip("/") or "/"


def resolve(given: Mapping[str, str | None], recorded: Mapping[str, str]) -> dict[str, str]:
    """Flags win, then the values the last run recorded, then the defaults; each
    validated. UsageError naming the first flag that has no value anywhere."""
    values = {}
    for name, flag in PLACEHOLDERS.items():
        value = given.get(name) or recorded.get(name) or DEFAULTS.get(name)
        if value is None:
            raise UsageError(f"{flag} is required (no earlier 'units configure' recorded it)")
        values[name] = validate(name, value)
    return values


@dataclass(frozen=True)
class _Line:
    section: str
    key: str
    text: str  # as written, continuation lines included


def _logical_lines(text: str) -> list[_Line]:
    lines: list[_Line] = []
    section = ""
    pending: list[str] = []
    for raw in text.splitlines():
        if pending:
            pending.append(raw)
            if not raw.rstrip().endswith("\\"):
                joined = "\n".join(pending)
                lines.append(_Line(section, joined.partition("=")[0].strip(), joined))
                pending = []
            continue
        stripped = raw.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        if stripped.startswith("["):
            section = stripped
            continue
        if stripped.endswith("\\"):
            pending = [raw]
            continue
        lines.append(_Line(section, stripped.partition("=")[0].strip(), raw))
    if pending:
        joined = "\n".join(pending)
        lines.append(_Line(section, joined.partition("=")[0].strip(), joined))
    return lines


def placeholders_in(template: str) -> set[str]:
    return set(_PLACEHOLDER_RE.findall(template))


def render_dropin(unit: str, template: str, values: Mapping[str, str], source: str) -> str:
    """The drop-in for ``unit`` from its shipped ``template`` (read from ``source``):
    the values recorded, then each ``[Service]`` line that names a placeholder,
    filled in. UsageError for a placeholder that is unknown, has no value, or sits
    outside ``[Service]`` (a template this command cannot fill)."""
    body: list[str] = []
    for line in _logical_lines(template):
        names = placeholders_in(line.text)
        if not names:
            continue
        unknown = sorted(names - values.keys())
        if unknown:
            raise UsageError(f"{source}: no value for placeholder(s) {', '.join(unknown)}")
        if line.section != "[Service]":
            raise UsageError(f"{source}: placeholder in {line.section}, only [Service] is filled")
        if line.key.startswith("Exec"):
            body.append(f"{line.key}=")  # a drop-in's Exec*= adds a command unless reset
        body.append(_RENDER_RE.sub(lambda m: _fill(m, values), line.text.strip()))
    record = [f"Environment={RECORD_PREFIX}{name}={values[name]}" for name in PLACEHOLDERS]
    return (
        "# Written by `k26-supervisor units configure`: this host's serving venv, model\n"
        f"# paths and GPU arch, filled into the lines of {source}\n"
        "# that name them. Run it again to change them; edits here are overwritten (use\n"
        f"# `systemctl edit {unit}` for settings of your own).\n"
        "[Service]\n" + "\n".join([*record, *body]) + "\n"
    )


def _fill(match: re.Match[str], values: Mapping[str, str]) -> str:
    slash, value = match.group(1), values[match.group(2)]
    return value if slash and value.startswith("/") else slash + value


def recorded_values(dropin: str) -> dict[str, str]:
    """The values a drop-in of ours recorded (``Environment=K26_NAME=value``)."""
    values = {}
    for line in dropin.splitlines():
        key, sep, value = line.strip().partition("=")
        if key != "Environment" or not sep:
            continue
        name, sep, recorded = value.partition("=")
        name = name.removeprefix(RECORD_PREFIX)
        if sep and value.startswith(RECORD_PREFIX) and name in PLACEHOLDERS:
            values[name] = recorded
    return values


def in_a_home(path: str) -> bool:
    return f"{path}/".startswith(HOME_ROOTS)


def home_dropin(values: Mapping[str, str], interpreter: str) -> str | None:
    """The supervisor's drop-in when the serving venv, or the interpreter its python
    links to, sits in a home directory (its ProtectHome=yes would hide it)."""
    where = [p for p in (values["SERVING_VENV"], interpreter) if in_a_home(p)]
    if not where:
        return None
    return (
        f"# Written by `k26-supervisor units configure`: the serving venv needs {where[0]},\n"
        "# which ProtectHome=yes would hide from the warm-up.\n"
        "[Service]\nProtectHome=read-only\n"
    )


def config_disagreements(config: str, path: str, values: Mapping[str, str]) -> list[str]:
    """Where the supervisor's config contradicts the units (a cold or unwritable cache)."""
    try:
        flashinfer = tomllib.loads(config).get("flashinfer", {})
    except tomllib.TOMLDecodeError as exc:
        return [f"{path} is not valid TOML ({exc})"]
    units_use = {
        "workspace": WORKSPACE,
        "arch": values["CUDA_ARCH"],
        "python": f"{values['SERVING_VENV']}/bin/python",
    }
    return [
        f"{path}: flashinfer.{key} is {flashinfer[key]!r}, the units use {want!r}"
        for key, want in units_use.items()
        if key in flashinfer and str(flashinfer[key]) != want
    ]
