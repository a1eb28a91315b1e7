"""The confined systemd: it starts, it is confined, and it always goes away."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k26dev import bootedhost, cgroups, sandbox
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _signals_at_their_defaults() -> Iterator[None]:
    """The children these tests signal get SIGINT and SIGHUP as a terminal would give
    them. An ignored signal is inherited across exec, and a suite started in the
    background (`nohup ... &`: both ignored) would otherwise test nothing but that."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, not ours to put back
                signal.signal(sig, handler)


CLI = [sys.executable, "-m", "k26dev"]  # k26-dev: the development tools


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
        import time
        from pathlib import Path
        from k26dev import sandbox
        with sandbox.running(Path({str(tmp_path / "i")!r})) as info:
            print(info.name, flush=True)
            # Not signal.pause(): a SIGINT that lands between the print and the
            # pause would leave it waiting forever. A short sleep wakes to raise.
            while True:
                time.sleep(0.2)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    name = ""
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith(sandbox.NAME_PREFIX)
        assert _ours(name)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) != 0
        assert _ours(name) == []
    finally:
        if proc.poll() is None:  # it did not tear down in time: end it, then its sandbox
            proc.kill()
            proc.wait()
        if name.startswith(sandbox.NAME_PREFIX) and _ours(name):
            sandbox.sweep(force=True, only={name})


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


