"""Whole runs with cluster=ray against cluster=local.

- Submitted with `ray job submit` to a Ray cluster of three nodes on this host (a head with no
  CPUs, two worker nodes: tests/ray_nodes.py), two vLLM replicas of the tiny model and a
  trainer group of two FSDP2 ranks spread over the worker nodes, the weights crossing into
  their object stores after every step: the same training as one process, per-replica and
  per-rank metrics in MLflow.
- On a local Ray: a multi-turn async PPO run whose trainer worker is SIGKILLed (the run stops
  with the resume hint), resumed with one worker, its driver SIGKILLed (no process left
  behind), resumed with two: every step logged once, the critic's too."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from tests.processes import running_cmdline
from tests.ray_nodes import VENV_BIN
from tests.test_resume import _resume_cmd, _run, _start, _steps, _wait_for
from tests.test_run import _history, _traces

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]
# cluster.address stays null: the job's RAY_ADDRESS names the cluster (docs/ray.md's recipe)
RAY = ("cluster=ray", "rollout.replicas=2", "trainer.workers=2", "cluster.strategy=SPREAD")
STEPS = 3  # keeps the suite short; docs/results.md has the 100-step curves


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _cmd(store, run_dir, models, *overrides):
    return [sys.executable, "-m", "rlexp.run", "experiment=smoke", "checkpoint.every_n_steps=0",
            f"logger.tracking_uri=sqlite:///{store}/mlflow.db", f"logger.artifact_location={store}/art",
            "logger.experiment_name=test", f"model.cache_dir={models}",
            # a model that gets some answers right: rewards vary, updates are real
            "model.warm_start_steps=200", "model.warm_start_lr=0.002", "data.source.max_operand=29",
            f"hydra.run.dir={run_dir}", *overrides]


def _finish(cmd, log, timeout=1200):
    """Run `cmd` to completion; on a timeout its whole process group goes (no run left
    competing with the next test)."""
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    assert rc == 0, Path(log).read_text()[-4000:]


def _open(tmp_path, models, *overrides, steps=STEPS, submit_to=None):
    """A run to its end, and its MLflow run. `submit_to`: a sweep of that one run submitted as
    a job of that Ray cluster (docs/sweeps.md "Sweeps on a Ray cluster"); its child run."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = _cmd(tmp_path, tmp_path / "out", models, f"trainer.total_steps={steps}", *overrides)
    if submit_to is None:
        _finish(cmd, tmp_path / "run.log")
        return _run(tmp_path)
    cmd[3:3] = ["-m", f"hydra.sweep.dir={tmp_path}/sweep"]  # after `python -m rlexp.run`
    _finish([str(VENV_BIN / "ray"), "job", "submit", f"--address={submit_to.dashboard}", "--", *cmd],
            tmp_path / "run.log")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    (child,) = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)  # the child and its parent
    return client, child


# Identical through 2 replicas and 2 trainer ranks: the replica that serves a request does not
# change its tokens (per-request seeds), and the 2 ranks' drift (below) flips no sampled token
# in these steps, so rollouts, rewards and evals are the same numbers.
IDENTICAL = ("rollout/reward_mean", "rollout/tokens", "rollout/response_length_mean", "samples/completed",
             "eval/accuracy", "eval/reward_mean", "train/response_tokens")
# Bounded: 2 FSDP ranks sum the gradients in another order than one process, so float32
# rounding (eps 1.2e-7) leaves the gradients 1e-7 apart (tests/test_trainer_ranks.py bounds
# one update's weights at 1.3e-6). AdamW divides by sqrt(v): where a gradient is near 0 that
# rounding can change a step by up to the learning rate, so the weights, and what later steps
# sample with them, drift further. Measured over 3 steps: loss 5.3e-8, grad norm 7.2e-7 (2.7e-7
# relative), entropy and ratios 3.6e-7 to 1.1e-5; sampled logprobs 0 at step 1 (the same
# weights), 1e-6 to 7e-6 at step 2, 2e-6 to 3.1e-4 at step 3. A sharding bug (a rank's rows
# dropped or counted twice, a wrong divisor) moves them by percents. What the object store
# delivers is exact: the ray run's sync check (engine vs its own trainer) stays at 1e-6.
DRIFT = {"train/loss": 1e-6, "train/grad_norm": 1e-5, "train/entropy": 1e-4, "train/ratio_mean": 1e-4}
TRACE_ROUNDING = 1e-6  # traces keep logprobs to 6 decimals
FIT_DRIFT_LOGPROB = 1e-3  # what the ranks' drift may move a sampled token's logprob by, per fit
SYNC_EXACT = 1e-5  # engine vs trainer on the same weights in fp32 (measured 8e-7 to 2e-6)


