"""The stand-in behind SGLang's own command line: ``python -m sglang.launch_server ...``.

A test serving venv that puts ``devtools/k26dev/standin/sglang_shim`` on its
path gets an ``sglang`` package whose ``launch_server`` runs this: the shipped
units (``units/sglang-k26*.service``) then start the stand-in with their real
ExecStart, unchanged. It accepts the flags those units and the GPU run use,
with the choices and types of sglang 0.5.17's ``server_args.py``; anything
else is refused as SGLang's argparse refuses it (usage, exit 2).

What a flag cannot say (a fault to play, shorter SIGTERM polls for tests)
comes from ``$K26_STANDIN_ARGS``, stand-in flags a test sets with a drop-in.
The FlashInfer cache the stand-in checks for a warm ``sampling`` module is the
unit's ``$FLASHINFER_WORKSPACE_BASE``, as for the real server.

Like SGLang, a ``--model-path`` that is not a model directory ends the launch
with the error the real loader gives (``model-load``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from k26dev.standin import options_from_args, serve
from k26dev.standin.lifecycle import stamp
from k26dev.standin.options import build_parser as standin_parser

# sglang 0.5.17, srt/server_args.py.
SAMPLING_BACKEND_CHOICES = ("flashinfer", "pytorch", "ascend")
ATTENTION_BACKEND_CHOICES = (
    "triton", "torch_native", "flex_attention", "dsa", "nsa", "dsv4", "compressed",
    "cutlass_mla", "fa3", "fa4", "flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla",
    "tokenspeed_mla", "trtllm_mha", "dual_chunk_flash_attn", "hpc_ops", "aiter", "wave",
    "intel_amx", "ascend", "intel_xpu",
)  # fmt: skip
LOAD_FORMAT_CHOICES = (
    "auto", "pt", "safetensors", "npcache", "dummy", "sharded_state", "presharded", "gguf",
    "bitsandbytes", "mistral", "layered", "flash_rl", "remote", "remote_instance",
    "fastsafetensors", "private", "runai_streamer",
)  # fmt: skip
GRAMMAR_BACKEND_CHOICES = ("xgrammar", "outlines", "llguidance", "none")
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK")
STANDIN_ARGS_ENV = "K26_STANDIN_ARGS"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch_server.py")
    add = parser.add_argument
    add("--model-path", "--model", required=True)
    add("--tokenizer-path")
    add("--served-model-name")
    add("--trust-remote-code", action="store_true")
    add("--tp-size", "--tensor-parallel-size", type=_positive_int, default=1)
    add("--dp-size", type=_positive_int, default=1)
    add("--attention-backend", choices=ATTENTION_BACKEND_CHOICES)
    add("--sampling-backend", choices=SAMPLING_BACKEND_CHOICES)
    add("--grammar-backend", choices=GRAMMAR_BACKEND_CHOICES)
    add("--load-format", choices=LOAD_FORMAT_CHOICES, default="auto")
    add("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS)
    add("--speculative-draft-model-path")
    add("--speculative-num-steps", type=_positive_int)
    add("--speculative-eagle-topk", type=_positive_int)
    add("--speculative-num-draft-tokens", type=_positive_int)
    add("--mem-fraction-static", type=float)
    add("--max-total-tokens", type=_positive_int)
    add("--context-length", type=_positive_int)
    add("--max-running-requests", type=_positive_int)
    add("--cuda-graph-backend-decode")
    add("--cuda-graph-backend-prefill")
    add("--skip-server-warmup", action="store_true")
    add("--enable-metrics", action="store_true")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        parser.error(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if args.speculative_algorithm and not args.speculative_draft_model_path:
        parser.error(f"--speculative-algorithm {args.speculative_algorithm} needs a draft model")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be 1..65535, got {args.port}")


def _model_missing(path: str) -> bool:
    return not (Path(path) / "config.json").is_file()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    extra = shlex.split(os.environ.get(STANDIN_ARGS_ENV, ""))
    standin = [
        "--host", args.host, "--port", str(args.port), "--model-path", args.model_path,
        "--sampling-backend", args.sampling_backend or "flashinfer",
    ]  # fmt: skip
    if args.skip_server_warmup:
        standin.append("--skip-server-warmup")
    if args.enable_metrics:
        standin.append("--enable-metrics")
    # What changes what SGLang prints, compiles and refuses (0.5.17's defaults when absent:
    # fa3 on Hopper, xgrammar, graphs on).
    standin += ["--attention-backend", args.attention_backend or "fa3"]
    standin += ["--grammar-backend", args.grammar_backend or "xgrammar"]
    if args.context_length:
        standin += ["--context-length", str(args.context_length)]
    if args.max_running_requests:
        standin += ["--max-running-requests", str(args.max_running_requests)]
    if args.cuda_graph_backend_decode != "disabled":
        standin.append("--cuda-graphs")
    if args.speculative_algorithm == "EAGLE3":
        standin += [
            "--eagle3",
            "--speculative-num-steps", str(args.speculative_num_steps or 3),
            "--speculative-eagle-topk", str(args.speculative_eagle_topk or 1),
            "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens or 4),
        ]  # fmt: skip
    workspace = os.environ.get("FLASHINFER_WORKSPACE_BASE")
    if workspace:
        standin += ["--flashinfer-cache", workspace]
    if args.load_format != "dummy" and _model_missing(args.model_path):
        # transformers' AutoConfig, as SGLang's loader meets a path that is no model.
        sys.stderr.write(
            f"{stamp()} OSError: {args.model_path} does not appear to have a file named "
            "config.json. Checkout 'https://huggingface.co/"
            f"{args.model_path.strip('/')}/tree/main' for available files.\n"
        )
        sys.stderr.flush()
        return 1
    parsed = standin_parser("launch_server.py (stand-in)").parse_args([*standin, *extra])
    return serve(options_from_args(parsed))
