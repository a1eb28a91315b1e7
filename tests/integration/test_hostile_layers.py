"""Hostile layers through a real registry: each refused naming the layer and the entry.

One good bundle of the session's real build is pushed (test_registry.py's node and
registry process); then, for every kind of tests/unit/fleet/hostile.py, a copy of
the artifact whose Triton layer is that hostile layer, pushed consistently (the
layer, the config and the manifest all naming it by its digest). ``bundle pull
--digest`` of each, through the real CLI, must exit 65 with one line naming the
artifact, the layer's digest and the entry, and leave every path of the node's
caches as it was (FlashInfer's warm, Triton's cold): kind, mode, mtime, bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fleet_registry import RegistryProcess
from supervisor.flashinfer import cache
from supervisor.fleet import distribute, registry
from supervisor.fleet.archive import DEFAULT_LIMITS
from supervisor.fleet.registry import Registry
from tests.unit.fleet.hostile import KINDS, Snapshot, corpus, hostile, snapshot

from .builds import SessionBuild
from .test_registry import Node, k26, with_triton_layer

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]


async def push_hostile(url: str, good: str) -> dict[str, str]:
    """A copy of the artifact ``good`` per hostile kind, its Triton layer that kind's
    layer; each kind's artifact digest."""
    out: dict[str, str] = {}
    async with Registry(url) as reg:
        raw, _ = await reg.get_manifest(good)
        manifest = registry.parse_manifest(raw, url)
        config = distribute.parse_config(
            await reg.fetch_bytes(manifest.config.digest, manifest.config.size), url
        )
        for n, case in enumerate(corpus()):
            out[case.kind] = await with_triton_layer(
                reg, manifest, config, case.layer, f"hostile-{n}"
            )
    return out


Pushed = tuple[Node, RegistryProcess, dict[str, str]]


@pytest.fixture(scope="module")
def pushed(small_build: SessionBuild, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    base = tmp_path_factory.mktemp("hostile")
    try:
        with RegistryProcess(base / "registry") as reg:
            node = Node(small_build, base / "node")
            node.wipe()
            node.fill()
            good = node.push(reg.url)
            digests = asyncio.run(push_hostile(reg.url, good["digest"]))
            node.wipe()
            node.build.restore()  # FlashInfer's warm (a pull would replace it) ...
            node.triton.mkdir(parents=True)  # ... Triton's cold: a pull would fill it
            (node.triton / "lock").write_text("")
            yield node, reg, digests
            node.wipe()
    except RuntimeError as exc:  # docker-registry not installed, or would not start
        pytest.fail(str(exc))


def everything(node: Node) -> Snapshot:
    """Every path of the node's caches. The pull's scratch dir under FlashInfer's cache
    root (made, emptied) and that root's mtime are the pull's own, left out."""
    root = str(cache.cache_root(node.workspace).relative_to(node.workspace))
    scratch = f"{root}/{distribute.PULL_WORK}"
    out = {
        f"ws/{k}": (v if k != root else (*v[:2], 0, v[3]))
        for k, v in snapshot(node.workspace).items()
        if k != scratch and not k.startswith(scratch + "/")
    }
    out.update({f"caches/{k}": v for k, v in snapshot(node.caches).items()})
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_layer_pulled_from_the_registry_is_refused_and_nothing_changes(
    pushed: Pushed, kind: str
) -> None:
    node, reg, digests = pushed
    case = hostile(kind)
    before = everything(node)
    limits = (
        [] if case.limits == DEFAULT_LIMITS else ["--max-entries", str(case.limits.max_entries)]
    )
    done = k26("flashinfer", "bundle", "pull", *node.args(), "--registry", reg.url,
               "--digest", digests[kind], *limits)  # fmt: skip
    assert done.returncode == 65, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("k26-supervisor: error: ")]
    assert len(lines) == 1, done.stderr
    said = lines[0]
    layer = registry.sha256_digest(case.layer)
    assert f"{reg.url}@{digests[kind]}: the triton layer ({layer}): " in said, said
    assert repr(case.entry) in said and case.said in said, said
    assert "push the bundle again" in said and distribute.PULL_WORK not in said, said
    assert everything(node) == before
    assert not list(Path(cache.cache_root(node.workspace), distribute.PULL_WORK).glob("*"))
