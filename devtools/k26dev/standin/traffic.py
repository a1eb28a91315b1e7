"""What the stand-in compiles while serving, as a real SGLang 0.5.17 does.

Measured on an H200 with every JIT cache empty (the project's field facts), after
the sampled probe had passed: penalties compile through torch inductor (2.8 s on
the first such request); a batch of a size not seen before (``n > 1``, concurrent
requests) compiles Triton's ``get_num_kv_splits_triton`` under the triton attention
backend, and with EAGLE-3 the draft's ``assign_req_to_token_pool`` and
``generate_draft_decode_kv_indices``; the first prefix-cache hit compiles
``write_req_to_token_pool_triton``; a grammar request compiles the token-bitmask
kernel. A Triton kernel is specialised the way Triton specialises integer
arguments (1, a multiple of 16, anything else); the EAGLE-3 draft path's on the
batch's next power of two (``next_power_of_2(num_seqs)``, a constexpr, in sglang
0.5.17's ``srt/speculative``) and on ``num_seqs`` as Triton specialises an integer (on
the H200 a batch of 12 compiled them again with a batch of 16 already compiled),
``generate_draft_decode_kv_indices`` only where no CUDA graph captured the size. Each compile writes files where the real libraries would: Triton's cache
(``TRITON_CACHE_DIR``, else ``~/.triton/cache``) and inductor's
(``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_<user>``), read from
this process's environment by the rules of ``core.jit_caches``. A kernel already
in its cache is loaded, not compiled: caches that outlive a restart spare the work.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from supervisor.core.jit_caches import JitCache, locate

_PENALTIES = {
    # sampling key -> (its neutral value, the compiled function)
    "repetition_penalty": (1.0, "apply_scaling_penalties"),
    "frequency_penalty": (0.0, "apply_additive_penalties"),
    "presence_penalty": (0.0, "apply_additive_penalties"),
}
_GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
CAPTURED_MAX_BS = 32  # the largest decode batch the stand-in's CUDA graphs cover


def cache_dirs(environ: dict[str, str] | None = None) -> dict[JitCache, Path]:
    env = dict(os.environ if environ is None else environ)
    home = env.get("HOME") or str(Path.home())
    user = env.get("USER") or getpass.getuser()
    return {loc.cache: Path(str(loc.path)) for loc in locate(env, home=home, user=user)}


def triton_variant(size: int) -> str:
    """How Triton specialises a kernel on an integer argument: 1, a multiple of 16,
    or anything else (one compiled variant each)."""
    if size == 1:
        return "1"
    return "d16" if size % 16 == 0 else "any"


def ttir(name: str, shape: str) -> str:
    """The TTIR Triton writes as ``<name>.source``: the kernel's signature, a pointer
    and an integer specialised on 16 where the variant is ``d16``; constexprs (the
    rest of the variant) are folded into the body, as Triton folds them."""
    parts = shape.split("-")
    integer = "i32 {tt.divisibility = 16 : i32}" if "d16" in parts else "i32"
    # a8: a KV slot slice that starts at an odd offset (prefill_kernels, batch_kernels)
    pointer = "!tt.ptr<i64>" if "a8" in parts else "!tt.ptr<i64> {tt.divisibility = 16 : i32}"
    return (
        "module {\n"
        f"  tt.func public @{name}(%arg0: {pointer}, "
        f"%arg1: {integer}) attributes {{noinline = false}} {{\n"
        "    tt.return\n  }\n}\n"
    )


def power_of_two(size: int) -> int:
    """A ``next_power_of_2`` constexpr (SGLang's draft path specialises on it)."""
    b = 1
    while b < size:
        b *= 2
    return b


class TrafficCompiles:
    """Compiles on first use, as the real server's request paths do. Thread-safe; the
    caller holds the scheduler while ``compile`` runs (the server blocks meanwhile)."""

    def __init__(
        self,
        *,
        attention_backend: str,
        eagle3: bool,
        cuda_graphs: bool = False,
        kv_alignment: bool = False,
        draft_tokens: int = 4,
        triton_s: float,
        inductor_s: float,
        wait: Callable[[float], object],
        environ: dict[str, str] | None = None,
    ) -> None:
        self.attention_backend = attention_backend
        self.eagle3 = eagle3
        self.cuda_graphs = cuda_graphs
        self.kv_alignment = kv_alignment
        self.draft_tokens = max(1, draft_tokens)  # --speculative-num-draft-tokens
        # KV slots handed out since the allocator last took slots back: where the next
        # slice of its free list starts (``finished``).
        self.kv_slots = 0
        self.triton_s = triton_s
        self.inductor_s = inductor_s
        self.wait = wait
        self.dirs = cache_dirs(environ)
        self.seen_prompts: set[str] = set()
        self.prefixes: set[bytes] = set()  # every prompt prefix served (cached_tokens)
        self._lock = threading.Lock()

    def kernels_for(
        self, params: dict[str, object], batch: int, prompt: str
    ) -> list[tuple[JitCache, str]]:
        """The (cache, kernel) pairs a forward of this request, in a batch of ``batch``,
        goes through that can need a compile."""
        out: list[tuple[JitCache, str]] = []
        for key, (neutral, kernel) in _PENALTIES.items():
            value = params.get(key)
            if isinstance(value, int | float) and float(value) != neutral:
                out.append((JitCache.INDUCTOR, kernel))
        out += self.batch_kernels(batch)
        with self._lock:
            hit = prompt in self.seen_prompts
            self.seen_prompts.add(prompt)
        if hit:
            out.append((JitCache.TRITON, "write_req_to_token_pool_triton"))
        if any(params.get(k) is not None for k in _GRAMMAR_KEYS):
            out.append((JitCache.TRITON, "apply_token_bitmask_inplace_kernel"))
        return out

    def flush(self) -> None:
        """/flush_cache: no prefix is cached any more, and the allocator starts over."""
        with self._lock:
            self.seen_prompts.clear()
            self.prefixes.clear()
            self.kv_slots = 0

    def cached_tokens(self, prompts: list[list[int]]) -> int:
        """The radix cache's match (page size 1): for each prompt, the longest prefix
        an earlier prompt had, at most all but its last token; then they are cached.
        An EAGLE server's cache keys token pairs (sglang 0.5.17's
        ``RadixKey.maybe_to_bigram_view(is_eagle)``): a shared prefix of N ids is
        N - 1 cached tokens (seen on the H200: every shared prefix one short)."""
        cached = 0
        with self._lock:
            for prompt in prompts:
                digest, shared = hashlib.sha256(), 0
                keys = []
                for at, token in enumerate(prompt, 1):
                    digest.update(token.to_bytes(4, "little", signed=True))
                    key = digest.digest()[:12]
                    keys.append(key)
                    if key in self.prefixes:
                        shared = at
                best = min(shared - 1 if self.eagle3 else shared, len(prompt) - 1)
                cached += max(0, best)
                self.prefixes.update(keys)
        return cached

    def prefill_kernels(self, tokens: int, later_slots: int) -> list[tuple[JitCache, str]]:
        """The KV store of a prefill of ``tokens`` new tokens (with ``--kv-alignment``):
        its out_cache_loc is a slice of the allocator's free slots (int64) that starts
        at the count handed out since slots were last handed back, and Triton
        specialises a pointer on 16-byte alignment, so an odd offset is a variant of
        its own. ``later_slots``: what the
        request takes after its prefill (its decode steps), all counted now. Cached
        tokens take no slot."""
        if not self.kv_alignment:
            return []
        with self._lock:
            offset = self.kv_slots
            self.kv_slots += tokens + later_slots
        aligned = "a16" if offset % 2 == 0 else "a8"
        return [(JitCache.TRITON, f"set_kv_buffer_kernel@{triton_variant(tokens)}-{aligned}")]

    def take_slots(self, count: int, *, first: bool = False, each: int = 1) -> None:
        """KV slots a decode step hands out for ``count`` running requests: one each;
        with EAGLE-3, sglang 0.5.17's spec v2 tops every request up to its committed
        length plus a fixed reserve (``eagle_prepare_for_decode``): a request's first
        decode step (``first``) takes the whole reserve, ``get_alloc_reserve_per_decode``,
        twice the draft tokens and so even; each later one what the step before
        committed (``each``): the drafts it accepted and the target's own token, one
        where the draft accepts none (as the GPU's tiny EAGLE-3 draft with dummy
        weights: "accept len: 1.00"), and without speculative decoding."""
        with self._lock:
            if self.eagle3 and first:
                self.kv_slots += count * 2 * self.draft_tokens
            else:
                self.kv_slots += count * each

    def finished(self) -> None:
        """A request ended. sglang 0.5.17 hands back what the radix cache does not
        keep: with EAGLE-3, the over-allocated draft slots and the last token (its
        radix key is token pairs), so every end frees slots, and ``free`` rebuilds the
        allocator's free list (``torch.cat``): the next slice starts at offset 0.
        Without, an end frees nothing and the offset stays (allocator/token.py)."""
        if self.eagle3:
            with self._lock:
                self.kv_slots = 0

    def batch_kernels(self, batch: int, *, step: bool = False) -> list[tuple[JitCache, str]]:
        """The kernels a forward at this batch size selects a variant of. A decode
        ``step`` with EAGLE-3 (and ``--kv-alignment``) passes the draft's
        ``assign_req_to_token_pool`` the slots the step takes (``out_cache_loc``, int64),
        a slice of the allocator's free list at the offset handed out since the last
        end (``take_slots``, ``finished``): an odd one is not 16-byte aligned, a variant
        of its own (on the H100, 2026-12-05, ``(*i64:16, *i32:16, *i32:16, *i32:16,
        *i64)`` compiled after READY)."""
        out: list[tuple[JitCache, str]] = []
        if self.attention_backend == "triton":
            out.append((JitCache.TRITON, f"get_num_kv_splits_triton@{triton_variant(batch)}"))
        if self.eagle3 and batch > 1:
            # The draft path. assign_req_to_token_pool: constexprs of the batch's next
            # power of two. generate_draft_decode_kv_indices takes every integer as a
            # tl.constexpr (sglang 0.5.17), its kv_indices stride num_seqs*topk*context
            # among them: each number of sequences is a variant of its own, except
            # inside a CUDA graph that captured the size (compiled at capture). Measured
            # on the H200: batches of 3, 5, 6 and 12 each compiled it again.
            shape = f"bs{power_of_two(batch)}-{triton_variant(batch)}"
            if step and self.kv_alignment:
                with self._lock:
                    shape += "-a8" if self.kv_slots % 2 else ""
            out.append((JitCache.TRITON, f"assign_req_to_token_pool@{shape}"))
            if not self.cuda_graphs or batch > CAPTURED_MAX_BS:
                out.append((JitCache.TRITON, f"generate_draft_decode_kv_indices@ns{batch}"))
        return out

    def compile(self, kernels: list[tuple[JitCache, str]]) -> list[Path]:
        """Compile whatever of ``kernels`` its cache lacks; the files written."""
        written: list[Path] = []
        for cache, kernel in kernels:
            files = self._files(cache, kernel)
            if all(f.exists() for f in files):
                continue  # in the cache: loaded, not compiled
            self._compiler_runs(self.triton_s if cache is JitCache.TRITON else self.inductor_s)
            for path, text in files.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                temp = path.with_name(f"tmp.pid_{os.getpid()}_{path.name}")
                temp.write_text(text)
                os.replace(temp, path)  # as Triton's cache manager does: no half file
                written.append(path)
        return written

    def _compiler_runs(self, seconds: float) -> None:
        """The compile's wall time, spent as the real one is: in a ``ptxas`` child (Triton
        assembles every kernel with it, inductor's kernels are Triton's), so the process
        tree shows a compiler at work for as long as it lasts."""
        if seconds <= 0:
            return
        ptxas = Path(tempfile.gettempdir()) / f"k26-standin-{os.getpid()}" / "ptxas"
        try:
            if not ptxas.exists():
                ptxas.parent.mkdir(exist_ok=True)
                ptxas.symlink_to(shutil.which("sleep") or "/bin/sleep")
            child = subprocess.Popen([str(ptxas), f"{seconds:.3f}"], stdin=subprocess.DEVNULL)
        except OSError:
            self.wait(seconds)
            return
        try:
            self.wait(seconds)  # the child sleeps as long; a stop cuts both short
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()

    def _files(self, cache: JitCache, kernel: str) -> dict[Path, str]:
        name, _, shape = kernel.partition("@")
        digest = hashlib.sha256(f"{cache}:{kernel}".encode()).hexdigest()[:32]
        meta = json.dumps({"name": name, "shape": shape or None, "standin": True})
        if cache is JitCache.TRITON:
            where = self.dirs[JitCache.TRITON] / digest
            # As Triton 3.6 writes an entry: the TTIR first (.source), the metadata last.
            return {
                where / f"{name}.source": ttir(name, shape),
                where / f"{name}.cubin": f"cubin {kernel}\n",
                where / f"{name}.json": meta,
            }
        where = self.dirs[JitCache.INDUCTOR] / "aotautograd" / digest[:2] / digest
        return {
            where / f"{name}.py": f"# inductor output for {kernel}\n",
            where / f"{name}.best_config": meta,
        }
