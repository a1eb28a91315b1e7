"""The supervisor's configuration: TOML text in, immutable pydantic models out.

Owns the schema (sections, defaults, limits), the cross-field rules (unique
unit names, a fallback for every EAGLE-3 unit, ...), the translation of every
problem into one line that names the field's path and says what to do, and the
converters from a ``Config`` to the core's own policy objects (this module is
where the configuration meets the core; ``policy`` and ``machine`` know nothing
of it). Pure: it parses bytes it is given; reading the file is
``adapters.config_file.load_config``, and whether ``flashinfer.python`` exists
on this host is for ``check-config`` to say, not for the model.

``parse_toml`` raises ``InvalidConfig`` (a ``ConfigError``, exit 78) listing
every problem.
"""

from __future__ import annotations

import ipaddress
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor.core import coverage
from supervisor.core.errors import ConfigError
from supervisor.core.machine import UnitPolicy
from supervisor.core.policy import PairPolicy, Role, UnitSpec
from supervisor.core.unitname import validate_service_name

DEFAULT_LISTEN = "127.0.0.1:9436"
_ARCH_RE = re.compile(r"[1-9][0-9]?\.[0-9]")
_MODULE_RE = re.compile(r"[a-z][a-z0-9_]*")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Problem:
    """One bad field: its dotted path (``units[1].url``) and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class FieldProblems(ValueError):
    """Raised inside model validators to report problems with their own paths.

    A model validator's error has no location of its own; pydantic keeps the
    exception in the error's context, where ``_problems_from`` finds these.
    """

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(str(p) for p in self.problems))


class _Section(BaseModel):
    # strict: TOML has real types, so "10" for a number or 1 for a boolean is a
    # mistake to report, not to coerce. Enum, Path and tuple fields opt out
    # (strict=False) because TOML can only spell them as strings and arrays.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def split_listen(listen: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` to ``(host, port)``; ValueError saying what is wrong.

    The package's one parser of listen addresses: the config validates
    ``supervisor.listen`` with it and the status server binds what it returns.
    Port 0 (the kernel picks one) only with ``allow_port_zero``, for tests and
    benchmarks: a configured daemon needs a port its clients can find.
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise ValueError("must be HOST:PORT, e.g. '127.0.0.1:9436'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError("write an IPv6 address in brackets, e.g. '[::1]:9436'")
    if not host or _CONTROL_RE.search(host) or any(c in host for c in " /[]@"):
        raise ValueError(f"invalid host {host!r}")
    lowest = 0 if allow_port_zero else 1
    if not (port_text.isascii() and port_text.isdigit()) or not lowest <= int(port_text) <= 65535:
        raise ValueError(f"port must be a number from {lowest} to 65535, got {port_text!r}")
    return host, int(port_text)


# An OCI repository name (the distribution spec's grammar): lowercase components
# separated by "/", each alphanumerics joined by ".", "_", "__" or dashes.
_REPOSITORY_RE = re.compile(
    r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*"
)


def _split_http_url(url: str, example: str) -> SplitResult:
    """``url`` split, once it is an http(s) URL with a host, a valid port and no
    credentials; ValueError saying what is wrong (``example`` shows a good one)."""
    if _CONTROL_RE.search(url) or " " in url:
        raise ValueError("must not contain spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"has no host, got {url!r}; e.g. {example!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"has an invalid port: {url!r}") from None
    if port == 0:
        raise ValueError("port must be from 1 to 65535")
    return parts


def split_registry(url: str) -> tuple[str, str]:
    """``"http(s)://host[:port]/repository"`` to ``(base URL, repository)``; ValueError
    saying what is wrong. The package's one parser of registry addresses: the config
    validates ``flashinfer.registry`` with it and the registry client connects to it."""
    parts = _split_http_url(url, "http://registry:5000/k26/bundles")
    if parts.query or parts.fragment:
        raise ValueError(f"must not have a query or fragment, got {url!r}")
    repository = parts.path.strip("/")
    if not repository:
        raise ValueError(
            f"names no repository, got {url!r}; e.g. 'http://registry:5000/k26/bundles'"
        )
    if len(repository) > 255 or not _REPOSITORY_RE.fullmatch(repository):
        raise ValueError(
            f"repository {repository!r} is not a valid OCI repository name: lowercase "
            "letters and digits, joined by '.', '_', '-' and '/'"
        )
    return f"{parts.scheme}://{parts.netloc}", repository


class SupervisorSection(_Section):
    bus: Literal["system", "user"] = "system"
    listen: str = DEFAULT_LISTEN
    resync_interval_s: float = Field(default=60.0, gt=0)
    job_timeout_s: float = Field(default=120.0, gt=0)
    # Until READY=1, each sign of progress (a build line, a health poll, a state
    # change) asks systemd for this much more start time (EXTEND_TIMEOUT_USEC).
    startup_silence_s: float = Field(default=120.0, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # From READY on, watch every JIT cache of each unit for kernels compiled under
    # live traffic (k26_jit_after_ready_total).
    jit_watch: bool = True
    # What the daemon keeps across restarts and reboots (learned shapes, the signed
    # bundles accepted from each registry tag), where the units cannot write. None:
    # systemd's $STATE_DIRECTORY (StateDirectory=), else /var/lib/k26-supervisor
    # (a user manager's: $XDG_STATE_HOME/k26-supervisor).
    state_dir: Path | None = Field(default=None, strict=False)

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_listen(value)
        return value

    @property
    def listen_host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return split_listen(self.listen)[1]


class FlashInferSection(_Section):
    enabled: bool = True
    python: Path = Field(default=Path("/opt/sglang/venv/bin/python"), strict=False)
    arch: str = "12.0"
    workspace: Path = Field(default=Path("/var/cache/k26/flashinfer"), strict=False)
    modules: tuple[str, ...] = Field(default=("sampling",), min_length=1, strict=False)
    timeout_s: float = Field(default=900.0, gt=0)
    allow_patch: bool = False
    pytorch_sampling_fallback: bool = False
    # Extra KEY=VALUE environment for builds (CUDA_HOME, CPATH, LIBRARY_PATH) on a
    # build host that lacks parts of the toolkit; empty on a normal GPU server.
    env_file: Path | None = Field(default=None, strict=False)
    warmup_attempts: int = Field(default=2, ge=1)
    # auto: when the gate accepts the arch with no patch to write, start the unit
    # at once and warm while it loads (core/warmup_plan.py); never: warm, then start.
    overlap: Literal["auto", "never"] = "auto"
    # What one pulled or imported bundle layer may hold (docs/fleet.md, "Hostile
    # archives"): files, bytes in one file, bytes in all. A layer whose manifest lists
    # more is refused before a byte of it is written; its stream is decompressed no
    # further than what its manifest lists. Large enough for real caches.
    bundle_max_entries: int = Field(default=200_000, ge=1, le=10_000_000)
    bundle_max_entry_bytes: int = Field(default=4 << 30, ge=1)
    bundle_max_total_bytes: int = Field(default=64 << 30, ge=1)
    # An OCI registry of cache bundles, "http(s)://host[:port]/repository"
    # (docs/fleet.md): a cold cache is pulled from it before anything is built, and
    # built here only when it holds no bundle for this node. None: build here.
    registry: str | None = None
    # Each request to the registry (connect, and each read or write of a chunk).
    registry_timeout_s: float = Field(default=30.0, gt=0)
    # The registry's credentials (docs/fleet.md, "Registry credentials and TLS"): a
    # Docker-style config.json ("auths") or a file of one USER:PASSWORD line, mode
    # 0600, read at each pull. None: no credentials (anonymous).
    registry_auth: Path | None = Field(default=None, strict=False)
    # A PEM CA bundle that the registry's and its token service's certificates must
    # chain to, in place of the usual trust store. None: the usual trust store.
    registry_ca: Path | None = Field(default=None, strict=False)
    # Public keys (PEM, ECDSA P-256) a pulled bundle must be signed with, cosign's
    # layout (docs/fleet.md, "Signed bundles"); any one will do. Empty: bundles are
    # installed unverified, with a warning on each pull (unsafe).
    registry_keys: tuple[Path, ...] = Field(default=(), strict=False)

    @field_validator("registry")
    @classmethod
    def _check_registry(cls, value: str | None) -> str | None:
        if value is not None:
            split_registry(value)
        return value

    @field_validator("registry_auth", "registry_ca")
    @classmethod
    def _check_absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"must be an absolute path, got {str(value)!r}")
        return value

    @field_validator("registry_keys", mode="before")
    @classmethod
    def _registry_key_paths(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):  # TOML strings: paths
            return tuple(Path(p) if isinstance(p, str) else p for p in value)
        return value

    @field_validator("registry_keys")
    @classmethod
    def _check_registry_keys(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        for path in value:
            if not PurePosixPath(path).is_absolute():
                raise ValueError(f"must be absolute paths, got {str(path)!r}")
        if len(set(value)) != len(value):
            raise ValueError("lists a key twice")
        return value

    @field_validator("arch")
    @classmethod
    def _check_arch(cls, value: str) -> str:
        if not _ARCH_RE.fullmatch(value):
            raise ValueError(
                f"must be a CUDA compute capability like '12.0' or '9.0', got {value!r}"
            )
        return value

    @field_validator("modules")
    @classmethod
    def _check_modules(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _MODULE_RE.fullmatch(name):
                raise ValueError(f"module names are lowercase identifiers, got {name!r}")
        if len(set(value)) != len(value):
            raise ValueError("lists a module twice")
        return value

    @field_validator("timeout_s", "registry_timeout_s")
    @classmethod
    def _check_finite(cls, value: float) -> float:
        return _finite(value)

    @model_validator(mode="after")
    def _check_paths(self) -> FlashInferSection:
        problems = list(_flashinfer_problems(self))
        if problems:
            raise FieldProblems(problems)
        return self


class ProbeSection(_Section):
    temperature: float = Field(default=0.7, gt=0, le=2)
    top_k: int = 20
    top_p: float = Field(default=0.8, gt=0, lt=1)
    max_new_tokens: int = Field(default=4, ge=1, le=256)
    seed: int = Field(default=1234, ge=0, lt=2**63)
    prompt: str = Field(default="The capital of France is", min_length=1, max_length=4096)
    timeout_s: float = Field(default=60.0, gt=0)
    startup_deadline_s: float = Field(default=900.0, gt=0)
    interval_s: float = Field(default=30.0, gt=0)
    failures_to_fail: int = Field(default=3, ge=1)
    # A ready unit whose server reports requests in flight while it produces no token
    # (and compiles nothing) for this long has stalled: it leaves READY and is
    # restarted (core/progress.py). Needs the server's --enable-metrics; 0: off.
    stall_after_s: float = Field(default=120.0, ge=0)
    # How often the server's /metrics is read while the unit is ready.
    progress_interval_s: float = Field(default=5.0, gt=0)

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        # top_k <= 1 makes SGLang treat the batch as greedy (torch.argmax), so
        # FlashInfer's sampling kernels never run and the probe proves nothing.
        if value != -1 and value <= 1:
            raise ValueError(
                f"must be greater than 1 (or -1 for the whole vocabulary) so the probe "
                f"exercises the sampling kernels, got {value}"
            )
        return value

    @field_validator(
        "temperature",
        "top_p",
        "timeout_s",
        "startup_deadline_s",
        "interval_s",
        "stall_after_s",
        "progress_interval_s",
    )
    @classmethod
    def _check_finite(cls, value: float) -> float:
        return _finite(value)


class RestartSection(_Section):
    backoff_initial_s: float = Field(default=10.0, gt=0)
    backoff_factor: float = Field(default=2.0, ge=1)
    backoff_max_s: float = Field(default=300.0, gt=0)
    backoff_reset_after_s: float = Field(default=600.0, gt=0)
    max_failures: int = Field(default=5, ge=1)
    failure_window_s: float = Field(default=600.0, gt=0)

    @field_validator(
        "backoff_initial_s", "backoff_factor", "backoff_max_s",
        "backoff_reset_after_s", "failure_window_s",
    )  # fmt: skip
    @classmethod
    def _check_finite(cls, value: float) -> float:
        return _finite(value)

    @model_validator(mode="after")
    def _check_order(self) -> RestartSection:
        if self.backoff_max_s < self.backoff_initial_s:
            raise FieldProblems(
                [
                    Problem(
                        "restart.backoff_max_s",
                        f"must be at least backoff_initial_s ({self.backoff_initial_s:g}), "
                        f"got {self.backoff_max_s:g}",
                    )
                ]
            )
        return self


class FallbackSection(_Section):
    oom_exits: int = Field(default=2, ge=1)
    window_s: float = Field(default=900.0, gt=0)
    retry_preferred_after_s: float = Field(default=3600.0, ge=0)

    @field_validator("window_s", "retry_preferred_after_s")
    @classmethod
    def _check_finite(cls, value: float) -> float:
        return _finite(value)


class CoverageCustom(_Section):
    """A request shape of the operator's own: what their clients send."""

    name: str
    endpoint: Literal["/generate", "/v1/completions", "/v1/chat/completions"] = "/generate"
    body: dict[str, Any]
    concurrent: int = Field(default=1, ge=1, le=256)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not coverage.valid_name(value):
            raise ValueError(
                f"must be lowercase letters, digits and dashes (at most 63), got {value!r}"
            )
        if value == coverage.DEFAULT_SET or value in coverage.builtin_names():
            raise ValueError(f"{value!r} is a built-in shape; give yours another name")
        if value.startswith("learned-"):
            raise ValueError(
                f"{value!r}: names starting learned- are the learned shapes'; give yours "
                "another name"
            )
        return value


