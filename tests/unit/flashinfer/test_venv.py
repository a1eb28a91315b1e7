"""The subprocess adapter: answers, unavailable interpreters, timeouts that end the group."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from supervisor.core.errors import InputError, UnavailableError
from supervisor.flashinfer import doctor, read_env_file, unit_environment, warm
from supervisor.flashinfer.venv import ServingEnv, ask, identity, run_script
from tests.waiting import wait_until


def test_identity_from_an_interpreter_without_flashinfer(tmp_path: Path) -> None:
    serving = ServingEnv(Path(sys.executable), "12.0", tmp_path)
    raw = asyncio.run(ask(serving, ["identity"], timeout_s=60))
    who = asyncio.run(identity(serving, timeout_s=60))
    assert who.flashinfer is None
    assert who.env["FLASHINFER_CUDA_ARCH_LIST"] == "12.0"
    assert who.env["TORCH_CUDA_ARCH_LIST"] == "12.0"
    # What a fingerprint stores is exactly what the script sent.
    assert who.recorded() == raw


def test_missing_interpreter_is_unavailable(tmp_path: Path) -> None:
    serving = ServingEnv(tmp_path / "nope" / "python", "12.0", tmp_path)
    with pytest.raises(UnavailableError, match="cannot run"):
        asyncio.run(ask(serving, ["identity"], timeout_s=10))


def test_bad_arch_is_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--arch"):
        ServingEnv(Path(sys.executable), "sm_120", tmp_path)


def test_timeout_ends_the_whole_process_group(tmp_path: Path) -> None:
    """A build's grandchildren (nvcc) must die with it."""
    fake = tmp_path / "python"
    pidfile = tmp_path / "child.pid"
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\necho started\nwait\n")
    fake.chmod(0o755)
    serving = ServingEnv(fake, "12.0", tmp_path)
    seen: list[str] = []
    with pytest.raises(TimeoutError):
        asyncio.run(run_script(serving, ["build"], timeout_s=3.0, on_line=seen.append))
    assert seen == ["started"]
    grandchild = int(pidfile.read_text())
    # The SIGKILL is sent; its delivery is the kernel's, a moment later on a busy host.
    wait_until(lambda: not running(grandchild), 10, f"the build's grandchild {grandchild} to die")


def test_a_silent_build_that_uses_the_cpu_is_busy_and_a_sleeping_one_is_not(
    tmp_path: Path,
) -> None:
    """One nvcc step can print nothing for minutes on a loaded host; it must still keep
    the start alive (EXTEND_TIMEOUT_USEC), while a hung build must not."""
    working = tmp_path / "working"
    # A grandchild burns the CPU, silently, as nvcc does under ninja.
    working.write_text("#!/bin/sh\nsh -c 'while :; do :; done' &\nsleep 2\nkill $!\necho done\n")
    hung = tmp_path / "hung"
    hung.write_text("#!/bin/sh\nsleep 2\necho done\n")
    for fake in (working, hung):
        fake.chmod(0o755)

    def beats(fake: Path) -> int:
        seen: list[int] = []
        serving = ServingEnv(fake, "12.0", tmp_path)
        run = asyncio.run(
            run_script(
                serving, ["build"], timeout_s=30, on_busy=lambda: seen.append(1),
                busy_every_s=0.25,
            )
        )  # fmt: skip
        assert run.returncode == 0 and run.tail == ["done"], run
        return len(seen)

    # About 8 quarter-seconds: nearly each one busy; the sleeper at most in the first
    # (its shell's own start-up may fall after the first look).
    assert beats(working) >= 5
    assert beats(hung) <= 1


def test_session_cpu_ticks_counts_the_session_and_nothing_else() -> None:
    import os

    from supervisor.flashinfer.venv import session_cpu_ticks

    mine = os.getsid(0)
    assert session_cpu_ticks(mine) > 0  # this test process's own session
    assert session_cpu_ticks(2**22 + 7) == 0  # no such session


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init whenever init gets to it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_doctor_unknown_without_flashinfer(tmp_path: Path) -> None:
    report = asyncio.run(doctor(Path(sys.executable), "12.0", tmp_path))
    assert report.status == "unknown"
    assert any("flashinfer is not installed" in p for p in report.problems)


def test_doctor_unknown_when_interpreter_missing(tmp_path: Path) -> None:
    report = asyncio.run(doctor(tmp_path / "python", "12.0", tmp_path))
    assert report.status == "unknown"
    assert report.exit_code == 3


def test_warm_reports_failure_instead_of_raising(tmp_path: Path) -> None:
    lines: list[str] = []
    result = asyncio.run(warm(tmp_path / "python", "12.0", tmp_path, progress=lines.append))
    assert not result.ok and result.exit_code == 69
    assert result.error is not None and "cannot run" in result.error
    assert lines and "warm-up failed" in lines[-1]


def test_env_file(tmp_path: Path) -> None:
    path = tmp_path / "build.env"
    path.write_text("# comment\nCUDA_HOME=/usr/local/cuda\nexport CPATH='/x y'\n\n")
    assert read_env_file(path) == {"CUDA_HOME": "/usr/local/cuda", "CPATH": "/x y"}
    path.write_text("not a pair\n")
    with pytest.raises(InputError, match="not KEY=VALUE"):
        read_env_file(path)


def test_unit_environment() -> None:
    assert unit_environment("12.0", Path("/var/cache/k26")) == {
        "FLASHINFER_WORKSPACE_BASE": "/var/cache/k26",
        "FLASHINFER_CUDA_ARCH_LIST": "12.0",
        "TORCH_CUDA_ARCH_LIST": "12.0",
    }


def test_the_childs_tvm_ffi_cache_is_the_workspaces_never_this_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing FlashInfer 0.7 with torch 2.8 builds tvm-ffi's addon; unpinned, that
    would land in the daemon's own ~/.cache/tvm-ffi."""
    monkeypatch.delenv("TVM_FFI_CACHE_DIR", raising=False)
    env = ServingEnv(Path(sys.executable), "12.0", tmp_path).environment()
    assert env["TVM_FFI_CACHE_DIR"] == str(tmp_path / ".cache" / "tvm-ffi")
    pinned = ServingEnv(Path(sys.executable), "12.0", tmp_path, {"TVM_FFI_CACHE_DIR": "/srv/t"})
    assert pinned.environment()["TVM_FFI_CACHE_DIR"] == "/srv/t"
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", "/srv/mine")
    assert (
        ServingEnv(Path(sys.executable), "12.0", tmp_path).environment()["TVM_FFI_CACHE_DIR"]
        == "/srv/mine"
    )


def test_a_debug_build_switch_is_part_of_the_identity_only_when_set(tmp_path: Path) -> None:
    plain = asyncio.run(identity(ServingEnv(Path(sys.executable), "12.0", tmp_path)))
    assert "FLASHINFER_JIT_VERBOSE" not in plain.env  # old fingerprints stay valid
    debug = ServingEnv(Path(sys.executable), "12.0", tmp_path, {"FLASHINFER_JIT_VERBOSE": "1"})
    assert asyncio.run(identity(debug)).env["FLASHINFER_JIT_VERBOSE"] == "1"