def test_two_replicas_and_two_ranks_on_two_nodes_train_like_one_engine_and_one_process(tmp_path, models,
                                                                                      nodes):
    """Sync scheduler, same seed, local vs 2 replicas and 2 trainer ranks on the two worker
    nodes (a `ray job submit`): every step samples the same tokens after each sync through
    the object store; rollout and eval histories are identical, the trainer's within DRIFT."""
    local = _open(tmp_path / "local", models)
    ray = _open(tmp_path / "ray", models, *RAY, submit_to=nodes)
    job_log = (tmp_path / "ray" / "run.log").read_text()
    assert f"ray: joined the cluster at {nodes.address} (RAY_ADDRESS={nodes.address}" in job_log
    assert "weight_transfer=auto: ObjectStoreTransport" in job_log
    for step in range(1, STEPS + 1):
        a, b = _traces(*local, step), _traces(*ray, step)
        assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b], step
        diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra["logprobs"], rb["logprobs"]))
        assert diff <= TRACE_ROUNDING + (step - 1) * FIT_DRIFT_LOGPROB, (step, diff)  # see DRIFT
    for key in IDENTICAL:
        assert _history(*local, key) == _history(*ray, key), key
        assert len(_history(*local, key)) in (STEPS, STEPS + 1), key  # eval also runs at step 0
    for key, rel in DRIFT.items():
        la, lb = _history(*local, key), _history(*ray, key)
        assert len(la) == len(lb) == STEPS and la != [0.0] * STEPS, key
        assert lb == pytest.approx(la, rel=rel, abs=1e-6), key
    client, run = ray
    assert max(_history(client, run, "sync/logprob_diff_max")) <= SYNC_EXACT  # every sync delivered
    assert _steps(client, run, "sync/logprob_diff_max") == list(range(1, STEPS + 1))
    params = run.data.params
    replica_nodes = params["cluster.replica_nodes"].split(",")
    trainer_nodes = params["cluster.trainer_nodes"].split(",")
    print("driver", params["cluster.driver_node"], "replicas", replica_nodes, "ranks", trainer_nodes)
    assert len(set(replica_nodes)) == 2 and set(trainer_nodes) == set(replica_nodes)  # one of each per node
    assert params["cluster.driver_node"] not in replica_nodes  # the head has no CPUs
    assert params["cluster.nodes"] == params["cluster.nodes_used"] == "3"  # the head, where the job runs
    assert params["cluster.multi_node"] == "True" and params["rollout.replicas"] == "2"
    assert params["cluster.auto_transport"] == "ObjectStoreTransport"
    # after every step's fit, both worker nodes pulled the new weights into their object stores
    assert _history(client, run, "weights/object_store_nodes_pulled") == [2.0] * STEPS
    pulled = _history(client, run, "weights/object_store_bytes_pulled")
    assert len(pulled) == STEPS and len(set(pulled)) == 1 and pulled[0] > 0
    print(f"object store: {pulled[0]:.0f} bytes pulled across nodes per sync")
    assert run.data.params["placement"] == "split" and run.data.params["trainer.workers"] == "2"
    assert "cluster.trainer_bundle" in run.data.params
    for rank in (0, 1):  # each trainer rank's peak memory, every step
        assert _steps(client, run, f"memory/rank_{rank}/peak_mb") == list(range(1, STEPS + 1))
        assert min(_history(client, run, f"memory/rank_{rank}/peak_mb")) > 0
    for i in (0, 1):  # both replicas served requests; each one's speed and restarts logged per step
        assert _steps(client, run, f"replica/{i}/requests") == list(range(1, STEPS + 1))
        assert sum(_history(client, run, f"replica/{i}/requests")) > 0
        assert _history(client, run, f"replica/{i}/restarts") == [0.0] * STEPS
        assert min(_history(client, run, f"replica/{i}/tokens_per_s")) > 0


def _kill_when(path, cmd, log, victim):
    """Start `cmd`, wait for `path`, SIGKILL `victim(proc)`'s processes; the run's exit code."""
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            _wait_for(path, proc)
            victim(proc)
            return proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _trainer_worker(proc) -> psutil.Process:
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "ray::TrainerWorker" in (running_cmdline(p) or "")]
    assert len(workers) == 2, workers
    return workers[-1]


