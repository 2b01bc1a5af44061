"""Takes the vLLM engine's processes down with rlexp's, however rlexp ends.

vLLM's engine core runs in a child process that outlives a SIGKILLed parent (measured:
the orphaned engine and its worker kept ~2.5 GB and a core busy). The reaper is a small
process holding the read end of a pipe from rlexp: when rlexp dies the pipe closes, and
the reaper kills the processes the engine started and removes their temporary files
(rlexp/orphans.py). A normal shutdown stops the reaper, then kills whatever of those
processes outlived it (none should; one stuck where vLLM's shutdown cannot reach it must not
outlive the run either). Processes are matched by pid and start time, so a reused pid is
never killed.

The reaper starts before the engine (`start`, then the engine starts inside `watching`): a
kill while the engine starts (seconds on CPU) must leave nothing either. Until the engine is
up, rlexp cannot list its processes, so the reaper lists rlexp's descendants itself every
POLL_S; a process started less than POLL_S before rlexp dies may escape it. Once the engine
is up, rlexp sends the reaper their pids and the reaper stops polling. (Marks a child could
inherit do not survive vLLM's: `setproctitle` overwrites its environment, and `spawn`
closes inherited descriptors.)

    python -m rlexp.rollout.reaper      (stdin: "<pid>:<start time>" lines, then ".")
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil

from rlexp import orphans

TEMP_PREFIX = "rlexp-vllm-"  # the engine's temporary directory (rlexp/orphans.py)
EXIT_GRACE_S = 5.0  # for a shut-down engine's processes to exit by themselves before they are killed
KILL_WAIT_S = 10.0  # for killed processes to be gone; the kernel frees a GB-sized one in well under 1 s
POLL_S = 0.2  # how often the reaper lists rlexp's descendants while the engine starts (~3 ms of CPU each)

log = logging.getLogger("rlexp")
_pipes: set[int] = set()  # this process's ends of its reapers' pipes, which no fork may hold open


@dataclass
class Reaper:
    process: subprocess.Popen
    watched: list[tuple[int, float]] = field(default_factory=list)  # (pid, start time) it takes down


def snapshot() -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process but reapers and multiprocessing's
    resource tracker: the whole process's (started with vLLM's engine, used by whatever comes
    after), it exits by itself when this process does."""
    return descendants(psutil.Process())


def descendants(process: psutil.Process) -> set[tuple[int, float]]:
    """(pid, start time) of `process`'s descendants but multiprocessing's resource tracker
    and reapers (each takes down its own watched processes)."""
    out = set()
    for p in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since it was listed
            command = " ".join(p.cmdline())
            if "multiprocessing.resource_tracker" not in command and "rlexp.rollout.reaper" not in command:
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


def start() -> Reaper:
    """A reaper, polling from its start; call the start it watches inside `watching`."""
    process = subprocess.Popen([sys.executable, "-m", "rlexp.rollout.reaper"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    _pipes.add(process.stdin.fileno())
    process.stdout.read(1)  # it has listed what ran before it, and polls
    return Reaper(process)


@contextlib.contextmanager
def watching(reaper: Reaper) -> Iterator[None]:
    """The processes started inside (and their descendants) are the reaper's from their start;
    once the block ends, their pids are sent to it and it stops polling. On an error too:
    whatever a failed start left running is killed by `stop`."""
    before = snapshot()
    try:
        yield
    finally:
        reaper.watched += sorted(snapshot() - before)
        assert reaper.process.stdin is not None
        reaper.process.stdin.write("".join(f"{pid}:{t!r}\n" for pid, t in reaper.watched).encode() + b".\n")
        reaper.process.stdin.flush()


def _after_fork_in_child() -> None:
    """A forked child holds no reaper's pipe open: that reaper would wait for the child too."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd in _pipes:  # pointed elsewhere, not closed: the number stays this file object's
        with contextlib.suppress(OSError):
            os.dup2(devnull, fd)
    os.close(devnull)
    _pipes.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def stop(reaper: Reaper | None) -> None:
    """Stop the reaper, then kill the watched processes that have not exited within
    EXIT_GRACE_S and wait (at most KILL_WAIT_S) until they are gone: when this returns,
    nothing the engine started runs."""
    if reaper is None:
        return
    assert reaper.process.stdin is not None and reaper.process.stdout is not None
    _pipes.discard(reaper.process.stdin.fileno())
    reaper.process.kill()
    reaper.process.wait()
    reaper.process.stdin.close()
    reaper.process.stdout.close()
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


def main() -> None:
    # Ctrl-C reaches the whole process group, SLURM's SIGTERM every process of the job: the
    # reaper stays until rlexp is gone, however rlexp ends (it stops the reaper with SIGKILL).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    rlexp = psutil.Process(os.getppid())
    ran_before = descendants(rlexp)  # this reaper among them
    os.write(1, b"r")
    watched = listen(rlexp, ran_before)
    kill(sorted(with_descendants(watched)))
    orphans.reap(TEMP_PREFIX)  # the dead engine's sockets and shared memory


def listen(rlexp: psutil.Process, ran_before: set[tuple[int, float]]) -> set[tuple[int, float]]:
    """What to take down once rlexp closes the pipe (it exited or died): the pids it sent and,
    while the engine starts, the descendants of rlexp's seen since this reaper started."""
    watched: set[tuple[int, float]] = set()
    starting, pending = True, b""
    while True:
        if starting:
            with contextlib.suppress(psutil.Error):  # rlexp is gone: the pipe is closing
                watched |= descendants(rlexp) - ran_before
        if not select.select([0], [], [], POLL_S if starting else None)[0]:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return watched
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line == b".":
                starting = False
            elif line:
                pid, created = line.decode().split(":")
                watched.add((int(pid), float(created)))


def with_descendants(watched: set[tuple[int, float]]) -> set[tuple[int, float]]:
    """`watched` and the descendants of those of them still running."""
    out = set(watched)
    for pid, created in watched:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3:
                out |= descendants(p)
    return out


if __name__ == "__main__":
    main()
