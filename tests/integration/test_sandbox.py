"""The confined systemd: it starts, it is confined, and it always goes away."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from supervisor.devtools import cgroups, sandbox
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "supervisor"]


def _ours(name: str) -> list[Path]:
    return [p for p in sandbox.leftovers() if p.name == name]


def test_up_down_leaves_pid1_and_cgroups_as_they_were(tmp_path: Path) -> None:
    before = Path("/proc/1/cgroup").read_text()
    info = sandbox.up(tmp_path / "s")
    try:
        assert Path("/proc/1/cgroup").read_text() == before
        assert len(_ours(info.name)) == len(sandbox.HIERARCHIES)
        # The manager itself sits inside our subtree, in every hierarchy it uses.
        manager_cgroups = Path(f"/proc/{info.launcher_pid}/cgroup").read_text()
        for line in manager_cgroups.splitlines():
            hierarchy = line.split(":", 2)[1]
            if hierarchy in {"", "name=systemd", "cpu", "memory", "pids"}:
                assert f"/{info.name}/" in line, line
    finally:
        sandbox.down(tmp_path / "s")
    assert Path("/proc/1/cgroup").read_text() == before
    assert _ours(info.name) == []
    assert not (tmp_path / "s" / sandbox.STATE_FILE).exists()


def test_cli_prints_exports_and_units_run_confined(tmp_path: Path) -> None:
    d = tmp_path / "cli"
    up = subprocess.run([*CLI, "sandbox", "up", "--dir", str(d)], capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    info = sandbox.SandboxInfo.load(d)
    try:
        assert f"export XDG_RUNTIME_DIR='{d.resolve() / 'run'}'" in up.stdout
        assert "export DBUS_SESSION_BUS_ADDRESS='unix:path=" in up.stdout
        env = dict(os.environ, **info.env)
        (info.unit_dir / "sbx-sleep.service").write_text("[Service]\nExecStart=/bin/sleep 300\n")
        subprocess.run(["systemctl", "--user", "daemon-reload"], env=env, check=True)
        subprocess.run(["systemctl", "--user", "start", "sbx-sleep.service"], env=env, check=True)
        pid = subprocess.run(
            ["systemctl", "--user", "show", "-p", "MainPID", "--value", "sbx-sleep.service"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert int(pid) > 0
        cg = Path(f"/proc/{pid}/cgroup").read_text()
        assert f"/{info.name}/app.slice/sbx-sleep.service" in cg
        status = subprocess.run(
            [*CLI, "sandbox", "status", "--dir", str(d)], capture_output=True, text=True
        )
        assert json.loads(status.stdout)["alive"] is True
    finally:
        down = subprocess.run(
            [*CLI, "sandbox", "down", "--dir", str(d)], capture_output=True, text=True
        )
    assert down.returncode == 0, down.stderr
    assert _ours(info.name) == []
    # The unit's process died with the sandbox.
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


def test_teardown_runs_when_the_body_fails(tmp_path: Path) -> None:
    name = ""
    with pytest.raises(RuntimeError, match="boom"), sandbox.running(tmp_path / "f") as info:
        name = info.name
        raise RuntimeError("boom")
    assert name and _ours(name) == []


def test_teardown_runs_when_interrupted(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        from supervisor.devtools import sandbox
        with sandbox.running(Path({str(tmp_path / "i")!r})) as info:
            print(info.name, flush=True)
            signal.pause()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith(sandbox.NAME_PREFIX)
    assert _ours(name)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) != 0
    assert _ours(name) == []


def test_sweep_removes_a_sandbox_whose_owner_was_killed(tmp_path: Path) -> None:
    d = tmp_path / "orphan"
    info = sandbox.up(d)
    # The owner dies without teardown: kill the manager and leave the state behind.
    os.kill(info.launcher_pid, signal.SIGKILL)
    try:
        assert _ours(info.name)
        # Only this one: a blanket sweep would also kill the session's sandbox.
        removed = sandbox.sweep(force=True, only={info.name})
        assert info.name in removed
        assert _ours(info.name) == []
    finally:
        if _ours(info.name):
            sandbox.down(d)


@pytest.mark.parametrize("step", ["launch", "inner"])
def test_inner_steps_refuse_to_start_systemd_unconfined(tmp_path: Path, step: str) -> None:
    """Run the confinement steps outside a sandbox: both must refuse, not start systemd."""
    outer = ",".join(os.readlink(f"/proc/self/ns/{ns}") for ns in ("cgroup", "mnt"))
    args = ["--name", "k26sbx-does-not-exist", "--runtime", str(tmp_path)]
    if step == "inner":
        args += ["--outer-ns", outer]
    before = Path("/proc/1/cgroup").read_text()
    result = subprocess.run(
        [sys.executable, "-I", "-m", "supervisor.devtools.sandbox_inner", step, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 70
    assert "refusing" in result.stderr
    assert Path("/proc/1/cgroup").read_text() == before
    assert not Path("/run/systemd/system").exists()


def test_up_refuses_without_the_hybrid_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "HIERARCHIES", ("systemd", "no-such-hierarchy"))
    with pytest.raises(sandbox.SandboxError, match="no-such-hierarchy"):
        sandbox.up(tmp_path / "x")


def test_a_registry_sweep_removes_this_runs_sandboxes_and_no_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "registry"
    monkeypatch.setenv(sandbox.REGISTRY_ENV, str(registry))
    mine = sandbox.up(tmp_path / "mine")
    monkeypatch.delenv(sandbox.REGISTRY_ENV)
    other = sandbox.up(tmp_path / "other")  # another run's: not in our registry
    try:
        os.kill(mine.launcher_pid, signal.SIGKILL)  # this run was killed
        assert sandbox.registered(registry) == {mine.name}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "supervisor",
                "sandbox",
                "sweep",
                "--force",
                "--registry",
                str(registry),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert mine.name in done.stdout
        assert _ours(mine.name) == []
        assert _ours(other.name), "another run's sandbox was swept"
    finally:
        sandbox.down(tmp_path / "other")
        if _ours(mine.name):
            sandbox.down(tmp_path / "mine")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=str)
def test_the_demo_tears_its_sandbox_down_on_a_signal(
    tmp_path: Path, sig: signal.Signals, serving_07: Any
) -> None:
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "demo", "--dir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state = workdir / "sandbox" / sandbox.STATE_FILE
    try:
        wait_until(lambda: state.exists() or proc.poll() is not None, 60, "the demo's sandbox")
        assert proc.poll() is None, proc.communicate()[0]
        info = sandbox.SandboxInfo.load(workdir / "sandbox")
        wait_until(lambda: _ours(info.name), 30, "the sandbox's cgroups")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, out
    assert _ours(info.name) == [], out
    assert not cgroups.pid_alive(info.launcher_pid)
    assert not state.exists()
