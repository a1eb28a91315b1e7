"""How a line is matched against the rule table (texts.py), and each kind's advice.

A warning line never decides (``is_warning``): torch's ``UserWarning: CUDA
initialization: ...``, a logger's ``WARNING`` line, glog's ``W`` lines, a compiler's
``warning:``/``nvcc warning :``; NCCL's ``NCCL WARN Cuda failure ...`` is an error
report, not a warning.
"""

from __future__ import annotations

import re

from .texts import ARCH_NEEDLES, ERROR_SHAPE, LINE_RULES, Rule

__all__ = ["LINE_RULES", "NO_RESTART", "OUTPUT_SUMMARY", "Rule", "is_warning", "line_rule"]

# A warning ends nothing ("Warning: CUDA warning: unspecified launch failure", torch's
# "UserWarning: CUDA initialization: Found no NVIDIA driver", a logger's WARNING line,
# glog's W lines). NCCL's "NCCL WARN Cuda failure ..." is an error report.
_WARNING_RE = re.compile(
    r"Warning: |CUDA warning: |\bWARNING\b|(?<!NCCL )\bWARN\b|\bwarning(?: #[\w-]+)? ?:"
    r"|(?:^|[\[\s:])W\d{3,4} [\d:.]+ |\[W [\w.]+:\d+\]"
)
# A warning whose message starts on the next line ("UserWarning: " then the text).
WARNING_HEAD_RE = re.compile(r"Warning:\s*$")


def is_warning(line: str) -> bool:
    return ("W" in line or "arning" in line) and _WARNING_RE.search(line) is not None


def line_rule(line: str) -> Rule | None:
    """The first rule the line matches (the caller leaves warnings out)."""
    for rule in LINE_RULES:
        if rule.needle in line and rule.pattern.search(line):
            if rule.unless is not None and rule.unless.search(line):
                continue
            if rule.needle in ARCH_NEEDLES and not ERROR_SHAPE.search(line):
                continue
            return rule
    return None


# --- the advice -----------------------------------------------------------------------

NO_RESTART = "restarting will not help"
# (prefix, advice) per kind: the summary is "<prefix>: <last line>; <advice>".
OUTPUT_SUMMARY: dict[str, tuple[str, str]] = {
    "cuda-oom": ("GPU out of memory", "lower --mem-fraction-static or free the GPU"),
    "kv-pool": (
        "GPU out of memory",
        "the weights leave no room for the KV cache: raise --mem-fraction-static "
        "(vLLM: --gpu-memory-utilization), shorten the context or add GPUs; " + NO_RESTART,
    ),
    "batch-tokens": (
        "GPU out of memory",
        "the warm-up batch does not fit next to the weights: lower --max-batch-prefill-tokens "
        "(TGI) or --max-batch-total-tokens, or free the GPU; " + NO_RESTART,
    ),
    "free-memory": (
        "GPU out of memory",
        "another process holds GPU memory: free the GPU or lower the memory fraction",
    ),
    "arch": (
        "GPU architecture rejected",
        "this build has no kernels for this GPU: use a build for its architecture "
        "or another backend; " + NO_RESTART,
    ),
    "cuda": (
        "CUDA failure",
        "a kernel fault or a bad GPU state: one restart may clear it; if it repeats, "
        "report it (CUDA_LAUNCH_BLOCKING=1) or check the GPU",
    ),
    "nccl": (
        "NCCL failure",
        "a collective failed between ranks: check the peers and the interconnect "
        "(NCCL_DEBUG=INFO); a restart helps only once the cause is gone",
    ),
    "jit": (
        "FlashInfer's JIT build failed in the server",
        "a build tool or header it needs is missing from the unit's environment (FlashInfer "
        "0.6 runs ninja on every module load, even warm: put the serving venv's bin on the "
        "unit's PATH) — " + NO_RESTART,
    ),
    "driver": (
        "GPU driver stack unusable",
        "fix the host's driver stack (a driver older than the CUDA runtime: upgrade the "
        "driver or use a build for it; 802: start nvidia-fabricmanager with the driver's "
        "exact version; a version mismatch: reboot or reload the driver), then reset the "
        "unit (SIGUSR1) — " + NO_RESTART,
    ),
    "port": ("port already in use", "another process holds it — " + NO_RESTART),
    "model": (
        "model failed to load",
        "fix the model path/weights/config (or the access token) — " + NO_RESTART,
    ),
}
