"""Takes the vLLM engine's processes down with rlexp's, however rlexp ends.

vLLM's engine core runs in a child process that outlives a SIGKILLed parent (measured:
the orphaned engine and its worker kept ~2.5 GB and a core busy). The reaper is a small
process holding the read end of a pipe from rlexp: when rlexp dies the pipe closes, and
the reaper kills the processes the engine started. A normal shutdown stops the reaper
first. Processes are matched by pid and start time, so a reused pid is never killed.

    python -m rlexp.rollout.reaper <pid>:<start time> ...
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil


def snapshot() -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since it was listed
            out.add((p.pid, p.create_time()))
    return out


def start(before: set[tuple[int, float]]) -> subprocess.Popen | None:
    """Watch the processes started since `before` was taken."""
    new = snapshot() - before
    if not new:
        return None
    args = [f"{pid}:{t!r}" for pid, t in sorted(new)]
    return subprocess.Popen([sys.executable, "-m", "rlexp.rollout.reaper", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def stop(reaper: subprocess.Popen | None) -> None:
    if reaper is not None:
        reaper.kill()
        reaper.wait()


def main(args: list[str]) -> None:
    sys.stdin.buffer.read()  # returns when rlexp closes the pipe: it exited or died
    for arg in args:
        pid, created = arg.split(":")
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(created)) < 1e-3:
                p.kill()
        except psutil.NoSuchProcess:
            continue  # already gone: nothing to kill


if __name__ == "__main__":
    main(sys.argv[1:])
