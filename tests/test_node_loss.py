"""A Ray node lost under a run (tests/ray_nodes.py: a head with no CPUs and worker nodes of
one CPU each, all on this host; the head's GCS notices a dead node within about 2 s).

1. The only worker node is SIGKILLed (raylet, object store and all) while a weight push to
   its replica is under way: the replica is reported lost with its node, cannot be placed
   again (no other node has room), is given up after cluster.restart_timeout_s, and the run
   stops with exit code 3 and the resume hint, its MLflow run FAILED, nothing it started
   left running and no weight file left in /dev/shm.
2. Two new nodes join; the run resumes on them. The replica's node is SIGKILLed between two
   steps (the run held still meanwhile), so the next rollout finds it gone: Ray places the
   replica on the other node, the pool reloads the current weights into it, and the run
   finishes: every step logged once, in one MLflow run."""

import contextlib
import os
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from rlexp import orphans
from tests.processes import like_a_terminal, running_cmdline
from tests.ray_nodes import RayNodes
from tests.test_resume import ROOT, _cmd, _resume_cmd, _run, _steps, _wait_for
from tests.test_run import _history

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.serial]  # see pyproject.toml
HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
GIVE_UP_S = 10  # cluster.restart_timeout_s of part 1: no node can take the replica
LINE = re.compile(r"^\[([\d-]+ [\d:,]+)\]\[([\w.]+)\]\[\w+\] - (.*)$")


@pytest.fixture
def cluster(tmp_path, run_temp):
    nodes = RayNodes(tmp_path / "ray").start(**HEALTH)  # its nodes' processes write into run_temp
    try:
        yield nodes
    finally:
        assert not nodes.stop()


def _start(cmd, log, env):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=like_a_terminal,
                            env=env | {"HF_HUB_OFFLINE": "1"})


def _lines(log: Path, after: float, pattern: str) -> list[tuple[float, str]]:
    """(seconds since `after`, message) of the log lines matching `pattern`."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m and re.search(pattern, m.group(3)):
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if t >= after:
                found.append((t - after, m.group(3)))
    return found


def _node_ips(log: Path) -> dict[str, str]:
    """Node id (short) -> address, from the run's cluster description."""
    _, line = _lines(log, 0, r"^ray: cluster of \d+ node")[-1]
    return dict(re.findall(r"(\w{8}) ([\d.]+) \d+ CPU", line))


def _left_running(cluster: RayNodes) -> list[str]:
    """The cluster's replicas and vLLM engine cores still running a minute after the run (none
    expected)."""
    procs = [p for p in cluster.processes()
             if "EngineReplica" in (cmd := running_cmdline(p) or "") or "VLLM::EngineCore" in cmd]
    _, alive = psutil.wait_procs(procs, timeout=60)
    return [cmd for p in alive if (cmd := running_cmdline(p))]


def _weight_files() -> set[Path]:
    """Weight files in the test's own temporary root (the `run_temp` fixture)."""
    return set(Path(os.environ[orphans.TEMP_DIR_ENV]).glob("rlexp-weights-*"))


def test_a_lost_node_stops_the_run_cleanly_and_a_node_with_room_takes_its_replica(tmp_path, run_models,
                                                                                  new_store, cluster):
    store, run_dir, log = new_store(tmp_path), tmp_path / "out", tmp_path / "run.log"
    ray = ("cluster=ray", f"cluster.address={cluster.address}", "rollout.replicas=1",
           "cluster.cpus_per_replica=1", "weight_transfer._target_=tests.fakes.MarksPush",
           f"+weight_transfer.marks={tmp_path / 'marks'}", f"cluster.restart_timeout_s={GIVE_UP_S}",
           # each sample waits 1 s before its rollout: a driver stopped right after a checkpoint
           # has sent no request of the next step yet
           "agent=faulty", "agent.hang_rate=1.0", "agent.hang_s=1")
    cmd = _cmd(store, run_dir, run_models, "trainer.total_steps=4", *ray)
    node_a = _lose_the_only_node(cluster, cmd, log, tmp_path / "marks")
    out = log.read_text()
    assert f"Resume: python -m rlexp.run resume={run_dir}" in out
    c, run = _run(store)
    assert run.info.status == "FAILED" and "EngineDead" in run.data.tags["rlexp.error"]
    assert _left_running(cluster) == []
    assert not _weight_files()
    params = run.data.params
    assert params["cluster.nodes"] == "2" and params["cluster.nodes_used"] == "2"  # the head and node a
    assert params["cluster.multi_node"] == "True" and params["cluster.cpus"] == "1.0"
    assert params["cluster.auto_transport"] == "ObjectStoreTransport"
    assert params["cluster.replica_nodes"] == node_a

    resumed = _move_the_replica(cluster, _resume_cmd(run_dir, "cluster=ray", "cluster.restart_timeout_s=300"),
                                log, run_dir, tmp_path / "resumed.log")
    assert resumed == 0, log.read_text()[-4000:]
    c, run = _run(store)
    assert run.info.status == "FINISHED" and run.data.tags["rlexp.resumes"] == "1"
    assert _steps(c, run, "train/loss") == [1, 2, 3, 4]  # every step once, in one MLflow run
    assert _history(c, run, "replica/0/restarts")[-1] == 1.0
    assert _left_running(cluster) == []
    assert not _weight_files()