@pytest.mark.parametrize("layout", ["hybrid", "unified"])
@pytest.mark.parametrize("step", ["launch", "inner"])
def test_inner_steps_refuse_to_start_systemd_unconfined(
    tmp_path: Path, step: str, layout: str
) -> None:
    """Run the confinement steps outside a sandbox: both must refuse, not start systemd."""
    outer = ",".join(os.readlink(f"/proc/self/ns/{ns}") for ns in ("cgroup", "mnt"))
    args = ["--name", "k26sbx-does-not-exist", "--runtime", str(tmp_path), "--layout", layout]
    if step == "inner":
        args += ["--outer-ns", outer]
    before = Path("/proc/1/cgroup").read_text()
    result = subprocess.run(
        [sys.executable, "-I", str(sandbox.INNER_SCRIPT), step, *args],
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


def _kit_from_this_machine(kit: Path) -> None:
    """The layout of the GPU kit (bench/gpu/KIT.md), made of this machine's own
    binaries and unit files, less Debian's dbus units (the kit has none)."""
    (kit / "bin").mkdir(parents=True)
    (kit / "share" / "dbus-1").mkdir(parents=True)
    (kit / "bin" / "systemd").symlink_to("/usr/lib/systemd/systemd")
    (kit / "bin" / "dbus-daemon").symlink_to("/usr/bin/dbus-daemon")
    (kit / "share" / "dbus-1" / "session.conf").symlink_to("/usr/share/dbus-1/session.conf")
    units = kit / "units"
    units.mkdir()
    for unit in (
        "default.target",
        "basic.target",
        "sockets.target",
        "paths.target",
        "timers.target",
        "shutdown.target",
        "exit.target",
        "systemd-exit.service",
        "app.slice",
        "session.slice",
        "background.slice",
    ):
        source = Path("/usr/lib/systemd/user") / unit
        if source.exists():
            (units / unit).write_bytes(source.read_bytes())


UNIFIED_BODY = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
from k26dev import sandbox
out = {"layout": sandbox.layout()}
d = Path(sys.argv[1])
with sandbox.running(d) as info:
    env = dict(os.environ, **info.env)
    out["cgroups"] = info.cgroups
    unit = info.unit_dir / "sbx-sleep.service"
    unit.write_text("[Service]\\nExecStart=/bin/sleep 300\\n")
    run = lambda *a: subprocess.run(["systemctl", "--user", *a], env=env, check=True,
                                    capture_output=True, text=True).stdout.strip()
    run("daemon-reload")
    run("start", "sbx-sleep.service")
    pid = int(run("show", "-p", "MainPID", "--value", "sbx-sleep.service"))
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    out["kernel_cgroup"] = next(line for line in lines if line.startswith("0::"))
    out["bus_unit_path"] = run("show", "-p", "FragmentPath", "--value", "dbus.service")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while run("show", "-p", "Result", "--value", "sbx-sleep.service") != "signal":
        assert time.monotonic() < deadline, "no Result=signal"
        subprocess.run(["systemctl", "--user", "is-failed", "-q", "sbx-sleep.service"], env=env)
    out["status"] = run("show", "-p", "ExecMainStatus", "--value", "sbx-sleep.service")
out["left"] = [str(p) for p in sandbox.leftovers() if p.name == Path(out["cgroups"][0]).name]
print(json.dumps(out))
"""


def test_the_unified_layout_with_a_kit_as_on_the_gpu_host(tmp_path: Path) -> None:
    """The GPU host's shape, emulated: a private mount namespace in which
    /sys/fs/cgroup is this machine's real cgroup2 hierarchy and nothing else, and
    systemd and dbus come from a kit folder. The sandbox must detect the layout, put
    its subtree at that hierarchy's root, run the kit's bus and leave nothing behind."""
    kit = tmp_path / "kit"
    _kit_from_this_machine(kit)
    body = tmp_path / "body.py"
    body.write_text(UNIFIED_BODY)
    before = Path("/proc/1/cgroup").read_text()
    script = (
        "umount -l /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup && "
        f'exec "$0" {body} {tmp_path / "s"}'
    )
    result = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=dict(os.environ, K26_SYSTEMD_KIT=str(kit)),
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    name = Path(out["cgroups"][0]).name
    assert out["layout"] == "unified"
    assert out["cgroups"] == [f"/sys/fs/cgroup/{name}"]
    assert out["kernel_cgroup"] == f"0::/{name}/app.slice/sbx-sleep.service"
    assert out["bus_unit_path"] == str(tmp_path / "s" / "run" / "systemd" / "user" / "dbus.service")
    assert out["status"] == "9"
    assert out["left"] == []
    assert Path("/proc/1/cgroup").read_text() == before
    assert not Path(f"/sys/fs/cgroup/unified/{name}").exists()


def test_an_incomplete_kit_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kit = tmp_path / "kit"
    _kit_from_this_machine(kit)
    (kit / "units" / "default.target").unlink()
    monkeypatch.setenv("K26_SYSTEMD_KIT", str(kit))
    with pytest.raises(sandbox.SandboxError, match=r"units/default.target is missing"):
        sandbox.up(tmp_path / "x")
    assert not (tmp_path / "x" / sandbox.STATE_FILE).exists()


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
                "k26dev",
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


def _launcher_recorded(directory: Path) -> bool:
    """The state file names the launcher: ``up`` writes it first with PID 0."""
    if not (directory / sandbox.STATE_FILE).exists():
        return False
    return sandbox.SandboxInfo.load(directory).launcher_pid > 0


# ``sandbox up`` returns within a second or two, too soon to aim a signal at. The
# harness runs the real command with one step held until a signal ends it: right
# after the cgroups are made (no launcher yet), or once the manager is up. (The
# booted host's own signal test aims at ``up --boot`` once booted, below.)
_HELD_UP = textwrap.dedent(
    """\
    import sys, threading
    from k26dev import cgroups, cli, sandbox

    step_name = sys.argv[1]
    calls = []

    def held(real, after, on_call=1):
        def step(*args, **kwargs):
            calls.append(1)
            if len(calls) != on_call:
                return real(*args, **kwargs)
            if after:
                result = real(*args, **kwargs)
            print("held:", step_name, flush=True)
            threading.Event().wait()  # until the signal's exception ends it
            return result if after else real(*args, **kwargs)
        return step

    if step_name == "cgroups-made":
        cgroups.launch = held(cgroups.launch, after=False)
    elif step_name == "manager-up":
        sandbox._wait_running = held(sandbox._wait_running, after=True)
    else:  # "up": checking PID 1's cgroups once it runs, the last step before it is handed over
        cgroups.read_pid1_cgroup = held(cgroups.read_pid1_cgroup, after=True, on_call=2)
    sys.exit(cli.main(["sandbox", "up", "--dir", *sys.argv[2:]]))
    """
)


@contextlib.contextmanager
def _held_up(step: str, directory: Path, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """``sandbox up`` in the harness, once it says it is held at ``step``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD_UP, step, str(directory), *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"held: {step}\n", line + proc.communicate(timeout=30)[0]
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _end_with(proc: subprocess.Popen[str], sig: signal.Signals) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, out
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=str)
@pytest.mark.parametrize("step", ["cgroups-made", "manager-up", "up"])
def test_a_signal_during_sandbox_up_tears_down_what_it_made(
    tmp_path: Path, step: str, sig: signal.Signals
) -> None:
    directory = tmp_path / "up"
    with _held_up(step, directory) as proc:
        info = sandbox.SandboxInfo.load(directory)
        assert _ours(info.name), "the cgroups were not made"
        if step != "cgroups-made":
            assert cgroups.pid_alive(info.launcher_pid)
        else:
            assert info.launcher_pid == 0
        out = _end_with(proc, sig)
    assert _ours(info.name) == [], out
    assert not cgroups.pid_alive(info.launcher_pid)
    assert not (directory / sandbox.STATE_FILE).exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=str)
