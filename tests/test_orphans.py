import contextlib
import os
import signal
import subprocess
import sys

from rlexp import orphans


def test_a_live_owners_directory_is_kept_and_a_dead_owners_is_removed(tmp_path):
    mine, lock = orphans.owned_tempdir("rlexp-test-", str(tmp_path))
    (mine / "weights").write_bytes(b"x" * 1024)
    assert orphans.reap("rlexp-test-", str(tmp_path)) == [] and mine.exists()

    # another process owns one, is SIGKILLed: its lock goes with it
    code = ("import sys, time; from rlexp import orphans;"
            "d, _ = orphans.owned_tempdir('rlexp-test-', sys.argv[1]); print(d, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    theirs = tmp_path / os.path.basename(child.stdout.readline().strip())
    assert theirs.is_dir()
    assert orphans.reap("rlexp-test-", str(tmp_path)) == []  # alive: kept
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert orphans.reap("rlexp-test-", str(tmp_path)) == [theirs] and not theirs.exists()
    assert mine.exists()  # still owned by this process

    os.close(lock)  # as if this process had died
    assert orphans.reap("rlexp-test-", str(tmp_path)) == [mine]


def test_a_young_directory_without_a_lock_is_left_to_its_creator(tmp_path):
    young = tmp_path / "rlexp-test-young"
    young.mkdir()
    old = tmp_path / "rlexp-test-old"
    old.mkdir()
    os.utime(old, (0, 0))  # left long ago by a run without locks
    assert orphans.reap("rlexp-test-", str(tmp_path)) == [old]
    assert young.exists()


def test_paths_a_directory_owns_go_with_it(tmp_path):
    elsewhere = tmp_path / "psm_segment"
    elsewhere.write_bytes(b"x")
    directory, lock = orphans.owned_tempdir("rlexp-test-", str(tmp_path))
    orphans.own(directory, [str(elsewhere)])
    assert orphans.reap("rlexp-test-", str(tmp_path)) == [] and elsewhere.exists()  # owner alive
    os.close(lock)
    assert orphans.reap("rlexp-test-", str(tmp_path)) == [directory]
    assert not elsewhere.exists() and not directory.exists()


def test_stopping_the_reaper_kills_the_watched_processes_that_outlive_the_grace(monkeypatch):
    """A process of the engine's that is still running after the engine's shutdown (here: one
    that sleeps) is killed when the reaper stops, which returns once it is gone. One that
    exits by itself within the grace is not killed, and a reused pid (another start time) is
    never touched."""
    import psutil

    from rlexp.rollout import reaper

    monkeypatch.setattr(reaper, "EXIT_GRACE_S", 0.5)
    r = reaper.start()
    with reaper.watching(r):
        hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        quick = subprocess.Popen([sys.executable, "-c", "pass"])
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert {pid for pid, _ in r.watched} == {hung.pid, quick.pid, other.pid}
    r.watched = [(pid, t + 1.0) if pid == other.pid else (pid, t) for pid, t in r.watched]  # a reused pid
    quick.wait()
    reaper.stop(r)
    assert hung.poll() == -signal.SIGKILL
    assert quick.returncode == 0 and psutil.Process(other.pid).status() != psutil.STATUS_ZOMBIE
    assert r.process.poll() is not None  # the reaper itself is gone
    other.kill()
    other.wait()


def test_with_a_temp_root_the_weights_sockets_and_every_child_temp_file_go_there(tmp_path, monkeypatch):
    """`RLEXP_TEMP_DIR`: the weight file's directory (RAM), vLLM's socket directory and, through
    TMPDIR, what a child process of the run makes with `tempfile`, all under that root."""
    import tempfile

    from rlexp.rollout.reaper import TEMP_PREFIX
    from rlexp.weights.ram_file import RamFileTransport

    root = tmp_path / "run-temp"
    monkeypatch.setenv(orphans.TEMP_DIR_ENV, str(root))
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    orphans.use_temp_root()
    transport = RamFileTransport()
    sockets, lock = orphans.owned_tempdir(TEMP_PREFIX)
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert transport.directory.parent == root and sockets.parent == root
    assert os.path.dirname(child) == str(root)
    transport.close()
    orphans.remove(sockets, lock)
    assert sorted(p.name for p in root.iterdir()) == [os.path.basename(child)]


def test_without_a_temp_root_weights_go_to_ram_and_the_rest_to_the_system_temp_dir(monkeypatch):
    import tempfile

    monkeypatch.delenv(orphans.TEMP_DIR_ENV, raising=False)
    assert orphans.ram_root() == ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    assert orphans.temp_root() == tempfile.gettempdir()




STARTING = """
import multiprocessing as mp, subprocess, sys, threading, time
from rlexp.rollout import reaper

fork = mp.get_context("fork")
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
def sleep(): time.sleep(600)
def fork_from_a_thread(out):
    out.append(fork.Process(target=sleep))
    out[0].start()
def child(q):
    grandchild = fork.Process(target=sleep)
    grandchild.start()
    q.put(grandchild.pid)
    sleep()

q = fork.Queue()
before_fork, before_exec = fork.Process(target=sleep), subprocess.Popen(SLEEP)
before_fork.start()
r = reaper.start()
with reaper.watching(r):
    forked = fork.Process(target=child, args=(q,))
    forked.start()
    from_a_thread = []
    t = threading.Thread(target=fork_from_a_thread, args=(from_a_thread,))
    t.start()
    t.join()
    RUN = "import subprocess, sys; subprocess.run(sys.argv[1:])"
    execd = subprocess.Popen([sys.executable, "-c", RUN, *SLEEP])
    while not reaper.psutil.Process(execd.pid).children():
        time.sleep(0.01)
    time.sleep(5 * reaper.POLL_S)  # the reaper has polled since: none started within its window
    print(before_fork.pid, before_exec.pid, forked.pid, q.get(), from_a_thread[0].pid, execd.pid,
          reaper.psutil.Process(execd.pid).children()[0].pid, flush=True)
    sleep()  # killed here: inside the start, before the reaper is sent any pid
"""


def test_what_a_start_left_dies_with_its_parent_killed_mid_start():
    """A process SIGKILLed while it starts an engine inside `reaper.watching`, before it could
    send the reaper any pid: every process the start left, forked (also by another thread or
    by a child) or exec'd, is killed by the reaper, which polled for them; those started
    before are left alone (and killed here). Forked children hold no reaper's pipe open: else
    the reaper would wait for them to exit."""
    import psutil

    parent = subprocess.Popen([sys.executable, "-c", STARTING], stdout=subprocess.PIPE, text=True)
    pids = list(map(int, parent.stdout.readline().split()))
    procs = [psutil.Process(pid) for pid in pids]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        gone, alive = psutil.wait_procs(procs[2:], timeout=20)
        assert not alive, [p.pid for p in alive]
        for p in procs[:2]:
            assert p.is_running() and p.status() != psutil.STATUS_ZOMBIE, p.pid
    finally:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
