"""The seed's pair for real: an EAGLE-3 SGLang and its autoregressive fallback, under
the daemon, act by act, in one call; on the tiny Llama or on Kimi K2's architecture.

    python3 bench/gpu/eagle3_real_sglang.py --out DIR [--acts cold,matrix,sigkill,forced]
        [--model tiny|k2] [--layers 2] [--precision bf16|fp8] [--graphs on|off]
        [--spec eagle3|none] [--flashinfer-modules norm,sampling]
    python3 bench/gpu/eagle3_real_sglang.py --out DIR --server standin   (a CPU rehearsal)
        [--flashinfer-workspace DIR] [--standin-cold-s 20] [--no-warmup]

What is served: ``--model tiny`` (default) is the 2-layer Llama of tiny_model.py;
``--model k2`` is Kimi K2's published architecture (SGLang's ``DeepseekV3ForCausalLM``,
``K2_CONFIG`` below) cut to ``--layers`` layers, in bf16 or K2's own block-wise fp8
(``--precision``), dummy weights, the tiny tokenizer. ``--graphs on`` lets SGLang
capture its CUDA graphs (decode and prefill), as the seed runs; ``off`` disables both.
``--spec eagle3`` (default) serves the pair below; ``--spec none`` one autoregressive
unit alone (the pair's acts are refused then).

On the lent GPU host, after ``bash bench/gpu/kit_setup.sh && . /tmp/k26kit/env.sh``
(see KIT.md). Two user units in ``k26-dev sandbox`` share the port and
``Conflicts=`` each other, as the shipped ones do:

- ``sglang-k26-eagle3.service`` (role eagle3): the real ``sglang.launch_server``
  with ``--speculative-algorithm EAGLE3`` and a one-layer ``LlamaForCausalLMEagle3``
  draft (the tiny Llama's, or ``K2_DRAFT`` at K2's hidden size 7168;
  ``draft_vocab_size`` = the vocabulary);
- ``sglang-k26.service`` (role autoregressive, its fallback).

Every JIT cache of both is pinned under ``--state`` (FlashInfer's workspace,
Triton, torch inductor, TVM-FFI, DeepGEMM, SGLang's own, and HOME), which starts
empty unless a previous call on the same (still warm) machine left it there.
``--flashinfer-workspace`` puts FlashInfer's elsewhere: the CPU rehearsal of the
bundle act points it at a build made beforehand (its ninja state names that path).
The daemon runs with the default coverage warm-up (every built-in shape).

Acts (``--acts``, in this order; each is skipped, and says so, when the time left
is less than it needs):

- ``cold``: the daemon's first start of the EAGLE-3 unit (or the lone unit): FlashInfer warm-up,
  load, sampled probe, coverage warm-up, READY; the modules learned; the start's
  timeline; what each cache holds.
- ``matrix``: a client matrix of request shapes (not the coverage set's bodies)
  against the ready unit: the files each cache gained (the goal: none) and the
  daemon's ``jit_after_ready``.
- ``sigkill``: SIGKILL of the ``sglang::scheduler``: the verdict, the warm
  restart's timeline (``last_recovery``).
- ``device-assert``: one client request that trips a device-side assert (a prompt of
  about 900 tokens under ``--context-length 1024``, else token ids past the
  vocabulary): the verdict (``cuda-error``, the Xid 43 as evidence), no person
  called, EAGLE-3 READY again or the fallback serving, ``/status``'s ``serving``.
- ``forced``: the Triton cache emptied, then a batch the coverage did not play
  (``n`` = 32, a new power-of-two bucket for the draft kernels): the watch's
  report and its latency from the file's mtime.
- ``kernel-oom``: ``MemoryMax=`` of the running EAGLE-3 unit set below what its
  processes hold (``systemctl set-property --runtime``): the kernel's OOM killer,
  ``Result=oom-kill``, the restart killed again, the fallback READY; then the
  matrix against the fallback.
- ``back``: the limit lifted, SIGUSR1: EAGLE-3 READY again, the fallback stopped.
- ``cuda-oom``: another process holds all but ``--hog-free-gib`` of the GPU's
  memory and the scheduler is killed: the restarts die of CUDA OOM at start-up
  (SGLang's ``Loaded weights leave no GPU memory for the KV cache``) until the
  fallback (``--mem-fraction-static 0.5``) serves; then the matrix against it.
  With ``--oom-mem-fraction F`` EAGLE-3 also restarts with ``--mem-fraction-static F``
  (a drop-in). SGLang 0.5.17 keeps ``(1 - F)`` of the memory free before the load as
  slack and raises that ValueError when what the load used exceeds ``F`` of it: a
  unit dies when ``F x free < used``. The tiny pair uses about 0.15 GiB (field facts:
  "Raise --mem-fraction-static above 0.077" with about 2 GiB free), so under a hog
  leaving 2 GiB, EAGLE-3 at F = 0.01 dies (20 MB) and the fallback at 0.5 serves
  (1 GiB). A fraction near 1 does the opposite: the slack shrinks, the KV pool grows,
  and the tiny pair starts.
- ``back2``: the other process ends (and the drop-in goes), SIGUSR1: EAGLE-3 READY again.
- ``learn`` (after ``matrix``, with ``--coverage-shapes`` leaving shapes out so that
  the matrix compiles after READY): the shapes the daemon learned from it; then the
  daemon and the units stop, every JIT cache but FlashInfer's is wiped (the learned
  record in the daemon's state directory is kept), the daemon starts again: its
  coverage replays what it learned before READY, and the same matrix is played
  again (the goal: no file after READY).
- ``bundle`` (after ``cold``): the fleet's round trip on this host, with the product's
  commands and Debian's docker-registry (``K26_DOCKER_REGISTRY``, else on PATH):
  the server's own warm start timed (daemon and units stopped and started again);
  ``bundle push`` of every cache, the modules of ``--flashinfer-modules``, the learned
  shapes and that start's coverage;
  every cache and the learned record wiped, ``bundle pull``, the daemon started
  again: that start against the warm one (the goal: within 10 %), the files made
  from the pull to READY (the goal: none), then the client matrix.

Writes DIR/eagle3_real_sglang.json, DIR/eagle3-logs.tar.gz (the servers' and the
daemon's output, ``k26-supervisor status``, /metrics, the kernel's OOM lines).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from supervise_real_sglang import (  # noqa: E402
    ROOT,
    SGLANG_PORT,
    STANDIN_PYTHONPATH,
    SUPERVISOR_PORT,
    Run,
    modules,
    scheduler_of,
)

EAGLE, AR = "sglang-k26-eagle3.service", "sglang-k26.service"
# The flags every server gets; --graphs off adds GRAPHS_OFF. SIZES and MEMORY by
# --model (the tiny Llama's context is its own 1024; K2 as run on the H200, field facts).
COMMON_FLAGS = (
    "--load-format dummy --attention-backend triton --sampling-backend flashinfer "
    "--grammar-backend none --skip-server-warmup --enable-metrics "
    f"--host 127.0.0.1 --port {SGLANG_PORT}"
)
GRAPHS_OFF = "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
# --graphs decode: SGLang 0.5.17's piecewise prefill graph of an EAGLE-3 draft fails at the
# first prefill on the H200 (prefill_cuda_graph_runner.load_batch: "The size of tensor a
# (384) must match the size of tensor b (128)", the draft's 3 x hidden input against a
# buffer of hidden), so the EAGLE-3 proof with graphs captures decode graphs only.
GRAPHS_DECODE = "--cuda-graph-backend-prefill disabled"
SIZES = {
    "tiny": "--max-total-tokens 8192 --context-length 1024",
    "k2": "--max-total-tokens 32768 --context-length 4096 --max-running-requests 64",
}
# --mem-fraction-static per (model, unit): the tiny EAGLE-3 pair as on 2026-12-02; K2's
# 37 GB of bf16 weights (2 layers) fit one H200 at 0.6.
MEMORY = {("tiny", EAGLE): 0.05, ("tiny", AR): 0.5, ("k2", EAGLE): 0.6, ("k2", AR): 0.6}
EAGLE_FLAGS = (
    "--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
    "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3"
)
# Kimi K2's architecture as published (moonshotai/Kimi-K2-Instruct, config.json on
# Hugging Face; the values ../shared/docs/field-facts.md quotes), served as SGLang's
# DeepseekV3ForCausalLM: MLA, 384 routed experts (top 8, one shared), the first layer
# dense. Cut to --layers layers, with the tiny model's byte-level tokenizer (ids past
# its 512 decode to nothing, which does no harm: field facts).
K2_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_attention_heads": 64, "num_key_value_heads": 64,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128,
    "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
    "vocab_size": 163840, "max_position_embeddings": 131072,
    "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.02,
}  # fmt: skip
# K2's own checkpoint is block-wise fp8 (e4m3, 128 x 128 blocks, dynamic activations).
K2_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}  # fmt: skip
# An EAGLE-3 draft for K2: one Llama layer at K2's hidden size (SGLang's
# LlamaForCausalLMEagle3), its vocabulary the target's.
K2_DRAFT: dict[str, Any] = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
    "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 163840, "draft_vocab_size": 163840, "max_position_embeddings": 131072,
    "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip


def k2_config(tiny: dict[str, Any], layers: int, precision: str) -> dict[str, Any]:
    """K2's architecture with ``layers`` layers and the tiny tokenizer's special ids."""
    config = {**K2_CONFIG, "num_hidden_layers": layers}
    config.update({k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    if precision == "fp8":
        config["quantization_config"] = dict(K2_FP8)
    return config


# The caches a unit writes (supervisor/core/jit_caches.py), each pinned under --state.
CACHES = {
    "flashinfer": "FLASHINFER_WORKSPACE_BASE",
    "triton": "TRITON_CACHE_DIR",
    "inductor": "TORCHINDUCTOR_CACHE_DIR",
    "tvm-ffi": "TVM_FFI_CACHE_DIR",
    "deepgemm": "SGLANG_DG_CACHE_DIR",
    "sglang": "SGLANG_CACHE_DIR",
    "cute-dsl": "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
    "cutlass-dsl": "CUTE_DSL_CACHE_DIR",
    "tilelang": "TILELANG_CACHE_DIR",
    "cuda": "CUDA_CACHE_PATH",
}
# --fail chaos: a prompt "k26-chaos:KIND" plays a fault (the device-assert act's);
# --xid-pci: its Xid on a fake PCI bus id of this script's own. {cold}: the seconds of
# FlashInfer's norm and sampling JIT at each stand-in start (--standin-cold-s).
STANDIN_ARGS = (
    "--load-seconds 3 --cold-norm-seconds {cold:g} --cold-sampling-seconds {cold:g} "
    "--fail chaos --xid-pci 0000:e3:00 --kv-alignment"
)
# What each act needs at least, in seconds on the H200 (a skipped act says so).
NEEDS = {
    "cold": 230, "matrix": 30, "sigkill": 110, "device-assert": 150, "forced": 30,
    "kernel-oom": 170, "back": 110, "cuda-oom": 200, "back2": 110, "learn": 230,
    "bundle": 330,
}  # fmt: skip
HOG = """\
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = int(float(sys.argv[1]) * (1 << 30))
held = torch.empty(max(free - keep, 0), dtype=torch.uint8, device="cuda")
free_after, _ = torch.cuda.mem_get_info()
print(f"gpu hog: holding {held.numel() / (1 << 30):.1f} GiB of {total / (1 << 30):.1f}; "
      f"{free_after / (1 << 30):.2f} GiB free", flush=True)
