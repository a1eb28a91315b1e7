"""What the stand-in compiles under traffic (issue 23.5): the model, then the server.

The kernels and their specialisation follow what sglang 0.5.17 did on the H200
(docs/sglang-shapes.md, "What the server compiles while serving").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from k26dev.standin.traffic import TrafficCompiles, power_of_two, triton_variant
from supervisor.core.jit_caches import JitCache
from tests.unit.k26dev.test_standin import DEADLINE_S, QUICK, standin


def compiles(tmp_path: Path, *, eagle3: bool = False, **kw: Any) -> TrafficCompiles:
    waited: list[float] = []
    model = TrafficCompiles(
        attention_backend=kw.pop("attention_backend", "triton"),
        eagle3=eagle3,
        triton_s=0.5,
        inductor_s=2.8,
        wait=waited.append,
        environ={
            "HOME": str(tmp_path / "home"),
            "USER": "sglang",
            "TRITON_CACHE_DIR": str(tmp_path / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        },
        **kw,
    )
    model.waited = waited  # type: ignore[attr-defined]
    return model


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


@pytest.mark.parametrize(
    ("size", "variant"), [(1, "1"), (2, "any"), (16, "d16"), (48, "d16"), (17, "any")]
)
def test_triton_specialises_integers_as_triton_does(size: int, variant: str) -> None:
    assert triton_variant(size) == variant


@pytest.mark.parametrize(("size", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (33, 64)])
def test_the_draft_path_specialises_on_the_next_power_of_two(size: int, bucket: int) -> None:
    assert power_of_two(size) == bucket


def test_each_penalty_compiles_through_inductor_and_neutral_values_do_not(
    tmp_path: Path,
) -> None:
    model = compiles(tmp_path, attention_backend="flashinfer")
    assert model.kernels_for({"repetition_penalty": 1.0, "frequency_penalty": 0}, 1, "a") == []
    assert model.kernels_for({"repetition_penalty": 1.2}, 1, "b") == [
        (JitCache.INDUCTOR, "apply_scaling_penalties")
    ]
    assert model.kernels_for({"presence_penalty": 0.5}, 1, "c") == [
        (JitCache.INDUCTOR, "apply_additive_penalties")
    ]


def test_triton_attention_compiles_per_batch_variant_and_a_repeat_hits_the_prefix_cache(
    tmp_path: Path,
) -> None:
    model = compiles(tmp_path)
    first = model.kernels_for({}, 1, "prompt")
    assert first == [(JitCache.TRITON, "get_num_kv_splits_triton@1")]
    again = model.kernels_for({}, 3, "prompt")
    assert again == [
        (JitCache.TRITON, "get_num_kv_splits_triton@any"),
        (JitCache.TRITON, "write_req_to_token_pool_triton"),
    ]
    grammar = model.kernels_for({"json_schema": "{}"}, 1, "other")
    assert (JitCache.TRITON, "apply_token_bitmask_inplace_kernel") in grammar


def test_eagle3_draft_kernels_follow_the_batch_and_the_cuda_graphs(tmp_path: Path) -> None:
    plain = compiles(tmp_path, eagle3=True)
    assert plain.kernels_for({}, 1, "a") == [(JitCache.TRITON, "get_num_kv_splits_triton@1")]
    draft = plain.kernels_for({}, 3, "b")
    assert (JitCache.TRITON, "assign_req_to_token_pool@bs4-any") in draft
    assert (JitCache.TRITON, "generate_draft_decode_kv_indices@ns3") in draft
    # 3 and 4 share the power-of-two bucket and Triton's class, so the pool kernel is
    # the same; the draft decode's takes the number of sequences as a constexpr.
    assert set(plain.kernels_for({}, 4, "b2")) - set(draft) == {
        (JitCache.TRITON, "generate_draft_decode_kv_indices@ns4")
    }
    # 12 and 16 share the bucket, not the class (as on the H200).
    twelve, sixteen = plain.kernels_for({}, 12, "b3"), plain.kernels_for({}, 16, "b4")
    assert (JitCache.TRITON, "assign_req_to_token_pool@bs16-any") in twelve
    assert (JitCache.TRITON, "assign_req_to_token_pool@bs16-d16") in sixteen
    graphed = compiles(tmp_path, eagle3=True, cuda_graphs=True)
    kernels = graphed.kernels_for({}, 3, "c")
    assert (JitCache.TRITON, "assign_req_to_token_pool@bs4-any") in kernels
    assert not any(k.startswith("generate_draft_decode_kv_indices") for _, k in kernels)
    beyond = graphed.kernels_for({}, 40, "d")  # above the captured batch sizes
    assert (JitCache.TRITON, "generate_draft_decode_kv_indices@ns40") in beyond


def test_a_compile_writes_the_cache_its_environment_names_once(tmp_path: Path) -> None:
    model = compiles(tmp_path)
    kernels = [
        (JitCache.TRITON, "get_num_kv_splits_triton@d16"),
        (JitCache.INDUCTOR, "apply_scaling_penalties"),
    ]
    written = model.compile(kernels)
    assert set(written) == files_under(tmp_path / "triton") | files_under(tmp_path / "inductor")
    assert {p.suffix for p in written} == {".source", ".json", ".cubin", ".py", ".best_config"}
    assert not list(tmp_path.rglob("tmp.pid_*"))  # written whole, renamed into place
    assert model.waited == [0.5, 2.8]  # type: ignore[attr-defined]
    # In the cache now: loaded, not compiled (a cache that outlives a restart spares it).
    again = compiles(tmp_path)
    assert again.compile(kernels) == [] and again.waited == []  # type: ignore[attr-defined]
    assert not (tmp_path / "home").exists()  # nothing in the default places


# --- the server: an EAGLE-3 stand-in under a batch ---------------------------------------


async def test_an_eagle3_standin_compiles_the_draft_kernels_of_a_new_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    args = ("--eagle3", "--triton-compile-seconds", "0", "--inductor-compile-seconds", "0")
    async with standin(*args, *QUICK) as s, httpx.AsyncClient(timeout=DEADLINE_S) as c:
        await s.wait_line(r"^standin: loaded$")
        assert any("EAGLE" in line or "draft" in line for line in s.output), s.output
        greedy = {"max_new_tokens": 2, "temperature": 0}
        one = await c.post(s.url + "/generate", json={"text": "a", "sampling_params": greedy})
        assert one.status_code == 200
        after_one = {p.parent.name + "/" + p.name for p in files_under(tmp_path / "triton")}
        batch = {"text": ["b", "c", "d"], "sampling_params": {**greedy, "repetition_penalty": 1.1}}
        three = await c.post(s.url + "/generate", json=batch)
        assert three.status_code == 200 and len(three.json()) == 3
        names = {p.stem for p in files_under(tmp_path / "triton")}
        assert {"get_num_kv_splits_triton", "assign_req_to_token_pool"} <= names, names
        assert "generate_draft_decode_kv_indices" in names  # no CUDA graphs by default
        assert {p.stem for p in files_under(tmp_path / "inductor")} == {"apply_scaling_penalties"}
        # The same batch again compiles nothing: every kernel is in its cache.
        before = files_under(tmp_path / "triton") | files_under(tmp_path / "inductor")
        again = {"text": ["e", "f", "g"], "sampling_params": batch["sampling_params"]}
        assert (await c.post(s.url + "/generate", json=again)).status_code == 200
        assert files_under(tmp_path / "triton") | files_under(tmp_path / "inductor") == before
        assert len(after_one) == 3  # the first request: one Triton kernel, three files
