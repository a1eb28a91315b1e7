"""systemd unit-name validation, before any name reaches the bus.

Mirrors ``unit_name_is_valid()`` in systemd's ``src/basic/unit-name.c``: at most
255 characters, a non-empty prefix of ``[A-Za-z0-9:_.\\-]``, at most one ``@``
(template/instance), and a known type suffix. Names are never paths, globs or
shell text. Pure: no I/O.
"""

from __future__ import annotations

import re

from supervisor.core.errors import UnitNameError

UNIT_NAME_MAX = 255
UNIT_TYPES: frozenset[str] = frozenset(
    {
        "service",
        "socket",
        "target",
        "device",
        "mount",
        "automount",
        "swap",
        "timer",
        "path",
        "slice",
        "scope",
    }
)
_PREFIX = r"[A-Za-z0-9:_.\\-]+"
_INSTANCE = r"[A-Za-z0-9:_.\\-]*"
_NAME_RE = re.compile(rf"(?P<prefix>{_PREFIX})(?:@(?P<instance>{_INSTANCE}))?\.(?P<type>[a-z]+)")


def validate_unit_name(name: object, *, allowed_types: frozenset[str] | None = None) -> str:
    """Return ``name`` unchanged if systemd would accept it, else raise UnitNameError.

    ``allowed_types`` narrows the accepted suffixes (the supervisor manages only
    ``service`` units). The error says what is wrong and what a valid name is.
    """
    if not isinstance(name, str):
        raise UnitNameError(f"unit name must be a string, got {type(name).__name__}")
    shown = repr(name) if len(name) <= 80 else repr(name[:77] + "...")
    if not name:
        raise UnitNameError("unit name is empty; expected e.g. 'sglang-k26.service'")
    if len(name) > UNIT_NAME_MAX:
        raise UnitNameError(f"unit name {shown} is longer than {UNIT_NAME_MAX} characters")
    match = _NAME_RE.fullmatch(name)
    if match is None:
        raise UnitNameError(
            f"invalid unit name {shown}: use only letters, digits and ':_.\\-' "
            "(plus one '@' for a template instance) and end in a type such as '.service'"
        )
    unit_type = match.group("type")
    if unit_type not in UNIT_TYPES:
        raise UnitNameError(f"invalid unit name {shown}: unknown unit type '.{unit_type}'")
    if allowed_types is not None and unit_type not in allowed_types:
        want = ", ".join(f".{t}" for t in sorted(allowed_types))
        raise UnitNameError(f"unit name {shown} must end in {want}")
    if match.group("prefix").startswith(".") or match.group("prefix") in {"..", "."}:
        raise UnitNameError(f"invalid unit name {shown}: must not start with '.'")
    if match.group("instance") == "" and "@" in name:
        # "foo@.service" is a template: it cannot be started or managed itself.
        raise UnitNameError(
            f"unit name {shown} is a template; name an instance like 'foo@1.service'"
        )
    return name


def validate_service_name(name: object) -> str:
    """A unit the supervisor may manage: a valid ``.service`` name."""
    return validate_unit_name(name, allowed_types=frozenset({"service"}))