def _watch_descendants(proc, path, seen: dict) -> None:
    """Until `path` appears, record every descendant `proc` ever has (Ray's, the replicas',
    vLLM's) in `seen` (pid -> process, its title as last read): a process listed only at the
    kill point could be caught between fork and retitling, or missed while one restarts."""
    while not path.exists():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {path} appeared"
        _record_descendants(proc, seen)
        time.sleep(0.2)


def _record_descendants(proc, seen: dict) -> None:
    """Every descendant `proc` has now, in `seen` (pid -> process, its title as read now)."""
    for p in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            seen[p.pid] = (p, " ".join([p.name(), *p.cmdline()]))


def _sigkill_driver_when(path, cmd, log, seen: dict) -> None:
    """Run `cmd` until `path` appears, its descendants recorded in `seen` all along, then
    SIGKILL its driver (only the driver: what it started must go by itself)."""
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            _watch_descendants(proc, path, seen)
            # Stopped first: steps 3 and 4 take seconds, so a running driver could finish the
            # run (its processes gone) while the last ones are listed; stopped, it keeps them.
            proc.send_signal(signal.SIGSTOP)
            _record_descendants(proc, seen)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _assert_all_seen_exit(seen: dict, log: Path) -> None:
    """Ray's processes, the replicas and vLLM's engine core were among those seen, and every
    one of them exits (within a minute) once the driver is gone."""
    titles = [title for _, title in seen.values()]
    for wanted in ("ray::EngineRep", "raylet", "gcs_server"):
        assert any(wanted in t for t in titles), (wanted, titles)
    # vLLM's engine core: by its title, and by the pid vLLM logs (a listing can catch the
    # process before it is retitled; the pid is certain)
    engine_cores = {int(pid) for pid in re.findall(r"\(EngineCore pid=(\d+)\)", log.read_text())}
    assert engine_cores or any("VLLM::EngineCo" in t for t in titles), titles
    procs = [p for p, _ in seen.values()]
    for pid in engine_cores - set(seen):
        with contextlib.suppress(psutil.NoSuchProcess):  # part 1's engine core is long gone
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not [cmd for p in alive if (cmd := running_cmdline(p))]


def test_killed_trainer_worker_then_driver_resume_with_one_then_two_workers(tmp_path, models):
    store, run_dir, log = tmp_path, tmp_path / "out", tmp_path / "run.log"
    ckpt = run_dir / "checkpoints"
    # PPO: the critic is sharded in the Ray trainer group like the policy, and its checkpoint
    # resumes on one worker (the driver), then on two again
    cmd = _cmd(store, run_dir, models, "agent=multiturn", "judge=multiturn", "scheduler=async", "recipe=ppo",
               "trainer.total_steps=4", "checkpoint.every_n_steps=1", "cluster=ray", "trainer.workers=2")
    # 1. a trainer rank dies: the run stops (exit 3) with the resume hint
    killed: list[int] = []

    def kill_worker(proc):
        worker = _trainer_worker(proc)
        killed.append(worker.pid)
        worker.kill()

    rc = _kill_when(ckpt / "step_1" / "meta.json", cmd, log, kill_worker)
    stopped = rf"run stopped: trainer worker [01] \(pid {killed[0]}, node \w+\) died"
    assert rc == 3 and re.search(stopped, log.read_text())
    assert f"Resume: python -m rlexp.run resume={run_dir}" in log.read_text()
    # 2. resumed with one worker (it trains in the driver), the driver SIGKILLed: nothing outlives it
    seen: dict[int, tuple[psutil.Process, str]] = {}
    _sigkill_driver_when(ckpt / "step_2" / "meta.json", _resume_cmd(run_dir, "trainer.workers=1"), log, seen)
    titles = [title for _, title in seen.values()]
    assert not any("ray::TrainerWorker" in t for t in titles), titles  # one worker: the driver trains
    _assert_all_seen_exit(seen, log)
    # 3. resumed with two workers: finishes, the same MLflow run, each step's loss logged once
    _finish(_resume_cmd(run_dir, "trainer.workers=2"), log)
    client, run = _run(store)
    assert run.info.status == "FINISHED" and run.data.tags["rlexp.resumes"] == "2"
    assert _steps(client, run, "train/loss") == [1, 2, 3, 4]
    assert _steps(client, run, "critic/vf_loss") == [1, 2, 3, 4]
    assert run.data.params["algorithm.recipe"] == "ppo"
    assert _steps(client, run, "memory/rank_1/peak_mb") == [1, 3, 4]  # step 2 trained in the driver
    assert sum(_history(client, run, "replica/0/requests")) > 0
    assert log.read_text().count("ray: started a local Ray") == 3
