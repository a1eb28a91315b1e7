"""bench/gpu/eagle3_real_sglang.py's server set-ups, as the GPU host will get them.

The script runs its servers only on a lent GPU; what it would launch is checked here:
K2's published architecture, the flags per --model, --graphs and --spec."""

from __future__ import annotations

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
    """An EagleRun as the script's own parser makes it; ``kw``: more flags, by name."""
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
            "--state", str(tmp_path / "state"), "--acts", "cold", "--deadline-s", "60"]  # fmt: skip
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return script.EagleRun(script.parse_args(argv))


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
    run = _run(script, tmp_path, oom_mem_fraction=0.01)
    run.python = Path("/venv/bin/python")  # type: ignore[attr-defined]
    run.model_dir = Path("/m")  # type: ignore[attr-defined]
    text = run.oom_dropin()  # type: ignore[attr-defined]
    head, empty, start, end = text.split("\n")
    assert (head, empty, end) == ("[Service]", "ExecStart=", "")
    assert start.startswith("ExecStart=/venv/bin/python -m sglang.launch_server --model-path /m ")
    usual = run.server_flags(script.EAGLE)  # type: ignore[attr-defined]
    fraction = f"--mem-fraction-static {script.MEMORY[('tiny', script.EAGLE)]}"
    assert start.endswith(usual.replace(fraction, "--mem-fraction-static 0.01"))
    assert "--speculative-algorithm EAGLE3" in start


def test_the_bundle_act_s_push_and_its_node_config_are_the_product_s_own(
    script: ModuleType, tmp_path: Path
) -> None:
    """The bundle act's push, read by the real parser, and the config its node starts
    with, read by the real config loader: a renamed option, a moved command or a
    config field gone fails here, not on the GPU host."""
    from supervisor.cli import build_parser
    from supervisor.core.config import parse_toml

    run = _run(script, tmp_path)
    run.python = Path("/venv/bin/python")  # type: ignore[attr-defined]
    learned = tmp_path / "k26-learned-shapes.json"
    learned.write_text("{}")
    push = run.push_command("http://127.0.0.1:5000/k26/bundles", learned)  # type: ignore[attr-defined]
    pushed = build_parser().parse_args(push)
    assert (pushed.unit, pushed.learned) == (script.EAGLE, learned)
    assert pushed.coverage_from.endswith(str(script.SUPERVISOR_PORT))
    caches = dict(c.split("=", 1) for c in pushed.cache)
    assert set(caches) == set(script.EagleRun.BUNDLED)
    assert all(Path(d).name == name for name, d in caches.items())
    assert str(pushed.python) == "/venv/bin/python"
    # The push carries every module the daemon's warm-up builds: sampling alone
    # would leave norm to build after the pull.
    assert pushed.modules == ["norm", "sampling"] == run.args.modules  # type: ignore[attr-defined]
    run.work.mkdir(parents=True)  # type: ignore[attr-defined]
    path = run.config(
        Path("/venv/bin/python"), tmp_path / "ws", registry="http://127.0.0.1:5000/k26/bundles"
    )  # type: ignore[attr-defined]
    config = parse_toml(path.read_bytes(), str(path))
    assert config.flashinfer.registry == "http://127.0.0.1:5000/k26/bundles"
    assert list(config.flashinfer.modules) == ["norm", "sampling"]
    plain = run.config(Path("/venv/bin/python"), tmp_path / "ws")  # type: ignore[attr-defined]
    assert parse_toml(plain.read_bytes(), str(plain)).flashinfer.registry is None


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--flashinfer-modules", ","], "--flashinfer-modules: module names"),
        (["--flashinfer-modules", "norm,../x"], "--flashinfer-modules: module names"),
        (["--standin-cold-s", "-1"], "--standin-cold-s must be at least 0"),
        (["--oom-mem-fraction", "1.5"], "--oom-mem-fraction must lie in (0, 1)"),
        (["--acts", "cold,nap"], "unknown acts ['nap']"),
    ],
)
def test_a_bad_command_line_is_refused_naming_the_flag(
    script: ModuleType, flags: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(["--out", "/tmp/x", *flags])
    assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_the_modules_default_by_server_and_the_standin_s_cold_seconds_reach_its_units(
    script: ModuleType, tmp_path: Path
) -> None:
    real = _run(script, tmp_path)
    assert real.args.modules == ["norm", "sampling"]  # type: ignore[attr-defined]
    standin = _run(script, tmp_path, server="standin", standin_cold_s=0)
    assert standin.args.modules == ["sampling"]  # type: ignore[attr-defined]
    assert "--cold-norm-seconds 0 --cold-sampling-seconds 0 " in standin.standin_args  # type: ignore[attr-defined]
    given = _run(script, tmp_path, flashinfer_modules="locality_domain",
                 flashinfer_workspace=tmp_path / "ws")  # fmt: skip
    assert given.args.modules == ["locality_domain"]  # type: ignore[attr-defined]
    assert given.caches["flashinfer"] == tmp_path / "ws"  # type: ignore[attr-defined]
