"""The production path on a booted host: `systemctl start k26-supervisor`, end to end.

systemd 252 as PID 1 of a container (``k26dev.bootedhost``), the
system bus, journald, logind and the real polkitd; the product installed by
the Debian package (``apt install``) as on a GPU server; the shipped, hardened units. The
tests share one host and run in any order: the cold FlashInfer build happens
once, in the ``booted_cold_start`` fixture that every test needing a warm cache
depends on, and each test starts from ``Product.reset``.

What the container cannot show: it has no /dev/kmsg and no v1 memory
controller (MemoryMax= is not enforced), so kernel OOM kills stay proven in the
user sandbox (test_exits.py, test_fault_matrix.py).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.measured import record
from tests.waiting import wait_until

from .booted import AR, EAGLE, QUICK, SUPERVISOR, WORKSPACE, Product, as_the_supervisor
from .conftest import ColdStart, files_owned_by_supervisor

pytestmark = [pytest.mark.integration, pytest.mark.flashinfer, pytest.mark.booted]


def as_supervisor_user(product: Product, *argv: str) -> tuple[int, str]:
    done = product.host.run("runuser", "-u", "k26-supervisor", "--", *argv, check=False)
    return done.returncode, (done.stderr + done.stdout).strip()


# --- polkit, for real -----------------------------------------------------------------


def test_polkit_lets_the_supervisor_user_drive_exactly_the_two_units(booted: Product) -> None:
    product = booted
    product.reset()
    h = product.host
    h.write(
        "/etc/systemd/system/k26-other.service",
        "[Service]\nType=exec\nExecStart=/bin/sleep 600\n",
    )
    h.systemctl("daemon-reload")
    for verb in ("start", "restart", "stop"):
        code, out = as_supervisor_user(product, "systemctl", verb, AR)
        assert code == 0, (verb, out)
    # A failed unit stays loaded: reset-failed on it must be refused, not "not loaded".
    h.systemctl("start", AR)
    h.systemctl("kill", "--signal=SIGKILL", AR)
    wait_until(lambda: h.show(AR, "ActiveState") == "failed", 30, f"{AR} to fail")
    refused = {
        "a third unit": ("systemctl", "start", "k26-other.service"),
        "reset-failed": ("systemctl", "reset-failed", AR),
        "a unit file change": ("systemctl", "enable", AR),
        "daemon-reload": ("systemctl", "daemon-reload"),
        "kill": ("systemctl", "kill", AR),
        "its own unit": ("systemctl", "restart", SUPERVISOR),
    }
    for what, argv in refused.items():
        code, out = as_supervisor_user(product, *argv)
        assert code != 0, what
        assert re.search(r"Access denied|Interactive authentication required", out), (what, out)
    # Anyone else is not the rule's business: polkit's default (admin auth) applies.
    done = h.run("runuser", "-u", "nobody", "--", "systemctl", "start", AR, check=False)
    assert done.returncode != 0 and "Interactive authentication required" in done.stderr
    assert h.show("k26-other.service", "ActiveState") == "inactive"
    assert h.show(AR, "ActiveState") == "failed"  # the refused reset-failed changed nothing
    h.systemctl("reset-failed", AR)
    # It was polkitd that answered, with the installed rule.
    assert h.systemctl("is-active", "polkit.service") == "active"
    assert h.path("/usr/share/polkit-1/rules.d/50-k26-supervisor.rules").is_file()
    h.run("rm", "-f", "/etc/systemd/system/k26-other.service")
    h.systemctl("daemon-reload")


# --- systemctl start returns only after READY=1 -------------------------------------------


def _supervisor_dropin(product: Product, text: str) -> None:
    product.host.write(f"/etc/systemd/system/{SUPERVISOR}.d/k26-test.conf", f"[Service]\n{text}\n")
    product.host.systemctl("daemon-reload")


def _no_supervisor_dropin(product: Product) -> None:
    product.host.run("rm", "-f", f"/etc/systemd/system/{SUPERVISOR}.d/k26-test.conf")
    product.host.systemctl("daemon-reload")


def test_a_wedged_warm_up_is_failed_by_systemd_and_starts_no_unit(booted: Product) -> None:
    product = booted
    product.reset()
    h = product.host
    # A serving interpreter that never answers: no progress, so no EXTEND_TIMEOUT_USEC.
    h.write("/usr/local/bin/k26-wedged-python", "#!/bin/sh\nexec sleep 3600\n", mode=0o755)
    product.configure(
        flashinfer=(
            '[flashinfer]\nenabled = true\npython = "/usr/local/bin/k26-wedged-python"\n'
            f'arch = "12.0"\nworkspace = "{WORKSPACE}"\n'
        ),
        startup_silence_s=5,
    )
    _supervisor_dropin(product, "TimeoutStartSec=10s")
    try:
        done, took = product.start_supervisor(timeout_s=120)
        assert done.returncode != 0
        assert h.show(SUPERVISOR, "Result") == "timeout"
        assert 9 <= took < 60, took
        for unit in (AR, EAGLE):
            assert h.show(unit, "ExecMainStartTimestampMonotonic") == "0", unit
    finally:
        _no_supervisor_dropin(product)
        product.configure()
        product.reset()


def test_start_returns_only_after_a_sampled_probe_kept_alive_through_a_cold_build(
    booted_cold_start: ColdStart, booted: Product
) -> None:
    """The session's cold start (conftest): TimeoutStartSec shorter than the cold nvcc
    build, so only EXTEND_TIMEOUT_USEC gets the start through."""
    start = booted_cold_start
    assert start.done.returncode == 0, (start.done.stderr, start.log[-3000:])
    assert start.took_s > start.timeout_start_s, (
        f"{start.took_s:.0f} s: the warm-up was not cold, or no extension was needed"
    )
    status = start.status
    assert status["ready"] is True
    eagle = booted.unit(status, EAGLE)
    assert eagle["state"] == "ready" and eagle["last_probe"]["ok"] is True
    assert status["warmup"]["state"] in ("built", "warm"), status["warmup"]
    log = start.log
    probe_ok = log.index("ready, sampled probe passed")
    assert log.index("READY=1: every unit passed a sampled generation") > probe_ok
    assert "building sampling" in log  # the real nvcc build, under the hardened unit
    assert re.search(r"Status: \"ready: .*=ready", start.systemctl_status), start.systemctl_status
    assert start.active_state == "active"


def test_the_hardened_daemon_wrote_only_the_shared_cache_and_its_own_dirs(
    booted_cold_start: ColdStart, booted: Product
) -> None:
    product = booted
    h = product.host
    assert booted_cold_start.active_state == "active", "the cold start did not come up"
    allowed = (
        "/var/cache/sglang-k26/flashinfer/",
        "/var/cache/k26-supervisor",
        "/run/k26-supervisor",
        "/var/lib/k26-supervisor",  # its StateDirectory= (learned shapes)
    )
    # What it wrote in its cold start (captured then: later tests may replace the
    # cache), and everything written as k26-supervisor since: all of it allowed.
    written = booted_cold_start.written_by_supervisor
    assert written, "the warm-up should have written the cache as k26-supervisor"
    assert any("/cached_ops/sampling/sampling.so" in p for p in written)
    stray = [
        p for p in {*written, *files_owned_by_supervisor(product)} if not p.startswith(allowed)
    ]
    assert stray == [], stray
    # What confined it, as systemd sees it.
    show = {
        prop: h.show(SUPERVISOR, prop)
        for prop in ("ProtectSystem", "DevicePolicy", "ProtectProc", "User", "NoNewPrivileges")
    }
    assert show == {
        "ProtectSystem": "strict",
        "DevicePolicy": "closed",
        "ProtectProc": "invisible",
        "User": "k26-supervisor",
        "NoNewPrivileges": "yes",
    }
    assert h.show(SUPERVISOR, "SystemCallFilter")  # the @system-service filter is on
    report = h.run("systemd-analyze", "security", SUPERVISOR, "--no-pager", check=False).stdout
    score = re.search(r"Overall exposure level for k26-supervisor\.service: ([\d.]+)", report)
    assert score is not None, report[-2000:]
    assert float(score.group(1)) <= 2.5, report[-2000:]
    record("booted host: systemd-analyze security k26-supervisor.service", score.group(1))


def test_a_start_that_cannot_succeed_fails_fast_and_says_why(booted: Product) -> None:
    """A serving venv without FlashInfer: the warm-up cannot run, so no unit can ever
    serve. `systemctl start` must fail within seconds, not wait out TimeoutStartSec
    (15 min), and `systemctl status` and `k26-supervisor status` must name the reason."""
    product = booted
    product.reset()
    h = product.host
    broken = "/opt/k26-broken-venv"  # a venv whose packages are gone
    h.run("/usr/bin/python3.11", "-m", "venv", "--without-pip", broken)
    product.configure(
        flashinfer=(
            f'[flashinfer]\nenabled = true\npython = "{broken}/bin/python"\narch = "12.0"\n'
            f'workspace = "{WORKSPACE}"\n'
        )
    )
    try:
        done, took = product.start_supervisor(timeout_s=300)
        record("booted host: systemctl start that cannot succeed, returned after s", f"{took:.1f}")
        assert done.returncode != 0, done.stdout
        assert took < 60, f"{took:.0f} s: the start waited instead of failing fast"
        assert h.show(SUPERVISOR, "ExecMainStatus") == "79"
        assert h.show(SUPERVISOR, "ActiveState") == "failed"
        assert h.show(SUPERVISOR, "NRestarts") == "0"  # RestartPreventExitStatus=79
        for unit in (AR, EAGLE):
            assert h.show(unit, "ExecMainStartTimestampMonotonic") == "0", unit  # never started
        shown = h.systemctl("status", SUPERVISOR, "--no-pager", "-n", "20", check=False)
        assert "start-up cannot succeed, no unit can serve" in shown, shown
        assert "No module named 'flashinfer'" in shown or "FlashInfer" in shown, shown
        cli = "/opt/k26-supervisor/venv/bin/k26-supervisor"
        status = h.run(cli, "status", check=False)
        assert status.returncode == 69, status.stderr
        assert "NOT RUNNING" in status.stdout and "with status 79" in status.stdout, status.stdout
        assert "start-up cannot succeed" in status.stdout
        for unit in (AR, EAGLE):
            assert re.search(rf"^{re.escape(unit)}\s+\S+\s+failed\s+no", status.stdout, re.M), (
                status.stdout
            )
        assert "warm-up" in status.stdout, status.stdout
    finally:
        product.configure()
        product.reset()
        h.run("rm", "-rf", broken)


# --- exit evidence from journald, as shipped ----------------------------------------


AR_ONLY = f'[[units]]\nname = "{AR}"\nrole = "autoregressive"\nurl = "http://127.0.0.1:30000"\n'


@pytest.mark.parametrize(
    ("fault", "cause", "line"),
    [
        ("--fail cuda-oom --load-seconds 0.5", "gpu-oom", "CUDA out of memory"),
        (
            "--fail sampling-arch --flashinfer-cache /nonexistent",
            "flashinfer-arch",
            "FlashInfer requires GPUs with sm75 or higher",
        ),
    ],
    ids=["gpu-oom", "flashinfer-arch"],
)
def test_exits_are_explained_from_the_journal(
    booted_cold_start: ColdStart, booted: Product, fault: str, cause: str, line: str
) -> None:
    product = booted
    product.reset()
    h = product.host
    product.configure(units=AR_ONLY)
    product.standin_args(AR, f"{QUICK} {fault}")
    try:
        h.systemctl("start", "--no-block", SUPERVISOR)
        status = product.wait_status(
            lambda s: (product.unit(s, AR)["last_exit"] or {}).get("cause") == cause,
            timeout_s=180,
            what=f"{AR} to exit with cause {cause}",
        )
        exit_ = product.unit(status, AR)["last_exit"]
        assert any(line in e for e in exit_["evidence"]), exit_
        assert exit_["signal"] == 9  # SGLang's own kill_process_tree
        # The unit logs to the journal only: the evidence came from there.
        assert h.show(AR, "StandardOutput") == "journal"
        waits = [float(m) for m in re.findall(r"journal caught up in ([\d.]+) s", product.log())]
        assert waits, "the supervisor did not read the journal"
        caught_up = ", ".join(f"{w:.3f}" for w in waits)
        record(f"booted host: journal catch-up before the {cause} verdict, s", caught_up)
    finally:
        product.standin_args(AR)
        product.configure()
        product.reset()


def test_explain_reads_a_dead_units_journal(booted: Product) -> None:
    """`k26-supervisor explain UNIT` after the fact, no daemon running: systemd's record,
    the unit's journal (the shipped units log nowhere else), the daemon's classifier."""
    product = booted
    product.reset()
    h = product.host
    product.standin_args(AR, f"{QUICK} --fail cuda-oom --load-seconds 0.5")
    try:
        h.systemctl("start", "--no-block", AR)  # an operator's start: no supervisor runs
        wait_until(lambda: h.show(AR, "ActiveState") == "failed", 60, f"{AR} to die")
        cli = "/opt/k26-supervisor/venv/bin/k26-supervisor"
        done = h.run(cli, "explain", AR, "--bus", "system", "--json", check=False)
        assert done.returncode == 0, done.stderr
        verdict = json.loads(done.stdout)
        assert verdict["cause"] == "gpu-oom", verdict
        assert verdict["source"] == "journal (system)", verdict
        assert verdict["signal"] == 9 and verdict["main_pid"] == int(h.show(AR, "ExecMainPID"))
        assert any("CUDA out of memory" in e for e in verdict["evidence"]), verdict
        text = h.run(cli, "explain", AR, "--bus", "system", check=False)
        assert text.returncode == 0 and "gpu-oom" in text.stdout, text.stdout + text.stderr
    finally:
        product.standin_args(AR)
        product.reset()


# --- the operator -----------------------------------------------------------------------


def test_an_operators_stop_holds_across_supervisor_restarts_and_a_ready_unit_is_adopted(
    booted_cold_start: ColdStart, booted: Product
) -> None:
    product = booted
    product.reset()
    h = product.host
    product.configure(units=AR_ONLY)
    try:
        done, _ = product.start_supervisor(timeout_s=300)
        assert done.returncode == 0, product.log()[-2000:]
        # An operator's stop of a real-SGLang-shaped unit: drain, then its own SIGKILL.
        h.systemctl("stop", AR)
        assert (h.show(AR, "Result"), h.show(AR, "ExecMainStatus")) == ("signal", "9")
        held = product.wait_status(lambda s: product.unit(s, AR)["held_by_operator"] is True)
        assert product.unit(held, AR)["last_exit"]["cause"] == "stopped"
        h.systemctl("restart", SUPERVISOR)
        status = product.wait_status(lambda s: product.unit(s, AR)["held_by_operator"] is True)
        assert product.unit(status, AR)["state"] == "stopped"
        assert h.show(AR, "ActiveState") == "failed"  # still down after the restart
        # The operator starts it: supervised again.
        h.systemctl("start", AR)
        product.wait_status(lambda s: product.unit(s, AR)["state"] == "ready")
        pid = h.show(AR, "MainPID")
        # Restart and stop of the supervisor leave a ready unit alone...
        h.systemctl("restart", SUPERVISOR)
        adopted = product.wait_status(
            lambda s: product.unit(s, AR)["state"] == "ready" and s["ready"] is True
        )
        assert h.show(AR, "MainPID") == pid and product.unit(adopted, AR)["restarts"] == 0
        assert product.unit(adopted, AR)["last_probe"]["ok"] is True  # ...adopted by a probe
        h.systemctl("stop", SUPERVISOR)
        assert h.show(AR, "ActiveState") == "active" and h.show(AR, "MainPID") == pid
    finally:
        product.configure()
        product.reset()


def test_a_unit_polkit_does_not_let_it_drive_is_reported_and_the_rest_keeps_serving(
    booted: Product,
) -> None:
    product = booted
    product.reset()
    h = product.host
    other = "k26-other.service"
    h.write(
        f"/etc/systemd/system/{other}",
        "[Service]\nType=exec\nRestart=no\nExecStart=/bin/sleep 600\n",
    )
    h.systemctl("daemon-reload")
    units = (
        AR_ONLY
        + f'\n[[units]]\nname = "{other}"\nrole = "autoregressive"\nurl = "http://127.0.0.1:30999"\n'
    )
    product.configure(units=units, flashinfer="[flashinfer]\nenabled = false\n")
    try:
        h.systemctl("start", "--no-block", SUPERVISOR)
        status = product.wait_status(
            lambda s: product.unit(s, other)["state"] == "failed",
            what=f"{other} to be failed on polkit's refusal",
        )
        reason = product.unit(status, other)["reason"]
        assert "refused by systemd" in reason and "Permission denied" in reason, reason
        assert "deploy/polkit" in reason and product.unit(status, other)["restarts"] == 0
        product.wait_status(lambda s: product.unit(s, AR)["state"] == "ready")
        assert h.show(SUPERVISOR, "ActiveState") in ("active", "activating")
        assert h.show(other, "ActiveState") == "inactive"
    finally:
        h.run("rm", "-f", f"/etc/systemd/system/{other}")
        h.systemctl("daemon-reload")
        product.configure()
        product.reset()


# --- locks and the cache as deployed ---------------------------------------------------


def test_a_lock_a_live_sglang_process_holds_is_never_taken_and_a_stale_one_is(
    booted_cold_start: ColdStart, booted: Product
) -> None:
    product = booted
    product.reset()
    h = product.host
    lock = f"{WORKSPACE}/.cache/flashinfer/0.7.4/120f/cached_ops/tmp/sampling.lock"
    fi = [
        "--python", "/opt/sglang/venv/bin/python", "--arch", "12.0", "--workspace", WORKSPACE,
        "--env-file", "/etc/k26-supervisor/build.env",
    ]  # fmt: skip
    cli = "/opt/k26-supervisor/venv/bin/k26-supervisor"
    holder = (
        "import fcntl, os, signal; "
        f"os.makedirs(os.path.dirname({lock!r}), exist_ok=True); "
        f"fd = os.open({lock!r}, os.O_RDWR | os.O_CREAT, 0o660); "
        "fcntl.flock(fd, fcntl.LOCK_EX); "
        "open('/tmp/k26-lockholder.held', 'w').write(str(os.getpid())); "
        "signal.pause()"
    )
    # The cache warm and vouched for first, whatever ran before: a stale lock beside
    # vouched modules is litter, not a half-built cache, and the verdicts below say so.
    ready = as_the_supervisor(product, cli, "flashinfer", "warm", *fi, timeout_s=900)
    assert ready.returncode == 0, ready.stderr + ready.stdout
    h.run(
        "systemd-run", "--unit=k26-lockholder", "-p", "User=sglang-k26", "-p", "Group=sglang-k26",
        "-p", "UMask=0007", "/opt/sglang/venv/bin/python", "-c", holder,
    )  # fmt: skip
    try:
        try:
            wait_until(
                lambda: h.path("/tmp/k26-lockholder.held").exists(), 30, "the holder's flock"
            )
        except AssertionError as exc:
            why = h.run("journalctl", "-u", "k26-lockholder", "--no-pager", check=False).stdout
            raise AssertionError(f"{exc}\n{why[-3000:]}") from None
        holder_pid = int(h.path("/tmp/k26-lockholder.held").read_text())
        # As the daemon runs: user k26-supervisor, ProtectProc=invisible (it cannot see
        # sglang-k26's processes in /proc), the whole sandbox.
        doctor = as_the_supervisor(product, cli, "flashinfer", "doctor", *fi, "--json")
        report = json.loads(doctor.stdout)
        [seen] = [lk for lk in report["locks"] if lk["path"] == lock]
        assert seen["state"] == "held", seen
        assert holder_pid in seen["holders"] or "cannot see" in seen["detail"], seen
        warm = as_the_supervisor(product, cli, "flashinfer", "warm", *fi)
        assert warm.returncode != 0, warm.stdout
        assert "a live build holds" in warm.stderr + warm.stdout, warm.stderr
        assert h.path(lock).exists() and h.systemctl("is-active", "k26-lockholder") == "active"
        assert doctor.returncode != 0  # a live build: not warm while it runs
        # The holder dies: its lock file stays behind, unheld. Beside vouched modules
        # that is no problem for doctor, and warm takes it away without a build.
        h.systemctl("stop", "k26-lockholder")
        doctor = as_the_supervisor(product, cli, "flashinfer", "doctor", *fi, "--json")
        stale_report = json.loads(doctor.stdout)
        [seen] = [lk for lk in stale_report["locks"] if lk["path"] == lock]
        assert seen["state"] == "stale", seen
        assert doctor.returncode == 0 and stale_report["status"] == "warm", stale_report
        warm = as_the_supervisor(product, cli, "flashinfer", "warm", *fi)
        assert warm.returncode == 0, warm.stderr + warm.stdout
        assert f"removed stale lock {lock}" in warm.stderr + warm.stdout, warm.stderr
        assert "building" not in warm.stderr + warm.stdout, warm.stderr
        assert not h.path(lock).exists()
        final = as_the_supervisor(product, cli, "flashinfer", "doctor", *fi)
        assert final.returncode == 0, final.stdout  # warm and valid, no lock left
    finally:
        h.systemctl("stop", "k26-lockholder", check=False)
        h.run("rm", "-f", "/tmp/k26-lockholder.held")
