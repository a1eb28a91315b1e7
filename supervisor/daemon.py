"""``k26-supervisor run``: the wiring. Pure decisions live in ``core``.

The daemon owns one event loop and never blocks it: D-Bus goes through
``SystemdBus`` (its own thread for calls), HTTP through httpx/asyncio, the
serving venv through asyncio subprocesses, files through ``to_thread``.

Lifecycle (after uvicorn's): ``run`` → ``startup`` (bus, kernel log, HTTP,
rediscover every unit's real state, operator holds included) → ``main_loop``
(bus events, the machines' own events, signals and the periodic re-read, one at
a time) → ``shutdown`` (close, never stop units, save the last /status). Signal
handlers only record the signal; the loop acts on it. A start-up in which every
unit fails for good ends the loop: the start fails fast (exit 79), with the reason
in STATUS=, the log and the saved /status, instead of waiting out TimeoutStartSec. Every action a machine asks for runs through
``UnitOps``, which always answers with an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor import __version__
from supervisor.adapters import sampling_env, unit_env
from supervisor.adapters.bus import Bus
from supervisor.adapters.config_file import load_config
from supervisor.adapters.evidence import KernelLog
from supervisor.adapters.exit_watch import ExitWatch, ExplainedExit, JournalReader
from supervisor.adapters.http import StatusServer
from supervisor.adapters.jit_watch import JitWatches
from supervisor.adapters.learned_shapes import (
    LearnedStore,
    Learner,
    state_dir,
    status_json,
)
from supervisor.adapters.metrics import build_registry
from supervisor.adapters.notify import Notifier, watchdog_interval_s
from supervisor.adapters.progress import ProgressWatch
from supervisor.adapters.startup_output import recent_output, run_output
from supervisor.adapters.state_file import OperatorHolds, save_last_status, state_path
from supervisor.adapters.systemd_bus import SystemdBus
from supervisor.adapters.unit_ops import UnitOps
from supervisor.adapters.warmup import Warmup, unit_cache_locations
from supervisor.core import jit_caches, startup_log
from supervisor.core.bus_events import UnitSnapshot
from supervisor.core.classify import gpus_own_fault
from supervisor.core.config import (
    Config,
    pair_policy,
    reload_refusals,
    unit_policy,
    unit_specs,
)
from supervisor.core.errors import ConfigError, SupervisorError
from supervisor.core.events import (
    Action,
    CancelOp,
    CancelTimer,
    CheckGate,
    Entered,
    Event,
    GpuFaultSeen,
    IllegalEvent,
    ManagementRefused,
    NotifyStatus,
    OperatorReset,
    OperatorStopSeen,
    ProgressStalled,
    RunWarmup,
    SampledProbe,
    SamplingBackend,
    ScheduleTimer,
    Severity,
    StartUnit,
    StopUnit,
    TimerFired,
    UnitActive,
    UnitExited,
    UnitState,
    UnitStoppedByOperator,
    UnitStoppedBySupervisor,
    WaitHealthy,
)
from supervisor.core.exits import ActiveStateChanged, ForeignJobDone
from supervisor.core.jit_caches import JitCache
from supervisor.core.learned_shapes import LearnedShape, parse_records
from supervisor.core.policy import (
    Command,
    Observed,
    RetryPreferred,
    StartupVerdict,
    Supervisor,
    SwitchToFallback,
    SwitchToPreferred,
)
from supervisor.core.status import ExitInfo, StatusBoard, iso8601, phase_label, utc_now
from supervisor.core.timeline import StartTimeline, Timelines
from supervisor.fleet import accepted

log = logging.getLogger("k26.daemon")
_ASYNC_ACTIONS = (RunWarmup, CheckGate, StartUnit, StopUnit, WaitHealthy, SampledProbe)
_RESYNC = "resync"  # a queue item of the loop's own: the periodic re-read is due
# Start-up cannot succeed: every unit failed for good before READY=1. Outside the
# sysexits range on purpose (69 is a bus that may come back), and listed in the unit's
# RestartPreventExitStatus=: restarting the supervisor heals nothing.
EXIT_CANNOT_START = 79
# How long the JIT watch of a ready unit waits for the serving venv's cache-roots scan.
ROOTS_WAIT_S = 60.0


class Daemon:
    def __init__(
        self, config: Config, config_path: Path, *, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = notifier or Notifier.from_env()
        self.bus: Bus = SystemdBus(config.supervisor.bus)
        self.kernel_log = KernelLog()
        self.units = {u.name: u for u in config.units}
        user_bus = config.supervisor.bus == "user"
        self.exits = ExitWatch(
            self.bus, self.units, kernel_log=self.kernel_log, journal=JournalReader(user=user_bus)
        )
        self.holds = OperatorHolds(state_path(config.supervisor.bus))
        self.board = StatusBoard(version=__version__, config_path=str(config_path))
        self.registry = build_registry(self.board)
        self.http = StatusServer(config.supervisor.listen, self._status_json, self.registry)
        state = state_dir(config.supervisor.state_dir, config.supervisor.bus)
        self.warmup = Warmup(
            config.flashinfer,
            self.board,
            on_progress=self._extend_timeout,
            # Rollback protection's record: the state directory, not the workspace
            # the units' group can write (fleet/accepted.py).
            accepted_record=accepted.record_path(state),
            # A registry pull fills the caches where the units keep them.
            cache_locations=lambda: unit_cache_locations(self.bus.snapshot, list(self.units)),
            learned_shapes=self._pulled_learned,
        )
        self.jit = JitWatches(self._on_jit_artifact)
        self.learned = LearnedStore(state)
        self.learner = Learner(self.learned, self._recent_output, self._on_learned)
        self._snapshots: dict[str, UnitSnapshot] = {}  # of each watched unit, at READY
        self._jit_roots: dict[str, dict[JitCache, Path]] = {}
        self.timelines = Timelines()
        self._cache_warned: set[str] = set()
        self.ops = UnitOps(
            config,
            self.bus,
            self.board,
            self.warmup,
            self.exits.tracker,
            on_progress=self._extend_timeout,
            learned=self.learned.for_unit,
            cache_roots=self._cache_roots,
        )
        self.policy = Supervisor(unit_specs(config), unit_policy(config), pair_policy(config))
        self._queue: asyncio.Queue[tuple[str, Event | str]] = asyncio.Queue()
        self._ops: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._ready_sent = False
        self._degraded = False
        # Set when start-up cannot succeed: the loop ends and run() exits with it.
        self._cannot_start: str | None = None
        self._stop = asyncio.Event()
        self._last_summary = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        # The forward-progress watch of each ready unit (adapters/progress.py).
        self._progress: dict[str, tuple[ProgressWatch, asyncio.Task[None]]] = {}
        for unit in config.units:
            self.board.add_unit(unit.name, str(unit.role))

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(signum, self._signals.put_nowait, signum)
        try:
            await self.startup()
            return await self.main_loop()
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        await self.ops.open()
        await self.kernel_log.start()
        await self.bus.connect()
        await self.http.start()
        await self.holds.load()
        await self.learned.load()
        for name in self.units:
            self._on_learned(name, self.learned.for_unit(name))
        self.notifier.status("k26-supervisor: rediscovering units")
        self._spawn(self._watchdog())
        self._spawn(self._watch_gpu_faults())
        if self.config.supervisor.jit_watch:  # the scan the JIT watch needs, begun now
            self._spawn(self.warmup.unknown_roots())
        now = time.monotonic()
        observed: dict[str, Observed] = {}
        refused: dict[str, str] = {}
        for name, unit in self.units.items():
            snap = await self.exits.seed(name)
            self.kernel_log.track(name, snap.control_group, snap.main_pid)
            self.board.set_systemd(name, active_state=snap.active_state, main_pid=snap.main_pid)
            if snap.restart not in ("", "no"):
                refused[name] = (
                    f"refusing to manage {name}: systemd Restart={snap.restart} would race the "
                    f"supervisor's restarts; set Restart=no in the unit (or a drop-in), run "
                    f"daemon-reload, then restart k26-supervisor"
                )
                continue
            backend = await sampling_env.current_backend(self.config.supervisor.bus, name)
            health_ok = probe_ok = False
            # This process has not seen the cache warm: the unit may have been started
            # alongside a warm-up that died with the previous supervisor. A sampled
            # request now could make the server build the module itself (or crash on
            # it), and would prove nothing: the machine warms first, then probes.
            unverified = self.config.flashinfer.enabled and backend is SamplingBackend.FLASHINFER
            if snap.active_state == "active" and unverified:
                health_ok = await self.ops.healthy(unit.url, 2.0)
            elif snap.active_state == "active":
                result = await self.ops.sampled(unit.url, timeout_s=10.0)
                probe_ok = result.ok
                health_ok = probe_ok or await self.ops.healthy(unit.url, 2.0)
                self.ops.record_probe(name, result)
            held = snap.active_state in ("inactive", "failed") and self.holds.holds(
                name, snap.invocation_id
            )
            if held:
                log.warning("%s was stopped by an operator; leaving it stopped", name)
            else:
                await self.holds.set(name, None)  # started again since: the hold is void
            observed[name] = Observed(
                snap.active_state, health_ok, probe_ok, backend, held, cache_unverified=unverified
            )
        self.policy, commands = Supervisor.rediscover(
            unit_specs(self.config),
            unit_policy(self.config),
            pair_policy(self.config),
            observed,
            now=now,
        )
        await self._execute(commands)
        for name, reason in refused.items():
            await self._refuse(name, reason)
        await self._execute(self.policy.start(time.monotonic()))
        await self._sync()
        self._spawn(self._resync_timer())

    async def main_loop(self) -> int:
        bus_events = self.bus.events().__aiter__()
        next_bus: asyncio.Task[Any] = asyncio.ensure_future(bus_events.__anext__())
        next_own: asyncio.Task[Any] = asyncio.ensure_future(self._queue.get())
        next_sig: asyncio.Task[Any] = asyncio.ensure_future(self._signals.get())
        stop: asyncio.Task[Any] = asyncio.ensure_future(self._stop.wait())
        try:
            while True:
                if self._stop.is_set():
                    return EXIT_CANNOT_START
                done, _ = await asyncio.wait(
                    {next_bus, next_own, next_sig, stop}, return_when=asyncio.FIRST_COMPLETED
                )
                if next_sig in done:
                    signum = next_sig.result()
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        log.info("signal %s: shutting down; managed units keep running", signum)
                        return 0
                    if signum == signal.SIGHUP:
                        await self._reload()
                    else:
                        await self._operator_action()
                    next_sig = asyncio.ensure_future(self._signals.get())
                if next_bus in done:
                    await self._on_changes(await self.exits.handle(next_bus.result()))
                    next_bus = asyncio.ensure_future(bus_events.__anext__())
                if next_own in done:
                    # What systemd said before this answer goes first. A job's end is
                    # read (JobRemoved, queued as a bus event behind every earlier
                    # signal) before the op that waited for it can report: seen live,
                    # a stop's answer overtook the start's "active", and the unit was
                    # taken for one an operator had started, then stopped.
                    if next_bus.done():
                        await self._on_changes(await self.exits.handle(next_bus.result()))
                        next_bus = asyncio.ensure_future(bus_events.__anext__())
                    for event in self.bus.pending_events():
                        await self._on_changes(await self.exits.handle(event))
                    unit, item = next_own.result()
                    if item == _RESYNC:
                        await self._on_changes(await self.exits.reconcile(list(self.units)))
                    elif isinstance(item, Event):
                        await self._feed(unit, item)
                    next_own = asyncio.ensure_future(self._queue.get())
        finally:
            for task in (next_bus, next_own, next_sig, stop):
                task.cancel()

    async def shutdown(self) -> None:
        if self._cannot_start:
            self.notifier.stopping(f"k26-supervisor: {self._cannot_start}")
        else:
            self.notifier.stopping("k26-supervisor stopping; managed units are left running")
        last = self._status_json()
        last["supervisor"]["exited_at"] = iso8601(utc_now())
        last["supervisor"]["exit"] = (
            {"code": EXIT_CANNOT_START, "reason": self._cannot_start}
            if self._cannot_start
            else {"code": 0, "reason": "stopped (SIGTERM/SIGINT); managed units left running"}
        )
        await asyncio.to_thread(save_last_status, self.config.supervisor.bus, last)
        for handle in self._timers.values():
            handle.cancel()
        self.jit.close()
        await self.learner.close()
        progress = [task for _watch, task in self._progress.values()]
        for task in [*self._ops.values(), *self._tasks, *progress]:
            task.cancel()
        for task in [*self._ops.values(), *self._tasks, *progress]:
            with contextlib.suppress(BaseException):
                await task
        for what, close in (
            ("the status server", self.http.close),
            ("the unit operations", self.ops.close),
            ("the exit watch", self.exits.close),
            ("the bus", self.bus.close),
        ):
            try:
                await close()
            except Exception:  # shutting down whatever happens; a failure is said, not raised
                log.exception("shutdown: closing %s failed", what)
        self.kernel_log.close()

    # --------------------------------------------------------------- inputs

    async def _on_changes(
        self, changes: Sequence[ActiveStateChanged | ExplainedExit | ForeignJobDone]
    ) -> None:
        for change in changes:
            if isinstance(change, ForeignJobDone):
                await self._feed(change.unit, OperatorStopSeen())
            elif isinstance(change, ActiveStateChanged):
                track = self.exits.tracker.watch(change.unit)
                self.board.set_systemd(
                    change.unit, active_state=change.new, main_pid=track.main_pid
                )
                self.kernel_log.track(change.unit, track.control_group, track.main_pid)
                if change.new == "active":
                    await self._feed(change.unit, UnitActive())
            else:
                await self._on_exit(change)

    async def _on_exit(self, explained: ExplainedExit) -> None:
        exit_, verdict = explained.exit, explained.verdict
        unit, cause = exit_.unit, verdict.cause
        log.info("exit seen: unit=%s monotonic=%.6f", unit, exit_.observed_at)
        self.board.record_exit(
            unit,
            ExitInfo(
                cause=cause,
                at=exit_.exited_at,
                main_pid=exit_.exec_main_pid,
                exit_code=verdict.exit_code,
                signal=verdict.signal,
                evidence=verdict.evidence,
                summary=verdict.summary,
            ),
        )
        by = f", stop asked by the {exit_.stop_by}" if exit_.stop_by else ""
        log.warning("%s exited: %s (%s)%s", unit, cause, verdict.summary, by)
        if not exit_.stop_by:  # a recovery runs from here to READY
            self.timelines.exited(unit, cause, exit_.observed_at, utc_now())
        if exit_.stop_by == "operator":
            await self._feed(unit, UnitStoppedByOperator(cause))
        elif exit_.stop_by == "supervisor":
            await self._feed(
                unit, UnitStoppedBySupervisor(cause, needs_person=verdict.needs_person)
            )
        else:
            await self._feed(unit, UnitExited(cause, needs_person=verdict.needs_person))

    async def _resync_timer(self) -> None:
        """The safety net for a lost signal: re-read every unit now and then."""
        while True:
            await asyncio.sleep(self.config.supervisor.resync_interval_s)
            self._queue.put_nowait(("", _RESYNC))

    # ------------------------------------------------------------- decisions

    async def _feed(self, unit: str, event: Event) -> None:
        try:
            commands = self.policy.handle(unit, event, time.monotonic())
        except IllegalEvent as exc:  # changed nothing; say so and go on
            log.warning("%s: ignored %s: %s", unit, type(event).__name__, exc)
            return
        log.debug("event: unit=%s %r -> %r", unit, event, [c.action for c in commands])
        await self._execute(commands)
        await self._sync()

    async def _execute(self, commands: tuple[Command, ...]) -> None:
        for command in commands:
            self._act(command.unit, command.action)

    def _act(self, unit: str, action: Action) -> None:
        if isinstance(action, _ASYNC_ACTIONS):
            self._op(unit, action)
        elif isinstance(action, CancelOp):
            task = self._ops.pop((unit, action.op), None)
            if task is not None:
                task.cancel()
        elif isinstance(action, ScheduleTimer):
            self._schedule(unit, action)
        elif isinstance(action, CancelTimer):
            handle = self._timers.pop((unit, str(action.timer)), None)
            if handle is not None:
                handle.cancel()
        elif isinstance(action, NotifyStatus):
            level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING}.get(
                action.severity, logging.ERROR
            )
            log.log(level, "%s", action.message)
            self.notifier.status(action.message)
        elif isinstance(action, SwitchToFallback):
            log.error("fallback: %s -> %s (%s)", action.from_, action.to, action.reason)
            self.notifier.status(
                f"fallback engaged: {action.from_} -> {action.to}: {action.reason}"
            )
        elif isinstance(action, Entered):
            self._entered(unit, action)
        elif isinstance(action, SwitchToPreferred):
            log.warning("retrying preferred unit %s (fallback %s)", action.to, action.from_)

    def _entered(self, unit: str, action: Entered) -> None:
        """A unit changed state: READY starts what a ready unit gets, leaving it ends it."""
        track = self.exits.tracker.watch(unit)  # a MainPID can come after "active"
        self.kernel_log.track(unit, track.control_group, track.main_pid)
        now = time.monotonic()
        log.info("state: unit=%s %s monotonic=%.6f", unit, action.state, now)
        self._extend_timeout()  # start-up moved on
        if action.state is UnitState.READY:  # what its FlashInfer built, for every later warm-up
            self._spawn(self.warmup.learn(unit))
            self._spawn(self.warmup.check_bundle(unit))  # did a pulled bundle prevent builds
            self._spawn(self._watch_jit(unit))
            self._watch_progress(unit)
            self._timeline_ready(unit, now)
            return
        self.timelines.entered(unit, action.state, now, utc_now())
        if action.left is UnitState.READY:
            self.jit.unwatch(unit)
            self.learner.forget_run(unit)
            self.board.set_jit_watched(unit, [])
            self._unwatch_progress(unit)

    def _op(
        self,
        unit: str,
        action: RunWarmup | CheckGate | StartUnit | StopUnit | WaitHealthy | SampledProbe,
    ) -> None:
        """Run ``action``; its completion event (``UnitOps`` always makes one) is queued."""

        async def work() -> None:
            self._queue.put_nowait((unit, await self.ops.run(unit, action)))

        key = (unit, action.op)
        task = asyncio.create_task(work())
        self._ops[key] = task
        task.add_done_callback(lambda _t: self._ops.pop(key, None))

    def _schedule(self, unit: str, action: ScheduleTimer) -> None:
        key = (unit, str(action.timer))
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, action.at - time.monotonic())
        event = TimerFired(action.timer)
        self._timers[key] = asyncio.get_running_loop().call_later(
            delay, self._queue.put_nowait, (unit, event)
        )

    async def _refuse(self, unit: str, reason: str) -> None:
        log.error("%s", reason)
        self.notifier.status(reason)
        await self._feed(unit, ManagementRefused(reason))

    # ------------------------------------------------------------- telling the truth

    async def _sync(self) -> None:
        """Board, READY=1, STATUS= and the saved operator holds, from the machines."""
        for name, machine in self.policy.machines.items():
            state = machine.state
            self.board.set_state(name, state)
            self.board.set_reason(
                name,
                machine.reason,
                held_by_operator=machine.held_by_operator,
                needs_person=machine.needs_person and machine.state is UnitState.FAILED,
            )
            self.board.set_fallback_engaged(name, self.policy.fallback_engaged(name))
            shown = self.board.unit(name)
            if (shown.warmup_mode, shown.warmup_why) != (machine.warmup_mode, machine.warmup_why):
                if machine.warmup_mode is not None:
                    log.info(
                        "warm-up plan: unit=%s mode=%s: %s",
                        name,
                        machine.warmup_mode,
                        machine.warmup_why,
                    )
                self.board.set_warmup_plan(name, machine.warmup_mode, machine.warmup_why)
            if machine.held_by_operator != bool(self.holds.holds(name, self._invocation(name))):
                await self.holds.set(
                    name, self._invocation(name) if machine.held_by_operator else None
                )
        for group, (units, serving) in self.policy.groups_serving().items():
            self.board.set_serving(group, units, serving)
        # /status and k26_supervisor_ready say what is true now; READY=1 goes once,
        # when start-up is settled (units an operator holds down are not waited for).
        self.board.set_ready(self.policy.serving_ready())
        verdict = self.policy.startup_verdict()
        if not self._ready_sent and verdict in (StartupVerdict.READY, StartupVerdict.DEGRADED):
            self._ready_sent = True
            self._degraded = verdict is StartupVerdict.DEGRADED
            why = self._ready_why(verdict)
            self.notifier.ready(f"k26-supervisor: {why}")
            log.info("READY=1: %s", why)
        elif not self._ready_sent and verdict is StartupVerdict.HOPELESS and not self._cannot_start:
            # Every group failed for good: only an operator brings one back, so systemd
            # would only wait out TimeoutStartSec. Fail the start now, saying why.
            failed = "; ".join(f"{u}: {r}" for u, r in self.policy.failed_for_good())
            self._cannot_start = f"start-up cannot succeed, no unit can serve: {failed}"
            log.error("%s; exiting %d (fix it, then systemctl start k26-supervisor)",
                      self._cannot_start, EXIT_CANNOT_START)  # fmt: skip
            self.notifier.status(f"failed: {self._cannot_start}")
            self._stop.set()
            return
        summary = self._summary()
        if summary != self._last_summary:
            self._last_summary = summary
            self.notifier.status(summary)

    def _timeline_ready(self, unit: str, now: float) -> None:
        """The start that just ended in READY, joined with the server's own account of
        it (read from the unit's output off the loop), onto the board and the log."""
        coverage = self.ops.last_coverage.pop(unit, None)
        shown = self.board.unit(unit)
        warmup = self.board.snapshot().warmup
        overlapped = (
            warmup.duration_s if shown.warmup_mode == "overlapped" and warmup is not None else None
        )
        start, recovery = self.timelines.ready(
            unit,
            now,
            utc_now(),
            coverage_s=None if coverage is None else coverage.duration_s,
            overlapped_warmup_s=overlapped,
        )
        if start is not None or recovery is not None:
            self._spawn(self._server_timings(unit, start, recovery))

    async def _server_timings(
        self, unit: str, start: StartTimeline | None, recovery: StartTimeline | None
    ) -> None:
        try:
            snap = await self.bus.snapshot(unit)
            lines = await run_output(snap, user=self.config.supervisor.bus == "user")
        except SupervisorError as exc:
            log.warning("timeline of %s: cannot read its output: %s", unit, exc)
            lines = []
        server = startup_log.parse(lines)
        if start is not None:
            start = start.with_server(server)
        if recovery is not None:
            recovery = recovery.with_server(server)
        self.board.record_start(unit, start, recovery)
        for timeline in (start, recovery):
            if timeline is not None:
                phases = " ".join(
                    f"{phase_label(k)}={'unknown' if v is None else f'{v:.2f}'}"
                    for k, v in timeline.all_phases().items()
                )
                log.info(
                    "timeline: unit=%s %s %.2f s: %s", unit, timeline.kind, timeline.total_s, phases
                )

    async def _watch_jit(self, unit: str) -> None:
        """From READY on, every JIT cache the unit writes, found from its own
        environment (core/jit_caches.py), is watched for new artifacts."""
        if not self.config.supervisor.jit_watch:
            return
        try:
            snap, locations = await self._cache_locations(unit)
        except SupervisorError as exc:
            log.warning("JIT watch of %s: cannot read the unit's environment: %s", unit, exc)
            return
        if unit not in self._cache_warned:
            self._cache_warned.add(unit)
            for assessed in jit_caches.assess(
                locations, private_tmp=snap.private_tmp, cache_directories=snap.cache_directories
            ):
                if assessed.problem:
                    log.warning("%s: %s", unit, assessed.problem)
        if self.policy.machines[unit].state is not UnitState.READY:
            return  # it left READY while the environment was read
        self._snapshots[unit] = snap
        self._jit_roots[unit] = {loc.cache: Path(str(loc.path)) for loc in locations}
        watch = await self.jit.watch(unit, locations)
        if watch is not None:
            dirs = [str(loc.path) for loc in locations]
            self.board.set_jit_watched(unit, dirs)
            log.info("JIT watch: unit=%s caches=%s", unit, " ".join(dirs))

    async def _cache_locations(
        self, unit: str
    ) -> tuple[UnitSnapshot, list[jit_caches.CacheLocation]]:
        """The unit's snapshot and every JIT cache root its own environment gives it
        (core/jit_caches.py), with the roots the serving venv's code reads beyond
        those where the unit pins them. SupervisorError when systemd cannot say."""
        snap = await self.bus.snapshot(unit)
        found = await unit_env.resolve(snap)
        locations = jit_caches.locate(found.env, home=found.home, user=found.user)
        locations += jit_caches.pinned_unknown(found.env, await self._unknown_roots())
        return snap, locations

    async def _cache_roots(self, unit: str) -> dict[str, list[Path]]:
        """Cache name -> root, for the coverage's check of what is made already: the
        roots the serving venv's scan adds only if it is done (READY does not wait)."""
        snap = await self.bus.snapshot(unit)
        found = await unit_env.resolve(snap)
        locations = jit_caches.locate(found.env, home=found.home, user=found.user)
        locations += jit_caches.pinned_unknown(found.env, self.warmup.unknown_roots_now())
        roots: dict[str, list[Path]] = {}
        for loc in locations:  # several for OTHER: one per variable a unit pins
            roots.setdefault(str(loc.cache), []).append(Path(str(loc.path)))
        return roots

    def _watch_progress(self, unit: str) -> None:
        """From READY on: requests in flight with no token for stall_after_s, and no
        compile seen, take the unit out of READY (core/progress.py)."""
        probe = self.config.probe
        if probe.stall_after_s <= 0 or self.ops.http is None:
            return
        self._unwatch_progress(unit)
        watch = ProgressWatch(
            unit,
            self.units[unit].url,
            stall_after_s=probe.stall_after_s,
            interval_s=probe.progress_interval_s,
            client=self.ops.http,
            main_pid=lambda: self.exits.tracker.watch(unit).main_pid,
        )

        async def run() -> None:
            try:
                why = await watch.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not pass for a healthy server
                log.exception("%s: the forward-progress watch failed; it is off for this run", unit)
                return
            if why is not None and self._progress.get(unit, (None,))[0] is watch:
                del self._progress[unit]
                log.error("%s: stalled while ready: %s", unit, why)
                self._queue.put_nowait((unit, ProgressStalled(why)))

        log.info(
            "forward-progress watch: unit=%s every %g s, stall after %g s",
            unit, probe.progress_interval_s, probe.stall_after_s,
        )  # fmt: skip
        task = asyncio.create_task(run())
        self._progress[unit] = (watch, task)

    def _unwatch_progress(self, unit: str) -> None:
        entry = self._progress.pop(unit, None)
        if entry is not None:
            entry[1].cancel()

    async def _unknown_roots(self) -> list[str]:
        """``Warmup.unknown_roots``, waited for at most ``ROOTS_WAIT_S`` (the scan reads
        the serving venv's sources once; a unit is rarely ready before it is done)."""
        try:
            async with asyncio.timeout(ROOTS_WAIT_S):
                return await self.warmup.unknown_roots()
        except TimeoutError:
            log.warning(
                "cache roots: the serving venv's scan took over %g s; the JIT watch "
                "follows the known caches only for now", ROOTS_WAIT_S,
            )  # fmt: skip
            return []

    def _on_jit_artifact(self, unit: str, cache: JitCache, kernel: str, path: Path) -> None:
        log.warning(
            "JIT after READY: unit=%s cache=%s kernel=%s file=%s monotonic=%.6f: a kernel "
            "compiled under live traffic; add the request shape that made it to the "
            "unit's coverage",
            unit, cache, kernel, path, time.monotonic(),
        )  # fmt: skip
        self.board.record_jit_after_ready(unit, str(cache), kernel, str(path))
        root = self._jit_roots.get(unit, {}).get(cache)
        if root is not None:
            self.learner.saw(unit, cache, root, path)
        entry = self._progress.get(unit)
        if entry is not None:  # a compile in progress is no stall
            entry[0].activity()

    async def _recent_output(self, unit: str) -> list[str]:
        snap = self._snapshots.get(unit)
        if snap is None:
            return []
        return await recent_output(snap, user=self.config.supervisor.bus == "user")

    async def _pulled_learned(self, document: Mapping[str, Any]) -> int:
        try:
            carried = parse_records(document, "the pulled bundle's learned shapes")
        except ValueError as exc:  # checked at pull; a bug if it gets here
            log.error("%s", exc)
            return 0
        new = await self.learned.merge_units(carried)
        for name in self.units:
            self._on_learned(name, self.learned.for_unit(name))
        return new

    def _on_learned(self, unit: str, records: list[LearnedShape]) -> None:
        self.board.set_learned_shapes(unit, status_json(self.learned.path, records))

    def _invocation(self, unit: str) -> str:
        return self.exits.tracker.watch(unit).invocation_id

    def _ready_why(self, verdict: StartupVerdict) -> str:
        held = [n for n, m in self.policy.machines.items() if m.held_by_operator]
        why = "every unit passed a sampled generation"
        if held:
            why += f", but {', '.join(held)} (held by an operator)"
        if verdict is StartupVerdict.DEGRADED:
            failed = ", ".join(u for u, _ in self.policy.failed_for_good())
            why = (
                f"degraded: {failed} failed for good (see /status); every other unit "
                "passed a sampled generation"
            )
        return why

    def _summary(self) -> str:
        parts = [f"{n}={m.state}" for n, m in self.policy.machines.items()]
        if not self._ready_sent:
            return "starting: " + " ".join(parts)
        return ("ready (degraded): " if self._degraded else "ready: ") + " ".join(parts)

    def _status_json(self) -> dict[str, Any]:
        return self.board.snapshot().to_json()

    def _extend_timeout(self) -> None:
        if not self._ready_sent:
            self.notifier.extend_timeout(self.config.supervisor.startup_silence_s)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_gpu_faults(self) -> None:
        """A hardware or driver Xid that names a managed unit's process is acted on the
        moment it is read, not at the death: the unit's requests stall on the broken
        GPU first, and a stall counted as an ordinary failure could start its fallback
        on the same GPUs (found by the chaos soak)."""
        seen = self.kernel_log.appended
        while True:
            seen, records = await self.kernel_log.records_after(seen)
            if not records:
                return  # the log is closed or was never available
            for record in records:
                if record.pid_unit not in self.units:
                    continue
                summary = gpus_own_fault([record.message])
                if summary is not None:
                    log.error("%s: kernel log: %s", record.pid_unit, record.message)
                    self._queue.put_nowait((record.pid_unit, GpuFaultSeen(summary)))

    async def _watchdog(self) -> None:
        interval = watchdog_interval_s()
        if not interval:
            return
        while True:  # WATCHDOG=1 from the loop itself: a stuck loop stops sending it
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    # ------------------------------------------------------------- operators

    async def _reload(self) -> None:
        """SIGHUP: take the new file whole, or keep the running config whole."""
        try:
            new = await asyncio.to_thread(load_config, self.config_path)
        except ConfigError as exc:
            self._say_reload(f"{self.config_path} is invalid; keeping the running config: {exc}")
            return
        refusals = reload_refusals(self.config, new)
        if refusals:
            self._say_reload(
                "not applied, the running config is kept: " + "; ".join(map(str, refusals))
            )
            return
        self.config = new
        self.ops.config = new
        self.warmup.cfg = new.flashinfer
        self.policy.update_policies(unit_policy(new), pair_policy(new))
        _set_log_level(new)
        log.info("SIGHUP: configuration reloaded from %s", self.config_path)
        self.notifier.status(f"SIGHUP: configuration reloaded from {self.config_path}")

    def _say_reload(self, message: str) -> None:
        log.error("SIGHUP: %s", message)
        self.notifier.status(f"SIGHUP: {message}")

    async def _operator_action(self) -> None:
        """SIGUSR1: reset failed units, release units an operator stopped, and retry
        preferred units in standby."""
        now = time.monotonic()
        for name, machine in self.policy.machines.items():
            if machine.state is UnitState.FAILED or machine.held_by_operator:
                await self._feed(name, OperatorReset())
            elif machine.state is UnitState.STANDBY and self.policy.fallback_engaged(name):
                await self._execute(self.policy.handle(name, RetryPreferred(), now))
        await self._sync()


def _set_log_level(config: Config) -> None:
    level = getattr(logging, str(config.supervisor.log_level).upper(), logging.INFO)
    logging.getLogger().setLevel(level)


def run(config_path: Path) -> int:
    config = load_config(config_path)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    _set_log_level(config)
    # One line per probe from httpx would drown the supervisor's own log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return asyncio.run(Daemon(config, config_path).run())