def _lose_the_only_node(cluster, cmd, log: Path, marks: Path) -> str:
    """Part 1: the only worker node lost during the weight push of version 2: exit 3, the
    replica reported lost with its node, then given up. Returns the node's id."""
    a = cluster.add_node(cpus=1)
    with open(log, "a") as f:
        proc = _start(cmd, f, cluster.env)
        try:
            _wait_for(marks / "push_2", proc)
            killed = time.time()
            cluster.kill(a)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = log.read_text()
    assert rc == 3, out[-4000:]
    ids = {ip: node for node, ip in _node_ips(log).items()}
    lost = _lines(log, killed, rf"^rollout replica 0 lost during .* \(node {ids[a]}\)")
    gone = _lines(log, killed, rf"^rollout replica 0 lost for good \(node {ids[a]}\): not running again "
                               rf"within {GIVE_UP_S}s")
    assert lost and gone, out[-4000:]
    print(f"node lost: {lost[0][0]:.1f} s to '{lost[0][1][:60]}', {gone[0][0]:.1f} s to given up, "
          f"{time.time() - killed:.1f} s to exit 3")
    assert f"rlexp: run stopped: every rollout replica was lost (1): replica 0 on node {ids[a]}" in out
    return ids[a]


def _move_the_replica(cluster, cmd, log: Path, run_dir: Path, resumed: Path) -> int:
    """Part 2: two nodes join, `cmd` resumes there; held still after its first checkpoint, the
    replica's node is SIGKILLed: the next rollout finds it lost, Ray places it on the other
    node. Returns the run's exit code."""
    b, c = cluster.add_node(cpus=1), cluster.add_node(cpus=1)
    printed = log.stat().st_size
    with open(log, "a") as f:
        proc = _start(cmd, f, cluster.env)
        try:
            _wait_for(run_dir / "checkpoints" / "step_2" / "meta.json", proc)
            proc.send_signal(signal.SIGSTOP)  # between steps 2 and 3: the next call is a rollout
            resumed.write_bytes(log.read_bytes()[printed:])
            ids = {ip: node for node, ip in _node_ips(resumed).items()}
            (_, up), = _lines(resumed, 0, r"^ray: 1 rollout replica\(s\) up")
            victim = next(ip for ip in (b, c) if ids[ip] in up)
            killed = time.time()
            cluster.kill(victim)
            # the replica's process outlives its raylet by a moment: gone, it cannot serve step 3
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(int(re.search(r"pid (\d+)", up).group(1))).wait(timeout=60)
            proc.send_signal(signal.SIGCONT)
            rc = proc.wait(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    resumed.write_bytes(log.read_bytes()[printed:])
    other = ids[c if victim == b else b]
    lost = _lines(resumed, killed, rf"^rollout replica 0 lost during a generation \(node {ids[victim]}\)")
    back = _lines(resumed, killed, rf"^rollout replica 0 restarted by Ray on node {other}; serves policy "
                                   r"version 2")
    assert lost and back, resumed.read_text()[-4000:]
    print(f"node lost: {lost[0][0]:.1f} s to the replica reported lost, {back[0][0]:.1f} s to it serving "
          "again on the other node")
    return rc
