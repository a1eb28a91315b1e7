"""The faults the stand-in can play, and the text a real server prints for each.

The traceback texts are assembled from real ones (tests/unit/samples/: a torch CUDA
OOM on an H200, FlashInfer 0.7.4's architecture rejection) inside the frame shape
SGLang's scheduler logs ("Scheduler hit an exception: ..."). The scheduler then
SIGQUITs the launcher, which kills its process tree and itself (``lifecycle``):
the stand-in's faults end the same way, in the launcher's own SIGKILL.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from k26dev.standin.lifecycle import stamp

FAULTS = (
    "cuda-oom",
    "kv-cache-oom",
    "norm-arch",
    "sampling-arch",
    "grow-memory",
    "sampled-hang",
    "device-assert",
    "crash-exit-0",
    "stall",
    "chaos",
)
# --fail chaos: the prompt text names the fault (bench/chaos.py), "k26-chaos:KIND[:XID]",
# KIND one of device-assert, crash-exit-0, stall, hang, grow-memory, compile (a Triton
# kernel variant named by the number, compiled as traffic's new shapes are).
CHAOS_PREFIX = "k26-chaos:"

_SITE = "/opt/sglang/.venv/lib/python3.12/site-packages"
# The scheduler's running loop, the frames under any fault of a forward pass.
_EVENT_LOOP_FRAMES = f"""\
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 3012, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 1035, in event_loop_overlap
    batch_result = self.run_batch(batch)
                   ^^^^^^^^^^^^^^^^^^^^^
