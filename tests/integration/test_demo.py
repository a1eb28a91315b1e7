"""The README's first command, played to its end: ``k26-dev demo``.

Every act runs for real (a confined user manager, the stand-in units, the real
daemon, a real nvcc build of FlashInfer's sampling module, the kernel OOM killer,
then a booted host with the Debian package, act 2's build imported as a bundle,
and ``systemctl start``). The test
checks that each act told its part of the story, in order, that the command
exited 0, and that nothing it brought up is left. (test_sandbox.py sends the demo
signals early; this is the run a newcomer sees.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from k26dev import bootedhost, sandbox

pytestmark = [
    pytest.mark.integration,
    pytest.mark.flashinfer,
    pytest.mark.precompile,
    pytest.mark.booted,
    # Its own host, its own build: nothing of the session's, so a worker of its own.
    pytest.mark.xdist_group("demo"),
]

ROOT = Path(__file__).resolve().parents[2]

# What each act must have said, in this order (a line may hold more).
STORY = (
    r"systemd sandbox k26sbx-\S+ is up",
    r"ACT 1 - no supervisor",
    r"greedy, temperature 0\) -> HTTP 200",
    r"watch: \S+ died, cause=flashinfer-arch",
    r"FlashInfer warm-up is real: .* builds 'sampling' for 12\.0 with nvcc",
    r"exited: cause=oom-kill",
    r"systemd got READY=1 \(only now: a sampled generation passed\)",
    r"ACT 3 - SIGKILL",
    r"bundle export: act 2's warmed cache, [\d.]+ MB, modules sampling",
    r"sandbox torn down; no k26sbx cgroup left",
    r"ACT 4 - the production path",
    r"booted host k26host-\S+: systemd is PID 1",
    r"flashinfer bundle import \(the installed command\): act 2's build .* no nvcc build here",
    r"systemctl start returned after \d+ s, once READY=1 came",
    r"polkit, for real: .*Access denied|polkit, for real: .*Interactive authentication",
    r"booted host powered off; no k26host cgroup left",
)


def test_the_demo_plays_every_act_to_the_end(tmp_path: Path, serving_07: Any) -> None:
    before = Path("/proc/1/cgroup").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "k26dev", "demo", "--dir", str(tmp_path / "demo")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    position = 0
    for step in STORY:
        found = re.compile(step).search(out, position)
        assert found is not None, f"the demo never said /{step}/ after offset {position}:\n{out}"
        position = found.end()
    assert "WARNING" not in out, out
    assert "\nTimeline\n" in out
    assert Path("/proc/1/cgroup").read_text() == before
    # Its own sandbox and booted host are gone (the session's, if any, are not its).
    mine = set(re.findall(r"\b(k26(?:sbx|host)-\d+-[0-9a-f]+)\b", out))
    assert len(mine) == 2, mine
    left = [p.name for p in (*sandbox.leftovers(), *bootedhost.leftovers()) if p.name in mine]
    assert left == [], left
    print(out[out.index("\nTimeline\n") :])
