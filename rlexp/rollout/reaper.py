"""Takes the vLLM engine's processes down with rlexp's, however rlexp ends.

vLLM's engine core runs in a child process that outlives a SIGKILLed parent (measured:
the orphaned engine and its worker kept ~2.5 GB and a core busy). The reaper is a small
process holding the read end of a pipe from rlexp: when rlexp dies the pipe closes, and
the reaper kills the processes the engine started and removes their temporary files
(rlexp/orphans.py). A normal shutdown stops the reaper, then kills whatever of those
processes outlived it (none should; one stuck where vLLM's shutdown cannot reach it must not
outlive the run either). Processes are matched by pid and start time, so a reused pid is
never killed.

    python -m rlexp.rollout.reaper <pid>:<start time> ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from rlexp import orphans

TEMP_PREFIX = "rlexp-vllm-"  # the engine's temporary directory (rlexp/orphans.py)
EXIT_GRACE_S = 5.0  # for a shut-down engine's processes to exit by themselves before they are killed
KILL_WAIT_S = 10.0  # for killed processes to be gone; the kernel frees a GB-sized one in well under 1 s

log = logging.getLogger("rlexp")


@dataclass
class Reaper:
    process: subprocess.Popen
    watched: list[tuple[int, float]]  # (pid, start time) of the processes it takes down


def snapshot() -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process but multiprocessing's resource
    tracker: the whole process's (started with vLLM's engine, used by whatever comes after),
    it exits by itself when this process does."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since it was listed
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.add((p.pid, p.create_time()))
    return out


def temp_names() -> set[str]:
    """The names in /dev/shm and the temp dir now."""
    shm = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {*shm, *os.listdir(orphans.temp_root())}


def new_temp_files(before: set[tuple[int, float]], names_before: set[str]) -> list[str]:
    """Files in /dev/shm and the temp dir that are new since `names_before` and that this
    process or those started since `before` map or hold open: vLLM's message queues (~160 MB
    of RAM each) and its torch.distributed store, which a killed engine leaves behind."""
    roots = ("/dev/shm/", orphans.temp_root() + "/")
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


def start(before: set[tuple[int, float]]) -> Reaper | None:
    """Watch the processes started since `before` was taken."""
    new = sorted(snapshot() - before)
    if not new:
        return None
    args = [f"{pid}:{t!r}" for pid, t in new]
    return Reaper(subprocess.Popen([sys.executable, "-m", "rlexp.rollout.reaper", *args],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL), new)


def stop(reaper: Reaper | None) -> None:
    """Stop the reaper, then kill the watched processes that have not exited within
    EXIT_GRACE_S and wait (at most KILL_WAIT_S) until they are gone: when this returns,
    nothing the engine started runs."""
    if reaper is None:
        return
    reaper.process.kill()
    reaper.process.wait()
    left = kill(reaper.watched, grace_s=EXIT_GRACE_S)
    if left:
        log.warning("killed %d process(es) left running after the shutdown: %s", len(left), left)


def kill(watched: list[tuple[int, float]], grace_s: float = 0.0) -> list[int]:
    """SIGKILL those of `watched` still running after `grace_s`; the pids killed, once they
    are gone (or zombies: dead, waiting for their parent to reap them) or KILL_WAIT_S has
    passed."""
    alive = []
    for pid, created in watched:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3:
                alive.append(p)
    alive = _wait_gone(alive, grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _wait_gone(alive, KILL_WAIT_S)
    return [p.pid for p in alive]


def _wait_gone(procs: list[psutil.Process], wait_s: float) -> list[psutil.Process]:
    """Those of `procs` still running after at most `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (running := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(args: list[str]) -> None:
    # Ctrl-C reaches the whole process group, SLURM's SIGTERM every process of the job: the
    # reaper stays until rlexp is gone, however rlexp ends (it stops the reaper with SIGKILL).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()  # returns when rlexp closes the pipe: it exited or died
    kill([(int(pid), float(created)) for pid, created in (arg.split(":") for arg in args)])
    orphans.reap(TEMP_PREFIX)  # the dead engine's sockets and shared memory


if __name__ == "__main__":
    main(sys.argv[1:])
