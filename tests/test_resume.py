"""Whole runs through real vLLM and a real SQLite MLflow store that get SIGKILLed, lose their
engine, or hit injected agent/judge faults, then resume. A SIGKILL's point is drawn at random
(seeded, printed) after some checkpoint (mid-step, mid-evaluation or mid-save) or during a
resume's start. An async run killed right at a checkpoint that holds what the test needs:
tests/test_resume_async.py."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from rlexp import orphans
from rlexp.checkpoint import checkpoints
from rlexp.trainer.critic import CRITIC_FILE
from tests.processes import like_a_terminal, running_cmdline
from tests.test_run import _history, _traces

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# Not compared: wall-clock and memory measurements (a process's peak RSS is not set by the seed).
PPO = ("recipe=ppo", "trainer.critic.critic_only_steps=1")  # step 1 trains the critic alone
TIMING = ("timing/", "throughput/", "rollout/engine_idle_frac", "train/idle_frac", "memory/")


def _cmd(store, run_dir, models, *overrides):
    judge = "judge.inner" if "judge=faulty" in overrides else "judge"
    return [sys.executable, "-m", "rlexp.run", "experiment=smoke", f"trainer.total_steps={STEPS}",
            "checkpoint.every_n_steps=1", f"{judge}.format_reward=0.5",  # rewards vary: real updates
            f"logger.tracking_uri=sqlite:///{store}/mlflow.db", f"logger.artifact_location={store}/art",
            "logger.experiment_name=test", "logger.trace_sample_rate=0.2",
            f"model.cache_dir={models}", "model.warm_start_steps=40", f"hydra.run.dir={run_dir}",
            *overrides]


def _resume_cmd(run_dir, *overrides):
    return [sys.executable, "-m", "rlexp.run", f"resume={run_dir}",
            f"hydra.run.dir={run_dir}_resumed_{time.monotonic_ns()}", *overrides]


def _start(cmd, log):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=like_a_terminal,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _finish(cmd, log, expect=0):
    with open(log, "a") as f:
        proc = _start(cmd, f)
        rc = proc.wait(timeout=600)
    assert rc == expect, Path(log).read_text()[-4000:]


def _wait_for(path: Path, proc):
    while not path.exists():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {path} appeared"
        time.sleep(0.05)


def _saves(run_dir: Path) -> set[Path]:
    """Checkpoint directories, finished or being written (`.tmp-step_*`)."""
    return set((run_dir / "checkpoints").glob("*step_*"))


def _until_next_save(run_dir: Path, proc, delay: float) -> None:
    """Wait `delay` s, or less: until the run starts writing its next checkpoint (mid-save).
    The kill point so never lies past the run's end, however fast the machine."""
    before, end = _saves(run_dir), time.monotonic() + delay
    while time.monotonic() < end and not _saves(run_dir) - before:
        time.sleep(0.02)


def _temp_state() -> set[Path]:
    """The runs' temporary state in the test's own root (the `run_temp` fixture): weight
    directories, vLLM engine directories (its sockets), and the shared-memory files those list
    as theirs."""
    root = Path(os.environ[orphans.TEMP_DIR_ENV])
    dirs = {*root.glob("rlexp-weights-*"), *root.glob("rlexp-vllm-*")}
    owned = {Path(p) for d in dirs if (d / ".owned").is_file() for p in (d / ".owned").read_text().split()}
    return dirs | owned


def _kill(cmd, log, run_dir: Path, new_checkpoints: int, delay: float) -> set[Path]:
    """Run `cmd` and SIGKILL its main process (a dying node) `delay` s after it wrote
    `new_checkpoints` checkpoints (0: `delay` s after it started, e.g. while it resumes), or
    as soon as it starts its next checkpoint if that comes first;
    then check that the vLLM engine processes it left went down too. Returns the temporary
    state (`_temp_state`) the killed run had."""
    before = _temp_state()
    done = [s for s, _ in checkpoints(run_dir)]
    target = run_dir / "checkpoints" / f"step_{max(done, default=0) + new_checkpoints}" / "meta.json"
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            if new_checkpoints:
                _wait_for(target, proc)
            _until_next_save(run_dir, proc, delay)
            proc.send_signal(signal.SIGSTOP)  # held still while its processes are listed
            assert proc.poll() is None, "finished before the kill point"
            engine = psutil.Process(proc.pid).children(recursive=True)
            left = _temp_state() - before
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            gone, alive = psutil.wait_procs(engine, timeout=20)
            assert not [p for p in alive if "VLLM" in (running_cmdline(p) or "")], "orphaned vLLM engine"
            return left
        finally:
            for p in psutil.process_iter():
                try:
                    if os.getsid(p.pid) == proc.pid:
                        p.kill()
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass


