"""SIGTERM and SIGINT stop a run the way a stop from inside it does.

`kill`, `scancel` and SLURM's time limit send SIGTERM; Ctrl-C sends SIGINT (to the whole
foreground process group: vLLM's engine core gets it too). Left to their defaults, SIGTERM
ends the process where it stands and Ray's handler (installed by `ray.init`) exits from
wherever the main thread is: the MLflow run stays RUNNING, the cleanup never runs. While a run
is under way (`StopOnSignals`, around `RLLoop.execute`'s body), either signal cancels the
run's task instead: the cleanup runs as for any stop (every process the run started is shut
down), the MLflow run ends KILLED with tag `rlexp.error` naming the signal, the resume command
is printed and the process exits with 128 + the signal's number (143, 130: what a shell
reports for a process the signal ended).

- A signal that arrives while the run already stops (its cleanup) does not interrupt it.
- A second signal while the run stops ends the process at once (same exit code): vLLM's
  engine is still taken down by its reaper, but the MLflow run stays RUNNING.
- A signal the process was started with ignored (`nohup`, a background shell) stays ignored.
- Code that holds the event loop finishes its stretch before the cancellation reaches the
  run (an engine's start: seconds); a fit running in its thread finishes before the process
  exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from types import FrameType

from rlexp.errors import Interrupted

log = logging.getLogger("rlexp")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SENDERS = {signal.SIGTERM: "kill, scancel or SLURM's time limit", signal.SIGINT: "Ctrl-C"}


class StopOnSignals:
    """From `install` (in the run's task) to `restore`: SIGTERM and SIGINT cancel that task;
    `received` is the first signal that came. `stopping`: the run stops (by itself or by a
    signal) and cleans up; no signal cancels it any more."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.stopping = False
        self._previous: dict[signal.Signals, object] = {}
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def install(cls) -> StopOnSignals:
        """Handlers for the task running now (on the main thread: the only one signals reach;
        elsewhere nothing is installed)."""
        self = cls()
        if threading.current_thread() is not threading.main_thread():
            return self
        self._task, self._loop = asyncio.current_task(), asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """The handlers from before `install` back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            os.write(2, f"rlexp: {sig.name} again while the run stops: exiting now\n".encode())
            os._exit(128 + signum)
        self.received = sig
        if self.stopping:
            log.warning("%s received while the run stops: its cleanup goes on (a second signal "
                        "exits at once)", sig.name)
            return
        log.warning("%s received (%s): stopping the run (a second signal exits at once)",
                    sig.name, SENDERS[sig])
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        """The run's task cancelled, unless it stops by itself meanwhile (its cleanup runs in
        that same task and must not be cut short)."""
        if not self.stopping and self._task is not None:
            self._task.cancel()

    def stop(self, resume_hint: str) -> Interrupted | None:
        """The error the run stops with, when a signal stopped it (whatever the run raised
        meanwhile: the engine core's own exit on the same Ctrl-C, a cancelled call)."""
        self.stopping = True
        if self.received is None:
            return None
        sig = self.received
        return Interrupted(f"{sig.name} ({SENDERS[sig]}) stopped the run; {resume_hint}", sig.value)
