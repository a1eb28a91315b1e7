"""ExitTracker: exits seen once, who asked for a stop, and what a re-read finds.

The signal sequences are the ones systemd 252 sent in the sandbox for a real
``systemctl stop`` (the unit's Job published while it is still active) and for
a SIGKILL out of the blue (no job at all): see tests/integration/test_operator.py
for the same cases end to end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from supervisor.core.bus_events import PropertiesChanged, UnitSnapshot
from supervisor.core.exits import (
    SERVICE_IFACE,
    UNIT_IFACE,
    ActiveStateChanged,
    ExitObserved,
    ExitTracker,
    ForeignJobDone,
)

UNIT = "sglang-k26.service"
JOB = [47, "/org/freedesktop/systemd1/job/47"]
NO_JOB = [0, "/"]
EXIT_US = 1_796_133_278_974_030


def snap(**kw: Any) -> UnitSnapshot:
    base: dict[str, Any] = {
        "unit": UNIT,
        "load_state": "loaded",
        "active_state": "active",
        "sub_state": "running",
        "result": "success",
        "exec_main_code": 0,
        "exec_main_status": 0,
        "exec_main_pid": 4242,
        "main_pid": 4242,
        "n_restarts": 0,
        "control_group": "/system.slice/sglang-k26.service",
        "restart": "no",
        "standard_output": "journal",
        "standard_output_path": "",
        "fragment_path": "",
        "invocation_id": "aa" * 16,
        "active_enter": None,
        "active_exit": None,
        "inactive_enter": None,
        "inactive_exit": None,
        "exec_main_start": None,
        "exec_main_exit": None,
        "state_change": None,
    }
    base.update(kw)
    return UnitSnapshot(**base)


def unit_sig(active: str, sub: str, job: list[Any], at: float = 1.0) -> PropertiesChanged:
    return PropertiesChanged(
        UNIT, UNIT_IFACE, {"ActiveState": active, "SubState": sub, "Job": job}, at
    )


def service_sig(
    main_pid: int, exit_us: int, result: str, code: int, status: int, at: float = 1.0
) -> PropertiesChanged:
    return PropertiesChanged(
        UNIT,
        SERVICE_IFACE,
        {
            "MainPID": main_pid,
            "ExecMainPID": 4242,
            "ExecMainExitTimestamp": exit_us,
            "Result": result,
            "ExecMainCode": code,
            "ExecMainStatus": status,
        },
        at,
    )


def tracked() -> ExitTracker:
    tracker = ExitTracker()
    tracker.seed(snap())
    return tracker


def exits(events: list[Any]) -> list[ExitObserved]:
    return [e for e in events if isinstance(e, ExitObserved)]


def feed_all(tracker: ExitTracker, signals: list[PropertiesChanged]) -> list[Any]:
    out: list[Any] = []
    for signal in signals:
        out += tracker.feed(signal)
    return out


# The exact order systemd 252 sent for `systemctl stop` of an SGLang-like unit.
OPERATOR_STOP = [
    service_sig(4242, 0, "success", 0, 0),
    unit_sig("active", "running", JOB),
    unit_sig("deactivating", "stop-sigterm", JOB),
    service_sig(0, EXIT_US, "signal", 2, 9),
    unit_sig("deactivating", "final-sigkill", JOB),
    unit_sig("failed", "failed", JOB),
    unit_sig("failed", "failed", NO_JOB),
]
# And for a SIGKILL of the main process that nobody asked for.
DEATH = [
    service_sig(0, EXIT_US, "signal", 2, 9),
    unit_sig("deactivating", "stop-sigkill", NO_JOB),
    unit_sig("failed", "failed", NO_JOB),
]


def test_an_operator_stop_is_told_from_a_death_by_its_job() -> None:
    stop = exits(feed_all(tracked(), OPERATOR_STOP))
    assert len(stop) == 1 and stop[0].stop_by == "operator"
    assert (stop[0].result, stop[0].exec_main_status) == ("signal", 9)
    death = exits(feed_all(tracked(), DEATH))
    assert len(death) == 1 and death[0].stop_by is None


def test_the_supervisors_own_stop_is_its_own() -> None:
    tracker = tracked()
    tracker.expect_job(UNIT)  # before the D-Bus call, as UnitOps does
    out = feed_all(tracker, OPERATOR_STOP[:4])
    tracker.job_answered(UNIT)
    out += feed_all(tracker, OPERATOR_STOP[4:])
    assert [e.stop_by for e in exits(out)] == ["supervisor"]


def test_a_job_published_while_the_supervisor_waits_is_attributed_then_not_later() -> None:
    tracker = tracked()
    tracker.expect_job(UNIT)
    tracker.feed(unit_sig("active", "running", JOB))
    tracker.job_answered(UNIT)
    # Our job's answer came before the exit signal: the job is still known as ours.
    out = feed_all(tracker, OPERATOR_STOP[2:])
    assert [e.stop_by for e in exits(out)] == ["supervisor"]


@pytest.mark.parametrize(("stopping", "owner"), [("theirs", "operator"), ("ours", "supervisor")])
def test_a_job_seen_while_our_call_is_unanswered_is_ours_only_if_the_answer_names_it(
    stopping: str, owner: str
) -> None:
    """Found by the chaos soak: `systemctl stop` while the supervisor's StartUnit call
    was unanswered. systemd replaced our start job with the operator's stop job, and
    the stop job, seen first, was taken as ours; the supervisor then restarted a unit
    the operator had stopped. Our call's answer names our job: any other is not ours."""
    jobs = {
        "ours": [60, "/org/freedesktop/systemd1/job/60"],
        "theirs": [61, "/org/freedesktop/systemd1/job/61"],
    }
    tracker = tracked()
    tracker.expect_job(UNIT)
    out = feed_all(tracker, [unit_sig("active", "running", jobs[stopping])])
    tracker.job_answered(UNIT, jobs["ours"][1])
    out += feed_all(
        tracker,
        [
            unit_sig("deactivating", "stop-sigterm", jobs[stopping]),
            service_sig(0, EXIT_US, "signal", 2, 9),
            unit_sig("failed", "failed", NO_JOB),
        ],
    )
    assert [e.stop_by for e in exits(out)] == [owner]


