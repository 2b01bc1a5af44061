"""Live progress of a run (and of the sweep it belongs to): step / total, elapsed, ETA, the
last training reward and eval accuracy.

On a terminal it is one status line kept at the bottom and redrawn in place after every step;
log records print above it. Anywhere else (a log file, a pipe, CI) it is a plain log line
every `every_s` seconds, without control characters. At every evaluation it is also logged,
so the run's log file has it either way."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger("rlexp")
ERASE_LINE = "\r\x1b[2K"


@dataclass
class SweepPosition:
    """Where a job sits in its sweep: `job` jobs ran before it, out of `jobs`, since `started`."""
    job: int
    jobs: int
    started: float
    name: str = ""


def duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    def __init__(self, total_steps: int, start_step: int = 0, sweep: SweepPosition | None = None,
                 stream: TextIO | None = None, every_s: float = 30.0):
        self.total, self.start_step, self.step = total_steps, start_step, start_step
        self.sweep, self.every_s = sweep, every_s
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() and os.environ.get("TERM", "") != "dumb"
        self.t0 = self.last_print = time.time()
        self.reward: float | None = None
        self.eval: tuple[int, float] | None = None
        self.shown = False
        self._hooked: list[tuple[logging.StreamHandler, TextIO]] = []
        if self.tty:
            self._hook_console()

    def line(self) -> str:
        now, done = time.time(), self.step - self.start_step
        left = self.total - self.step
        eta = (now - self.t0) / done * left if done else None
        parts = [f"step {self.step}/{self.total} {100 * self.step // max(self.total, 1)}%",
                 f"{duration(now - self.t0)} elapsed, ETA {duration(eta) if eta is not None else '?'}"]
        if self.reward is not None:
            parts.append(f"reward {self.reward:.3f}")
        if self.eval is not None:
            parts.append(f"eval {self.eval[1]:.3f} @{self.eval[0]}")
        if self.sweep is not None and self.sweep.jobs:
            sw = self.sweep
            frac = sw.job + (done / (done + left) if done + left else 1.0)  # jobs' worth done
            sweep_eta = (now - sw.started) / frac * (sw.jobs - frac) if frac > 0 else None
            parts.append(f"job {sw.job + 1}/{sw.jobs} {sw.name}, sweep ETA "
                         f"{duration(sweep_eta) if sweep_eta is not None else '?'}".replace("  ", " "))
        return " | ".join(parts)

    def update(self, step: int, reward: float | None = None) -> None:
        self.step = step
        if reward is not None:
            self.reward = reward
        if self.tty:
            self.draw()
        elif time.time() - self.last_print >= self.every_s:
            self.log()

    def evaluated(self, step: int, accuracy: float) -> None:
        self.eval = (step, accuracy)
        self.log()

    def log(self) -> None:
        self.last_print = time.time()
        log.info("progress: %s", self.line())

    # ---- terminal ---------------------------------------------------------------------
    def draw(self) -> None:
        width = shutil.get_terminal_size((120, 24)).columns
        self.stream.write(ERASE_LINE + self.line()[: width - 1])
        self.stream.flush()
        self.shown = True

    def erase(self) -> None:
        if self.shown:
            self.stream.write(ERASE_LINE)
            self.shown = False

    def _hook_console(self) -> None:
        """Console log handlers writing to our stream erase the status line first and redraw it
        after each record."""
        for logger in (logging.getLogger(), log):
            for h in logger.handlers:
                if type(h) is logging.StreamHandler and h.stream is self.stream:
                    self._hooked.append((h, h.stream))
                    h.setStream(_StatusAware(self))  # type: ignore[arg-type]

    def close(self) -> None:
        self.erase()
        for handler, stream in self._hooked:
            handler.setStream(stream)  # type: ignore[arg-type]
        self._hooked.clear()
        if self.tty:
            self.stream.flush()


class _StatusAware:
    def __init__(self, progress: Progress):
        self.progress = progress

    def write(self, text: str) -> int:
        p = self.progress
        redraw = p.shown
        p.erase()
        n = p.stream.write(text)
        if redraw and text.endswith("\n"):
            p.draw()
        return n

    def flush(self) -> None:
        self.progress.stream.flush()
