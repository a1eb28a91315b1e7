"""A real OCI registry as a child process, for tests/integration/test_registry.py and
bench/fleet_pull.py.

The binary is Debian's docker-registry (the CNCF distribution server, 2.8), which
scripts/tools.sh unpacks into the shared cache (``tools_bin()``): run with a
config of its own on a free loopback port and a temporary storage directory, and
stopped by PID (SIGTERM, then SIGKILL). Never a system service. Plain library
code, no pytest.
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time
from pathlib import Path

import httpx

from k26dev import shared_cache
from k26dev.ports import free_port

CONFIG = """\
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def registry_binary() -> Path:
    """docker-registry: ``$K26_DOCKER_REGISTRY`` (the GPU kit's, bench/gpu/make_kit.sh
    registry), else scripts/tools.sh's, else on PATH; RuntimeError saying how to get it."""
    given = os.environ.get("K26_DOCKER_REGISTRY")
    if given:
        if not os.access(given, os.X_OK):
            raise RuntimeError(f"K26_DOCKER_REGISTRY={given} is not an executable file")
        return Path(given)
    candidate = shared_cache.tools_dir() / "bin" / "docker-registry"
    if candidate.exists():
        return candidate
    found = shutil.which("docker-registry")
    if found:
        return Path(found)
    raise RuntimeError(
        f"docker-registry not found: scripts/tools.sh unpacks Debian's docker-registry into "
        f"{candidate.parent} (run scripts/tools.sh, or scripts/dev.sh test)"
    )


class RegistryProcess:
    """``with RegistryProcess(dir) as reg: reg.url`` is an empty registry that is up.

    ``tls``: its certificate and key (PEM), served over https; ``ca``: what that
    certificate chains to. ``auth``: the config's ``auth:`` section as YAML (htpasswd
    or token), for tests/integration/test_registry_auth.py."""

    def __init__(
        self,
        directory: Path,
        repository: str = "k26/bundles",
        *,
        tls: tuple[Path, Path] | None = None,
        ca: Path | None = None,
        auth: str = "",
    ) -> None:
        self.directory = directory
        self.storage = directory / "storage"
        self.port = free_port()
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.tls, self.ca, self.auth = tls, ca, auth
        self.url = f"{self.base}/{repository}"
        self.log = directory / "registry.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        self.storage.mkdir(parents=True, exist_ok=True)
        config = self.directory / "config.yml"
        text = CONFIG.format(storage=self.storage, port=self.port)
        if self.tls is not None:
            text += f"  tls:\n    certificate: {self.tls[0]}\n    key: {self.tls[1]}\n"
        config.write_text(text + self.auth)
        verify = True if self.ca is None else ssl.create_default_context(cafile=str(self.ca))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(registry_binary()), "serve", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:  # up when /v2/ answers (the event), bounded by the deadline
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"docker-registry exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                answer = httpx.get(f"{self.base}/v2/", timeout=1.0, verify=verify)
                if answer.status_code in (200, 401):  # 401: up, asking for credentials
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry not answering on {self.base} in {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def blob_file(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes (for the tampering tests)."""
        hexdigest = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def __enter__(self) -> RegistryProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