time.sleep(3600)
"""


def inventory(root: Path) -> set[str]:
    """Every file under ``root`` (relative), less lock and temporary files."""
    if not root.exists():
        return set()
    out = set()
    for path in root.rglob("*"):
        name = path.name
        if path.is_file() and not name.endswith(".lock") and not name.startswith("tmp."):
            out.add(str(path.relative_to(root)))
    return out


def post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, str, float]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace"), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        return exc.code, text, time.monotonic() - started
    except (urllib.error.URLError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}", time.monotonic() - started


def client_matrix() -> list[tuple[str, str, list[dict[str, Any]]]]:
    """(name, path, bodies sent at once): what clients send, in other words than the
    coverage set's (other prompts, other values, other batch sizes)."""
    p = "Clients ask about the weather in Lisbon"

    def gen(text: str, **sp: Any) -> dict[str, Any]:
        return {"text": text, "sampling_params": {"max_new_tokens": 6, **sp}}

    # Token ids: the tiny model's byte-level BPE makes about 5.5 tokens of a word.
    long_ids = [120 + i % 200 for i in range(700)]
    return [
        ("greedy", "/generate", [gen(p + " 1", temperature=0)]),
        ("temperature", "/generate", [gen(p + " 2", temperature=1.1)]),
        ("top-k", "/generate", [gen(p + " 3", temperature=0.6, top_k=7)]),
        ("top-p", "/generate", [gen(p + " 4", temperature=0.6, top_p=0.5)]),
        ("min-p", "/generate", [gen(p + " 5", temperature=0.9, min_p=0.2)]),
        ("filters", "/generate", [gen(p + " 6", temperature=0.8, top_k=3, top_p=0.7, min_p=0.05)]),
        ("repetition", "/generate", [gen(p + " 7", temperature=0.7, repetition_penalty=1.4)]),
        ("frequency", "/generate", [gen(p + " 8", temperature=0.7, frequency_penalty=1.1)]),
        ("presence", "/generate", [gen(p + " 9", temperature=0.7, presence_penalty=0.9)]),
        ("penalties", "/generate", [gen(p + " 10", temperature=0.7, repetition_penalty=1.1,
                                        frequency_penalty=0.2, presence_penalty=0.3)]),
        ("min-new", "/generate", [gen(p + " 11", temperature=0.7, min_new_tokens=5)]),
        ("logprobs", "/generate", [{**gen(p + " 12", temperature=0.7), "return_logprob": True,
                                    "top_logprobs_num": 5}]),
        ("n=2", "/generate", [gen(p + " 13", temperature=0.9, n=2)]),
        ("n=3", "/generate", [gen(p + " 14", temperature=0.9, top_p=0.9, n=3)]),
        ("n=6", "/generate", [gen(p + " 15", temperature=0.9, top_k=20, n=6)]),
        ("stop", "/generate", [gen(p + " 16", temperature=0.7, stop=[".", "\n"])]),
        ("long-output", "/generate", [gen(p + " 17", temperature=0.7, max_new_tokens=200)]),
        ("long-prompt", "/generate", [{"input_ids": long_ids,
                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0.7}}]),
        ("prefix-repeat", "/generate", [gen(p + " 7", temperature=0.7, repetition_penalty=1.4)]),
        ("batch-3", "/generate", [gen(f"{p} b{i}", temperature=0.3 * i) for i in range(3)]),
        ("batch-5-mixed", "/generate", [
            gen(f"{p} m{i}", temperature=0.8, top_k=2 + i, presence_penalty=0.1 * i)
            for i in range(5)
        ]),
        ("batch-12-mixed", "/generate", [
            gen(f"{p} x{i}", temperature=0 if i % 3 == 0 else 0.9, top_p=0.6 + 0.03 * i,
                frequency_penalty=0.5 if i % 2 else 0.0)
            for i in range(12)
        ]),
        # Batch sizes no earlier matrix sent: what clients do is not what we guessed.
        ("batch-7", "/generate", [gen(f"{p} s{i}", temperature=0.6, top_p=0.9) for i in range(7)]),
        ("batch-20-mixed", "/generate", [
            gen(f"{p} t{i}", temperature=0.5 + 0.02 * i, top_k=4 + i, max_new_tokens=3 + i % 5)
            for i in range(20)
        ]),
        ("batch-33", "/generate", [gen(f"{p} u{i}", temperature=0.8) for i in range(33)]),
        ("openai", "/v1/completions", [{"model": "default", "prompt": p + " 18",
                                         "max_tokens": 5, "temperature": 0.5, "seed": 11,
                                         "logit_bias": {"20": 3}}]),
        ("openai-n2", "/v1/completions", [{"model": "default", "prompt": p + " 19",
                                            "max_tokens": 5, "temperature": 0.9, "n": 2}]),
    ]  # fmt: skip


