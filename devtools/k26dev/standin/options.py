"""The stand-in's command line, shared by ``python -m k26dev.standin`` and
``k26-dev standin``."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from k26dev.standin.faults import FAULTS

MIB = 1 << 20


@dataclass(frozen=True)
class StandinOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = "k26/standin-tiny"
    load_seconds: float = 0.0
    fail: str | None = None
    fail_after_requests: int = 0
    flashinfer_cache: Path | None = None
    # The module whose presence in flashinfer_cache spares sampling-arch: FlashInfer's
    # sampling, or in tests whose subject is not that build, any cheaper module.
    sampling_module: str = "sampling"
    grow_step_bytes: int = 16 * MIB
    grow_interval_s: float = 0.05
    grow_limit_bytes: int = 0
    access_log: bool = True
    sampling_backend: str = "flashinfer"
    # SGLang 0.5.17's own timings and stop: its SIGTERM watchdog polls every 5 s,
    # a failed child costs 5 s of "crash diagnostics", and a stop ends in SIGKILL.
    sigterm_poll_s: float = 5.0
    crash_diagnostics_s: float = 5.0
    stop_mode: str = "sglang"
    scheduler: bool = True
    # A cold FlashInfer cache costs a JIT build inside the first forward (norm) and
    # the first sampled forward (sampling): about 100 s and 90 s on an H200.
    cold_norm_s: float = 0.0
    cold_sampling_s: float = 0.0
    health_check_timeout_s: float = 20.0
    skip_server_warmup: bool = False
    # Modules the first forward JIT-builds for real, through the serving venv's
    # FlashInfer (as a model that uses more kernels than norm and sampling would).
    jit_python: Path | None = None
    jit_modules: tuple[str, ...] = ()
    # SGLang's own flags that change what it prints, compiles and refuses.
    attention_backend: str = "triton"
    grammar_backend: str = "xgrammar"
    eagle3: bool = False
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    # How many draft tokens a verify step accepts: none (a dummy draft's, as the GPU's
    # tiny EAGLE-3), or random, 0 to num_draft_tokens - 1 (a trained draft's).
    draft_accepts: str = "none"
    cuda_graphs: bool = False
    kv_alignment: bool = False
    context_length: int = 2048
    max_running_requests: int | None = None  # SGLang's flag; None: its own choice
    # What a compile under live traffic costs (H200: inductor 2.8 s for penalties).
    triton_compile_s: float = 0.5
    inductor_compile_s: float = 2.8
    # SGLang's --enable-metrics: /metrics with the scheduler's gauges and counters.
    enable_metrics: bool = False
    # The NVIDIA Xid that device-assert (and crash-exit-0) logs to /dev/kmsg for the
    # scheduler's PID, on this fake PCI bus id (tests use one of their own): none if unset.
    xid_pci: str | None = None
    xid: int = 43


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=30000, help="port (default 30000; 0 picks a free one)"
    )
    parser.add_argument(
        "--model-path", default="k26/standin-tiny", help="reported as model_path/tokenizer_path"
    )
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="answer 503 on /health, /health_generate and /generate for S seconds",
    )
    parser.add_argument(
        "--fail",
        choices=FAULTS,
        help=(
            "cuda-oom: a torch CUDA OOM traceback when loading ends; kv-cache-oom: sglang "
            "0.5.17's 'no GPU memory for the KV cache' at load; norm-arch: FlashInfer's gate "
            "rejecting the arch in the norm JIT of the first forward (cold cache); "
            "sampling-arch: exit 1 with FlashInfer's arch rejection on the first sampled "
            "/generate (greedy ones keep working); grow-memory: allocate and touch memory "
            "until killed; sampled-hang: sampled /generate never answers; on a prompt of "
            "at least 3/4 of --context-length tokens (real SGLang's crash on a ~900-token "
            "prompt under 1024): device-assert: a device-side assert and cuBLAS failure, "
            "then the SIGQUIT path (Xid on --xid-pci); crash-exit-0: an engine error, then "
            "exit status 0; stall: the request stays running and no token comes"
        ),
    )
    parser.add_argument(
        "--fail-after-requests",
        type=int,
        default=0,
        metavar="N",
        help="arm the fault only after N /generate requests were served (default 0)",
    )
    parser.add_argument(
        "--flashinfer-cache",
        type=Path,
        metavar="DIR",
        help="sampling-arch only crashes while DIR holds no cached_ops/sampling/sampling.so",
    )
    parser.add_argument(
        "--sampling-module",
        default="sampling",
        metavar="NAME",
        help="the FlashInfer module that sampling-arch needs in --flashinfer-cache "
        "(default sampling; tests whose subject is not that build name a cheaper one)",
    )
    parser.add_argument(
        "--grow-step-mib", type=int, default=16, help="grow-memory: MiB per step (default 16)"
    )
    parser.add_argument(
        "--grow-interval",
        type=float,
        default=0.05,
        metavar="S",
        help="grow-memory: seconds between steps (default 0.05)",
    )
    parser.add_argument(
        "--grow-limit-mib",
        type=int,
        default=0,
        help="grow-memory: stop growing at this many MiB (default 0: never stop)",
    )
    parser.add_argument(
        "--no-access-log", action="store_true", help="do not print one line per request"
    )
    parser.add_argument(
        "--sigterm-poll-seconds",
        type=float,
        default=5.0,
        metavar="S",
        help="how often the SIGTERM watchdog checks for a stop and for drained requests "
        "(SGLang 0.5.17: 5; tests shorten it)",
    )
    parser.add_argument(
        "--crash-diagnostics-seconds",
        type=float,
        default=5.0,
        metavar="S",
        help="the pause after a failed child before the process tree is killed "
        "(SGLang 0.5.17: 5, 'Sleeping 5 seconds before crash diagnostics'; 0 skips it)",
    )
    parser.add_argument(
        "--stop-mode",
        choices=["sglang", "clean", "sigterm"],
        default="sglang",
        help="sglang: after draining on SIGTERM, SIGKILL itself as SGLang does (systemd "
        "records Result=signal, status 9); clean: exit 0 after the drain; sigterm: die of "
        "SIGTERM's default action at once, as a plain Python server (default sglang)",
    )
    parser.add_argument(
        "--cold-norm-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="with --flashinfer-cache lacking norm.so: the first forward JIT-builds it for S s "
        "(sglang 0.5.17 on an H200: about 100 s; health checks fail meanwhile)",
    )
    parser.add_argument(
        "--cold-sampling-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="likewise for the first sampled forward and sampling.so (H200: about 90 s)",
    )
    parser.add_argument(
        "--jit-module",
        action="append",
        default=[],
        metavar="NAME",
        help="the first forward also JIT-builds FlashInfer module NAME when --flashinfer-cache "
        "lacks it: a real build by --jit-python's FlashInfer, into the unit's "
        "FLASHINFER_WORKSPACE_BASE (repeatable)",
    )
    parser.add_argument(
        "--jit-python",
        type=Path,
        metavar="PY",
        help="the serving venv's interpreter that --jit-module builds with",
    )
    parser.add_argument(
        "--health-check-timeout-seconds",
        type=float,
        default=20.0,
        metavar="S",
        help="how long /health waits for a busy scheduler before its 503 (sglang 0.5.17: 20)",
    )
    parser.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="as SGLang's flag: no warm-up generation once listening (the ready line is "
        "printed at once; a cold norm module is then built by the first health check)",
    )
    parser.add_argument(
        "--no-scheduler",
        action="store_true",
        help="do not start the sglang::scheduler child process",
    )
    parser.add_argument(
        "--attention-backend",
        default="triton",
        help="as SGLang's flag; with triton, a batch of a new size compiles "
        "get_num_kv_splits_triton (default triton, the incident's)",
    )
    parser.add_argument(
        "--grammar-backend",
        choices=["xgrammar", "outlines", "llguidance", "none"],
        default="xgrammar",
        help="as SGLang's flag; with none, a json_schema/regex/ebnf request is refused (400)",
    )
    parser.add_argument(
        "--eagle3",
        action="store_true",
        help="EAGLE-3 speculative decoding: the draft model's start-up lines, KV cache and "
        "graphs, and the draft path's Triton kernels under traffic",
    )
    parser.add_argument("--speculative-num-steps", type=int, default=3, metavar="N")
    parser.add_argument("--speculative-eagle-topk", type=int, default=1, metavar="K")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=4, metavar="N")
    parser.add_argument(
        "--draft-accepts",
        choices=("none", "random"),
        default="none",
        help="draft tokens an EAGLE-3 verify step accepts: none (a dummy draft's, as the "
        "GPU's tiny one), or 0 to N-1 at random, seeded (a trained draft's): a streamed "
        "request's step then yields that many tokens more",
    )
    parser.add_argument(
        "--kv-alignment",
        action="store_true",
        help="prefills compile a KV-store kernel per Triton class of their token count and "
        "16-byte alignment of their first KV slot (as set_mla_kv_buffer_kernel did on the "
        "H200): the slot offset is the count of slots handed out so far",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture CUDA graphs at start-up (their lines, their time in the load)",
    )
    parser.add_argument(
        "--context-length", type=int, default=2048, metavar="N", help="as SGLang's flag"
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        metavar="N",
        help="as SGLang's flag (absent: 4096, or 48 with EAGLE-3, as sglang 0.5.17 resets it)",
    )
    parser.add_argument(
        "--triton-compile-seconds",
        type=float,
        default=0.5,
        metavar="S",
        help="what a Triton compile under traffic costs (the cache written for real)",
    )
    parser.add_argument(
        "--inductor-compile-seconds",
        type=float,
        default=2.8,
        metavar="S",
        help="what a torch-inductor compile costs (H200, penalties: 2.8 s)",
    )
    parser.add_argument(
        "--sampling-backend",
        choices=["flashinfer", "pytorch"],
        default="flashinfer",
        help="as SGLang's flag: with pytorch, sampled requests never touch FlashInfer, "
        "so the sampling-arch fault cannot happen (default flashinfer)",
    )
    _add_fault_arguments(parser)


def _add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="as SGLang's flag: serve /metrics (sglang:num_running_reqs, "
        "sglang:num_queue_reqs, sglang:realtime_tokens_total, ...)",
    )
    parser.add_argument(
        "--xid-pci",
        metavar="BUS",
        help="device-assert, crash-exit-0 and stall write an NVIDIA Xid record for the "
        "scheduler's PID to /dev/kmsg on this PCI bus id (0000:NN:NN), as the driver does "
        "(root only); stall then holds the scheduler, alive, until stopped",
    )
    parser.add_argument(
        "--xid", type=int, default=43, metavar="N", help="the Xid number --xid-pci logs (43)"
    )


def options_from_args(args: argparse.Namespace) -> StandinOptions:
    """Validated options; ``ValueError`` names the bad flag."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if args.load_seconds < 0:
        raise ValueError(f"--load-seconds must be >= 0, got {args.load_seconds}")
    if args.fail_after_requests < 0:
        raise ValueError(f"--fail-after-requests must be >= 0, got {args.fail_after_requests}")
    if args.grow_step_mib <= 0 or args.grow_interval < 0 or args.grow_limit_mib < 0:
        raise ValueError("--grow-step-mib must be > 0; --grow-interval, --grow-limit-mib >= 0")
    if args.cold_norm_seconds < 0 or args.cold_sampling_seconds < 0:
        raise ValueError("--cold-norm-seconds and --cold-sampling-seconds must be >= 0")
    if args.jit_module and (args.jit_python is None or args.flashinfer_cache is None):
        raise ValueError("--jit-module needs --jit-python and --flashinfer-cache")
    if args.triton_compile_seconds < 0 or args.inductor_compile_seconds < 0:
        raise ValueError("--triton-compile-seconds and --inductor-compile-seconds must be >= 0")
    if args.context_length < 16:
        raise ValueError(f"--context-length must be at least 16, got {args.context_length}")
    if not args.sampling_module.isidentifier():
        raise ValueError(f"--sampling-module must be a module name, got {args.sampling_module!r}")
    if not args.health_check_timeout_seconds > 0:
        raise ValueError("--health-check-timeout-seconds must be > 0")
    if args.max_running_requests is not None and args.max_running_requests < 1:
        raise ValueError(
            f"--max-running-requests must be at least 1, got {args.max_running_requests}"
        )
    if args.xid_pci is not None and not re.fullmatch(
        r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?", args.xid_pci
    ):
        raise ValueError(f"--xid-pci must be a PCI bus id such as 0000:3b:00, got {args.xid_pci!r}")
    if not args.sigterm_poll_seconds > 0 or args.crash_diagnostics_seconds < 0:
        raise ValueError("--sigterm-poll-seconds must be > 0, --crash-diagnostics-seconds >= 0")
    return StandinOptions(
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        load_seconds=args.load_seconds,
        fail=args.fail,
        fail_after_requests=args.fail_after_requests,
        flashinfer_cache=args.flashinfer_cache,
        sampling_module=args.sampling_module,
        grow_step_bytes=args.grow_step_mib * MIB,
        grow_interval_s=args.grow_interval,
        grow_limit_bytes=args.grow_limit_mib * MIB,
        access_log=not args.no_access_log,
        sampling_backend=args.sampling_backend,
        sigterm_poll_s=args.sigterm_poll_seconds,
        crash_diagnostics_s=args.crash_diagnostics_seconds,
        stop_mode=args.stop_mode,
        scheduler=not args.no_scheduler,
        cold_norm_s=args.cold_norm_seconds,
        cold_sampling_s=args.cold_sampling_seconds,
        health_check_timeout_s=args.health_check_timeout_seconds,
        skip_server_warmup=args.skip_server_warmup,
        jit_python=args.jit_python,
        jit_modules=tuple(args.jit_module),
        attention_backend=args.attention_backend,
        grammar_backend=args.grammar_backend,
        eagle3=args.eagle3,
        num_steps=args.speculative_num_steps,
        eagle_topk=args.speculative_eagle_topk,
        num_draft_tokens=args.speculative_num_draft_tokens,
        draft_accepts=args.draft_accepts,
        cuda_graphs=args.cuda_graphs,
        kv_alignment=args.kv_alignment,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        triton_compile_s=args.triton_compile_seconds,
        inductor_compile_s=args.inductor_compile_seconds,
        enable_metrics=args.enable_metrics,
        xid_pci=args.xid_pci,
        xid=args.xid,
    )


def build_parser(prog: str = "python -m k26dev.standin") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "A stand-in SGLang server: SGLang's HTTP shapes (/health, /health_generate, "
            "/generate, /get_model_info) over a toy model, with the faults the "
            "supervisor must explain. Standard library only."
        ),
    )
    add_arguments(parser)
    return parser
