"""The registry's artifact without a registry: manifests, configs, digests, identities,
the lookup key, the pull plan and its refusals, the coverage marker.

The client against a real registry process is tests/integration/test_registry.py.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.errors import CacheError, InputError
from supervisor.flashinfer.venv import ServingEnv
from supervisor.fleet import cache_layers, distribute, registry

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
DIGEST_C = "sha256:" + "c" * 64
FLASHINFER_ID: dict[str, Any] = {
    "python": "/usr/bin/python3.11",
    "prefix": "/srv/venv",
    "flashinfer": {"name": "flashinfer-python", "version": "0.7.4", "record_sha256": "aa"},
    "torch": {"name": "torch", "version": "2.8.0", "record_sha256": "cc", "cuda": "12.9"},
    "nvcc": {"release": "13.0", "version_sha256": "dd", "mtime_ns": 1},
    "env": {"FLASHINFER_CUDA_ARCH_LIST": "12.0"},
}
TOOLS: dict[str, Any] = {
    "python_version": "3.11.7",
    "prefix": "/srv/venv",
    "distributions": {
        "torch": {"name": "torch", "version": "2.8.0", "record_sha256": "cc"},
        "triton": {"name": "triton", "version": "3.4.0", "record_sha256": "ee"},
        "tvm_ffi": {"name": "apache-tvm-ffi", "version": "0.1.15", "record_sha256": "ff"},
        "deep_gemm": None,
        "sgl_kernel": {"name": "sgl-kernel", "version": "0.3.9", "record_sha256": "11"},
    },
    "torch_cuda": "12.9",
    "ptxas": {"path": "/srv/venv/triton/ptxas", "release": "12.8", "version_sha256": "22"},
    "nvcc": {"path": "/usr/local/cuda/bin/nvcc", "release": "13.0", "version_sha256": "33"},
    "gpu_models": ["NVIDIA H200"],
    "env": {"CC": None, "CXX": None, "TRITON_PTXAS_PATH": None},
}


def tools(**changes: Any) -> cache_layers.ToolsReply:
    data = copy.deepcopy(TOOLS)
    data.update(changes)
    return cache_layers.ToolsReply.model_validate(data)


# --- references and digests -------------------------------------------------------


def test_references_are_tags_or_sha256_digests() -> None:
    assert registry.check_reference("k26-12.0-abc") == "k26-12.0-abc"
    assert registry.check_reference(DIGEST_A) == DIGEST_A
    for bad in ("sha256:ABC", "sha256:" + "a" * 63, "-tag", ".tag", "a" * 129, "a/b", "t g"):
        with pytest.raises(InputError, match=r"(digest|tag) .* is not"):
            registry.check_reference(bad)


def test_digests_are_sha256_of_the_bytes(tmp_path: Path) -> None:
    assert registry.sha256_digest(b"") == (
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    blob = tmp_path / "blob"
    blob.write_bytes(b"k26" * 1_000_000)
    assert registry.file_digest(blob) == (registry.sha256_digest(blob.read_bytes()), 3_000_000)


def test_a_bad_registry_url_names_what_is_wrong() -> None:
    with pytest.raises(InputError, match="registry 'ftp://x/y': must start with http"):
        registry.Registry("ftp://x/y")
    reg = registry.Registry("http://127.0.0.1:5000/k26/bundles/")
    assert (reg.base, reg.repository) == ("http://127.0.0.1:5000", "k26/bundles")


# --- the manifest ---------------------------------------------------------------------


def manifest(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": registry.MANIFEST_MEDIA_TYPE,
        "artifactType": registry.ARTIFACT_TYPE,
        "config": {"mediaType": registry.CONFIG_MEDIA_TYPE, "digest": DIGEST_A, "size": 10},
        "layers": [
            {
                "mediaType": registry.FLASHINFER_LAYER,
                "digest": DIGEST_B,
                "size": 20,
                "annotations": {registry.CACHE_ANNOTATION: "flashinfer"},
            },
            {
                "mediaType": registry.CACHE_LAYER,
                "digest": DIGEST_C,
                "size": 30,
                "annotations": {registry.CACHE_ANNOTATION: "triton"},
            },
        ],
    }
    data.update(changes)
    return data


def test_the_manifest_is_an_oci_image_manifest_with_our_artifact_type() -> None:
    built = registry.Manifest(
        config=registry.Descriptor(mediaType=registry.CONFIG_MEDIA_TYPE, digest=DIGEST_A, size=10),
        layers=(
            registry.Descriptor(
                mediaType=registry.CACHE_LAYER,
                digest=DIGEST_C,
                size=30,
                annotations={registry.CACHE_ANNOTATION: "triton"},
            ),
        ),
    )
    body = json.loads(built.body())
    assert body["schemaVersion"] == 2
    assert body["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert body["artifactType"] == "application/vnd.k26.jit-caches.v1"
    assert body["config"]["mediaType"] == "application/vnd.k26.jit-caches.config.v1+json"
    assert registry.parse_manifest(built.body(), "x") == built
    # The digest is of the bytes pushed, and the bytes are canonical.
    assert registry.sha256_digest(built.body()) == registry.sha256_digest(built.body())


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"schemaVersion": 1}, "manifest field schemaVersion"),
        ({"mediaType": "application/vnd.docker.distribution.manifest.v2+json"}, "mediaType"),
        ({"artifactType": "application/vnd.other"}, "manifest field artifactType"),
        ({"layers": []}, "manifest field layers"),
        ({"surprise": 1}, "manifest field surprise"),
    ],
)
def test_a_manifest_that_is_not_ours_is_refused_naming_the_field(
    changes: dict[str, Any], match: str
) -> None:
    with pytest.raises(InputError, match=f"reg@x: not a k26 cache bundle: .*{match}"):
        registry.parse_manifest(json.dumps(manifest(**changes)).encode(), "reg@x")


def test_manifest_layers_must_be_ours_named_and_once() -> None:
    bad = manifest()
    bad["config"]["mediaType"] = "application/json"
    with pytest.raises(InputError, match="config media type 'application/json'"):
        registry.parse_manifest(json.dumps(bad).encode(), "x")
    bad = manifest()
    bad["layers"][1]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip"
    with pytest.raises(InputError, match=r"layers\.1\.mediaType: .* is not a k26 layer"):
        registry.parse_manifest(json.dumps(bad).encode(), "x")
    bad = manifest()
    bad["layers"][1]["annotations"] = {}
    with pytest.raises(InputError, match=r"layers\.1 names no cache"):
        registry.parse_manifest(json.dumps(bad).encode(), "x")
    bad = manifest()
    bad["layers"][1]["annotations"] = {registry.CACHE_ANNOTATION: "flashinfer"}
    with pytest.raises(InputError, match="lists the flashinfer cache twice"):
        registry.parse_manifest(json.dumps(bad).encode(), "x")
    bad = manifest()
    bad["layers"][0]["digest"] = "md5:abc"
    with pytest.raises(InputError, match=r"layers\.0\.digest"):
        registry.parse_manifest(json.dumps(bad).encode(), "x")


# --- identities and the key -----------------------------------------------------------


def test_each_cache_has_its_own_identity() -> None:
    ids = cache_layers.identities(tools(), "12.0")
    assert ids["triton"] == {
        "arch": "12.0",
        "python_version": "3.11.7",
        "triton": {"name": "triton", "version": "3.4.0", "record_sha256": "ee"},
        "ptxas": {"release": "12.8", "version_sha256": "22"},  # not where it is installed
    }
    assert ids["inductor"]["torch"]["version"] == "2.8.0"
    assert ids["inductor"]["torch_cuda"] == "12.9"
    assert ids["inductor"]["triton"]["version"] == "3.4.0"
    assert ids["inductor"]["gpu_models"] == ["NVIDIA H200"]
    assert ids["tvm-ffi"]["tvm_ffi"]["version"] == "0.1.15"
    assert ids["tvm-ffi"]["nvcc"] == {"release": "13.0", "version_sha256": "33"}
    assert ids["deepgemm"]["deep_gemm"] is None
    assert ids["deepgemm"]["sgl_kernel"]["version"] == "0.3.9"
    assert {i["arch"] for i in ids.values()} == {"12.0"}


def test_the_key_follows_every_identity_but_not_paths_or_nvcc_mtime() -> None:
    base = distribute.node_identity(FLASHINFER_ID, tools(), "12.0")
    key = distribute.lookup_key(base)
    assert len(key) == 64
    tag = distribute.default_tag("12.0", key)
    assert tag == f"k26-12.0-{key[:40]}" and registry.check_reference(tag) == tag
    moved_ptxas = tools(ptxas={**TOOLS["ptxas"], "path": "/elsewhere/ptxas"})
    assert (
        distribute.lookup_key(distribute.node_identity(FLASHINFER_ID, moved_ptxas, "12.0")) == key
    )
    reinstalled = copy.deepcopy(FLASHINFER_ID)
    reinstalled["nvcc"]["mtime_ns"] = 2  # the same toolkit installed at another time
    assert distribute.lookup_key(distribute.node_identity(reinstalled, tools(), "12.0")) == key
    others = [
        distribute.node_identity(FLASHINFER_ID, tools(), "9.0"),
        distribute.node_identity(FLASHINFER_ID, tools(gpu_models=["NVIDIA B200"]), "12.0"),
        distribute.node_identity(
            FLASHINFER_ID, tools(ptxas={**TOOLS["ptxas"], "release": "12.9"}), "12.0"
        ),
        distribute.node_identity({**FLASHINFER_ID, "prefix": "/other"}, tools(), "12.0"),
    ]
    assert len({key, *(distribute.lookup_key(o) for o in others)}) == 5


# --- the config and the plan ------------------------------------------------------------


def config(tmp_path: Path, **changes: Any) -> distribute.ArtifactConfig:
    ids = cache_layers.identities(tools(), "12.0")
    identity = distribute.node_identity(FLASHINFER_ID, tools(), "12.0")
    data: dict[str, Any] = {
        "arch": "12.0",
        "key": distribute.lookup_key(identity),
        "identity": identity,
        "created_at": "2026-12-01T00:00:00Z",
        "caches": [
            {
                "cache": "flashinfer",
                "media_type": registry.FLASHINFER_LAYER,
                "layer": DIGEST_B,
                "size": 20,
                "identity": FLASHINFER_ID,
                "path": str(tmp_path / "ws"),
                "relocatable": False,
                "pinned_because": "ninja state names absolute paths",
                "files": 4,
                "bytes": 100,
            },
            {
                "cache": "triton",
                "media_type": registry.CACHE_LAYER,
                "layer": DIGEST_C,
                "size": 30,
                "identity": ids["triton"],
                "path": str(tmp_path / "triton"),
                "relocatable": True,
                "files": 3,
                "bytes": 60,
            },
            {
                "cache": "inductor",
                "media_type": registry.CACHE_LAYER,
                "layer": DIGEST_A,
                "size": 40,
                "identity": ids["inductor"],
                "path": str(tmp_path / "inductor"),
                "relocatable": False,
                "pinned_because": "torch inductor's files name its cache path",
                "files": 2,
                "bytes": 50,
            },
        ],
    }
    data.update(changes)
    return distribute.parse_config(json.dumps(data).encode(), "reg@x")


def serving(tmp_path: Path, arch: str = "12.0") -> ServingEnv:
    return ServingEnv(Path("/srv/venv/bin/python"), arch, tmp_path / "ws")


def plan(
    tmp_path: Path,
    conf: distribute.ArtifactConfig,
    locations: dict[str, Path] | None = None,
    *,
    flashinfer: dict[str, Any] = FLASHINFER_ID,
    node_tools: cache_layers.ToolsReply | None = None,
    arch: str = "12.0",
    kept: str | None = None,
) -> distribute.Plan:
    where = (
        {"triton": tmp_path / "triton", "inductor": tmp_path / "inductor"}
        if locations is None
        else locations
    )
    identity = distribute.node_identity(flashinfer, node_tools or tools(), arch)
    return distribute.plan_pull(
        conf, identity, flashinfer, serving(tmp_path, arch), where, flashinfer_kept=kept
    )


def test_the_config_lists_each_cache_once_with_a_layer(tmp_path: Path) -> None:
    good = config(tmp_path)
    assert [r.cache for r in good.caches] == ["flashinfer", "triton", "inductor"]
    with pytest.raises(InputError, match="config lists a cache twice"):
        config(tmp_path, caches=[*good.model_dump()["caches"], good.model_dump()["caches"][1]])
    with pytest.raises(InputError, match="config field key"):
        config(tmp_path, key="short")
    with pytest.raises(InputError, match=r"config field caches\.0\.cache"):
        broken = good.model_dump()["caches"]
        broken[0]["cache"] = "sglang"
        config(tmp_path, caches=broken)


def test_layers_must_be_the_configs(tmp_path: Path) -> None:
    conf = config(tmp_path)
    parsed = registry.parse_manifest(json.dumps(manifest()).encode(), "x")
    with pytest.raises(InputError, match=r"layers \(flashinfer, triton\) are not the caches"):
        distribute.check_layers(parsed, conf, "x")
    data = manifest()
    data["layers"].append(
        {
            "mediaType": registry.CACHE_LAYER,
            "digest": DIGEST_A,
            "size": 41,
            "annotations": {registry.CACHE_ANNOTATION: "inductor"},
        }
    )
    parsed = registry.parse_manifest(json.dumps(data).encode(), "x")
    with pytest.raises(InputError, match=r"inductor layer is .* \(41 bytes.*config says .*40"):
        distribute.check_layers(parsed, conf, "x")
    data["layers"][-1]["size"] = 40
    distribute.check_layers(registry.parse_manifest(json.dumps(data).encode(), "x"), conf, "x")


def test_the_pull_s_account_carries_when_the_build_host_made_the_bundle(
    tmp_path: Path,
) -> None:
    """A node shows the age of what its registry gives it (the created gauge)."""
    conf = config(tmp_path, created_at="2026-11-24T08:30:00Z")
    made = plan(tmp_path, conf)
    account = distribute._pulled(
        "http://r:5000/k26/b", DIGEST_A, "k26-12.0-x", conf, made, {"caches": []}, 0, 0.0, {}
    )
    assert account["created_at"] == "2026-11-24T08:30:00Z"
    assert (account["digest"], account["installed"]) == (DIGEST_A, [])


def test_a_fitting_bundle_goes_where_this_node_keeps_each_cache(tmp_path: Path) -> None:
    made = plan(tmp_path, config(tmp_path))
    assert [(s.record.cache, s.target) for s in made.steps] == [
        ("flashinfer", tmp_path / "ws"),
        ("triton", tmp_path / "triton"),
        ("inductor", tmp_path / "inductor"),
    ]
    assert made.notes == []


def test_a_relocatable_cache_goes_elsewhere_a_pinned_one_is_refused(tmp_path: Path) -> None:
    moved = plan(
        tmp_path,
        config(tmp_path),
        {"triton": tmp_path / "t2", "inductor": tmp_path / "inductor"},
    )
    assert ("triton", tmp_path / "t2") in [(s.record.cache, s.target) for s in moved.steps]
    with pytest.raises(InputError) as caught:
        plan(tmp_path, config(tmp_path), {"inductor": tmp_path / "i2"})
    message = str(caught.value)
    assert f"inductor: bundle {tmp_path / 'inductor'}, this node {tmp_path / 'i2'}" in message
    assert "torch inductor's files name its cache path" in message
    assert f"set TORCHINDUCTOR_CACHE_DIR={tmp_path / 'inductor'}" in message


def test_every_identity_mismatch_is_named_with_both_values(tmp_path: Path) -> None:
    host = copy.deepcopy(FLASHINFER_ID)
    host["torch"]["version"] = "2.9.0"
    node = tools(ptxas={**TOOLS["ptxas"], "release": "12.9"}, gpu_models=["NVIDIA B200"])
    with pytest.raises(InputError) as caught:
        plan(tmp_path, config(tmp_path), flashinfer=host, node_tools=node)
    message = str(caught.value)
    assert "flashinfer.torch.version: bundle 2.8.0, this node 2.9.0" in message
    assert "triton.ptxas.release: bundle 12.8, this node 12.9" in message
    assert "inductor.gpu_models: bundle ['NVIDIA H200'], this node ['NVIDIA B200']" in message
    with pytest.raises(InputError, match=r"arch: bundle 12\.0, this node 9\.0"):
        plan(tmp_path, config(tmp_path), arch="9.0")


def test_flashinfer_only_at_its_workspace_path(tmp_path: Path) -> None:
    conf = config(tmp_path)
    records = conf.model_dump()["caches"]
    records[0]["path"] = "/var/cache/elsewhere"
    with pytest.raises(InputError, match=r"flashinfer.workspace: bundle /var/cache/elsewhere"):
        plan(tmp_path, config(tmp_path, caches=records))


def test_what_is_warm_kept_unpinned_or_absent_is_noted_not_pulled(tmp_path: Path) -> None:
    (tmp_path / "triton" / "KEY").mkdir(parents=True)
    (tmp_path / "triton" / "KEY" / "k.cubin").write_bytes(b"kernel")
    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / "lock").write_text("")  # a lock is not a kernel: still cold
    (tmp_path / "inductor" / "x.lock").write_text("")
    made = plan(
        tmp_path,
        config(tmp_path),
        {
            "triton": tmp_path / "triton",
            "inductor": tmp_path / "inductor",
            "tvm-ffi": tmp_path / "tvm",
        },
        kept="a process is building in it; kept",
    )
    assert [s.record.cache for s in made.steps] == ["inductor"]
    assert made.notes == [
        "flashinfer: a process is building in it; kept",
        f"triton: {tmp_path / 'triton'} holds kernels already; kept",
        "tvm-ffi: the bundle carries none",
    ]
    unpinned = plan(tmp_path, config(tmp_path), {})
    assert "triton: this node's environment does not pin it (TRITON_CACHE_DIR); not pulled" in (
        unpinned.notes
    )


# --- the coverage marker ------------------------------------------------------------------


def status(**unit: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "state": "ready",
        "coverage": {
            "ok": True,
            "at": "2026-12-01T10:00:00Z",
            "duration_s": 3.9,
            "shapes": [{"name": "top-k", "result": "ok"}],
        },
        "jit_after_ready": {"count": 0, "watched": ["triton"], "latest": []},
    }
    entry.update(unit)
    return {"units": {"sglang-k26.service": entry}}


AT_NS = int(datetime(2026, 12, 1, 10, tzinfo=UTC).timestamp()) * 10**9


def test_the_marker_records_a_coverage_that_passed_with_these_caches() -> None:
    marker = distribute.coverage_marker(
        status(), "http://127.0.0.1:9436", "sglang-k26.service", ("/c/triton/K/k.cubin", AT_NS)
    )
    assert marker.ok and marker.unit == "sglang-k26.service"
    assert marker.at == "2026-12-01T10:00:00Z" and marker.shapes[0]["name"] == "top-k"
    assert marker.newest_file == "/c/triton/K/k.cubin"
    assert marker.newest_file_at == "2026-12-01T10:00:00Z"


@pytest.mark.parametrize(
    ("unit", "newest", "error", "match"),
    [
        ({"coverage": None}, None, CacheError, "has run no coverage warm-up"),
        ({"coverage": {"ok": False, "at": "2026-12-01T10:00:00Z"}}, None, CacheError, "failed"),
        ({"state": "loading"}, None, CacheError, "is loading, not ready"),
        (
            {"jit_after_ready": {"count": 2}},
            None,
            CacheError,
            "compiled 2 kernel.*add the shapes that made them to its coverage",
        ),
        # What the daemon learned from those builds its next coverage replays.
        (
            {"jit_after_ready": {"count": 2}, "learned_shapes": {"count": 2, "replayable": 1}},
            None,
            CacheError,
            r"restart it \(its coverage then replays the 1 shape\(s\) it has learned.*; or add the",
        ),
        ({}, ("/c/triton/K/new.cubin", AT_NS + 5 * 10**9), CacheError, "new.cubin changed at"),
    ],
)
def test_the_marker_is_refused_when_the_caches_are_not_those_covered(
    unit: dict[str, Any], newest: tuple[str, int] | None, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        distribute.coverage_marker(status(**unit), "http://d", "sglang-k26.service", newest)
    with pytest.raises(InputError, match=r"no unit 'other\.service'"):
        distribute.coverage_marker(status(), "http://d", "other.service", None)
