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

from supervisor.devtools.standin.lifecycle import stamp

FAULTS = ("cuda-oom", "sampling-arch", "grow-memory", "sampled-hang")
SAMPLING_MODULE_GLOB = "**/cached_ops/sampling/sampling.so"

_SITE = "/opt/sglang/.venv/lib/python3.12/site-packages"

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
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 3012, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 1035, in event_loop_overlap
    batch_result = self.run_batch(batch)
                   ^^^^^^^^^^^^^^^^^^^^^
  File "{_SITE}/sglang/srt/managers/scheduler.py", line 2128, in run_batch
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


CUDA_OOM_FRAMES = _CUDA_OOM_FRAMES
SAMPLING_ARCH_FRAMES = _SAMPLING_ARCH_FRAMES


def sampling_module_cached(cache_dir: Path | None) -> Path | None:
    """The warmed FlashInfer sampling module under ``cache_dir``, if there is one
    (``<base>/.cache/flashinfer/<version>/<arch>/cached_ops/sampling/sampling.so``)."""
    if cache_dir is None:
        return None
    return next(iter(sorted(cache_dir.glob(SAMPLING_MODULE_GLOB))), None)


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