class CoverageSection(_Section):
    """The coverage warm-up: the request shapes a unit plays after its sampled probe
    and before READY, so that nothing is left to compile under live traffic."""

    enabled: bool = True
    # Built-in shape names, "default" (every built-in shape), and custom names.
    shapes: tuple[str, ...] = Field(default=(coverage.DEFAULT_SET,), strict=False)
    custom: tuple[CoverageCustom, ...] = Field(default=(), strict=False)
    timeout_s: float = Field(default=120.0, gt=0)
    max_new_tokens: int = Field(default=8, ge=1, le=64)
    # The decode descent's cap: decode batches above it are not played (and /status
    # says so). Each size costs a few decode steps; the sizes ride on one batch.
    max_decode_batch: int = Field(default=256, ge=1, le=4096)
    # Replay what compiled after READY on earlier starts (learned shapes, kept in the
    # daemon's state directory) after the unit's own shapes.
    learned: bool = True

    @field_validator("timeout_s")
    @classmethod
    def _check_finite(cls, value: float) -> float:
        return _finite(value)

    @model_validator(mode="after")
    def _check_names(self) -> CoverageSection:
        problems = list(_shape_problems("coverage.shapes", self.shapes, self.custom))
        names = [c.name for c in self.custom]
        for i, name in enumerate(names):
            if name in names[:i]:
                problems.append(Problem(f"coverage.custom[{i}].name", f"{name!r} appears twice"))
        if problems:
            raise FieldProblems(problems)
        return self

    def custom_shapes(self) -> tuple[coverage.CustomShape, ...]:
        return tuple(
            coverage.CustomShape(c.name, c.endpoint, c.body, c.concurrent) for c in self.custom
        )


