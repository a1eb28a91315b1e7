"""FlashInfer JIT warm-up: doctor, warm, patch and revert, driving the serving venv.

The daemon never imports flashinfer or torch: every question runs as a
subprocess of the serving venv's interpreter (``venv_scripts/k26_serving.py``)
under the environment the units get (``unit_environment``). All entry points
are async so the daemon can await them without blocking its loop; the CLI
wraps them with ``asyncio.run``.

    doctor(python, arch, workspace, modules) -> DoctorReport   (.status, .to_json())
    warm(python, arch, workspace, modules, timeout_s, progress) -> WarmResult
    patch(python, arch, workspace, dry_run=...) -> PatchResult
    revert(python, arch, workspace, dry_run=...) -> PatchResult
"""

from supervisor.flashinfer.doctor import doctor
from supervisor.flashinfer.models import (
    EXIT_NEEDS_WARMUP,
    EXIT_UNKNOWN,
    EXIT_WARM,
    DoctorReport,
    Gate,
    ModuleReport,
    PatchResult,
    WarmResult,
)
from supervisor.flashinfer.patching import patch, revert
from supervisor.flashinfer.venv import read_env_file, unit_environment
from supervisor.flashinfer.warm import warm

__all__ = [
    "EXIT_NEEDS_WARMUP",
    "EXIT_UNKNOWN",
    "EXIT_WARM",
    "DoctorReport",
    "Gate",
    "ModuleReport",
    "PatchResult",
    "WarmResult",
    "doctor",
    "patch",
    "read_env_file",
    "revert",
    "unit_environment",
    "warm",
]
