"""Reading other processes' command lines in tests that watch a run's processes exit."""
import contextlib

import psutil


def running_cmdline(p: psutil.Process) -> str | None:
    """The first 100 characters of a process's command line; None once it has exited or is a
    zombie, which it may become between any two calls on it."""
    with contextlib.suppress(psutil.Error):
        if p.status() != psutil.STATUS_ZOMBIE:
            return " ".join(p.cmdline())[:100]
    return None