def _shape_problems(
    path: str, names: Iterable[str], custom: Iterable[CoverageCustom]
) -> Iterable[Problem]:
    known = {coverage.DEFAULT_SET, *coverage.builtin_names(), *(c.name for c in custom)}
    for i, name in enumerate(names):
        if name not in known:
            yield Problem(
                f"{path}[{i}]",
                f"unknown shape {name!r}; use 'default', a built-in shape "
                f"({', '.join(coverage.builtin_names())}) or a [[coverage.custom]] name",
            )


class UnitConfig(_Section):
    name: str
    role: Role = Field(strict=False)
    url: str
    fallback: str | None = None
    # This unit's coverage shapes; absent: coverage.shapes; []: none for this unit.
    coverage: tuple[str, ...] | None = Field(default=None, strict=False)

    @field_validator("name", "fallback")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        return None if value is None else validate_service_name(value)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return normalize_server_url(value)


class Config(_Section):
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)
    flashinfer: FlashInferSection = Field(default_factory=FlashInferSection)
    probe: ProbeSection = Field(default_factory=ProbeSection)
    restart: RestartSection = Field(default_factory=RestartSection)
    fallback: FallbackSection = Field(default_factory=FallbackSection)
    coverage: CoverageSection = Field(default_factory=CoverageSection)
    units: tuple[UnitConfig, ...] = Field(strict=False)

    @field_validator("units")
    @classmethod
    def _check_units(cls, units: tuple[UnitConfig, ...]) -> tuple[UnitConfig, ...]:
        if not units:
            raise ValueError("no units configured; add at least one [[units]] table")
        problems = list(_unit_problems(units))
        if problems:
            raise FieldProblems(problems)
        return units

    @model_validator(mode="after")
    def _check_unit_shapes(self) -> Config:
        problems = [
            p
            for i, unit in enumerate(self.units)
            if unit.coverage is not None
            for p in _shape_problems(f"units[{i}].coverage", unit.coverage, self.coverage.custom)
        ]
        if problems:
            raise FieldProblems(problems)
        return self

    def coverage_names(self, unit: str) -> tuple[str, ...]:
        """The shapes ``unit`` plays before READY (none when coverage is disabled)."""
        if not self.coverage.enabled:
            return ()
        own = self.unit(unit).coverage
        return self.coverage.shapes if own is None else own

    def unit(self, name: str) -> UnitConfig:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(name)


