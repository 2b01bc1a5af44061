"""On-policy distillation in whole runs (`python -m rlexp.run`): a local teacher scoring every
sample in its own vLLM engine (single-turn, multi-turn under the async scheduler, the top-k
forward KL), its figures in MLflow and its logprobs in the traces. A teacher with another
tokenizer, and the teachers a run refuses: test_distill_teachers.py."""

import json
from pathlib import Path

import pytest

from tests.distill_helpers import distill_run, mlflow_run, student


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("session", [
    ["recipe=distill"], ["recipe=distill", "agent=multiturn", "judge=multiturn", "scheduler=async"],
    ["recipe=grpo_distill", "teacher.top_k=4", "trainer.distill.forward_kl_coef=1.0"],
], ids=["single_turn", "multiturn_async", "grpo_top_k_forward_kl"])
def test_a_local_teacher_scores_every_trained_token(tmp_path, new_store, tiny_model_path, session):
    """The student's own weights as the teacher: the reverse KL of the first step's samples
    (sampled by those weights) is 0 up to the engines' float noise, at every token: an
    off-by-one between the teacher's positions and the student's would show as nats. In
    multi-turn sessions the environment's tokens are context, never scored."""
    store = new_store(tmp_path / "run")
    res, uri = distill_run(store, *student(tiny_model_path), "teacher=local", *session,
                           f"teacher.model_path={tiny_model_path}", "trainer.total_steps=2")
    assert res.returncode == 0, res.stderr[-4000:]
    client, run = mlflow_run(uri)
    m = run.data.metrics
    if "teacher.top_k=4" in session:  # the same distribution: every top-k bucket agrees
        forward = client.get_metric_history(run.info.run_id, "train/distill_forward_kl")
        assert [x.step for x in forward] == [1, 2] and 0 <= forward[0].value < 1e-3
    first = client.get_metric_history(run.info.run_id, "distill/reverse_kl")
    assert [x.step for x in first] == [1, 2] and abs(first[0].value) < 1e-3
    assert m["distill/scored_frac"] == 1.0 and m["teacher/failed"] == 0.0
    assert m["teacher/tokens_per_s"] > 0
    scored = [x.value for x in client.get_metric_history(run.info.run_id, "teacher/scored_samples")]
    if "scheduler=async" in session:  # samples are scored as they finish, for this batch or the next
        assert sum(scored) >= 16.0
    else:
        assert scored == [16.0, 16.0]
    path = client.download_artifacts(run.info.run_id, "traces/step_00001.jsonl")
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert len(lines) == 16
    turns = 0
    for row in lines:
        turns += sum(t["mask"] for t in row["turns"])
        assert len(row["teacher_logprobs"]) == len(row["token_ids"])
        for lp, teacher, trained in zip(row["logprobs"], row["teacher_logprobs"], row["loss_mask"]):
            assert (teacher is None) == (not trained)
            if trained:
                assert teacher == pytest.approx(lp, abs=1e-3)
    # some multi-turn sessions took several turns
    assert turns > len(lines) if "agent=multiturn" in session else turns == len(lines)
