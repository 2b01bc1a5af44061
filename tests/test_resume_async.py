"""A whole run with the async scheduler and a multi-turn agent, SIGKILLed right after a
checkpoint that holds prompt groups both waiting for a batch and in flight, then resumed:
every group is trained once (or still pending, or counted as expired) and the staleness
bound holds across the resume. Runs through real vLLM and a real SQLite MLflow store, as
tests/test_resume.py's do (its helpers start and read them)."""

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.test_resume import STEPS, _finish, _resume_cmd, _run, _start, _steps, _wait_for
from tests.test_run import _history, _traces


def _kill_at_first_checkpoint(cmd, log, run_dir: Path, holds) -> tuple[int, dict]:
    """Start `cmd`; as each checkpoint appears, stop the run's whole process group (SIGSTOP)
    and read the checkpoint's state: at the first one that `holds`, SIGKILL the group (a dying
    node), else let the run go on (SIGCONT). Returns that checkpoint's step and state."""
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            for step in range(1, STEPS):
                path = run_dir / "checkpoints" / f"step_{step}"
                _wait_for(path / "meta.json", proc)
                os.killpg(proc.pid, signal.SIGSTOP)
                state = torch.load(path / "state.pt", weights_only=False)
                print(f"checkpoint {step}:", {k: len(state["scheduler"][k]) for k in GROUP_STATES})
                if holds(state):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return step, state
                os.killpg(proc.pid, signal.SIGCONT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    pytest.fail(f"no checkpoint of steps 1..{STEPS - 1} held what the test needs")


GROUP_STATES = ("accepted", "in_flight", "set_aside")  # the async scheduler's groups not trained yet


def _group_ids(state: dict) -> list[int]:
    return [r.fresh[0].group_id for k in GROUP_STATES for r in state["scheduler"][k]]


@pytest.mark.slow
@pytest.mark.vllm
def test_async_multiturn_run_killed_at_a_checkpoint_resumes_in_bound_training_every_prompt_once(
        tmp_path, run_models, new_store):
    """SIGKILLed right after a checkpoint that holds groups both waiting for a batch and in
    flight, then resumed: every prompt group the run drew is trained exactly once, still
    pending in the final checkpoint, or counted as expired (η = 1, so groups can expire); the
    staleness bound holds across the resume, in the logged metric and in every trained
    token's version; the lengths generated and trained are logged side by side every step."""
    store, run_dir, log = new_store(tmp_path), tmp_path / "out", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "rlexp.run", "experiment=smoke", "agent=multiturn", "judge=multiturn",
           "rollout.max_model_len=256", "scheduler=async", "scheduler.staleness_threshold=1",
           # launches go on during evaluation, so that the checkpoints after one (steps 2, 4) also
           # hold groups in flight: more chances of the checkpoint this test needs
           "scheduler.pause_for_eval=false",
           f"trainer.total_steps={STEPS}", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
           f"logger.tracking_uri=sqlite:///{store}/mlflow.db", f"logger.artifact_location={store}/art",
           "logger.experiment_name=test", f"model.cache_dir={run_models}", "model.warm_start_steps=40",
           f"hydra.run.dir={run_dir}"]
    killed_at, killed = _kill_at_first_checkpoint(
        cmd, log, run_dir, lambda s: s["scheduler"]["accepted"] and s["scheduler"]["in_flight"])
    assert killed["version"] == killed_at and "version" not in killed["scheduler"]  # the loop's, saved once
    _finish(_resume_cmd(run_dir), log)

    c, run = _run(store)
    assert run.info.status == "FINISHED" and run.data.tags["rlexp.resumes"] == "1"
    assert _steps(c, run, "train/loss") == list(range(1, STEPS + 1))
    per_prompt = 4  # experiment=smoke: 4 prompts x 4 samples a step
    trained: dict[int, int] = {}  # group id -> the step that trained it
    assert max(_history(c, run, "rollout/staleness_max")) <= 1
    for step in range(1, STEPS + 1):
        rows = _traces(c, run, step)
        assert all(r["uid"] // per_prompt == r["group_id"] for r in rows)  # numbering kept across the kill
        for row in rows:
            if row["status"] == "completed":  # staleness recomputed from the trace
                assert step - 1 - min(v for v, m in zip(row["versions"], row["loss_mask"]) if m) <= 1
        groups = {r["group_id"] for r in rows}
        assert len(groups) == 4, (step, groups)
        for gid in groups:
            assert gid not in trained, f"group {gid} trained at step {trained[gid]} and again at {step}"
            trained[gid] = step
    final = torch.load(run_dir / "checkpoints" / f"step_{STEPS}" / "state.pt", weights_only=False)
    pending = _group_ids(final)
    assert len(pending) == len(set(pending)) and not set(pending) & set(trained)
    drawn = final["data"]["next_group"]
    # expired samples: as logged each step, and since the last step's log (the final checkpoint)
    since_last_log = final["scheduler"]["counts"].get("samples/expired", 0)
    expired = sum(_history(c, run, "samples/expired")) + since_last_log
    unaccounted = set(range(drawn)) - set(trained) - set(pending)
    print(f"groups drawn {drawn}, trained {len(trained)}, pending {len(pending)}, expired samples {expired}")
    assert len(unaccounted) * per_prompt == expired, f"neither trained nor pending: {sorted(unaccounted)}"
    for gid in _group_ids(killed):  # waiting or in flight at the kill: trained after the resume
        assert trained.get(gid, STEPS + 1) > killed_at, gid
    for key in ("rollout/generated_response_length_mean", "rollout/generated_response_length_p90",
                "rollout/response_length_mean", "rollout/response_length_p90"):
        assert _steps(c, run, key) == list(range(1, STEPS + 1)), key
    assert sum(_history(c, run, "rollout/generated_samples")) > 0