def test_a_noop_job_on_an_active_unit_is_forgotten_when_it_goes() -> None:
    tracker = tracked()
    tracker.feed(unit_sig("active", "running", JOB))  # `systemctl start` of an active unit
    tracker.feed(unit_sig("active", "running", NO_JOB))
    assert [e.stop_by for e in exits(feed_all(tracker, DEATH))] == [None]


def test_a_restart_job_is_the_operators_and_the_new_run_starts_clean() -> None:
    tracker = tracked()
    restart = [
        unit_sig("active", "running", JOB),
        unit_sig("deactivating", "stop-sigterm", JOB),
        service_sig(0, EXIT_US, "signal", 2, 9),
        unit_sig("activating", "start", JOB),
        unit_sig("active", "running", JOB),
        unit_sig("active", "running", NO_JOB),
    ]
    out = feed_all(tracker, restart)
    assert [e.stop_by for e in exits(out)] == ["operator"]
    later = exits(feed_all(tracker, [service_sig(0, EXIT_US + 5, "signal", 2, 9)]))
    assert [e.stop_by for e in later] == [None]


def test_repeated_signals_report_one_exit_and_state_changes_once() -> None:
    tracker = tracked()
    out = feed_all(tracker, [s for s in DEATH for _ in range(3)])  # systemd repeats itself
    assert len(exits(out)) == 1
    changes = [e for e in out if isinstance(e, ActiveStateChanged)]
    assert [(c.old, c.new) for c in changes] == [
        ("active", "deactivating"),
        ("deactivating", "failed"),
    ]


def test_a_failure_without_a_process_is_an_exit_too() -> None:
    tracker = tracked()
    out = tracker.feed(PropertiesChanged(UNIT, SERVICE_IFACE, {"Result": "start-limit-hit"}, 1.0))
    assert [(e.result, e.exec_main_pid) for e in exits(out)] == [("start-limit-hit", 0)]


def test_seeding_makes_an_old_exit_old_news() -> None:
    tracker = ExitTracker()
    tracker.seed(snap(active_state="failed", exec_main_exit_us=EXIT_US, result="signal"))
    assert exits(tracker.feed(service_sig(0, EXIT_US, "signal", 2, 9))) == []


def test_reconcile_reports_an_exit_no_signal_told_of() -> None:
    tracker = tracked()
    before = tracker.signal_count(UNIT)
    found = tracker.reconcile(
        snap(
            active_state="failed",
            sub_state="failed",
            result="signal",
            exec_main_code=2,
            exec_main_status=9,
            main_pid=0,
            exec_main_exit_us=EXIT_US,
        ),
        5.0,
        signals_seen=before,
    )
    [exit_] = exits(found)
    assert (exit_.result, exit_.exec_main_status, exit_.observed_at) == ("signal", 9, 5.0)
    assert [(c.old, c.new) for c in found if isinstance(c, ActiveStateChanged)] == [
        ("active", "failed")
    ]
    # Once reported, it is not news again, from a signal or another re-read.
    assert exits(tracker.feed(service_sig(0, EXIT_US, "signal", 2, 9))) == []
    assert (
        tracker.reconcile(replace(snap(), active_state="failed", exec_main_exit_us=EXIT_US), 6.0)
        == []
    )


def test_reconcile_stands_back_while_signals_flow() -> None:
    tracker = tracked()
    before = tracker.signal_count(UNIT)
    feed_all(tracker, DEATH)  # arrived while the snapshot was being read
    stale = snap(active_state="active")  # read before the death
    assert tracker.reconcile(stale, 5.0, signals_seen=before) == []
    assert tracker.watch(UNIT).active_state == "failed"