def test_the_demo_tears_its_sandbox_down_on_a_signal(
    tmp_path: Path, sig: signal.Signals, serving_07: Any
) -> None:
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "k26dev", "demo", "--dir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: _launcher_recorded(workdir / "sandbox") or proc.poll() is not None,
            60,
            "the demo's sandbox",
        )
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
    assert not (workdir / "sandbox" / sandbox.STATE_FILE).exists()


# --- the booted host's one command ---------------------------------------------------


def _hosts(name: str) -> list[Path]:
    return [p for p in bootedhost.leftovers() if p.name == name]


@pytest.mark.booted
def test_sandbox_up_boot_gives_a_shell_in_a_booted_host_and_tears_it_down(
    tmp_path: Path,
) -> None:
    before = Path("/proc/1/cgroup").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "k26dev", "sandbox", "up", "--boot", "--dir", str(tmp_path)],
        input="systemctl is-system-running --wait\nbusctl --system status org.freedesktop.systemd1 "
        "| grep -c ^PID=1\ncat /proc/1/comm\nexit 7\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout.split() == ["running", "1", "systemd"], done.stdout
    name = re.search(r"booted host (k26host-\S+) up", done.stderr)
    assert name is not None, done.stderr
    assert _hosts(name.group(1)) == []
    assert Path("/proc/1/cgroup").read_text() == before
    assert not Path("/run/systemd/nspawn").exists()


@pytest.mark.booted
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=str)
def test_a_signal_tears_the_booted_host_down(tmp_path: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "k26dev", "sandbox", "up", "--boot", "--dir", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        state = tmp_path / bootedhost.STATE_FILE
        wait_until(
            lambda: (
                (state.exists() and bootedhost.HostInfo.load(tmp_path).boot_s > 0)
                or proc.poll() is not None
            ),
            60,
            "the booted host",
        )
        assert proc.poll() is None, proc.communicate()
        info = bootedhost.HostInfo.load(tmp_path)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert _hosts(info.name) == [] and not cgroups.pid_alive(info.launcher_pid)
    assert not state.exists()


@pytest.mark.booted
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=str)
def test_a_signal_before_the_boot_tears_down_the_cgroups_made(
    tmp_path: Path, sig: signal.Signals
) -> None:
    with _held_up("cgroups-made", tmp_path, "--boot") as proc:
        info = bootedhost.HostInfo.load(tmp_path)
        assert _hosts(info.name) and info.launcher_pid == 0
        out = _end_with(proc, sig)
    assert _hosts(info.name) == [], out
    assert not (tmp_path / bootedhost.STATE_FILE).exists()


@pytest.mark.booted
def test_a_signal_between_the_boot_and_the_shell_tears_the_host_down(tmp_path: Path) -> None:
    # The window a random signal once hit: the host is up (its state says so) and
    # the shell has not started yet.
    with _held_up("up", tmp_path, "--boot") as proc:
        info = bootedhost.HostInfo.load(tmp_path)
        assert info.boot_s > 0 and cgroups.pid_alive(info.launcher_pid)
        out = _end_with(proc, signal.SIGHUP)
    assert _hosts(info.name) == [] and not cgroups.pid_alive(info.launcher_pid), out
    assert not (tmp_path / bootedhost.STATE_FILE).exists()