def normalize_server_url(value: str) -> str:
    """The base URL of an SGLang server, without a trailing slash."""
    parts = _split_http_url(value, "http://127.0.0.1:30000")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"must be the server's base URL (no path, query or fragment), got {value!r}; "
            "the supervisor adds /health and /generate itself"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _flashinfer_problems(section: FlashInferSection) -> Iterable[Problem]:
    if section.bundle_max_entry_bytes > section.bundle_max_total_bytes:
        yield Problem(
            "flashinfer.bundle_max_entry_bytes",
            f"{section.bundle_max_entry_bytes} is more than bundle_max_total_bytes "
            f"({section.bundle_max_total_bytes}); one file cannot exceed them all",
        )
    if not section.enabled:
        return
    for field in ("python", "workspace"):
        value: Path = getattr(section, field)
        if not PurePosixPath(value).is_absolute():
            yield Problem(
                f"flashinfer.{field}",
                f"must be an absolute path when FlashInfer warm-up is enabled, got {str(value)!r}",
            )


def _unit_problems(units: tuple[UnitConfig, ...]) -> Iterable[Problem]:
    index: dict[str, int] = {}
    for i, unit in enumerate(units):
        if unit.name in index:
            yield Problem(
                f"units[{i}].name",
                f"{unit.name!r} is already configured as units[{index[unit.name]}]; "
                "each unit appears once",
            )
        else:
            index[unit.name] = i
    served: dict[str, int] = {}
    for i, unit in enumerate(units):
        path = f"units[{i}].fallback"
        if unit.role is Role.EAGLE3 and unit.fallback is None:
            yield Problem(
                path,
                "an eagle3 unit needs a fallback: name the autoregressive unit that "
                "serves while it is in standby",
            )
        if unit.fallback is None:
            continue
        if unit.role is not Role.EAGLE3:
            yield Problem(path, "only an eagle3 unit takes a fallback; remove this key")
            continue
        if unit.fallback == unit.name:
            yield Problem(path, "a unit cannot be its own fallback")
            continue
        target = index.get(unit.fallback)
        if target is None:
            yield Problem(
                path,
                f"{unit.fallback!r} is not a configured unit; add a [[units]] entry "
                'for it with role = "autoregressive"',
            )
            continue
        if units[target].role is not Role.AUTOREGRESSIVE:
            yield Problem(
                path,
                f"{unit.fallback!r} (units[{target}]) has role "
                f"{units[target].role.value!r}; a fallback must be autoregressive",
            )
        if unit.fallback in served:
            yield Problem(
                path,
                f"{unit.fallback!r} is already the fallback of units[{served[unit.fallback]}]; "
                "give each eagle3 unit its own fallback",
            )
        else:
            served[unit.fallback] = i