def test_reconcile_never_reports_an_older_exit_than_the_last_seen() -> None:
    tracker = tracked()
    feed_all(tracker, DEATH)
    older = snap(active_state="failed", exec_main_exit_us=EXIT_US - 1_000_000)
    assert exits(tracker.reconcile(older, 5.0)) == []


def test_the_invocation_id_follows_the_runs() -> None:
    tracker = tracked()
    assert tracker.watch(UNIT).invocation_id == "aa" * 16
    tracker.feed(
        PropertiesChanged(UNIT, UNIT_IFACE, {"InvocationID": list(bytes.fromhex("bb" * 16))}, 1.0)
    )
    assert tracker.watch(UNIT).invocation_id == "bb" * 16


# systemd 252, `systemctl stop` of a server that hangs in its drain: at
# TimeoutStopSec it sets Result=timeout (the process still alive), then SIGKILLs.
STOP_TIMEOUT = [
    service_sig(4242, 0, "success", 0, 0),
    unit_sig("active", "running", JOB),
    unit_sig("deactivating", "stop-sigterm", JOB),
    service_sig(4242, 0, "timeout", 0, 0),
    unit_sig("deactivating", "stop-sigkill", JOB),
    service_sig(0, EXIT_US, "timeout", 2, 9),
    unit_sig("failed", "failed", JOB),
    unit_sig("failed", "failed", NO_JOB),
]


def test_a_stop_timeout_is_one_exit_when_the_process_is_gone() -> None:
    tracker = tracked()
    tracker.expect_job(UNIT)
    out = feed_all(tracker, STOP_TIMEOUT[:5])
    assert exits(out) == []  # Result=timeout while it lives: its exit is still to come
    out = feed_all(tracker, STOP_TIMEOUT[5:])
    (exit_,) = exits(out)
    assert (exit_.result, exit_.exec_main_pid, exit_.stop_by) == ("timeout", 4242, "supervisor")


def test_the_supervisors_quick_stop_is_its_own_though_the_job_was_answered_first() -> None:
    # A server that dies at once of SIGTERM: the stop job is done (JobRemoved, the
    # call returns) before the loop has read the signals that publish the job.
    tracker = tracked()
    tracker.expect_job(UNIT)
    tracker.job_answered(UNIT, JOB[1])
    out = feed_all(tracker, OPERATOR_STOP)
    assert [e.stop_by for e in exits(out)] == ["supervisor"]


def test_our_stop_answered_before_the_start_and_stop_signals_are_read_is_still_ours() -> None:
    """Seen live (the alerting test, on a loaded machine): a restart's start job and
    the stop the supervisor asked for right after it were both answered before the
    daemon read the signals that came with them. The late start signal began a new
    run, which used to forget who owned the stop job: the stop read as an operator's."""
    start_job = [51, "/org/freedesktop/systemd1/job/51"]
    stop_job = [52, "/org/freedesktop/systemd1/job/52"]
    tracker = ExitTracker()
    tracker.seed(snap(active_state="failed", sub_state="failed", main_pid=0))
    tracker.expect_job(UNIT)
    tracker.job_answered(UNIT, start_job[1])
    tracker.expect_job(UNIT)
    tracker.job_answered(UNIT, stop_job[1])
    assert tracker.watch(UNIT).own_jobs == 0
    late = [
        unit_sig("activating", "start", start_job),
        unit_sig("active", "running", NO_JOB),
        unit_sig("deactivating", "stop-sigterm", stop_job),
        service_sig(0, EXIT_US, "success", 2, 15),
        unit_sig("inactive", "dead", NO_JOB),
    ]
    assert [e.stop_by for e in exits(feed_all(tracker, late))] == ["supervisor"]


def test_a_foreign_job_that_ends_on_a_unit_that_is_down_is_reported() -> None:
    """`systemctl stop` of a unit between runs: no exit, only the job's end."""
    tracker = ExitTracker()
    tracker.seed(snap(active_state="failed", sub_state="failed", main_pid=0))
    stop = "/org/freedesktop/systemd1/job/70"
    assert tracker.job_removed(UNIT, stop, "done", 5.0) == ForeignJobDone(UNIT, stop, 5.0)
    assert tracker.job_removed(UNIT, stop, "canceled", 5.0) is None  # only a done job
    assert tracker.job_removed("other.service", stop, "done", 5.0) is None


def test_our_own_job_or_a_job_while_ours_is_unanswered_is_not_foreign() -> None:
    tracker = ExitTracker()
    tracker.seed(snap(active_state="inactive", sub_state="dead", main_pid=0))
    ours = "/org/freedesktop/systemd1/job/71"
    tracker.expect_job(UNIT)
    assert tracker.job_removed(UNIT, ours, "done", 1.0) is None  # the answer is still due
    tracker.job_answered(UNIT, ours)
    assert tracker.job_removed(UNIT, ours, "done", 1.0) is None


def test_a_foreign_job_on_a_unit_that_is_up_is_no_stop_between_runs() -> None:
    tracker = tracked()  # active
    assert tracker.job_removed(UNIT, "/org/freedesktop/systemd1/job/72", "done", 1.0) is None
