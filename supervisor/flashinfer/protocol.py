"""What ``venv_scripts/k26_serving.py`` answers, as validated models.

The script runs inside the serving venv (any Python 3.8+, none of our
imports), so its replies cross a process boundary as JSON. Each command's
reply is checked here, where it is read: a field missing, misnamed or of the
wrong type is an UnavailableError naming the command and the field, never a
``KeyError`` deep inside doctor or warm.

Models forbid unknown fields: the script ships inside this package, so a
reply that does not match is a mismatch between the two, not a newer FlashInfer.
``recorded()`` gives back exactly the JSON the script sent (only the keys it
set), which is what a fingerprint stores and compares.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from supervisor.core.errors import UnavailableError

GateVerdict = Literal["accepts", "rejects", "unknown"]


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def recorded(self) -> dict[str, Any]:
        """The reply as the script sent it (the keys it set, JSON types)."""
        return self.model_dump(mode="json", exclude_unset=True)


class Distribution(Reply):
    """An installed distribution: name, version and a hash of its RECORD."""

    name: str
    version: str
    record_sha256: str
    cuda: str | None = None  # torch only: the CUDA it was built for


class Nvcc(Reply):
    """The nvcc FlashInfer would run, and what it says it is."""

    cuda_home: str | None = None
    path: str | None = None
    release: str | None = None
    version_sha256: str | None = None
    realpath: str | None = None
    size: int | None = None
    mtime_ns: int | None = None
    error: str | None = None


class Identity(Reply):
    """``identity``: who would build (no flashinfer or torch import)."""

    python: str
    python_version: str
    prefix: str
    flashinfer: Distribution | None
    flashinfer_dir: str | None
    gate_files: dict[str, str | None]
    torch: Distribution | None
    nvcc: Nvcc
    env: dict[str, str | None]
    aot_wheels: list[Distribution] = []


class GateAnswer(Reply):
    """FlashInfer's own arch check, as run in the venv."""

    verdict: GateVerdict
    error: str | None = None
    where: str | None = None
    arch_flags: list[str] = []
    target_archs: list[str] | None = None


class Artifact(Reply):
    """One prebuilt module file FlashInfer chose, and the wheel that installed it."""

    provider: str
    path: str
    archs: list[str] | None = None
    distribution: str | None = None
    version: str | None = None
    record_sha256: str | None = None


class Resolution(Reply):
    """Where FlashInfer will load a module from: a provider wheel, its package, or JIT."""

    source: Literal["provider", "package", "jit"]
    artifacts: list[Artifact] = []


class Provider(Reply):
    """A flashinfer-jit-cache provider wheel FlashInfer accepted."""

    id: str
    distribution: str
    version: str
    dir: str
    archs: list[str]
    modules: int


class Cubin(Reply):
    """Where FlashInfer reads downloaded cubins from."""

    dir: str | None = None
    package: str | None = None
    error: str | None = None


class MissingHeader(Reply):
    """A header nvcc's dependency scan could not find."""

    header: str
    included_from: str | None = None
    source: str | None = None


class Preflight(Reply):
    """``nvcc -M`` over a module's sources with FlashInfer's own flags."""

    checked: bool
    missing: list[MissingHeader] = []
    error: str | None = None


class ModuleAnswer(Reply):
    """Where FlashInfer puts one module, or why it could not say."""

    path: str | None = None
    build_dir: str | None = None
    compiled: bool = False
    aot: bool = False
    lock_path: str | None = None
    resolution: Resolution | None = None
    headers: Preflight | None = None
    generator: bool = True  # False: FlashInfer builds it only from arguments it is given
    error: str | None = None
    where: str | None = None


class LoadAnswer(Reply):
    """One ``.so`` loaded the way FlashInfer loads it."""

    ok: bool
    error: str | None = None
    loader: str | None = None
    seconds: float | None = None


class Probe(Reply):
    """``probe``: identity, gate, directories, modules and loads."""

    identity: Identity
    gate: GateAnswer
    workspace_dir: str | None = None
    jit_dir: str | None = None
    arch_tag: str | None = None
    dir_error: str | None = None
    flashinfer_version: str | None = None
    cuda_version: str | None = None
    cuda_version_error: str | None = None
    modules: dict[str, ModuleAnswer] = {}
    loads: dict[str, LoadAnswer] = {}
    providers: list[Provider] = []
    cubin: Cubin | None = None
    gate_without_arch_list: GateAnswer | None = None


class Build(Reply):
    """``build``: which modules were built, or which one failed and why."""

    ok: bool
    built: list[str] = []
    failed: str | None = None
    error: str | None = None
    gate: GateAnswer | None = None
    probe: Probe | None = None  # ``--verify``: the probe after the build, same process


class TorchArches(Reply):
    """``torch-arches``: the capabilities torch's cpp_extension accepts."""

    known: list[str]


R = TypeVar("R", bound=Reply)


def parse(model: type[R], command: str, raw: Any) -> R:
    """Validate one reply; UnavailableError naming the command and the fields."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or '(reply)'}: {error['msg']}"
            for error in exc.errors()[:5]
        )
        raise UnavailableError(
            f"k26_serving.py {command} answered something this supervisor does not "
            f"understand ({problems}); the script and the package are out of step: "
            "reinstall k26-supervisor"
        ) from None
