"""Reading the configuration file: the one piece of config handling that does I/O."""

from __future__ import annotations

from pathlib import Path

from supervisor.core.config import Config, InvalidConfig, Problem, parse_toml


def load_config(path: Path) -> Config:
    """Read and validate the TOML file at ``path``; raise InvalidConfig naming each problem."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InvalidConfig(
            str(path), [Problem("", f"cannot read the config file: {reason}")]
        ) from None
    return parse_toml(raw, str(path))