"""

_CUDA_OOM_FRAMES = f"""\
Traceback (most recent call last):
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 2998, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 353, in __init__
    self.tp_worker = TpWorkerClass(
                     ^^^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/managers/tp_worker.py", line 101, in __init__
    self.model_runner = ModelRunner(
                        ^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/model_executor/model_runner.py", line 331, in __init__
    self.initialize(min_per_gpu_memory)
  File "{_SITE}/sglang/srt/model_executor/model_runner.py", line 451, in initialize
    self.init_memory_pool(
  File "{_SITE}/sglang/srt/model_executor/model_runner.py", line 1872, in init_memory_pool
    self.token_to_kv_pool = MHATokenToKVPool(
                            ^^^^^^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/mem_cache/memory_pool.py", line 541, in __init__
    self._create_buffers()
  File "{_SITE}/sglang/srt/mem_cache/memory_pool.py", line 571, in _create_buffers
    torch.zeros(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 60.00 GiB. GPU 0 has a total \
capacity of 139.80 GiB of which 39.29 GiB is free. Including non-PyTorch memory, this process \
has 100.51 GiB memory in use. Of the allocated memory 100.00 GiB is allocated by PyTorch, and \
0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try \
setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See \
documentation for Memory Management  \
(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)
"""

_SAMPLING_ARCH_FRAMES = f"""\
Traceback (most recent call last):
{_EVENT_LOOP_FRAMES}  File "{_SITE}/sglang/srt/managers/scheduler.py", line 2128, in run_batch
    batch_result = self.model_worker.forward_batch_generation(model_worker_batch)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/managers/tp_worker.py", line 264, in forward_batch_generation
    next_token_ids = self.model_runner.sample(logits_output, forward_batch)
                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/model_executor/model_runner.py", line 2245, in sample
    next_token_ids = self.sampler(
                     ^^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/layers/sampler.py", line 112, in forward
    batch_next_token_ids = top_k_top_p_sampling_from_probs(
                           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/flashinfer/api_logging.py", line 2369, in _auto_dump_wrapper
    return _inner(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/flashinfer/sampling.py", line 2072, in top_k_top_p_sampling_from_probs
    renorm_probs = top_k_renorm_probs(probs, top_k)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/flashinfer/sampling.py", line 2256, in top_k_renorm_probs
    return get_sampling_module().top_k_renorm_probs(
           ^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/flashinfer/sampling.py", line 214, in get_sampling_module
    module = gen_sampling_module().build_and_load()
             ^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/flashinfer/jit/sampling.py", line 22, in gen_sampling_module
    return gen_jit_spec(
           ^^^^^^^^^^^^^
  File "{_SITE}/flashinfer/jit/core.py", line 760, in gen_jit_spec
    check_cuda_arch()
  File "{_SITE}/flashinfer/jit/core.py", line 172, in check_cuda_arch
    raise RuntimeError(
RuntimeError: FlashInfer requires GPUs with sm75 or higher. Detected TARGET_CUDA_ARCHS=[].
"""


def print_scheduler_exception(frames: str, err: TextIO = sys.stderr) -> None:
    """What SGLang's scheduler logs when its event loop raises, before it SIGQUITs us."""
    err.write(f"{stamp(tp=True)} Scheduler hit an exception: {frames}\n")
    err.flush()


# sglang 0.5.17 on an H200 with another process holding the GPU's memory
# (tests/unit/samples/real-sglang-0.5.17/gpu-memory-held-at-start.log), site path
# as there.
KV_CACHE_OOM_FRAMES = """\
Traceback (most recent call last):
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 4931, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 498, in __init__
    self.init_model_worker()
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 981, in init_model_worker
    self.init_memory_pools()
  File "/tmp/site/sglang/srt/managers/tp_worker.py", line 399, in alloc_memory_pool
    self.model_runner.alloc_memory_pool(memory_pool_config)
  File "/tmp/site/sglang/srt/mem_cache/kv_cache_configurator.py", line 1647, in _profile_available_bytes
    raise ValueError(
ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.05. \
Raise --mem-fraction-static above 0.173 (minimum viable = 1 - available/pre = 0.1729). If using \
speculative decoding, draft weights are now counted.
"""

# FlashInfer 0.6.15.post1's gate in the norm JIT, on the first forward of sglang 0.5.17
# with FLASHINFER_CUDA_ARCH_LIST=7.0 (real-sglang-0.5.17/arch-list-7.0-norm-gate.log,
# the torch frames in between left out).
NORM_ARCH_FRAMES = """\
Traceback (most recent call last):
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 4947, in run_scheduler_process
    scheduler.run_event_loop()
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 3594, in run_batch
    batch_result = self.model_worker.forward_batch_generation(
  File "/tmp/site/sglang/srt/layers/layernorm.py", line 486, in forward_cuda
    out = rmsnorm(x, self.weight.data, self.variance_epsilon)
  File "/tmp/site/sgl_kernel/elementwise.py", line 120, in rmsnorm
    return _flashinfer_norm.rmsnorm(input, weight, eps, out, enable_pdl)
  File "/tmp/site/flashinfer/norm/__init__.py", line 83, in get_norm_module
    return gen_norm_module().build_and_load()
  File "/tmp/site/flashinfer/jit/norm.py", line 26, in gen_norm_module
    return gen_jit_spec(
  File "/tmp/site/flashinfer/jit/core.py", line 413, in gen_jit_spec
    check_cuda_arch()
  File "/tmp/site/flashinfer/jit/core.py", line 108, in check_cuda_arch
    raise RuntimeError("FlashInfer requires GPUs with sm75 or higher")
RuntimeError: FlashInfer requires GPUs with sm75 or higher
"""

CUDA_OOM_FRAMES = _CUDA_OOM_FRAMES
SAMPLING_ARCH_FRAMES = _SAMPLING_ARCH_FRAMES


def module_cached(cache_dir: Path | None, name: str = "sampling") -> Path | None:
    """The warmed FlashInfer module ``name`` under ``cache_dir``, if there is one
    (``<base>/.cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so``)."""
    if cache_dir is None:
        return None
    pattern = f"**/cached_ops/{name}/{name}.so"
    return next(iter(sorted(cache_dir.glob(pattern))), None)


class MemoryGrower:
    """Allocates ``step_bytes`` and writes every page of it, every ``interval_s``,
    until killed (or until ``limit_bytes``, a safety cap for tests; 0 = none).
    Touching each page matters: untouched pages of a large zeroed buffer are never
    charged to the cgroup, so they would not bring the OOM killer. ``report`` gets a
    line each time the total reaches a power of two MiB (64, 128, 256, ...)."""

    def __init__(
        self,
        step_bytes: int,
        interval_s: float,
        limit_bytes: int,
        stop: threading.Event,
        report: Callable[[str], None] = print,
    ) -> None:
        self.step_bytes = step_bytes
        self.interval_s = interval_s
        self.limit_bytes = limit_bytes
        self._stop = stop
        self._report = report
        self._chunks: list[bytearray] = []
        self._thread: threading.Thread | None = None
        self.allocated = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grow-memory", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        next_report = 64 << 20
        while not self._stop.is_set():
            if self.limit_bytes and self.allocated + self.step_bytes > self.limit_bytes:
                self._report(f"standin: grow-memory: limit reached at {self.allocated >> 20} MiB")
                self._stop.wait()
                return
            chunk = bytearray(self.step_bytes)
            chunk[::page] = b"\x01" * len(range(0, self.step_bytes, page))
            self._chunks.append(chunk)
            self.allocated += self.step_bytes
            while self.allocated >= next_report:
                self._report(f"standin: grow-memory: {self.allocated >> 20} MiB allocated")
                next_report *= 2
            self._stop.wait(self.interval_s)


# What real SGLang 0.5.17 printed on an H200 when one request (a ~900-token prompt
# under --context-length 1024) tripped a device-side assert (the project's field
# facts); the driver then logged Xid 43 for the scheduler's PID.
DEVICE_ASSERT_FRAMES = f"""\
/pytorch/aten/src/ATen/native/cuda/IndexKernelUtils.cu:16: vectorized_gather_kernel: block: \
[3,0,0], thread: [64,0,0] Assertion `ind >=0 && ind < ind_dim_size && "vectorized gather kernel \
index out of bounds"` failed.
Traceback (most recent call last):
{_EVENT_LOOP_FRAMES}  File "{_SITE}/torch/nn/modules/linear.py", line 134, in forward
    return F.linear(input, self.weight, self.bias)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, \
opa, opb, m, n, k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, c, CUDA_R_16BF, \
ldc, compute_type, CUBLAS_GEMM_DEFAULT_TENSOR_OP)`
"""

# sglang #29284: a fatal engine error, then the process exits with status 0.
ENGINE_ERROR_FRAMES = f"""\
Traceback (most recent call last):
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 1035, in event_loop_overlap
    batch_result = self.run_batch(batch)
                   ^^^^^^^^^^^^^^^^^^^^^
torch.AcceleratorError: CUDA error: an illegal memory access was encountered
"""

KMSG_PATH = "/dev/kmsg"


def log_xid(pci: str, xid: int, pid: int, kmsg: str = KMSG_PATH) -> str:
    """Write the NVIDIA driver's Xid record for ``pid`` to the kernel log, as the
    driver does when a GPU context faults (root only). Returns the line."""
    detail = {
        43: "name=python, channel 0x00000009",
        13: "name=python, Graphics Exception: ESR 0x405840=0x0",
        31: "name=python, Ch 00000030, intr 00000000. MMU Fault",
        48: "name=python, An uncorrectable double bit error (DBE) has been detected on GPU",
        79: "name=python, GPU has fallen off the bus.",
    }.get(xid, "name=python, Ch 00000010")
    line = f"NVRM: Xid (PCI:{pci}): {xid}, pid={pid}, {detail}"
    fd = os.open(kmsg, os.O_WRONLY)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)
    return line