def _run(store):
    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    return client, run


def _steps(client, run, key):
    return [m.step for m in client.get_metric_history(run.info.run_id, key)]


def _lose_engine(cmd, log: Path, run_dir: Path) -> tuple[int, str, set[Path]]:
    """Run `cmd` and SIGKILL its vLLM engine process (and that one's children) once the run
    wrote a new checkpoint. Returns the run's exit code, what it printed, and the temporary
    state (`_temp_state`) it had."""
    before, printed = _temp_state(), log.stat().st_size if log.exists() else 0
    done = [s for s, _ in checkpoints(run_dir)]
    target = run_dir / "checkpoints" / f"step_{max(done, default=0) + 1}" / "meta.json"
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            _wait_for(target, proc)
            left = _temp_state() - before
            children = psutil.Process(proc.pid).children()
            (core,) = [p for p in children if "EngineCore" in " ".join(p.cmdline())]
            for p in [core] + core.children(recursive=True):
                p.kill()
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, log.read_bytes()[printed:].decode(errors="replace"), left


@pytest.mark.slow
@pytest.mark.vllm
def test_sync_run_killed_twice_and_losing_its_engine_matches_an_uninterrupted_run(tmp_path, run_models,
                                                                                  new_store, run_temp):
    """PPO with a critic (its weights, optimizer and lr schedule are checkpointed beside the
    policy's), stopped three times and resumed each time: SIGKILLed after its 1st checkpoint
    (mid-step, mid-evaluation or mid-save); its vLLM engine killed after the 1st resume's
    first checkpoint (the run stops, says why and how to resume, and its MLflow run is
    FAILED); SIGKILLed during the start of the 2nd resume. The uninterrupted run makes its
    updates with the trainer's low-level calls (loop=low_level), the interrupted one with
    `fit`: equal numbers show both at once."""
    ref_store, store = new_store(tmp_path / "ref"), new_store(tmp_path / "killed")
    _finish(_cmd(ref_store, ref_store / "out", run_models, *PPO, "loop=low_level"), tmp_path / "ref.log")

    rng = random.Random(6)
    run_dir, log = store / "out", tmp_path / "killed.log"
    # seconds at most (`_kill` stops at the next save): after the 1st checkpoint; into the
    # start of the 2nd resume (config, model, MLflow clean-up or engine start-up)
    mid_step, start_up = rng.uniform(0, 2.0), rng.uniform(2.0, 12.0)
    print(f"kill points: {mid_step:.2f} s after the 1st checkpoint, {start_up:.2f} s into the 2nd resume")
    left_behind = _kill(_cmd(store, run_dir, run_models, *PPO), log, run_dir, 1, mid_step)
    assert {p.name.split("-")[1] for p in left_behind if p.name.startswith("rlexp-")} == {"weights", "vllm"}

    rc, out, left = _lose_engine(_resume_cmd(run_dir), log, run_dir)
    left_behind |= left
    assert rc == 3, out[-3000:]
    assert "rlexp: run stopped: the vLLM engine process died" in out
    assert f"Resume: python -m rlexp.run resume={run_dir}" in out
    _, stopped = _run(store)
    assert stopped.info.status == "FAILED" and "EngineDead" in stopped.data.tags["rlexp.error"]

    left_behind |= _kill(_resume_cmd(run_dir), log, run_dir, 0, start_up)
    _finish(_resume_cmd(run_dir), log)
    assert not [d for d in left_behind if d.exists()], "temporary files of stopped runs were left behind"

    (c_ref, ref), (c, run) = _run(ref_store), _run(store)
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlexp.resumes"] in ("2", "3")  # the last kill may come before the run reopened
    assert _steps(c, run, "train/loss") == list(range(1, STEPS + 1))  # each step exactly once
    compared = [k for k in ref.data.metrics if not k.startswith(TIMING)]
    assert len(compared) > 30 and set(compared) <= set(run.data.metrics)
    assert "critic/vf_loss" in compared and "timing/fit/values_s" in ref.data.metrics
    for key in compared:
        assert _steps(c, run, key) == _steps(c_ref, ref, key), key
        assert _history(c, run, key) == pytest.approx(_history(c_ref, ref, key), rel=1e-5, abs=1e-7), key
    assert any(v != 0 for v in _history(c, run, "train/pg_loss"))  # the weights did move
    for step in range(1, STEPS + 1):  # the same tokens were sampled and trained
        tokens = [r["token_ids"] for r in _traces(c, run, step)]
        assert tokens == [r["token_ids"] for r in _traces(c_ref, ref, step)], step
    final = load_file(run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors")
    final_ref = load_file(ref_store / "out" / "checkpoints" / f"step_{STEPS}" / "model.safetensors")
    initial = load_file(Path(ref.data.params["model.resolved_path"]) / "model.safetensors")
    for name, w in final_ref.items():
        assert (final[name] - w).abs().max() <= 1e-6, name
    critic = load_file(run_dir / "checkpoints" / f"step_{STEPS}" / CRITIC_FILE)
    critic_ref = load_file(ref_store / "out" / "checkpoints" / f"step_{STEPS}" / CRITIC_FILE)
    assert max((critic[n] - w).abs().max().item() for n, w in critic_ref.items()) <= 1e-6
    assert any((final_ref[n] != initial[n]).any() for n in initial)  # trained (lm_head is tied: not saved)
    assert _trace_steps(c, run) == _trace_steps(c_ref, ref)  # sampled MLflow traces: none twice


def _trace_steps(client, run):
    traces = client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id,
                                  include_spans=False, max_results=1000)
    return sorted(int(t.info.tags["rlexp.step"]) for t in traces)