class InvalidConfig(ConfigError):
    """A config that cannot be used. ``problems`` lists each bad field."""

    def __init__(self, source: str, problems: Iterable[Problem]) -> None:
        self.source = source
        self.problems = tuple(problems)
        count = len(self.problems)
        if count == 1 and not self.problems[0].path:
            # A file-level problem (unreadable, bad TOML): one line, file first.
            super().__init__(f"{source}: {self.problems[0].message}")
            return
        head = f"{source}: invalid configuration ({count} problem{'s' if count != 1 else ''})"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


# Readable text for pydantic's error types; the rest keep pydantic's message.
_FRIENDLY = {
    "missing": "is required; add it",
    "float_type": "must be a number",
    "int_type": "must be a whole number",
    "bool_type": "must be true or false",
    "string_type": "must be a string in quotes",
    "tuple_type": 'must be an array, e.g. ["sampling"]',
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "path_type": "must be a path string",
}

# Allowed keys under each table, to say what a misspelt key could have been.
_TABLES: dict[str, type[BaseModel]] = {
    "": Config,
    "supervisor": SupervisorSection,
    "flashinfer": FlashInferSection,
    "probe": ProbeSection,
    "restart": RestartSection,
    "fallback": FallbackSection,
    "units": UnitConfig,
}