class EagleRun(Run):
    RESULT = "eagle3_real_sglang.json"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.state: Path = args.state
        self.caches = {name: self.state / "caches" / name for name in CACHES}
        if args.flashinfer_workspace is not None:
            self.caches["flashinfer"] = args.flashinfer_workspace
        self.standin_args = STANDIN_ARGS.format(cold=args.standin_cold_s)
        self.hog: subprocess.Popen[str] | None = None
        self.unit_dir: Path | None = None
        self.model_dir: Path | None = None  # the target's (units())
        self.vocab = 512  # the tiny tokenizer's; models() reads the target's own
        # The unit the acts play on: EAGLE-3, or the autoregressive unit alone.
        self.primary = EAGLE if args.spec == "eagle3" else AR
        self.result["acts"] = {}
        self.result["skipped"] = []
        self.result["setup"] = {k: getattr(args, k) for k in (
            "model", "layers", "precision", "graphs", "spec", "server")}  # fmt: skip

    # --- set-up -----------------------------------------------------------------------

    def models(self) -> tuple[Path, Path]:
        """The target (``--model``) and, for ``--spec eagle3``, its one-layer draft."""
        model, draft = self.work / "model", self.work / "draft"
        if self.args.server == "real":
            subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(model)], check=True)
            shutil.copytree(model, draft)
            tiny = json.loads((model / "config.json").read_text())
            if self.args.model == "k2":
                target = k2_config(tiny, self.args.layers, self.args.precision)
                (model / "config.json").write_text(json.dumps(target, indent=1))
                drafted = {**K2_DRAFT, **{k: tiny[k] for k in ("bos_token_id", "eos_token_id")}}
            else:
                drafted = {**tiny, "architectures": ["LlamaForCausalLMEagle3"],
                           "num_hidden_layers": 1, "draft_vocab_size": tiny["vocab_size"]}  # fmt: skip
            (draft / "config.json").write_text(json.dumps(drafted, indent=1))
            self.vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        else:
            for d in (model, draft):
                d.mkdir(parents=True)
                (d / "config.json").write_text("{}")
        return model, draft

    def server_flags(self, unit: str, fraction: float | None = None) -> str:
        """This unit's flags past the model path, from --model, --graphs and --spec
        (``fraction``: another --mem-fraction-static)."""
        flags = [COMMON_FLAGS, SIZES[self.args.model]]
        if self.args.graphs == "off":
            flags.append(GRAPHS_OFF)
        elif self.args.graphs == "decode":
            flags.append(GRAPHS_DECODE)
        if fraction is None:
            fraction = MEMORY[(self.args.model, unit)]
        flags.append(f"--mem-fraction-static {fraction}")
        if unit == EAGLE:
            flags.append(EAGLE_FLAGS.format(draft=self.work / "draft"))
        return " ".join(flags)

    def unit_text(self, name: str, python: Path, model: Path, flags: str, other: str) -> str:
        env = [f"Environment={var}={self.caches[c]}" for c, var in CACHES.items()]
        env.append(f"Environment=HOME={self.state / 'home'}")
        extra = ["UnsetEnvironment=PYTHONPATH"]
        if self.args.server == "standin":
            extra = [
                f"Environment=PYTHONPATH={STANDIN_PYTHONPATH}",
                f'Environment="K26_STANDIN_ARGS={self.standin_args}"',
            ]
        cuda_home = self.env.get("CUDA_HOME", "")
        lines = [
            "[Unit]",
            f"Description={name} (tiny Llama) under k26-supervisor",
            f"Conflicts={other}",
            "[Service]",
            "Type=exec",
            f"ExecStart={python} -m sglang.launch_server --model-path {model} {flags}",
            "Restart=no",
            "KillMode=mixed",
            "TimeoutStopSec=60",
            "OOMPolicy=stop",
            "MemoryAccounting=yes",
            "Environment=PYTHONUNBUFFERED=1",
            f"Environment=PATH={python.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
            f"Environment=CUDA_HOME={cuda_home}",
            f"Environment=FLASHINFER_CUDA_ARCH_LIST={self.args.arch}",
            f"Environment=TORCH_CUDA_ARCH_LIST={self.args.arch}",
            *env,
            "EnvironmentFile=-%t/k26-supervisor/sampling/%n.env",
            *extra,
            f"StandardOutput=append:{self.logs}/{name}.log",
            "StandardError=inherit",
        ]
        return "\n".join(lines) + "\n"

    def units(
        self, python: Path, unit_dir: Path, workspace: Path, model: Path, memory: bool
    ) -> None:
        self.unit_dir = unit_dir
        self.memory = memory
        self.python = python
        self.model_dir = model
        for unit, other in ((EAGLE, AR), (AR, EAGLE)):
            text = self.unit_text(unit, python, model, self.server_flags(unit), other)
            (unit_dir / unit).write_text(text)

    def config(self, python: Path, workspace: Path, registry: str | None = None) -> Path:
        """The daemon's config (``registry``: its warm-up pulls from there)."""
        env_file = self.work / "build.env"
        if self.args.server == "standin":
            shutil.copy(python.parent.parent / "k26-build.env", env_file)
        else:
            keys = ("CUDA_HOME", "PATH")
            env_file.write_text("".join(f"{k}={self.env[k]}\n" for k in keys if self.env.get(k)))
        path = self.work / "supervisor.toml"
        modules = ", ".join(f'"{m}"' for m in self.args.modules)
        eagle_unit = (
            f'[[units]]\nname = "{EAGLE}"\nrole = "eagle3"\n'
            f'url = "http://127.0.0.1:{SGLANG_PORT}"\nfallback = "{AR}"\n\n'
            if self.args.spec == "eagle3"
            else ""
        )
        path.write_text(
            textwrap.dedent(
                f"""\
                [supervisor]
                bus = "user"
                listen = "127.0.0.1:{SUPERVISOR_PORT}"
                job_timeout_s = 90
                resync_interval_s = 10
                state_dir = "{self.state / "daemon"}"

                [flashinfer]
                enabled = {"false" if self.args.no_warmup else "true"}
                python = "{python}"
                arch = "{self.args.arch}"
                workspace = "{workspace}"
                modules = [{modules}]
                timeout_s = 400
                env_file = "{env_file}"
                @REGISTRY@
                [probe]
                timeout_s = 120
                startup_deadline_s = 420
                interval_s = 15
                failures_to_fail = 3

                [restart]
                backoff_initial_s = 1
                backoff_max_s = 4
                max_failures = 8
                failure_window_s = 900

                [fallback]
                oom_exits = 2
                window_s = 900
                retry_preferred_after_s = 0

                [coverage]
                timeout_s = 300
                shapes = [{", ".join(f'"{s}"' for s in self.args.coverage_shapes)}]

                @EAGLE_UNIT@[[units]]
                name = "{AR}"
                role = "autoregressive"
                url = "http://127.0.0.1:{SGLANG_PORT}"
                """
            )
            .replace("@EAGLE_UNIT@", eagle_unit)
            .replace("@REGISTRY@", f'registry = "{registry}"\n' if registry else "")
        )
        return path

    def go(self) -> None:
        if self.args.fresh:
            shutil.rmtree(self.state, ignore_errors=True)
        self.result["state_was_warm"] = {c: len(inventory(d)) for c, d in self.caches.items()}
        for d in (*self.caches.values(), self.state / "home"):
            d.mkdir(parents=True, exist_ok=True)
        self.models()
        self.args.workspace = self.caches["flashinfer"]
        super().go()

    # --- helpers ----------------------------------------------------------------------

    def unit(self, status: dict[str, Any] | None, name: str) -> dict[str, Any]:
        return ((status or {}).get("units") or {}).get(name) or {}

    def inventories(self) -> dict[str, set[str]]:
        return {c: inventory(d) for c, d in self.caches.items()}

    def metrics(self) -> str:
        try:
            url = f"http://127.0.0.1:{SUPERVISOR_PORT}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return str(resp.read().decode())
        except (urllib.error.URLError, OSError):
            return ""

    def exits(self, unit: str) -> dict[str, float]:
        found = {}
        for m in re.finditer(
            rf'^k26_unit_exits_total{{cause="([^"]+)",unit="{re.escape(unit)}"}} (\S+)$',
            self.metrics(),
            re.M,
        ):
            found[m.group(1)] = float(m.group(2))
        if not found:  # label order differs between client versions
            for m in re.finditer(
                rf'^k26_unit_exits_total{{unit="{re.escape(unit)}",cause="([^"]+)"}} (\S+)$',
                self.metrics(),
                re.M,
            ):
                found[m.group(1)] = float(m.group(2))
        return found

    def ready(self, unit: str, limit_s: float, *, restarts_above: int = -1) -> Any:
        status = self.wait(
            f"{unit} ready",
            lambda s: (
                self.unit(s, unit).get("ready")
                and self.unit(s, unit).get("restarts", 0) > restarts_above
                and s
            ),
            limit_s,
            failed=unit,
        )
        if status:
            # In the printed output at once: a call cut at its device limit keeps it.
            cov = self.unit(status, unit).get("coverage") or {}
            self.mark(
                f"{unit} coverage", ok=cov.get("ok"), duration_s=cov.get("duration_s"),
                shapes=len(cov.get("shapes") or ()),
            )  # fmt: skip
        return status

    def kill_scheduler(self, unit: str) -> dict[str, Any]:
        main_pid = int(self.prop(unit, "MainPID") or 0)
        sched = scheduler_of(main_pid)
        if sched is None:
            return {"main_pid": main_pid, "error": "no sglang::scheduler child"}
        os.kill(sched, signal.SIGKILL)
        return {"main_pid": main_pid, "scheduler_pid": sched, "at": time.monotonic()}

    def play(self, unit: str) -> dict[str, Any]:
        """The client matrix against ``unit``: files each cache gained, the watch's count."""
        before = self.inventories()
        count_before = (self.unit(self.status(), unit).get("jit_after_ready") or {}).get("count")
        url = f"http://127.0.0.1:{SGLANG_PORT}"
        results = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=40) as pool:
            for name, path, bodies in client_matrix():
                answers = list(pool.map(lambda b, p=path: post(url + p, b), bodies))
                results.append(
                    {
                        "shape": name,
                        "status": sorted({a[0] for a in answers}),
                        "s": round(max(a[2] for a in answers), 3),
                        "error": next((a[1][:300] for a in answers if a[0] != 200), None),
                    }
                )
        after = self.inventories()
        gained = {c: sorted(after[c] - before[c]) for c in after if after[c] - before[c]}
        status = self.status()
        # What Triton specialised each new kernel on (its metadata), to tell why.
        metadata = {}
        for rel in gained.get("triton", []):
            if rel.endswith(".json") and "__grp__" not in rel:
                text = (self.caches["triton"] / rel).read_text(errors="replace")
                metadata[rel] = text[:1500]
        return {
            "new_triton_metadata": metadata,
            "unit": unit,
            "shapes": results,
            "all_200": all(r["status"] == [200] for r in results),
            "files_gained": gained,
            "n_files_gained": sum(len(v) for v in gained.values()),
            "jit_after_ready_count": [
                count_before,
                (self.unit(status, unit).get("jit_after_ready") or {}).get("count"),
            ],
            "jit_after_ready_latest": (self.unit(status, unit).get("jit_after_ready") or {}).get(
                "latest"
            ),
        }

    def snapshot(self, unit: str) -> dict[str, Any]:
        u = self.unit(self.status(), unit)
        return {
            k: u.get(k)
            for k in (
                "state", "ready", "restarts", "reason", "last_exit", "last_probe",
                "coverage", "jit_after_ready", "last_start", "last_recovery", "warmup",
            )
        }  # fmt: skip

    def explain(self, unit: str) -> Any:
        out = self.cli("explain", "--bus", "user", unit, "--json", check=False, timeout=60)
        try:
            return json.loads(out)
        except ValueError:
            return out[-2000:]

    def dropin(self, unit: str, name: str, text: str | None) -> None:
        assert self.unit_dir is not None
        d = self.unit_dir / f"{unit}.d"
        d.mkdir(exist_ok=True)
        if text is None:
            (d / name).unlink(missing_ok=True)
        else:
            (d / name).write_text(text)
        self.systemctl("daemon-reload")

    # --- the acts ---------------------------------------------------------------------

    def plan(self, steps: dict[str, Any], workspace: Path, started: float) -> None:
        acts = self.result["acts"]
        for act in self.args.acts:
            if self.left() < NEEDS[act] * (1 if self.args.server == "real" else 0.4):
                self.result["skipped"].append({"act": act, "left_s": round(self.left(), 1)})
                self.mark(f"skipped {act}: {self.left():.0f} s left")
                continue
            self.mark(f"act {act}")
            t = time.monotonic()
            try:
                acts[act] = getattr(self, "act_" + act.replace("-", "_"))(started)
            except Exception as exc:  # the act's failure is a result; the run goes on
                acts[act] = {"error": f"{type(exc).__name__}: {exc}"}
            acts[act]["act_s"] = round(time.monotonic() - t, 1)
            self.save()  # what is done so far is under --out, should the call be cut
            if acts[act].get("stop_here"):
                self.mark(f"{act} left nothing to go on with")
                break

    def act_cold(self, started: float) -> dict[str, Any]:
        status = self.ready(self.primary, 480)
        out: dict[str, Any] = {"ready_s_since_daemon_start": round(time.monotonic() - started, 1)}
        if not status:
            out.update(stop_here=True, primary=self.snapshot(self.primary))
            return out
        learned_file = self.caches["flashinfer"] / "k26-learned-modules.json"
        deadline = time.monotonic() + (0 if self.args.no_warmup else 30)
        while not learned_file.exists() and time.monotonic() < deadline:
            time.sleep(0.25)
        out.update(
            primary=self.snapshot(self.primary),
            warmup=status.get("warmup"),
            learned=json.loads(learned_file.read_text()) if learned_file.exists() else None,
            flashinfer_modules=sorted(modules(self.caches["flashinfer"])),
            caches={c: len(v) for c, v in self.inventories().items()},
            status_text=self.cli("status", "--url", f"http://127.0.0.1:{SUPERVISOR_PORT}",
                                 check=False),
            doctor=self.cli("flashinfer", "doctor", "--python", str(self.python), "--arch",
                            self.args.arch, "--workspace", str(self.caches["flashinfer"]),
                            "--env-file", str(self.work / "build.env"), "--unit", self.primary,
                            *(f"--module={m}" for m in self.args.modules),
                            "--bus", "user", check=False, timeout=120)[-3000:],
        )  # fmt: skip
        return out

    def act_matrix(self, started: float) -> dict[str, Any]:
        # What the server says of itself: the coverage's decode descent reads it, and
        # the CPU tests' fixture of /server_info is checked against it.
        info: Any = None
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{SGLANG_PORT}/server_info", timeout=10
            ) as r:
                info = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            info = f"{type(exc).__name__}: {exc}"
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "server_info.json").write_text(json.dumps(info, indent=1, default=str))
        keys = (
            "max_running_requests",
            "context_length",
            "chunked_prefill_size",
            "max_total_num_tokens",
            "max_req_input_len",
            "speculative_algorithm",
            "speculative_num_steps",
            "speculative_num_draft_tokens",
            "cuda_graph_config",
            "disable_cuda_graph",
            "cuda_graph_max_bs_decode",
            "cuda_graph_bs_decode",
        )
        facts = {k: info.get(k) for k in keys} if isinstance(info, dict) else {"error": info}
        if isinstance(info, dict) and isinstance(info.get("internal_states"), list):
            facts["internal_states"] = [
                {k: v for k, v in st.items() if "running" in k or "token" in k}
                for st in info["internal_states"]
                if isinstance(st, dict)
            ]
        return {"server_info": facts, **self.play(self.primary)}

    def learned_settled(self) -> dict[str, Any]:
        """The primary unit's ``learned_shapes`` on /status once it has not changed for
        8 s (the watch records a compile a moment after its file lands), at most 60 s."""
        seen: dict[str, Any] = {"since": time.monotonic()}

        def settled(status: Any) -> Any:
            learned = self.unit(status, self.primary).get("learned_shapes") or {}
            key = (learned.get("count"), json.dumps(learned.get("latest"), sort_keys=True))
            if key != seen.get("key"):
                seen.update(key=key, since=time.monotonic())
                return None
            return learned if time.monotonic() - seen["since"] >= 8 else None

        return self.wait("the learned shapes settled", settled, 60) or {}

    def act_learn(self, started: float) -> dict[str, Any]:
        """What the daemon learned from the matrix; then a second start with every JIT
        cache but FlashInfer's wiped and the learned record kept: its coverage replays
        it before READY, and the same matrix is played again."""
        learned = self.learned_settled()
        record_path = Path(str(learned.get("path") or ""))
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
        out: dict[str, Any] = {"learned": learned, "record": record}
        self.stop_daemon_and_units()
        wiped = {}
        for cache, directory in self.caches.items():
            if cache == "flashinfer":
                continue  # the warm-up's (and rebuilt by it); learning is about the rest
            wiped[cache] = len(inventory(directory))
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        out["wiped_files"] = wiped
        ready_s, status = self.start_daemon("supervisor-2.log", 480)
        out["ready_s_since_daemon_start"] = ready_s
        if not status:
            out.update(stop_here=True, primary=self.snapshot(self.primary))
            return out
        out["primary"] = self.snapshot(self.primary)
        out["caches_at_ready"] = {c: len(v) for c, v in self.inventories().items()}
        out["matrix"] = self.play(self.primary)
        return out

    # The caches a bundle carries besides FlashInfer's (``bundle push --cache``); the
    # units pin them with Environment=, which the --env-file does not say.
    BUNDLED = ("triton", "inductor", "tvm-ffi", "deepgemm")

    def push_command(self, registry: str, learned: Path) -> list[str]:
        """``bundle push`` as the act runs it: this host's serving venv, arch, workspace,
        modules (the daemon's warm-up's, no fewer) and caches, the registry repository,
        the daemon's coverage record and ``learned`` (when the file is there)."""
        push = ["flashinfer", "bundle", "push", "--python", str(self.python),
                "--arch", self.args.arch, "--workspace", str(self.caches["flashinfer"]),
                "--env-file", str(self.work / "build.env"), "--registry", registry, "--json",
                "--coverage-from", f"http://127.0.0.1:{SUPERVISOR_PORT}",
                "--unit", self.primary]  # fmt: skip
        for cache in self.BUNDLED:
            push += ["--cache", f"{cache}={self.caches[cache]}"]
        for module in self.args.modules:
            push += ["--module", module]
        if learned.is_file():
            push += ["--learned", str(learned)]
        return push

    def restart_daemon(self, log: str, limit_s: float) -> tuple[float | None, Any]:
        """The daemon and the units stopped, then the daemon started again."""
        self.stop_daemon_and_units()
        return self.start_daemon(log, limit_s)

    def start_daemon(self, log: str, limit_s: float) -> tuple[float | None, Any]:
        """The daemon started (again): the seconds waited for the primary unit's READY
        (at most ``limit_s``), and the status (None: not ready in time)."""
        config = self.work / "supervisor.toml"
        t = time.monotonic()
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(config)],
            env=self.env,
            stdout=open(self.logs / log, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        self.mark("daemon started again", pid=self.daemon.pid, log=log)
        status = self.ready(self.primary, limit_s)
        return round(time.monotonic() - t, 1), status

    def stop_daemon_and_units(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(timeout=60)
        for unit in (self.primary, AR):
            self.systemctl("stop", unit)

    def act_bundle(self, started: float) -> dict[str, Any]:
        """The fleet's round trip on this host (issue 37, part 5), with the product's
        own commands: the server's own warm start is timed (daemon and units stopped,
        the daemon started again, caches as they are); every cache it holds then is
        pushed to a registry here (``bundle push``, with the learned shapes and that
        start's coverage); then every cache and the learned record are wiped, and the
        daemon starts again with the registry in its config, as a fleet's node does:
        its warm-up pulls the bundle. The goals: that start within 10 % of the warm
        one, nothing built from the pull to READY (start, probe, coverage) by the
        product's own verdict (``bundle.effective`` on /status) and by the files."""
        sys.path[:0] = [str(ROOT), str(ROOT / "devtools")]
        from bench.fleet_registry import RegistryProcess  # the project's own harness
        from supervisor.adapters.warmup import list_artifacts  # the verdict's own listing
        from supervisor.flashinfer.cache import cache_root

        # Each cache as the product's verdict lists it: FlashInfer's from its cache root.
        roots = {c: cache_root(d) if c == "flashinfer" else d for c, d in self.caches.items()}

        if self.args.no_warmup:
            return {"error": "the bundle act pulls through the daemon's warm-up: drop --no-warmup"}
        out: dict[str, Any] = {"learned": self.learned_settled()}
        with RegistryProcess(self.work / "registry") as reg:
            learned = Path(
                out["learned"].get("path") or self.state / "daemon" / "k26-learned-shapes.json"
            )
            push = self.push_command(reg.url, learned)
            # The warm start first: its coverage passes over the caches as the push
            # takes them (kernels the clients compiled after READY included, their
            # learned shapes replayed), which push checks against /status.
            warm_s, status = self.restart_daemon("supervisor-warm.log", 480)
            out["warm_start_s"] = warm_s if status else None
            out["warm_primary"] = self.snapshot(self.primary) if status else None
            if not status:
                out["stop_here"] = True
                return out
            t = time.monotonic()
            out["push"] = json.loads(self.cli(*push, timeout=900))
            out["push_s"] = round(time.monotonic() - t, 1)
            out["pushed_layers"] = {e["cache"]: e["files"] for e in out["push"]["caches"]}
            pushed = list_artifacts(roots)
            out["pushed_files"] = {c: len(v) for c, v in pushed.items()}
            self.stop_daemon_and_units()
            out["wiped_files"] = {c: len(inventory(d)) for c, d in self.caches.items()}
            for directory in self.caches.values():
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
            learned.unlink(missing_ok=True)
            assert self.python is not None
            self.config(self.python, self.caches["flashinfer"], registry=reg.url)
            bundle_s, status = self.start_daemon("supervisor-bundle.log", 480)
            out["bundle_start_s"] = bundle_s if status else None
            if not status:
                out.update(stop_here=True, primary=self.snapshot(self.primary))
                return out
            # The product's verdict, made at READY (a moment after /status says ready).
            verdict = self.wait(
                "the pulled bundle judged",
                lambda s: (s.get("bundle") or {}).get("effective") is not None and s["bundle"],
                30,
            )
            out["bundle"] = verdict or (self.status() or {}).get("bundle")
            out["pulled_flashinfer_modules"] = sorted(modules(self.caches["flashinfer"]))
            out["learned_after_pull"] = self.unit(self.status(), self.primary).get("learned_shapes")
            record = json.loads(learned.read_text()) if learned.is_file() else {"units": {}}
            out["learned_variants"] = sorted(
                {r["variant"] for rs in record["units"].values() for r in rs}
            )
            # Each build from the pull to READY, as the product's verdict finds them: an
            # artifact not as pushed (new, or written again: the pull keeps mtimes).
            at_ready = list_artifacts(roots)
            built = {
                c: sorted(f for f, stamp in v.items() if pushed.get(c, {}).get(f) != stamp)
                for c, v in at_ready.items()
            }
            out["built_through_ready"] = {c: v[:40] for c, v in built.items() if v}
            out["built_through_ready_count"] = sum(len(v) for v in built.values())
            out["ratio_to_warm"] = round(bundle_s / warm_s, 3)
            out["within_10_percent"] = bundle_s <= 1.10 * warm_s
            out["primary"] = self.snapshot(self.primary)
            out["matrix"] = self.play(self.primary)
        return out

    def act_sigkill(self, started: float) -> dict[str, Any]:
        restarts = self.unit(self.status(), self.primary).get("restarts", 0)
        kill = self.kill_scheduler(self.primary)
        if "error" in kill:
            return kill
        seen = self.wait(
            "the kill classified",
            lambda s: (
                (self.unit(s, self.primary).get("last_exit") or {}).get("main_pid")
                == kill["main_pid"]
                and s
            ),
            60,
        )
        systemd = {k: self.prop(self.primary, k) for k in ("Result", "ExecMainStatus")}
        again = self.ready(self.primary, 300, restarts_above=restarts)
        return {
            **kill,
            "verdict": self.unit(seen, self.primary).get("last_exit"),
            "systemd": systemd,
            "recovered_s": round(time.monotonic() - kill["at"], 1) if again else None,
            "primary": self.snapshot(self.primary),
        }

    def act_device_assert(self, started: float) -> dict[str, Any]:
        """One client request that trips a device-side assert in the ready primary unit
        server (issue 36): a prompt of about 900 tokens under --context-length 1024,
        else token ids past the vocabulary (field facts: both crash SGLang 0.5.17).
        Then: the verdict, the Xid in its evidence, who serves again, and when."""
        before = self.status()
        restarts = self.unit(before, self.primary).get("restarts", 0)
        serving_before = (before or {}).get("serving")
        main_pid = int(self.prop(self.primary, "MainPID") or 0)
        url = f"http://127.0.0.1:{SGLANG_PORT}/generate"
        sampled = {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
        words = "the weather in lisbon stays mild while clients keep asking about it "
        attempts: list[tuple[str, dict[str, Any]]] = [
            # 13 copies made 743 tokens on the H200 (2026-12-03): 16 make about 915.
            ("text-900-tokens", {"text": words * 16, "sampling_params": sampled}),
            ("ids-past-vocab", {"input_ids": [120 + i % 200 for i in range(300)]
                                + [self.vocab + 100], "sampling_params": sampled}),
        ]  # fmt: skip
        if self.args.server == "standin":  # the stand-in's one hook: the prompt names it
            attempts = [("chaos-device-assert", {"text": "k26-chaos:device-assert:43",
                                                 "sampling_params": sampled})]  # fmt: skip
        sent: list[dict[str, Any]] = []
        t = time.monotonic()
        for name, body in attempts:
            code, text, took = post(url, body, timeout=60)
            sent.append({"request": name, "http": code, "s": round(took, 1), "answer": text[:300]})
            self.mark(f"device-assert: {name} -> {code}")
            gone = self.wait(
                "the server's exit classified",
                lambda s: (
                    (self.unit(s, self.primary).get("last_exit") or {}).get("main_pid") == main_pid
                    and s
                ),
                10 if code == 200 else 90,
            )
            if gone:
                break
        else:
            return {"sent": sent, "error": "no request took the server down", "stop_here": True}
        verdict = self.unit(gone, self.primary).get("last_exit") or {}
        serving = self.wait(
            "something serving again",
            lambda s: (
                (self.unit(s, self.primary).get("ready") and self.unit(s, self.primary).get("restarts", 0)
                 > restarts and self.primary)
                or (self.unit(s, AR).get("ready") and AR)
            ),
            300,
        )  # fmt: skip
        after = self.status()
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
        xids = [ln for ln in dmesg.stdout.splitlines() if "NVRM: Xid" in ln][-10:]
        evidence = "\n".join(map(str, verdict.get("evidence") or []))
        return {
            "main_pid": main_pid,
            "sent": sent,
            "verdict": verdict,
            "verdict_cause": verdict.get("cause"),
            "xid_in_evidence": "NVRM: Xid" in evidence,
            "device_assert_in_evidence": "device-side assert" in evidence
            or "index out of bounds" in evidence,
            "serving_again": serving,
            "serving_again_s": round(time.monotonic() - t, 1) if serving else None,
            "needs_person": self.unit(after, self.primary).get("needs_person"),
            "status_serving": (after or {}).get("serving"),
            "status_serving_before": serving_before,
            "kernel_xids": xids,
            "metrics": [ln for ln in self.metrics().splitlines()
                        if ln.startswith(("k26_serving", "k26_unserved", "k26_unit_needs_person",
                                          "k26_unit_exits_total"))],
            "primary": self.snapshot(self.primary),
            "ar": {k: self.snapshot(AR)[k] for k in ("state", "ready", "reason")},
            "explain": self.explain(self.primary),
        }  # fmt: skip

    def act_forced(self, started: float) -> dict[str, Any]:
        triton = self.caches["triton"]
        count = (self.unit(self.status(), self.primary).get("jit_after_ready") or {}).get(
            "count", 0
        )
        for entry in triton.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        emptied = time.monotonic()
        body = {"text": "a batch nobody warmed", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0.8, "top_p": 0.9, "n": 32}}  # fmt: skip
        code, text, took = post(f"http://127.0.0.1:{SGLANG_PORT}/generate", body)
        answered = time.monotonic()
        seen = self.wait(
            "the watch reports the compile",
            lambda s: (
                (self.unit(s, self.primary).get("jit_after_ready") or {}).get("count", 0) > count
                and s
            ),
            15,
        )
        reported = time.monotonic()
        latest = (self.unit(seen, self.primary).get("jit_after_ready") or {}).get("latest") or []
        latencies = []
        for entry in latest:
            try:
                mtime = Path(entry["path"]).stat().st_mtime
            except OSError:
                continue
            at = entry["at"].replace("Z", "+00:00")
            from datetime import datetime

            latencies.append(round(datetime.fromisoformat(at).timestamp() - mtime, 3))
        return {
            "request": {
                "status": code,
                "s": round(took, 3),
                "error": None if code == 200 else text,
            },
            "files_after": sorted(inventory(triton)),
            "reported_s_after_answer": round(reported - answered, 3) if seen else None,
            "since_emptied_s": round(reported - emptied, 3),
            "latest": latest,
            "latency_from_mtime_s": latencies,
        }

    def act_kernel_oom(self, started: float) -> dict[str, Any]:
        current = self.prop(EAGLE, "MemoryCurrent")
        out: dict[str, Any] = {"memory_current_before": current, "memory_controller": self.memory}
        t = time.monotonic()
        if self.memory:
            limit = "600M"
            self.systemctl("set-property", "--runtime", EAGLE, f"MemoryMax={limit}",
                           "MemorySwapMax=0")  # fmt: skip
            out["memory_max"] = limit
        else:  # the rehearsal's sandbox has no memory controller: a CUDA OOM instead
            self.dropin(EAGLE, "50-fault.conf",
                        f'[Service]\nEnvironment="K26_STANDIN_ARGS={self.standin_args} '
                        '--fail cuda-oom --crash-diagnostics-seconds 0.2"\n')  # fmt: skip
            out["kill"] = self.kill_scheduler(EAGLE)
        standby = self.wait(
            "EAGLE-3 in standby, the fallback engaged",
            lambda s: self.unit(s, EAGLE).get("state") == "standby" and s,
            150,
        )
        out["to_standby_s"] = round(time.monotonic() - t, 1)
        out["eagle_exits"] = self.exits(EAGLE)
        out["systemd"] = {k: self.prop(EAGLE, k) for k in ("Result", "ExecMainStatus", "NRestarts")}
        out["eagle"] = self.snapshot(EAGLE)
        out["explain"] = self.explain(EAGLE)
        if not standby:
            out["stop_here"] = True
            return out
        ready = self.ready(AR, 300)
        out["fallback_ready_s_since_the_limit"] = round(time.monotonic() - t, 1) if ready else None
        out["ar"] = self.snapshot(AR)
        if ready:
            out["matrix_on_fallback"] = self.play(AR)
        else:
            out["stop_here"] = True
        return out

    def act_back(self, started: float) -> dict[str, Any]:
        if self.memory:
            self.systemctl("set-property", "--runtime", EAGLE, "MemoryMax=infinity",
                           "MemorySwapMax=infinity")  # fmt: skip
        else:
            self.dropin(EAGLE, "50-fault.conf", None)
        return self.retry_preferred()

    def retry_preferred(self) -> dict[str, Any]:
        assert self.daemon is not None
        restarts = self.unit(self.status(), EAGLE).get("restarts", 0)
        t = time.monotonic()
        self.daemon.send_signal(signal.SIGUSR1)
        ready = self.ready(EAGLE, 300, restarts_above=restarts - 1)
        return {
            "eagle_ready_s_after_sigusr1": round(time.monotonic() - t, 1) if ready else None,
            "ar_active_state": self.prop(AR, "ActiveState"),
            "ar": {k: self.snapshot(AR)[k] for k in ("state", "ready", "reason")},
            "eagle": self.snapshot(EAGLE),
        }

    def act_cuda_oom(self, started: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.args.server == "real":
            self.hog = subprocess.Popen(
                [sys.executable, "-c", HOG, str(self.args.hog_free_gib)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={k: v for k, v in self.env.items() if k != "PYTHONPATH"},
            )
            assert self.hog.stdout is not None
            out["hog"] = self.hog.stdout.readline().strip()
            self.mark("gpu hog", line=out["hog"])
            if self.args.oom_mem_fraction is not None:
                # SGLang 0.5.17 dies at start-up when F x (memory free before the
                # load) < what the load used (kv_cache_configurator: the slack is
                # (1 - F) of it): a low F does it, a high one does not.
                self.dropin(EAGLE, "50-oom.conf", self.oom_dropin())
                out["eagle_mem_fraction_static"] = self.args.oom_mem_fraction
        else:
            self.dropin(EAGLE, "50-fault.conf",
                        f'[Service]\nEnvironment="K26_STANDIN_ARGS={self.standin_args} '
                        '--fail kv-cache-oom --crash-diagnostics-seconds 0.2"\n')  # fmt: skip
        t = time.monotonic()
        out["kill"] = self.kill_scheduler(EAGLE)
        before = self.exits(EAGLE).get("gpu-oom", 0)
        standby = self.wait(
            "EAGLE-3 in standby after CUDA OOM",
            lambda s: self.unit(s, EAGLE).get("state") == "standby" and s,
            240,
        )
        out["to_standby_s"] = round(time.monotonic() - t, 1)
        out["gpu_oom_exits"] = self.exits(EAGLE).get("gpu-oom", 0) - before
        out["eagle_exits"] = self.exits(EAGLE)
        out["eagle"] = self.snapshot(EAGLE)
        out["explain"] = self.explain(EAGLE)
        if not standby:
            out["stop_here"] = True
            return out
        ready = self.ready(AR, 300)
        out["fallback_ready_s_since_the_kill"] = round(time.monotonic() - t, 1) if ready else None
        out["ar"] = self.snapshot(AR)
        if ready:
            out["matrix_on_fallback"] = self.play(AR)
        return out

    def oom_dropin(self) -> str:
        """EAGLE-3's ExecStart again with ``--oom-mem-fraction`` as its
        --mem-fraction-static (a drop-in, so ``back2`` only removes it)."""
        flags = self.server_flags(EAGLE, self.args.oom_mem_fraction)
        command = f"{self.python} -m sglang.launch_server --model-path {self.model_dir} {flags}"
        return f"[Service]\nExecStart=\nExecStart={command}\n"

    def act_back2(self, started: float) -> dict[str, Any]:
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()
            self.hog = None
            if self.args.oom_mem_fraction is not None:
                self.dropin(EAGLE, "50-oom.conf", None)
        else:
            self.dropin(EAGLE, "50-fault.conf", None)
        return self.retry_preferred()

    # --- the end ----------------------------------------------------------------------

    def teardown(self, steps: dict[str, Any], pid1_before: str, name: str) -> None:
        (self.logs / "status.txt").write_text(
            self.cli("status", "--url", f"http://127.0.0.1:{SUPERVISOR_PORT}", check=False)
        )
        (self.logs / "metrics.txt").write_text(self.metrics())
        status = self.status()
        if status is not None:
            (self.logs / "status.json").write_text(json.dumps(status, indent=1))
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
        (self.logs / "dmesg-oom.txt").write_text(
            "\n".join(ln for ln in dmesg.stdout.splitlines() if re.search(r"(?i)oom|killed", ln))
        )
        super().teardown(steps, pid1_before, name)

    def save(self) -> None:
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        self.result["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (out / self.RESULT).write_text(json.dumps(self.result, indent=1, default=str))
        if self.logs.exists():
            with tarfile.open(out / "eagle3-logs.tar.gz", "w:gz") as tar:
                tar.add(self.logs, arcname="logs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``parser.error`` on a bad one), as ``EagleRun`` takes it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--server", choices=["real", "standin"], default="real")
    parser.add_argument("--acts", default="cold,matrix,sigkill,forced")
    parser.add_argument("--deadline-s", type=float, default=560)
    parser.add_argument("--work", type=Path, default=Path("/tmp/k26-eagle3"))
    parser.add_argument("--state", type=Path, default=ROOT / ".cache" / "gpu" / "state")
    parser.add_argument("--fresh", action="store_true", help="empty --state first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--hog-free-gib", type=float, default=3.0)
    parser.add_argument(
        "--oom-mem-fraction", type=float, default=None, metavar="F",
        help="cuda-oom: EAGLE-3's --mem-fraction-static during the act (a drop-in), "
        "e.g. 0.01: under a hog leaving 2 GiB, 20 MB, less than the tiny pair's load "
        "uses (about 0.15 GiB), while the fallback's 0.5 fits",
    )  # fmt: skip
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="rehearsals: no FlashInfer warm-up (its cold nvcc build takes minutes on a "
        "CPU machine; the acts do not need it)",
    )
    parser.add_argument(
        "--flashinfer-modules",
        metavar="A,B",
        help="the FlashInfer modules the daemon warms and a bundle carries "
        "(default: norm,sampling; the stand-in: sampling)",
    )
    parser.add_argument(
        "--flashinfer-workspace",
        type=Path,
        metavar="DIR",
        help="FlashInfer's workspace (default: under --state); a rehearsal's points at a "
        "build made beforehand, whose ninja state names that path. The bundle act wipes "
        "it as it wipes every cache",
    )
    parser.add_argument(
        "--standin-cold-s",
        type=float,
        default=20.0,
        metavar="S",
        help="the stand-in: seconds of FlashInfer's norm and sampling JIT at each start (20)",
    )
    parser.add_argument(
        "--model",
        choices=["tiny", "k2"],
        default="tiny",
        help="tiny: the 2-layer Llama; k2: Kimi K2's architecture (DeepseekV3)",
    )
    parser.add_argument("--layers", type=int, default=2, help="--model k2's layers (2)")
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="--model k2: bf16, or K2's own block-wise fp8",
    )
    parser.add_argument(
        "--graphs",
        choices=["on", "decode", "off"],
        default="off",
        help="SGLang's CUDA graphs: decode and prefill, decode only, or none",
    )
    parser.add_argument(
        "--coverage-shapes",
        default="default",
        help="the daemon's [coverage] shapes, comma-separated (default: every built-in)",
    )
    parser.add_argument("--spec", choices=["eagle3", "none"], default="eagle3",
                        help="eagle3: the pair (EAGLE-3 and its fallback); none: one "
                        "autoregressive unit")  # fmt: skip
    args = parser.parse_args(argv)
    pair_only = {"kernel-oom", "back", "cuda-oom", "back2"}
    if args.oom_mem_fraction is not None and not 0 < args.oom_mem_fraction < 1:
        parser.error(f"--oom-mem-fraction must lie in (0, 1), got {args.oom_mem_fraction}")
    if args.spec == "none" and pair_only & set(args.acts.split(",")):
        parser.error(f"acts {sorted(pair_only)} need the pair: --spec eagle3")
    if args.layers < 1 or (args.model == "k2" and args.layers < 2):
        parser.error("--layers: at least 2 for k2 (its first layer is dense, then MoE)")
    args.acts = [a for a in args.acts.split(",") if a]
    args.coverage_shapes = [s for s in args.coverage_shapes.split(",") if s]
    unknown = [a for a in args.acts if a not in NEEDS]
    if unknown:
        parser.error(f"unknown acts {unknown}; known: {', '.join(NEEDS)}")
    # The stand-in's serving venv (FlashInfer 0.7.4) lacks the cuBLAS headers its norm
    # build needs on this machine (docs/flashinfer.md): sampling alone there.
    default = "norm,sampling" if args.server == "real" else "sampling"
    args.modules = [m for m in (args.flashinfer_modules or default).split(",") if m]
    if not args.modules or not all(m.isidentifier() for m in args.modules):
        parser.error(f"--flashinfer-modules: module names, comma-separated, got "
                     f"{args.flashinfer_modules!r}")  # fmt: skip
    if args.standin_cold_s < 0:
        parser.error(f"--standin-cold-s must be at least 0, got {args.standin_cold_s:g}")
    args.warm_limit_s = args.start_limit_s = 0  # unused here
    args.workspace = None
    return args


def main() -> int:
    args = parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    run = EagleRun(args)
    code = 0
    try:
        run.go()
    except Exception as exc:
        run.result["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    finally:
        run.save()
    summary = {k: {kk: vv for kk, vv in v.items() if kk.endswith("_s") or kk in (
        "n_files_gained", "error", "recovered_s", "eagle_exits", "gpu_oom_exits", "latency_from_mtime_s")}
        for k, v in run.result["acts"].items()}  # fmt: skip
    print(json.dumps({"acts": summary, "skipped": run.result["skipped"]}, indent=1)[:6000])
    return code


if __name__ == "__main__":
    sys.exit(main())
