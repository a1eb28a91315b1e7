"""bench/gpu/eagle3_real_sglang.py's server set-ups, as the GPU host will get them.

The script runs its servers only on a lent GPU; what it would launch is checked here:
K2's published architecture, the flags per --model, --graphs and --spec."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    sys.path.insert(0, str(GPU))
    try:
        return importlib.import_module("eagle3_real_sglang")
    finally:
        sys.path.remove(str(GPU))


TINY = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "vocab_size": 512}


def test_k2_is_kimi_k2_s_published_architecture_cut_to_its_layers(script: ModuleType) -> None:
    config = script.k2_config(TINY, 3, "bf16")
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_hidden_layers"] == 3 and config["first_k_dense_replace"] == 1
    assert (config["hidden_size"], config["vocab_size"]) == (7168, 163840)
    assert (config["kv_lora_rank"], config["q_lora_rank"]) == (512, 1536)
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (384, 8)
    assert config["rope_scaling"]["factor"] == 32.0
    assert "quantization_config" not in config and config["bos_token_id"] == 0
    fp8 = script.k2_config(TINY, 2, "fp8")["quantization_config"]
    assert fp8["weight_block_size"] == [128, 128] and fp8["fmt"] == "e4m3"
    assert script.K2_DRAFT["hidden_size"] == 7168
    assert script.K2_DRAFT["architectures"] == ["LlamaForCausalLMEagle3"]


def _run(script: ModuleType, tmp_path: Path, **kw: object) -> object:
    args = argparse.Namespace(
        server="real", work=tmp_path / "work", state=tmp_path / "state", model="tiny",
        layers=2, precision="bf16", graphs="off", spec="eagle3", out=tmp_path / "out",
        deadline_s=60.0, acts=["cold"], arch="9.0",
        no_warmup=False, coverage_shapes=["default"],
    )  # fmt: skip
    for key, value in kw.items():
        setattr(args, key, value)
    return script.EagleRun(args)


@pytest.mark.parametrize(
    ("model", "graphs", "spec"),
    [
        ("tiny", "off", "eagle3"),
        ("tiny", "on", "none"),
        ("k2", "on", "eagle3"),
        ("k2", "off", "none"),
    ],
)
def test_the_flags_follow_model_graphs_and_spec(
    script: ModuleType, tmp_path: Path, model: str, graphs: str, spec: str
) -> None:
    run = _run(script, tmp_path, model=model, graphs=graphs, spec=spec)
    primary = script.EAGLE if spec == "eagle3" else script.AR
    assert run.primary == primary  # type: ignore[attr-defined]
    eagle = run.server_flags(script.EAGLE)  # type: ignore[attr-defined]
    fallback = run.server_flags(script.AR)  # type: ignore[attr-defined]
    for flags in (eagle, fallback):
        assert "--enable-metrics" in flags and "--load-format dummy" in flags
        assert ("--cuda-graph-backend-decode disabled" in flags) is (graphs == "off")
        assert script.SIZES[model] in flags
    assert "--speculative-algorithm EAGLE3" in eagle and "--speculative" not in fallback
    assert f"--mem-fraction-static {script.MEMORY[(model, script.AR)]}" in fallback


@pytest.mark.parametrize("spec", ["eagle3", "none"])
def test_the_daemon_config_holds_the_pair_or_the_lone_unit(
    script: ModuleType, tmp_path: Path, spec: str
) -> None:
    import tomllib

    run = _run(script, tmp_path, spec=spec)
    (tmp_path / "work").mkdir()
    path = run.config(Path("/usr/bin/python3"), tmp_path / "ws")  # type: ignore[attr-defined]
    units = tomllib.loads(path.read_text())["units"]
    names = [u["name"] for u in units]
    if spec == "eagle3":
        assert names == [script.EAGLE, script.AR] and units[0]["fallback"] == script.AR
    else:
        assert names == [script.AR]


def test_the_cuda_oom_drop_in_restarts_eagle3_with_the_fraction_it_names(
    script: ModuleType, tmp_path: Path
) -> None:
    """--oom-mem-fraction: the act's drop-in gives EAGLE-3 the same command with its
    --mem-fraction-static replaced (ExecStart= emptied first, as a drop-in must)."""
    run = _run(script, tmp_path, oom_mem_fraction=0.98)
    run.python = Path("/venv/bin/python")  # type: ignore[attr-defined]
    run.model_dir = Path("/m")  # type: ignore[attr-defined]
    text = run.oom_dropin()  # type: ignore[attr-defined]
    head, empty, start, end = text.split("\n")
    assert (head, empty, end) == ("[Service]", "ExecStart=", "")
    assert start.startswith("ExecStart=/venv/bin/python -m sglang.launch_server --model-path /m ")
    usual = run.server_flags(script.EAGLE)  # type: ignore[attr-defined]
    fraction = f"--mem-fraction-static {script.MEMORY[('tiny', script.EAGLE)]}"
    assert start.endswith(usual.replace(fraction, "--mem-fraction-static 0.98"))
    assert "--speculative-algorithm EAGLE3" in start


def test_the_bundle_act_s_push_and_pull_parse_with_the_product_s_own_cli(
    script: ModuleType, tmp_path: Path
) -> None:
    """The bundle act's command lines, read by the real parser: a renamed option or a
    moved command fails here, not on the GPU host."""
    from supervisor.cli import build_parser

    run = _run(script, tmp_path)
    run.python = Path("/venv/bin/python")  # type: ignore[attr-defined]
    learned = tmp_path / "k26-learned-shapes.json"
    learned.write_text("{}")
    push, pull = run.bundle_commands("http://127.0.0.1:5000/k26/bundles", learned)  # type: ignore[attr-defined]
    parser = build_parser()
    pushed = parser.parse_args(push)
    pulled = parser.parse_args(pull)
    assert (pushed.unit, pushed.learned, pulled.learned_into) == (script.EAGLE, learned, learned)
    assert pushed.coverage_from.endswith(str(script.SUPERVISOR_PORT))
    caches = dict(c.split("=", 1) for c in pushed.cache)
    assert set(caches) == set(script.EagleRun.BUNDLED)
    assert all(Path(d).name == name for name, d in caches.items())
    assert str(pushed.python) == str(pulled.python) == "/venv/bin/python"