@pytest.mark.slow
@pytest.mark.vllm
def test_too_many_failures_stop_the_run_and_resumed_with_fewer_the_faults_are_counted(tmp_path, run_models,
                                                                                     new_store):
    """Every sample of step 1 failing (more than max_failure_fraction) stops the run with a
    checkpoint; resumed with the agent and the judge raising, hanging past their timeouts or
    (the judge) returning NaN at 10% each, the run goes on: each fault counted and traced
    with its reason, every other sample completed. The resumed run's first step is the first
    its new vLLM engine serves (a new run's warm-up is its step-0 evaluation), so on a loaded
    machine slow replies may time out beside the hung ones: that step may fail any share of
    its samples (max_failure_fraction=1.0; with all of them failed it has nothing to train),
    the next three at most 0.9 each."""
    store = new_store(tmp_path)
    run_dir, log = tmp_path / "out", tmp_path / "run.log"
    faulty = ("agent=faulty", "agent.guard.timeout_s=3", "judge=faulty", "judge.guard.timeout_s=1")
    _finish(_cmd(store, run_dir, run_models, "trainer.total_steps=5", "checkpoint.every_n_steps=0", *faulty,
                 "judge.raise_rate=1.0"), log, expect=3)
    out = log.read_text()
    assert ("rlexp: run stopped: step 1: 16 of 16 samples failed, more than "
            "max_failure_fraction=0.5 (most common: 16x judge raised InjectedFault: "
            "injected judge fault)") in out
    assert (run_dir / "checkpoints" / "step_1" / "meta.json").is_file()
    c, run = _run(store)
    assert run.info.status == "FAILED" and _steps(c, run, "samples/failed_frac") == [1]  # logged, kept

    rates = ("agent.raise_rate=0.1", "agent.hang_rate=0.1", "judge.raise_rate=0.1", "judge.nan_rate=0.1",
             "judge.hang_rate=0.1")
    _finish(_resume_cmd(run_dir, "agent=faulty", "judge=faulty", *rates, "max_failure_fraction=1.0"), log)
    c, run = _run(store)
    assert run.info.status == "FINISHED"
    failed = _history(c, run, "samples/failed_frac")
    assert failed[0] == 1.0 and len(failed) == 5 and max(failed[2:]) <= 0.9  # the new rates took effect
    # 1: nothing to train; 2 (the new engine's first) trains unless every one of its samples failed
    trained = [2] * (failed[1] < 1.0) + [3, 4, 5]
    assert _steps(c, run, "train/loss") == trained
    assert sum(failed[1:]) > 0 and sum(_history(c, run, "samples/aborted")) > 0
    rows = [r for step in (2, 3, 4, 5) for r in _traces(c, run, step)]
    reasons = {r["error"].split(" (")[0] for r in rows if r["error"]}
    assert reasons == {"agent raised InjectedFault: injected agent fault", "agent timed out after 3s",
                       "judge raised InjectedFault: injected judge fault", "judge timed out after 1s",
                       "judge returned a reward that is not a finite number: nan"}
    assert all(r["status"] == "completed" for r in rows if not r["error"])
