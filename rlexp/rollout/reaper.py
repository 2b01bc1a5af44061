"""Takes the vLLM engine's processes down with rlexp's, however rlexp ends.

vLLM's engine core runs in a child process that outlives a SIGKILLed parent (measured:
the orphaned engine and its worker kept ~2.5 GB and a core busy). The reaper is a small
process holding the read end of a pipe from rlexp: when rlexp dies the pipe closes, and
the reaper kills the processes the engine started and removes their temporary files
(rlexp/orphans.py). A normal shutdown stops the reaper first. Processes are matched by
pid and start time, so a reused pid is never killed.

    python -m rlexp.rollout.reaper <pid>:<start time> ...
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import psutil

from rlexp import orphans

TEMP_PREFIX = "rlexp-vllm-"  # the engine's temporary directory (rlexp/orphans.py)


def snapshot() -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since it was listed
            out.add((p.pid, p.create_time()))
    return out


def temp_names() -> set[str]:
    """The names in /dev/shm and the temp dir now."""
    shm = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {*shm, *os.listdir(tempfile.gettempdir())}


def new_temp_files(before: set[tuple[int, float]], names_before: set[str]) -> list[str]:
    """Files in /dev/shm and the temp dir that are new since `names_before` and that this
    process or those started since `before` map or hold open: vLLM's message queues (~160 MB
    of RAM each) and its torch.distributed store, which a killed engine leaves behind."""
    roots = ("/dev/shm/", tempfile.gettempdir() + "/")
    paths: set[str] = set()
    for pid in [os.getpid(), *(pid for pid, _ in snapshot() - before)]:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                paths |= {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    new = temp_names() - names_before
    return sorted(p for p in paths if p.startswith(roots) and p.split("/")[-1] in new and "/rlexp-" not in p)


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
                p.wait(10)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            continue  # already gone: nothing to kill
    orphans.reap(TEMP_PREFIX)  # the dead engine's sockets and shared memory


if __name__ == "__main__":
    main(sys.argv[1:])
