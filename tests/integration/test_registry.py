"""Cache bundles through a real OCI registry: push, wipe, pull, and the daemon's pull.

The registry is Debian's docker-registry (the CNCF distribution server) that
scripts/tools.sh unpacks, started per test as a process on a free port with its own
storage (bench/fleet_registry.py); a machine without it fails here, it does not
skip. The FlashInfer cache is the session's real nvcc build of a small module
(``small_build``), the serving venv the real FlashInfer 0.7.4 one; Triton's and
inductor's caches are laid out as those libraries lay them out, pinned by the units'
environment file. Everything goes through the real CLI or the daemon's own warm-up
(``adapters/warmup.py``), over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bench.fleet_registry import RegistryProcess
from supervisor.adapters.warmup import Warmup
from supervisor.core.config import FlashInferSection
from supervisor.core.learned_shapes import LearnedShape, parse_batch_line, parse_records
from supervisor.core.learned_shapes import document as learned_document
from supervisor.core.status import StatusBoard
from supervisor.flashinfer import cache
from supervisor.fleet import accepted, distribute, registry
from supervisor.fleet.registry import Registry

from .builds import ARCH, SMALL_MODULE, SessionBuild

pytestmark = [pytest.mark.flashinfer, pytest.mark.precompile]

ROOT = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).with_name("k26-supervisor"))]


def k26(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def snapshot(directory: Path) -> dict[str, tuple[str, int, int]]:
    """Each file under ``directory``: sha256, mtime (ns), mode."""
    return {
        str(p.relative_to(directory)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
            p.stat().st_mode & 0o777,
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Node:
    """A host's caches: FlashInfer's workspace (the session build's path) and Triton's
    and inductor's dirs, pinned by the units' environment file."""

    def __init__(self, build: SessionBuild, base: Path) -> None:
        self.build = build
        self.workspace = build.workspace
        self.caches = base / "caches"
        self.triton = self.caches / "triton"
        self.inductor = self.caches / "inductor"
        self.env_file = base / "units.env"
        self.state = base / "state"  # the daemon's (fleet/accepted.py's record)
        base.mkdir(parents=True, exist_ok=True)
        self.write_env()

    def write_env(self, **extra: str) -> None:
        env = {
            **self.build.env,
            "TRITON_CACHE_DIR": str(self.triton),
            "TORCHINDUCTOR_CACHE_DIR": str(self.inductor),
            **extra,
        }
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))

    def args(self) -> list[str]:
        return [
            "--python", str(self.build.python), "--arch", ARCH,
            "--workspace", str(self.workspace), "--env-file", str(self.env_file),
        ]  # fmt: skip

    def state_args(self) -> list[str]:
        """The daemon's state directory, for the commands that keep its records."""
        return ["--state-dir", str(self.state)]

    def fill(self) -> None:
        """Warm FlashInfer (the real build), and Triton's and inductor's caches."""
        self.build.restore()
        for n in range(3):
            key = self.triton / f"{n:02d}QZX4UVB6WLM2D7YPKE5HN3TCRA"
            key.mkdir(parents=True)
            (key / "_kernel.cubin").write_bytes(os.urandom(64 << 10))
            (key / "_kernel.json").write_text(json.dumps({"name": "_kernel", "num_warps": 4}))
            children = {f: str(key / f) for f in ("_kernel.cubin", "_kernel.json")}
            (key / "__grp___kernel.json").write_text(json.dumps({"child_paths": children}))
        (self.inductor / "ab").mkdir(parents=True)
        (self.inductor / "ab" / "cabxyz.py").write_text(
            f"# kernel path: {self.inductor}/ab/cabxyz.py\nimport triton\n"
        )

    def wipe(self) -> None:
        shutil.rmtree(cache.cache_root(self.workspace), ignore_errors=True)
        shutil.rmtree(self.caches, ignore_errors=True)

    def files(self) -> dict[str, tuple[str, int, int]]:
        """Every carried file: FlashInfer's module build dir, Triton's, inductor's."""
        out: dict[str, tuple[str, int, int]] = {}
        ops = self.build.dir / "cached_ops" / SMALL_MODULE
        for name, root in (("fi", ops), ("triton", self.triton), ("inductor", self.inductor)):
            if root.is_dir():
                out.update({f"{name}/{k}": v for k, v in snapshot(root).items()})
        return out

    def all_files(self) -> dict[str, tuple[str, int, int]]:
        """Everything under the workspace and the caches (to prove nothing changed)."""
        out = {f"ws/{k}": v for k, v in snapshot(self.workspace).items()}
        if self.caches.is_dir():
            out.update({f"caches/{k}": v for k, v in snapshot(self.caches).items()})
        return out

    def push(self, url: str, *extra: str) -> dict[str, Any]:
        done = k26("flashinfer", "bundle", "push", *self.args(), "--module", SMALL_MODULE,
                   "--registry", url, "--json", *extra)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_push_wipe_pull_gives_identical_files_and_nothing_to_build(
    node: Node, registry_proc: RegistryProcess
) -> None:
    node.fill()
    pushed = node.push(registry_proc.url, "--chunk-size", str(256 << 10))
    assert [c["cache"] for c in pushed["caches"]] == ["flashinfer", "inductor", "triton"]
    relocatable = {c["cache"]: c["relocatable"] for c in pushed["caches"]}
    assert relocatable == {"flashinfer": False, "inductor": False, "triton": True}
    assert pushed["layers_uploaded"] == 3 and pushed["tags"][0].startswith("k26-12.0-")

    async def config_blob(reference: str) -> bytes:
        async with Registry(registry_proc.url) as reg:
            raw, _ = await reg.get_manifest(reference)
            manifest = registry.parse_manifest(raw, reference)
            return await reg.fetch_bytes(manifest.config.digest, manifest.config.size)

    # No learned shapes pushed: no such field, which older nodes' config model forbids.
    assert b"learned_shapes" not in asyncio.run(config_blob(pushed["tags"][0]))
    # The same caches again: the same layers, by digest; nothing is sent twice.
    again = node.push(registry_proc.url)
    assert again["layers_uploaded"] == 0 and again["layers_already_there"] == 3

    before = node.files()
    node.wipe()
    done = k26("flashinfer", "bundle", "pull", *node.args(), "--registry", registry_proc.url,
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    pulled = json.loads(done.stdout)
    assert pulled["digest"] == again["digest"]
    assert sorted(c["cache"] for c in pulled["installed"]) == ["flashinfer", "inductor", "triton"]
    assert node.files() == before  # bytes, mtimes to the ns, modes
    # FlashInfer's own warm-up finds it warm and vouched for: nothing to build.
    warmed = k26("flashinfer", "warm", *node.args(), "--module", SMALL_MODULE, "--no-learned")
    assert warmed.returncode == 0 and "built nothing" in warmed.stdout, warmed.stdout

    # A second pull has nothing cold to fill: FlashInfer replaced as import does,
    # the other caches kept as they are.
    done = k26("flashinfer", "bundle", "pull", *node.args(), "--registry", registry_proc.url,
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = json.loads(done.stdout)["notes"]
    assert f"triton: {node.triton} holds kernels already; kept" in notes


def test_triton_moves_inductor_does_not_and_a_mismatch_is_refused(
    node: Node, registry_proc: RegistryProcess, tmp_path: Path
) -> None:
    node.fill()
    digest = node.push(registry_proc.url)["digest"]
    node.wipe()
    pull = ["flashinfer", "bundle", "pull", *node.args(), "--registry", registry_proc.url]

    # Triton elsewhere: its group files name the new path; inductor's cannot move.
    elsewhere = tmp_path / "elsewhere"
    node.write_env(TRITON_CACHE_DIR=str(elsewhere / "triton"))
    done = k26(*pull, "--json")
    assert done.returncode == 0, done.stderr
    groups = sorted((elsewhere / "triton").rglob("__grp__*.json"))
    assert len(groups) == 3
    for group in groups:
        children = json.loads(group.read_text())["child_paths"]
        assert {Path(p).parent for p in children.values()} == {group.parent}
    node.wipe()
    node.write_env(TORCHINDUCTOR_CACHE_DIR=str(elsewhere / "inductor"))
    before = node.all_files()
    done = k26(*pull)
    assert done.returncode == 65, done.stderr
    assert f"inductor: bundle {node.inductor}, this node {elsewhere / 'inductor'}" in done.stderr
    assert "# kernel path: ..." in done.stderr and len(done.stderr.splitlines()) == 1
    assert node.all_files() == before

    # Another build environment: another identity. No bundle for it by its key...
    node.write_env(FLASHINFER_EXTRA_CUDAFLAGS="-O1")
    done = k26(*pull)
    assert done.returncode == 69, done.stderr
    assert "holds no bundle for this node" in done.stderr
    # ... and the one named by digest is refused naming the field, nothing changed.
    done = k26(*pull, "--digest", digest)
    assert done.returncode == 65, done.stderr
    assert "flashinfer.env.FLASHINFER_EXTRA_CUDAFLAGS: bundle none, this node -O1" in done.stderr
    assert node.all_files() == before


def test_bytes_that_are_not_their_digest_are_refused(
    node: Node, registry_proc: RegistryProcess
) -> None:
    node.fill()
    pushed = node.push(registry_proc.url)
    triton = next(c for c in pushed["caches"] if c["cache"] == "triton")
    node.wipe()
    node.build.restore()  # FlashInfer warm here: the pull would replace it
    before = node.all_files()
    blob = registry_proc.blob_file(triton["layer"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the registry's disk flipped a bit
    blob.write_bytes(bytes(data))
    done = k26("flashinfer", "bundle", "pull", *node.args(), "--registry", registry_proc.url)
    assert done.returncode == 65, done.stderr
    assert f"blob {triton['layer']}: the bytes it sent hash to sha256:" in done.stderr
    assert node.all_files() == before
    assert not list(cache.cache_root(node.workspace).glob("k26-pull-work/*"))


@contextlib.contextmanager
def status_server(units: dict[str, Any]) -> Iterator[str]:
    """A daemon's ``/status`` as it answers it (``units`` only), over real HTTP."""
    body = json.dumps({"units": units}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/status"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


LEARNED_LINE = (
    "[2026-12-04 14:22:47] Prefill batch, #new-seq: 5, #new-token: 40, #cached-token: 0, "
    "token usage: 0.00, #running-req: 0, #queue-req: 0"
)


def learned_file(path: Path) -> Path:
    """A daemon's learned-shapes file with one variant."""
    batch = parse_batch_line(LEARNED_LINE)
    assert batch is not None
    shape = LearnedShape("triton", "kern", "HASH", "t0", "t0", batches=(batch,))
    path.write_text(json.dumps(learned_document({"sglang-k26.service": [shape]})))
    return path


def test_the_coverage_marker_travels_and_a_jit_after_ready_refuses_the_push(
    node: Node, registry_proc: RegistryProcess, tmp_path: Path
) -> None:
    node.fill()
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")  # after every carried file
    unit = "sglang-k26.service"
    covered = {
        "state": "ready",
        "coverage": {"ok": True, "at": now, "duration_s": 3.5, "shapes": [{"name": "top-k"}]},
        "jit_after_ready": {"count": 0},
    }
    learned = learned_file(tmp_path / "k26-learned-shapes.json")
    with status_server({unit: covered}) as daemon:
        pushed = node.push(registry_proc.url, "--coverage-from", daemon, "--unit", unit,
                           "--learned", str(learned))  # fmt: skip
    assert pushed["coverage"] == {"unit": unit, "at": now}
    assert pushed["learned_shapes"] == {unit: 1}
    node.wipe()
    into = tmp_path / "node-state" / "k26-learned-shapes.json"
    done = k26("flashinfer", "bundle", "pull", *node.args(), "--registry", registry_proc.url,
               "--learned-into", str(into))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"coverage: passed on {unit} at {now} (1 shapes)" in done.stdout
    assert f"learned shapes: 1 of {unit}; 1 new, merged into {into}" in done.stdout
    assert json.loads(into.read_text()) == json.loads(learned.read_text())

    # A learned-shapes file that is not one: refused before anything is pushed.
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "units": {"u": [{"cache": "triton"}]}}')
    done = k26("flashinfer", "bundle", "push", *node.args(), "--module", SMALL_MODULE,
               "--registry", registry_proc.url, "--learned", str(bad))  # fmt: skip
    assert f"{bad}: units.u[0]: kernel None" in refused(done, 65)

    # A kernel compiled after READY: these caches are not the ones the warm-up
    # passed with. Refused before anything is pushed.
    compiled = {**covered, "jit_after_ready": {"count": 2}}
    with status_server({unit: compiled}) as daemon:
        done = k26("flashinfer", "bundle", "push", *node.args(), "--module", SMALL_MODULE,
                   "--registry", registry_proc.url, "--tag", "refused",
                   "--coverage-from", daemon, "--unit", unit)  # fmt: skip
    said = refused(done, 74)
    assert f"{unit} compiled 2 kernel(s) after READY" in said
    missing = k26("flashinfer", "bundle", "pull", *node.args(), "--registry", registry_proc.url,
                  "--tag", "refused")  # fmt: skip
    assert missing.returncode == 69 and "manifest refused: not found" in missing.stderr


def warmup(node: Node, url: str) -> tuple[Warmup, StatusBoard]:
    cfg = FlashInferSection(
        python=node.build.python,
        arch=ARCH,
        workspace=node.workspace,
        modules=(SMALL_MODULE,),
        env_file=node.env_file,
        registry=url,
        registry_timeout_s=5.0,
    )
    board = StatusBoard(version="test", config_path="test")
    return Warmup(cfg, board, accepted_record=accepted.record_path(node.state)), board


async def test_the_daemon_pulls_a_cold_cache_before_it_builds(
    node: Node, registry_proc: RegistryProcess, tmp_path: Path
) -> None:
    node.fill()
    node.push(registry_proc.url, "--learned", str(learned_file(tmp_path / "learned.json")))
    before = node.files()
    node.wipe()
    warm, board = warmup(node, registry_proc.url)
    carried: list[Any] = []

    async def learned_shapes(document: Any) -> int:
        carried.append(document)
        return 1

    warm.learned_shapes = learned_shapes
    outcome = await warm.ensure(recheck=False, patch_allowed=False)
    (document,) = carried  # the bundle's learned shapes, handed to the daemon's record
    assert [s.kernel for s in parse_records(document, "pulled")["sglang-k26.service"]] == ["kern"]
    assert outcome.ok, outcome.error
    assert outcome.built == ()  # pulled, verified: nothing built
    assert node.files() == before
    shown = board.snapshot().warmup
    assert shown is not None and shown.state == "warm" and shown.error is None


async def test_a_registry_that_is_down_warns_then_the_node_warms_here(
    node: Node, registry_proc: RegistryProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # FlashInfer's cache as the session built it (no second nvcc build); Triton's and
    # inductor's cold: the daemon asks the registry for them before it warms.
    node.build.restore()
    registry_proc.stop()  # nothing listens on its port now
    warm, board = warmup(node, registry_proc.url)
    with caplog.at_level(logging.WARNING, logger="k26.warmup"):
        outcome = await warm.ensure(recheck=False, patch_allowed=False)
    assert outcome.ok, outcome.error
    assert outcome.built == ()  # the local warm-up ran: it found FlashInfer warm
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(registry_proc.url in m and "unreachable" in m for m in warned), warned
    shown = board.snapshot().warmup
    assert shown is not None and shown.state == "warm"
    assert shown.error is not None and "registry pull failed" in shown.error
    assert "unreachable" in shown.error and shown.error.endswith("warmed here")
    assert not node.triton.exists() and not node.inductor.exists()


async def with_triton_layer(
    reg: Registry,
    manifest: registry.Manifest,
    config: distribute.ArtifactConfig,
    layer: bytes,
    tag: str,
) -> str:
    """``manifest`` pushed again as ``tag`` with its Triton layer (and its config's
    record of it) replaced by ``layer``: what a corrupt or hostile registry serves."""
    digest, size = registry.sha256_digest(layer), len(layer)
    await reg.push_blob(layer, digest, size)
    records = tuple(
        r.model_copy(update={"layer": digest, "size": size}) if r.cache == "triton" else r
        for r in config.caches
    )
    config_bytes = config.model_copy(update={"caches": records}).model_dump_json().encode()
    config_digest = registry.sha256_digest(config_bytes)
    await reg.push_blob(config_bytes, config_digest, len(config_bytes))
    layers = tuple(
        d.model_copy(update={"digest": digest, "size": size})
        if (d.annotations or {}).get(registry.CACHE_ANNOTATION) == "triton"
        else d
        for d in manifest.layers
    )
    descriptor = manifest.config.model_copy(
        update={"digest": config_digest, "size": len(config_bytes)}
    )
    bad = manifest.model_copy(update={"config": descriptor, "layers": layers})
    return await reg.put_manifest(bad.body(), tag)


def refused(done: subprocess.CompletedProcess[str], code: int) -> str:
    """A refusal: the exit code, and one line on stderr (no traceback)."""
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k26-supervisor: error: "), done.stderr
    return lines[0]


def test_the_cli_says_what_is_wrong_and_changes_nothing(
    node: Node, registry_proc: RegistryProcess
) -> None:
    """Each refusal is one line naming the thing and what to do; nothing changes."""
    node.fill()
    pushed = node.push(registry_proc.url)
    node.wipe()
    node.build.restore()
    before = node.all_files()
    pull = ["flashinfer", "bundle", "pull", *node.args(), "--registry"]

    # A reference that is not one, a registry address that is not one: said at once.
    said = refused(k26(*pull, registry_proc.url, "--digest", "sha256:abc"), 65)
    assert "digest 'sha256:abc' is not sha256:<64 lowercase hex digits>" in said
    said = refused(k26(*pull, "http://127.0.0.1:1/K26 Bundles"), 65)
    assert "must not contain spaces" in said
    # A digest the registry does not hold.
    missing = "sha256:" + "0" * 64
    said = refused(k26(*pull, registry_proc.url, "--digest", missing), 69)
    assert f"registry {registry_proc.url}: manifest {missing}: not found" in said

    # A layer whose bytes are its digest but not a layer (a build host's broken push):
    # the manifest and config name it consistently; the pull reads it whole and refuses.
    digest = asyncio.run(push_a_corrupt_triton_layer(registry_proc.url, pushed["digest"]))
    said = refused(k26(*pull, registry_proc.url, "--digest", digest), 65)
    assert f"{registry_proc.url}@{digest}: the triton layer (sha256:" in said
    assert "truncated or corrupt archive" in said and "push the bundle again" in said
    assert "k26-pull-work" not in said  # named by what it is, not by a scratch file

    # The registry down: pull and push say which registry and what happened.
    registry_proc.stop()
    said = refused(k26(*pull, registry_proc.url), 69)
    assert f"registry {registry_proc.url}: manifest k26-12.0-" in said
    assert "unreachable (ConnectError" in said
    push = ["flashinfer", "bundle", "push", *node.args(), "--module", SMALL_MODULE]
    said = refused(k26(*push, "--registry", registry_proc.url), 69)
    assert f"registry {registry_proc.url}" in said and "unreachable" in said

    assert node.all_files() == before
    assert not list(cache.cache_root(node.workspace).glob("k26-pull-work/*"))


async def push_a_corrupt_triton_layer(url: str, good: str) -> str:
    """A copy of the artifact ``good`` whose triton layer is gzip'd garbage, pushed
    consistently (layer, config and manifest all naming it); its digest."""
    async with Registry(url) as reg:
        raw, _ = await reg.get_manifest(good)
        manifest = registry.parse_manifest(raw, url)
        config = distribute.parse_config(
            await reg.fetch_bytes(manifest.config.digest, manifest.config.size), url
        )
        garbage = gzip.compress(b"not a tar archive, just bytes" * 100, mtime=0)
        return await with_triton_layer(reg, manifest, config, garbage, "corrupt")
