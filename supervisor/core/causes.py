"""Why a unit's main process ended, and what the supervisor does about each cause.

One place: a cause is a member of ``ExitCause`` (the spelling alerts, ``/status`` and
users key on: docs/architecture.md lists them) and a row of ``CAUSES``, here.
Everything else derives from these two: the classifier returns the member, the
machine and the pair policy act on its row, and the status board, the metrics and
JSON turn it into its string at the edge (tests/unit/core/test_causes.py checks that
a member without a row, or a row without a member, cannot exist).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType


class ExitCause(StrEnum):
    CLEAN = "clean"
    EXIT_CODE = "exit-code"
    SIGKILL = "sigkill"
    OOM_KILL = "oom-kill"
    GPU_OOM = "gpu-oom"
    FLASHINFER_ARCH = "flashinfer-arch"
    FLASHINFER_JIT = "flashinfer-jit"
    SIGNAL = "signal"
    CORE_DUMP = "core-dump"
    WATCHDOG = "watchdog"
    TIMEOUT = "timeout"
    START_LIMIT = "start-limit"
    CUDA_ERROR = "cuda-error"
    NCCL = "nccl"
    GPU_XID = "gpu-xid"
    GPU_DRIVER = "gpu-driver"
    PORT_IN_USE = "port-in-use"
    MODEL_LOAD = "model-load"
    STOPPED = "stopped"


@dataclass(frozen=True)
class CausePolicy:
    """What a death with this cause makes the supervisor do. The default: restarted
    under backoff, counted in the failure window."""

    # No restart heals it: the unit fails at once, saying what to fix (the pair policy
    # then starts the fallback).
    unhealable: str | None = None
    # The reason shown when its verdict is the GPUs' own (``needs_person``): failed for a
    # person, the fallback on the same GPUs kept off. None: the gpu-xid text.
    gpus_own: str | None = None
    # Counts toward the pair's hand-over after repeated out-of-memory deaths.
    oom: bool = False
    # The next warm-up re-checks FlashInfer's arch gate (and fails if it cannot fix it).
    recheck_arch: bool = False


_RESTART = CausePolicy()
CAUSES: Mapping[ExitCause, CausePolicy] = MappingProxyType(
    {
        ExitCause.CLEAN: _RESTART,
        ExitCause.EXIT_CODE: _RESTART,
        ExitCause.SIGKILL: _RESTART,
        ExitCause.OOM_KILL: CausePolicy(oom=True),
        ExitCause.GPU_OOM: CausePolicy(oom=True),
        ExitCause.FLASHINFER_ARCH: CausePolicy(recheck_arch=True),
        ExitCause.FLASHINFER_JIT: CausePolicy(
            unhealable=(
                "FlashInfer's JIT could not build or run inside the server (a tool or header is "
                "missing from the unit's environment; FlashInfer 0.6 runs ninja on every load): "
                "restarting cannot help; put the serving venv's bin on the unit's PATH, then reset "
                "the unit (SIGUSR1)"
            )
        ),
        ExitCause.SIGNAL: _RESTART,
        ExitCause.CORE_DUMP: _RESTART,
        ExitCause.WATCHDOG: _RESTART,
        ExitCause.TIMEOUT: _RESTART,
        ExitCause.START_LIMIT: _RESTART,
        ExitCause.CUDA_ERROR: _RESTART,
        ExitCause.NCCL: _RESTART,
        # A program's fault Xid (13, 31, 43) or a contained ECC error (94) is restarted;
        # a hardware or driver Xid makes the verdict ``needs_person``.
        ExitCause.GPU_XID: CausePolicy(
            gpus_own=(
                "the GPU reported a hardware or driver NVIDIA Xid: it needs a person (nvidia-smi -q, "
                "reset the GPU or drain the node); neither it nor its fallback is started on these "
                "GPUs until an operator resets the unit (SIGUSR1)"
            )
        ),
        ExitCause.GPU_DRIVER: CausePolicy(
            gpus_own=(
                "the host's GPU driver stack is unusable (a driver older than the CUDA runtime, "
                "nvidia-fabricmanager not running or not of the driver's version (error 802), or a "
                "driver/library version mismatch): it needs a person (nvidia-smi, systemctl status "
                "nvidia-fabricmanager, then upgrade the driver, start the fabric manager, or reboot); "
                "no restart until an operator resets the unit (SIGUSR1)"
            )
        ),
        ExitCause.PORT_IN_USE: CausePolicy(
            unhealable=(
                "another process holds its port: restarting cannot help; free the port "
                "(ss -ltnp), then reset the unit (SIGUSR1)"
            )
        ),
        ExitCause.MODEL_LOAD: CausePolicy(
            unhealable=(
                "the model's weights, config or tokenizer could not be loaded: restarting cannot "
                "help; fix the model path or files, then reset the unit (SIGUSR1)"
            )
        ),
        ExitCause.STOPPED: _RESTART,
    }
)


def gpus_own_reason(cause: ExitCause) -> str:
    """The reason a unit failed for a person shows, for a death with ``cause``."""
    return CAUSES[cause].gpus_own or CAUSES[ExitCause.GPU_XID].gpus_own or ""
