"""The developer tools' own errors: k26-dev's, never the daemon's."""

from __future__ import annotations

from supervisor.core.errors import OSLevelError


class SandboxError(OSLevelError):
    """The confined systemd (the sandbox, a booted host) could not be made or removed,
    or a developer tool it needs failed. Exit 71, one line, as the product's errors."""
