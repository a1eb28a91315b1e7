"""The stand-in's start-up, told in sglang 0.5.17's own lines and paced by its load time.

The lines and their order are sglang 0.5.17's (``srt/model_executor/model_runner.py``,
``srt/mem_cache/memory_pool.py``, ``model_runner_components/cuda_graph_setup.py``,
``srt/speculative/eagle_worker_v2.py``, ``srt/entrypoints/engine.py``) and what a real
server printed on an H200 (``tests/unit/samples/real-sglang-0.5.17/``): the target's
weights, the draft's with EAGLE-3 (``type=LlamaForCausalLMEagle3``), the KV cache of
each, the CUDA-graph captures when graphs are on (decode, or target verify, draft
decode and draft extend with EAGLE-3), the scheduler's limits, and last the
``Engine startup timings (s): ...`` line with every ``cuda_graph`` key, those not
captured at 0.00. With TP 1 the scheduler's lines carry no ``TP0`` tag.

The load time ``--load-seconds`` is spent across the phases in fixed shares, so the
timings line adds up to what the stand-in really waited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from k26dev.standin.lifecycle import stamp

GRAPH_KEYS = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
DECODE_BS = "[1, 2, 4, 8, 12, 16, 24, 32]"
# Shares of --load-seconds (the rest: spawning and the tokenizer).
_WEIGHTS, _DRAFT_WEIGHTS, _KV, _GRAPHS = 0.5, 0.1, 0.1, 0.2


@dataclass(frozen=True)
class StartupPlan:
    load_s: float
    eagle3: bool = False
    cuda_graphs: bool = False
    num_steps: int = 3
    num_draft_tokens: int = 4
    topk: int = 1
    context_len: int = 2048
    max_total_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_running_requests: int | None = None  # the flag; None: SGLang's own choice


def running_requests(eagle3: bool, flag: int | None) -> int:
    """SGLang 0.5.17's max_running_requests: the flag, else 48 with speculative
    decoding (it resets it and says so), else 4096 here."""
    if flag is not None:
        return flag
    return 48 if eagle3 else 4096


def play(plan: StartupPlan, say: Callable[[str], None], stopping: threading.Event) -> bool:
    """Print the start-up lines, spending the load time between them. False when a stop
    came first."""
    started = time.monotonic()
    avail = 139.13

    def wait(share: float) -> bool:
        return not stopping.wait(plan.load_s * share)

    if plan.eagle3 and plan.max_running_requests is None:
        # sglang 0.5.17's server_args, before anything loads (H200, EAGLE-3)
        say(
            f"{stamp()} Max running requests is reset to 48 for speculative decoding. You "
            "can override this by explicitly setting --max-running-requests."
        )
    say(f"{stamp()} Init torch distributed begin.")
    say(f"{stamp()} Init torch distributed ends. elapsed=0.05 s, mem usage=0.09 GB")
    weights = [("LlamaForCausalLM", _WEIGHTS)]
    if plan.eagle3:
        weights.append(("LlamaForCausalLMEagle3", _DRAFT_WEIGHTS))
    load_weight = 0.0
    for kind, share in weights:
        say(f"{stamp()} Load weight begin. avail mem={avail:.2f} GB")
        tic = time.monotonic()
        if not wait(share):
            return False
        took = time.monotonic() - tic
        load_weight += took
        say(
            f"{stamp()} Load weight end. elapsed={took:.2f} s, type={kind}, "
            f"avail mem={avail:.2f} GB, mem usage=0.00 GB."
        )
    tic = time.monotonic()
    for _pool in range(2 if plan.eagle3 else 1):
        if not wait(_KV / (2 if plan.eagle3 else 1)):
            return False
        say(
            f"{stamp()} KV Cache is allocated. dtype: torch.bfloat16, "
            f"#tokens: {plan.max_total_tokens}, K size: 0.00 GB, V size: 0.00 GB"
        )
        say(f"{stamp()} Memory pool end. avail mem={avail - 0.04:.2f} GB")
    kv = time.monotonic() - tic
    graphs = dict.fromkeys(GRAPH_KEYS, 0.0)
    say(
        f"{stamp()} Disable prefill CUDA graph because cuda_graph_config resolved "
        "prefill.backend='disabled' (e.g. via --cuda-graph-backend-prefill=disabled or "
        "auto-disable rules)."
    )
    if plan.cuda_graphs:
        captures = (
            [("target verify", "target_verify", plan.num_draft_tokens),
             ("draft decode", "draft_decode", plan.topk),
             ("draft extend", "draft_extend", plan.num_draft_tokens)]
            if plan.eagle3
            else [("target decode", "decode", 1)]
        )  # fmt: skip
        for name, key, per_req in captures:
            say(
                f"{stamp()} Capture {name} CUDA graph begin. backend=full, "
                f"num_tokens_per_req={per_req}, bs={DECODE_BS}, avail mem={avail - 0.05:.2f} GB"
            )
            tic = time.monotonic()
            if not wait(_GRAPHS / len(captures)):
                return False
            graphs[key] = time.monotonic() - tic
            say(
                f"{stamp()} Capture {name} CUDA graph end. elapsed={graphs[key]:.2f} s, "
                f"mem usage=0.01 GB, avail mem={avail - 0.06:.2f} GB."
            )
    say(
        f"{stamp()} max_total_num_tokens={plan.max_total_tokens}, "
        f"chunked_prefill_size={plan.chunked_prefill_size}, "
        f"max_prefill_tokens=16384, max_running_requests={running_requests(plan.eagle3, plan.max_running_requests)}, "
        f"context_len={plan.context_len}, available_gpu_mem={avail - 0.14:.2f} GB"
    )
    spent = sum(s for _, s in weights) + _KV + (_GRAPHS if plan.cuda_graphs else 0.0)
    if not wait(max(0.0, 1.0 - spent)):
        return False
    total = time.monotonic() - started
    cuda_graph = ", ".join(f"{k}={v:.2f}" for k, v in graphs.items())
    say(
        f"{stamp()} Engine startup timings (s): load_weight={load_weight:.2f}, "
        f"kv_cache_allocation={kv:.2f}, scheduler_e2e={total:.2f}, "
        f"cuda_graph={{{cuda_graph}}}, tokenizer_e2e={total:.2f}"
    )
    return True
