"""``k26-supervisor run``: the wiring. Pure decisions live in ``policy``/``machine``.

The daemon owns one event loop and never blocks it: D-Bus goes through
``SystemdBus`` (its own thread for calls), HTTP through httpx/asyncio, the
serving venv through asyncio subprocesses, files through ``to_thread``.

Lifecycle (after uvicorn's): ``run`` → ``startup`` (bus, kernel log, HTTP,
rediscover every unit's real state) → ``main_loop`` (bus events and the
machines' own events, one at a time) → ``shutdown`` (close, never stop units).
Signal handlers only record the signal; the loop acts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx

from supervisor import __version__
from supervisor.adapters import sampling_env
from supervisor.adapters.config_file import load_config
from supervisor.adapters.evidence import KernelLog
from supervisor.adapters.explain import explain, output_size
from supervisor.adapters.http import StatusServer
from supervisor.adapters.metrics import build_registry
from supervisor.adapters.notify import Notifier, watchdog_interval_s
from supervisor.adapters.probe import ProbeParams, sampled_probe, wait_healthy
from supervisor.adapters.systemd_bus import SystemdBus
from supervisor.adapters.warmup import Warmup
from supervisor.core.bus_events import BusReconnected, PropertiesChanged
from supervisor.core.config import Config, pair_policy, unit_policy, unit_specs
from supervisor.core.errors import ConfigError, SupervisorError
from supervisor.core.events import (
    Action,
    CancelOp,
    CancelTimer,
    Event,
    HealthOk,
    JobDone,
    ManagementRefused,
    NotifyStatus,
    OperatorReset,
    ProbeFailed,
    ProbeOk,
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
    WaitHealthy,
    WarmupFailed,
    WarmupOk,
)
from supervisor.core.exits import ActiveStateChanged, ExitObserved, ExitTracker
from supervisor.core.policy import (
    Command,
    Observed,
    RetryPreferred,
    Supervisor,
    SwitchToFallback,
    SwitchToPreferred,
)
from supervisor.core.status import ExitInfo, ProbeInfo, StatusBoard

log = logging.getLogger("k26.daemon")
EXTEND_TIMEOUT_S = 120.0  # each EXTEND_TIMEOUT_USEC buys this much more start time


class Daemon:
    def __init__(
        self, config: Config, config_path: Path, *, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = notifier or Notifier.from_env()
        self.bus = SystemdBus(config.supervisor.bus)
        self.kernel_log = KernelLog()
        self.tracker = ExitTracker()
        self.board = StatusBoard(version=__version__, config_path=str(config_path))
        self.registry = build_registry(self.board)
        self.http = StatusServer(config.supervisor.listen, self._status_json, self.registry)
        self.warmup = Warmup(config.flashinfer, self.board)
        self.policy = Supervisor(unit_specs(config), unit_policy(config), pair_policy(config))
        self.units = {u.name: u for u in config.units}
        self._queue: asyncio.Queue[tuple[str, Event]] = asyncio.Queue()
        self._ops: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._stopping: set[str] = set()  # units whose stop job we issued
        self._deactivating: set[str] = set()
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._ready_sent = False
        self._last_summary = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        # One client for every probe: building one (SSL context, CA bundle) costs
        # the event loop 16-33 ms each time.
        self._http: httpx.AsyncClient | None = None
        for unit in config.units:
            self.board.add_unit(unit.name, str(unit.role))
            self.tracker.watch(unit.name)

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
        self._http = await asyncio.to_thread(
            lambda: httpx.AsyncClient(trust_env=False, follow_redirects=False)
        )
        await self.kernel_log.start()
        await self.bus.connect()
        await self.http.start()
        self.notifier.status("k26-supervisor: rediscovering units")
        self._spawn(self._watchdog())
        now = time.monotonic()
        observed: dict[str, Observed] = {}
        refused: dict[str, str] = {}
        for name, unit in self.units.items():
            snap = await self.bus.snapshot(name)
            self.tracker.seed(snap, output_offset=await output_size(snap.standard_output_path))
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
            if snap.active_state == "active":
                result = await sampled_probe(
                    unit.url, self._probe_params(), 10.0, client=self._http
                )
                probe_ok = result.ok
                health_ok = probe_ok or (await wait_healthy(unit.url, 2.0, client=self._http)).ok
                self._record_probe(name, result)
            observed[name] = Observed(snap.active_state, health_ok, probe_ok, backend)
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
        self._sync_board()

    async def main_loop(self) -> int:
        bus_events = self.bus.events().__aiter__()
        next_bus: asyncio.Task[Any] = asyncio.ensure_future(bus_events.__anext__())
        next_own: asyncio.Task[Any] = asyncio.ensure_future(self._queue.get())
        next_sig: asyncio.Task[Any] = asyncio.ensure_future(self._signals.get())
        try:
            while True:
                done, _ = await asyncio.wait(
                    {next_bus, next_own, next_sig}, return_when=asyncio.FIRST_COMPLETED
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
                    await self._on_bus(next_bus.result())
                    next_bus = asyncio.ensure_future(bus_events.__anext__())
                if next_own in done:
                    unit, event = next_own.result()
                    await self._feed(unit, event)
                    next_own = asyncio.ensure_future(self._queue.get())
        finally:
            for task in (next_bus, next_own, next_sig):
                task.cancel()

    async def shutdown(self) -> None:
        self.notifier.stopping("k26-supervisor stopping; managed units are left running")
        for handle in self._timers.values():
            handle.cancel()
        for task in [*self._ops.values(), *self._tasks]:
            task.cancel()
        for task in [*self._ops.values(), *self._tasks]:
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            await self.http.close()
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.aclose()
        with contextlib.suppress(Exception):
            await self.bus.close()
        self.kernel_log.close()

    # --------------------------------------------------------------- inputs

    async def _on_bus(self, event: Any) -> None:
        if isinstance(event, BusReconnected):
            log.warning("D-Bus reconnected (%s): re-reading every unit", event.reason)
            await self._resync()
            return
        if not isinstance(event, PropertiesChanged) or event.unit not in self.units:
            return
        for change in self.tracker.feed(event):
            if isinstance(change, ActiveStateChanged):
                await self._on_active_state(change)
            else:
                await self._on_exit(change)

    async def _on_active_state(self, change: ActiveStateChanged) -> None:
        unit = change.unit
        track = self.tracker.watch(unit)
        self.board.set_systemd(unit, active_state=change.new, main_pid=track.main_pid)
        if change.new == "deactivating":
            self._deactivating.add(unit)
        elif change.new in ("activating", "active"):
            self._deactivating.discard(unit)
            if change.old in ("inactive", "failed"):
                self._stopping.discard(
                    unit
                )  # a new run: a stop of ours that caused no exit is over
        if change.new == "active":
            self._spawn(self._learn_run(unit))
            await self._feed(unit, UnitActive())

    async def _learn_run(self, unit: str) -> None:
        snap = await self.bus.snapshot(unit)
        self.tracker.seed(snap)
        self.board.set_systemd(unit, active_state=snap.active_state, main_pid=snap.main_pid)

    async def _on_exit(self, exit_: ExitObserved) -> None:
        unit = exit_.unit
        log.info("exit seen: unit=%s monotonic=%.6f", unit, exit_.observed_at)
        verdict = await explain(
            exit_, self.kernel_log, user_bus=self.config.supervisor.bus == "user"
        )
        self.tracker.note_output_offset(unit, await output_size(exit_.output_path))
        self.board.record_exit(
            unit,
            ExitInfo(
                cause=str(verdict.cause),
                at=exit_.exited_at,
                main_pid=exit_.exec_main_pid,
                exit_code=verdict.exit_code,
                signal=verdict.signal,
                evidence=verdict.evidence,
            ),
        )
        log.warning("%s exited: %s (%s)", unit, verdict.cause, verdict.summary)
        by_operator = unit in self._deactivating and unit not in self._stopping
        self._deactivating.discard(unit)
        self._stopping.discard(unit)
        if by_operator and str(verdict.cause) == "clean":
            await self._feed(unit, UnitStoppedByOperator())
        else:
            await self._feed(unit, UnitExited(str(verdict.cause)))

    async def _resync(self) -> None:
        for name in self.units:
            snap = await self.bus.snapshot(name)
            machine = self.policy.machines[name]
            if snap.active_state in ("inactive", "failed") and machine.running:
                await self._feed(name, UnitExited(snap.result or "signal"))
            elif snap.active_state == "active" and not machine.running:
                await self._feed(name, UnitActive())
            self.tracker.seed(snap)

    # ------------------------------------------------------------- decisions

    async def _feed(self, unit: str, event: Event) -> None:
        try:
            commands = self.policy.handle(unit, event, time.monotonic())
        except Exception as exc:  # an illegal event changed nothing; say so and go on
            log.warning("%s: ignored %s: %s", unit, type(event).__name__, exc)
            return
        await self._execute(commands)
        self._sync_board()

    async def _execute(self, commands: tuple[Command, ...]) -> None:
        for command in commands:
            await self._act(command.unit, command.action)

    async def _act(self, unit: str, action: Action) -> None:
        cfg = self.units[unit]
        if isinstance(action, RunWarmup):
            self._op(unit, action.op, self._warm(unit, action))
        elif isinstance(action, StartUnit):
            self._op(unit, action.op, self._start(unit, action))
        elif isinstance(action, StopUnit):
            self._stopping.add(unit)
            self._op(unit, action.op, self._stop(unit, action.op))
        elif isinstance(action, WaitHealthy):
            self._op(unit, action.op, self._wait_healthy(unit, cfg.url, action.op))
        elif isinstance(action, SampledProbe):
            self._op(unit, action.op, self._probe(unit, cfg.url, action.op))
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
        elif isinstance(action, SwitchToPreferred):
            log.warning("retrying preferred unit %s (fallback %s)", action.to, action.from_)

    def _op(self, unit: str, op: int, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._ops[(unit, op)] = task
        task.add_done_callback(lambda _t: self._ops.pop((unit, op), None))

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

    # ------------------------------------------------------------- actions

    async def _warm(self, unit: str, action: RunWarmup) -> None:
        self._extend_timeout()
        result = await self.warmup.ensure(
            recheck=action.recheck, patch_allowed=action.patch_allowed
        )
        if result.ok:
            self._queue.put_nowait((unit, WarmupOk(action.op)))
        else:
            event = WarmupFailed(action.op, result.error or "warm-up failed", result.arch_rejected)
            self._queue.put_nowait((unit, event))

    async def _start(self, unit: str, action: StartUnit) -> None:
        try:
            # The units read this file at start: no daemon-reload needed.
            await sampling_env.apply(
                self.config.supervisor.bus, unit, action.sampling_backend is SamplingBackend.PYTORCH
            )
            self.board.set_sampling_backend(unit, str(action.sampling_backend))
            if action.restart:
                self.board.record_restart(unit)
            self._extend_timeout()
            log.info(
                "start issued: unit=%s restart=%s monotonic=%.6f",
                unit,
                action.restart,
                time.monotonic(),
            )
            job = await self.bus.start(unit, timeout_s=self.config.supervisor.job_timeout_s)
            result = job.result
        except SupervisorError as exc:
            log.error("%s: start failed: %s", unit, exc)
            result = "failed"
        self._queue.put_nowait((unit, JobDone(action.op, result)))

    async def _stop(self, unit: str, op: int) -> None:
        try:
            job = await self.bus.stop(unit, timeout_s=self.config.supervisor.job_timeout_s)
            result = job.result
        except SupervisorError as exc:
            log.error("%s: stop failed: %s", unit, exc)
            result = "failed"
        if result != "done":
            self._stopping.discard(unit)
        # Otherwise the unit stays marked ours until its exit is handled: the job's
        # answer can arrive before the bus event of the exit it caused.
        self._queue.put_nowait((unit, JobDone(op, result)))

    async def _wait_healthy(self, unit: str, url: str, op: int) -> None:
        def progress(p: Any) -> None:
            self._extend_timeout()

        result = await wait_healthy(
            url, self.config.probe.startup_deadline_s, progress, client=self._http
        )
        if result.ok:
            self._queue.put_nowait((unit, HealthOk(op)))
        else:
            reason = str(result.reason or "timeout")
            self._queue.put_nowait((unit, ProbeFailed(op, reason, result.error or "")))

    async def _probe(self, unit: str, url: str, op: int) -> None:
        result = await sampled_probe(
            url, self._probe_params(), self.config.probe.timeout_s, client=self._http
        )
        log.debug("probe: unit=%s ok=%s monotonic=%.6f", unit, result.ok, time.monotonic())
        self._record_probe(unit, result)
        if result.ok:
            event: Event = ProbeOk(op, result.latency_ms or 0.0, result.completion_tokens or 0)
        else:
            event = ProbeFailed(op, str(result.reason), result.error or "")
        self._queue.put_nowait((unit, event))

    async def _refuse(self, unit: str, reason: str) -> None:
        log.error("%s", reason)
        self.notifier.status(reason)
        await self._feed(unit, ManagementRefused(reason))

    # ------------------------------------------------------------- helpers

    def _probe_params(self) -> ProbeParams:
        return ProbeParams.from_config(self.config.probe)

    def _record_probe(self, unit: str, result: Any) -> None:
        error = result.error
        if not result.ok:
            # Say the typed reason in /status too, not only in the metric.
            error = f"{result.reason}: {result.error or 'probe failed'}"
        info = ProbeInfo(
            ok=result.ok,
            at=result.at,
            latency_ms=result.latency_ms,
            error=error,
            completion_tokens=result.completion_tokens,
        )
        self.board.record_probe(
            unit, info, failure_reason=None if result.ok else str(result.reason)
        )

    def _sync_board(self) -> None:
        for name, machine in self.policy.machines.items():
            state = str(machine.state)
            if self.board.unit(name).state != state:
                log.info("state: unit=%s %s monotonic=%.6f", name, state, time.monotonic())
            self.board.set_state(name, state)
            self.board.set_fallback_engaged(name, self.policy.fallback_engaged(name))
        serving = self._all_serving_ready()
        # /status and k26_supervisor_ready say what is true now; READY=1 goes once.
        self.board.set_ready(serving)
        if serving and not self._ready_sent:
            self._ready_sent = True
            self.notifier.ready("k26-supervisor: every unit passed a sampled generation")
            log.info("READY=1: every serving unit passed a sampled probe")
        summary = self._summary()
        if summary != self._last_summary:
            self._last_summary = summary
            self.notifier.status(summary)

    def _all_serving_ready(self) -> bool:
        """Every unit that should serve is ready; for a pair, either of the two."""
        machines = self.policy.machines
        fallbacks = {s.fallback for s in self.policy.specs if s.fallback}
        for spec in self.policy.specs:
            if spec.name in fallbacks:
                continue  # judged together with its preferred unit
            members = [spec.name, spec.fallback] if spec.fallback else [spec.name]
            if not any(machines[m].state is UnitState.READY for m in members):
                return False
        return True

    def _summary(self) -> str:
        parts = [f"{n}={m.state}" for n, m in self.policy.machines.items()]
        return ("ready: " if self._ready_sent else "starting: ") + " ".join(parts)

    def _status_json(self) -> dict[str, Any]:
        return self.board.snapshot().to_json()

    def _extend_timeout(self) -> None:
        if not self._ready_sent:
            self.notifier.extend_timeout(EXTEND_TIMEOUT_S)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watchdog(self) -> None:
        interval = watchdog_interval_s()
        if not interval:
            return
        while True:  # WATCHDOG=1 from the loop itself: a stuck loop stops sending it
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def _reload(self) -> None:
        try:
            new = await asyncio.to_thread(load_config, self.config_path)
        except ConfigError as exc:
            msg = f"SIGHUP: {self.config_path} is invalid; keeping the running config: {exc}"
            log.error("%s", msg)
            self.notifier.status(msg)
            return
        if [u.model_dump() for u in new.units] != [u.model_dump() for u in self.config.units]:
            msg = "SIGHUP: the [[units]] list changed; restart the supervisor to apply it"
            log.error("%s", msg)
            self.notifier.status(msg)
            return
        self.config = new
        self.warmup = Warmup(new.flashinfer, self.board)
        log.info("SIGHUP: configuration reloaded from %s", self.config_path)

    async def _operator_action(self) -> None:
        """SIGUSR1: an operator asks to reset failed units and retry preferred ones."""
        now = time.monotonic()
        for name, machine in self.policy.machines.items():
            if machine.state is UnitState.FAILED:
                await self._feed(name, OperatorReset())
            elif machine.state is UnitState.STANDBY and self.policy.fallback_engaged(name):
                await self._execute(self.policy.handle(name, RetryPreferred(), now))
        self._sync_board()


def run(config_path: Path) -> int:
    config = load_config(config_path)
    logging.basicConfig(
        level=getattr(logging, str(config.supervisor.log_level).upper(), logging.INFO),
        format="%(levelname)s %(name)s: %(message)s",
    )
    # One line per probe from httpx would drown the supervisor's own log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return asyncio.run(Daemon(config, config_path).run())
