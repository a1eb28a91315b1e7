"""How the stand-in lives and dies: SGLang 0.5.17's process shape, stop and crash paths.

Read from sglang 0.5.17 (``srt/managers/tokenizer_manager.py``,
``srt/entrypoints/engine.py``, ``srt/utils/watchdog.py``, ``srt/utils/common.py``)
and seen on a real server (docs/sglang-shapes.md):

- The launcher runs the HTTP server and starts a scheduler child
  (``sglang::scheduler``); a watchdog thread notices the child's death and
  SIGQUITs the launcher: ``Subprocess scheduler_0 (pid=N) crashed with exit code
  -9. Triggering SIGQUIT for cleanup...``.
- SIGQUIT while starting: ``Received sigquit from a child process. It usually
  means the child failed.``; once running: ``SIGQUIT received. signum=...,
  frame=.... It usually means one child failed.``, then ``Sleeping 5 seconds
  before crash diagnostics to let GPU activity settle.`` Either way it ends in
  ``kill_process_tree(os.getpid())``: children SIGKILLed, then the launcher
  SIGKILLs itself, so systemd reports ``Result=signal``, status 9.
- SIGTERM: ``SIGTERM received. signum=15 frame=... Draining requests and shutting
  down...``; a watchdog polling every 5 s then logs ``Gracefully exiting...
  Remaining number of requests N. ...`` until none remain, and calls
  ``kill_process_tree(os.getpid(), include_parent=True)``: an ordinary stop also
  ends in the launcher's own SIGKILL.

``--stop-mode clean`` (not SGLang's behaviour) exits 0 after the drain instead;
``--stop-mode sigterm`` dies of SIGTERM's default action at once, as any plain
Python server does.
Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
SCHEDULER_TITLE = "sglang::scheduler"
_SCHEDULER_CODE = f"""
import ctypes, signal
ctypes.CDLL(None).prctl({_PR_SET_NAME}, b"sglang::schedul", 0, 0, 0)
while True:
    signal.pause()
"""


def _die_with_parent() -> None:
    # Set before exec (the child has no threads yet): no window in which the
    # launcher could die and leave the child behind.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def stamp(tp: bool = False) -> str:
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"[{now} TP0]" if tp else f"[{now}]"


class Lifecycle:
    """The launcher's side: its scheduler child, the stop drain and the crash path."""

    def __init__(
        self,
        say: Callable[[str], None],
        *,
        in_flight: Callable[[], list[str]],
        on_stop: Callable[[], None],
        sigterm_poll_s: float = 5.0,
        crash_diagnostics_s: float = 5.0,
        stop_mode: str = "sglang",
    ) -> None:
        self.say = say
        self.in_flight = in_flight  # rids of requests being served
        self.on_stop = on_stop  # stop serving (used by --stop-mode clean)
        self.sigterm_poll_s = sigterm_poll_s
        self.crash_diagnostics_s = crash_diagnostics_s
        self.stop_mode = stop_mode
        self.running = False  # past start-up: SIGQUIT takes the running-phase path
        self.gracefully_exit = threading.Event()
        self._dying = threading.Lock()
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.scheduler_title = SCHEDULER_TITLE

    # --- the scheduler child ------------------------------------------------------

    def start_scheduler(self) -> int:
        """Start the ``sglang::scheduler`` child; it dies with the launcher. Call it
        before starting any thread (it forks with a pre-exec hook)."""
        self.scheduler = subprocess.Popen(
            [SCHEDULER_TITLE, "-c", _SCHEDULER_CODE],
            executable=sys.executable,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            preexec_fn=_die_with_parent,  # safe: no thread runs yet
        )
        threading.Thread(target=self._watch_scheduler, name="watchdog", daemon=True).start()
        return self.scheduler.pid

    def _watch_scheduler(self) -> None:
        proc = self.scheduler
        assert proc is not None
        code = proc.wait()
        if self.gracefully_exit.is_set() or not self._dying.acquire(blocking=False):
            return  # we are taking it down ourselves
        self._dying.release()
        self.say(
            f"{stamp()} Subprocess scheduler_0 (pid={proc.pid}) crashed with exit code {code}. "
            "Triggering SIGQUIT for cleanup..."
        )
        self.child_failed()

    # --- SIGQUIT: a child failed --------------------------------------------------

    def child_failed(self) -> None:
        """What SGLang's SIGQUIT handlers do; never returns."""
        with self._dying:
            if self.running:
                # SGLang's handler is called with signum=None (seen on 0.5.17).
                self.say(
                    f"{stamp()} SIGQUIT received. signum=None, frame=None. "
                    "It usually means one child failed."
                )
                if self.crash_diagnostics_s > 0:
                    self.say(
                        f"{stamp()} Sleeping 5 seconds before crash diagnostics to let GPU "
                        "activity settle."
                    )
                    time.sleep(self.crash_diagnostics_s)
                    if self.scheduler is None or self.scheduler.poll() is not None:
                        self.say(
                            f"{stamp()} No live scheduler processes found; skipping py-spy "
                            "and CUDA coredump."
                        )
            else:
                self.say(
                    f"{stamp()} Received sigquit from a child process. "
                    "It usually means the child failed."
                )
            self.kill_process_tree()

    def exit_quietly(self, status: int) -> None:
        """A launcher that ends after a fatal engine error with ``status`` and no
        SIGQUIT path (sglang #29284: exit 0 after the scheduler's error); never returns."""
        with self._dying:
            if self.scheduler is not None and self.scheduler.poll() is None:
                self.scheduler.kill()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def kill_process_tree(self) -> None:
        pid = os.getpid()
        self.say(
            f"{stamp()} kill_process_tree called: parent_pid={pid}, include_parent=True, pid={pid}"
        )
        if self.scheduler is not None and self.scheduler.poll() is None:
            self.scheduler.kill()
        os.kill(pid, signal.SIGKILL)

    # --- SIGTERM: drain, then the same end ----------------------------------------

    def on_sigterm(self, signum: int) -> None:
        """The signal handler's part: log and raise the flag, as SGLang does."""
        if self.stop_mode == "sigterm":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.gracefully_exit.is_set():
            return
        self.say(  # signum=None: as SGLang 0.5.17 printed it on a real stop
            f"{stamp()} SIGTERM received. signum=None frame=None. "
            "Draining requests and shutting down..."
        )
        self.gracefully_exit.set()

    def sigterm_watchdog(self) -> None:
        """SGLang's ``sigterm_watchdog``: polls every 5 s, drains, then kills the tree."""
        while not self.gracefully_exit.is_set():
            time.sleep(self.sigterm_poll_s)  # SGLang checks its flag every 5 s
        while True:
            rids = self.in_flight()
            self.say(
                f"{stamp()} Gracefully exiting... Remaining number of requests {len(rids)}. "
                f"Remaining requests remaining_rids={rids!r}."
            )
            if not rids:
                break
            time.sleep(self.sigterm_poll_s)
        with self._dying:
            if self.stop_mode == "clean":
                if self.scheduler is not None and self.scheduler.poll() is None:
                    self.scheduler.terminate()
                    self.scheduler.wait()
                self.on_stop()
                return
            self.kill_process_tree()
