"""Starting runs as a terminal would, and reading other processes' command lines in tests that
watch a run's processes exit."""
import contextlib
import signal

import psutil

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def like_a_terminal() -> None:
    """`preexec_fn` for a run a test signals: SIGINT and SIGTERM at their defaults and unblocked,
    as a terminal's foreground process has them. Otherwise the run inherits the test worker's
    state: one started with SIGINT ignored keeps it ignored (rlexp/signals.py: `nohup`), and a
    blocked SIGINT is never delivered (a CI harness may start the suite so)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def running_cmdline(p: psutil.Process) -> str | None:
    """The first 100 characters of a process's command line; None once it has exited or is a
    zombie, which it may become between any two calls on it."""
    with contextlib.suppress(psutil.Error):
        if p.status() != psutil.STATUS_ZOMBIE:
            return " ".join(p.cmdline())[:100]
    return None
