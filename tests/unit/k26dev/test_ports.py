"""free_port never hands a port out twice: in one process, nor across the processes
that share a claims directory (the test session's xdist workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from k26dev import ports

PICK = "from k26dev.ports import free_port\nprint(*(free_port() for _ in range(150)))"


def test_one_process_never_gets_the_same_port_twice() -> None:
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)


def test_processes_sharing_a_claims_directory_never_get_the_same_port(tmp_path: Path) -> None:
    env = {**os.environ, ports.CLAIMS_ENV: str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", PICK], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    picks = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(len(p) == 150 for p in picks)
    assert not (picks[0] & picks[1] or picks[0] & picks[2] or picks[1] & picks[2])
    assert {int(f.name) for f in tmp_path.iterdir()} == picks[0] | picks[1] | picks[2]
