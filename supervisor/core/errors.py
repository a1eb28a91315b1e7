"""The error tree. Every failure a user can cause or meet is one of these.

    SupervisorError            exit 1, one clear line on stderr
    ├── UsageError             exit 64  (EX_USAGE)   bad command line
    ├── InputError             exit 65  (EX_DATAERR) bad data, e.g. a unit name
    │   └── UnitNameError
    ├── UnavailableError       exit 69  (EX_UNAVAILABLE) a dependency is not there
    │   ├── BusError           D-Bus / systemd manager unreachable or refused
    │   │   └── BusRefused     the caller may not do that (polkit, D-Bus policy)
    │   └── AuthRefused        exit 77 (EX_NOPERM) a registry wants credentials
    │                          that are missing, wrong, or not enough
    ├── OSLevelError           exit 71  (EX_OSERR); k26dev's SandboxError is one
    ├── CacheError             exit 74  (EX_IOERR) FlashInfer cache unusable
    └── ConfigError            exit 78  (EX_CONFIG) bad configuration

Dependency errors (pystemd, httpx, OSError) are mapped to these at the adapter
boundary with ``raise X(...) from exc`` so they never leak to the CLI.
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error the CLI turns into one line and an exit code."""

    exit_code: int = 1


class UsageError(SupervisorError):
    exit_code = 64


class InputError(SupervisorError):
    exit_code = 65


class UnitNameError(InputError, ValueError):
    """A unit name that systemd would reject (or that tries to be a path)."""


class UnavailableError(SupervisorError):
    exit_code = 69


class BusError(UnavailableError):
    """D-Bus or the systemd manager is unreachable or refused a call."""


class BusRefused(BusError):
    """Permission denied: polkit or the bus policy does not let this user do it.
    Retrying cannot help until someone changes what the user is allowed."""


class AuthRefused(UnavailableError):
    """A registry (or its token service) refused: no credentials where it asks for
    some, wrong ones, or ones that may not do what was asked. Unavailable to whoever
    treats it as a registry that cannot serve (the daemon then builds here); its own
    exit code, since retrying cannot help until someone fixes the credentials."""

    exit_code = 77


class OSLevelError(SupervisorError):
    exit_code = 71


class CacheError(SupervisorError):
    exit_code = 74


class ConfigError(SupervisorError):
    """Invalid configuration. The message names each bad field's path."""

    exit_code = 78