def _loc_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _clean(text: str) -> str:
    # Values come from the file; never let one forge extra lines in the report.
    return _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problems_from(exc: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    for err in exc.errors():
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, FieldProblems):
            problems.extend(inner.problems)
            continue
        loc = tuple(err["loc"])
        path = _loc_path(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            table = str(loc[0]) if len(loc) > 1 else ""
            allowed = ", ".join(_TABLES[table].model_fields) if table in _TABLES else ""
            hint = f" (known keys here: {allowed})" if allowed else ""
            problems.append(Problem(path, f"unknown key; remove it or fix its spelling{hint}"))
            continue
        if kind == "value_error":
            message = str(err["msg"]).removeprefix("Value error, ")
        else:
            message = _FRIENDLY.get(kind) or (
                str(err["msg"])
                .replace("Input should", "must", 1)
                .replace("greater than or equal to", "at least")
                .replace("less than or equal to", "at most")
            )
            if kind != "missing":
                message += f", got {_shown(err['input'])}"
        problems.append(Problem(path, message))
    return problems


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Validate already-parsed TOML data; raise InvalidConfig naming each bad field."""
    try:
        return Config.model_validate(dict(data))
    except ValidationError as exc:
        problems = [Problem(_clean(p.path), _clean(p.message)) for p in _problems_from(exc)]
        raise InvalidConfig(source, problems) from None


_TOML_AT = re.compile(r"^(?P<what>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def parse_toml(raw: bytes, source: str = "<config>") -> Config:
    """Decode, parse and validate a config file's bytes; ``source`` names it in errors."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InvalidConfig(
            source, [Problem("", f"line {line}: not valid UTF-8 (TOML files are UTF-8)")]
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_AT.match(str(exc))
        if match:
            where = f"line {match['line']}, column {match['col']}"
            detail = f"{where}: TOML syntax error: {match['what']}"
        else:
            detail = f"TOML syntax error: {exc}"
        raise InvalidConfig(source, [Problem("", _clean(detail))]) from None
    except RecursionError:
        # tomllib recurses per nesting level; a hostile file must not crash us.
        detail = "nested too deeply to be a k26-supervisor config (arrays/tables inside each other)"
        raise InvalidConfig(source, [Problem("", detail)]) from None
    return parse_config(data, source)


# --- where the configuration meets the core ------------------------------------------


# A warm-up may take flashinfer.timeout_s to build, plus the gate check, a patch
# and the verification; a start job gets supervisor.job_timeout_s from systemd.
# Past these the machine stops waiting (the adapters' own limits should end the
# work first: these deadlines are the net under them).
WARMUP_SLACK_S = 60.0
START_SLACK_S = 30.0


def unit_policy(config: Config) -> UnitPolicy:
    fi, probe, restart = config.flashinfer, config.probe, config.restart
    return UnitPolicy(
        warmup_enabled=fi.enabled,
        allow_patch=fi.allow_patch,
        pytorch_sampling_fallback=fi.pytorch_sampling_fallback,
        warmup_attempts=fi.warmup_attempts,
        overlap=fi.overlap,
        warmup_deadline_s=fi.timeout_s + WARMUP_SLACK_S,
        start_deadline_s=config.supervisor.job_timeout_s + START_SLACK_S,
        startup_deadline_s=probe.startup_deadline_s,
        probe_interval_s=probe.interval_s,
        probe_failures_to_fail=probe.failures_to_fail,
        backoff_initial_s=restart.backoff_initial_s,
        backoff_factor=restart.backoff_factor,
        backoff_max_s=restart.backoff_max_s,
        backoff_reset_after_s=restart.backoff_reset_after_s,
        max_failures=restart.max_failures,
        failure_window_s=restart.failure_window_s,
    )


def pair_policy(config: Config) -> PairPolicy:
    fb = config.fallback
    return PairPolicy(fb.oom_exits, fb.window_s, fb.retry_preferred_after_s)


def unit_specs(config: Config) -> tuple[UnitSpec, ...]:
    return tuple(UnitSpec(u.name, u.role, u.fallback) for u in config.units)


# Keys a running daemon cannot take over: the bus it is connected to, the socket
# it listens on, and the units it supervises (machines, pairs, metrics series).
_RESTART_KEYS = (("supervisor", "bus"), ("supervisor", "listen"))


def reload_refusals(running: Config, new: Config) -> list[Problem]:
    """Why ``new`` cannot replace ``running`` without a supervisor restart (empty: it can).

    Everything else (probe, restart, fallback, flashinfer, the other
    [supervisor] keys) applies at run time, all together.
    """
    problems = [
        Problem(
            f"{section}.{key}",
            f"changed from {getattr(getattr(running, section), key)!r} to "
            f"{getattr(getattr(new, section), key)!r}; this key needs "
            "`systemctl restart k26-supervisor`",
        )
        for section, key in _RESTART_KEYS
        if getattr(getattr(running, section), key) != getattr(getattr(new, section), key)
    ]

    # A unit's coverage shapes apply at run time like [coverage]; the rest does not.
    def identity(config: Config) -> list[dict[str, Any]]:
        return [u.model_dump(exclude={"coverage"}) for u in config.units]

    if identity(new) != identity(running):
        problems.append(
            Problem(
                "units",
                "the [[units]] list changed; that needs `systemctl restart k26-supervisor` "
                "(the units themselves keep running)",
            )
        )
    return problems
