"""On-policy distillation in whole runs (`python -m rlexp.run`): a local teacher scoring every
sample in its own vLLM engine, its figures in MLflow and its logprobs in the traces; a teacher
with another tokenizer mapped through the text; and the teachers a run refuses before any
engine starts (another vocabulary without align, an unreachable server, a distillation term
without a teacher)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]


def _run(store, *overrides):
    uri = f"sqlite:///{store}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "experiment=smoke", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={store}/artifacts", "logger.experiment_name=test",
           f"hydra.run.dir={store}/out", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, HF_HUB_OFFLINE="1")), uri


def _the_run(uri):
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    return client, run


def _refused(res):
    """Exit code 2 with one line on stderr, no engine started."""
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("rlexp: config error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "vLLM engine up" not in res.stderr + res.stdout
    return lines[0]


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
    res, uri = _run(store, "model=local", f"model.path={tiny_model_path}", "rollout.max_model_len=256",
                    "rollout.max_response_tokens=8", "teacher=local", *session,
                    f"teacher.model_path={tiny_model_path}", "trainer.total_steps=2")
    assert res.returncode == 0, res.stderr[-4000:]
    client, run = _the_run(uri)
    m = run.data.metrics
    if "teacher.top_k=4" in session:  # the same distribution: every top-k bucket agrees
        forward = client.get_metric_history(run.info.run_id, "train/distill_forward_kl")
        assert [x.step for x in forward] == [1, 2] and 0 <= forward[0].value < 1e-3
    first = client.get_metric_history(run.info.run_id, "distill/reverse_kl")
    assert [x.step for x in first] == [1, 2] and abs(first[0].value) < 1e-3
    assert m["distill/scored_frac"] == 1.0 and m["teacher/failed"] == 0.0
    assert m["teacher/scored_samples"] == 16.0 and m["teacher/tokens_per_s"] > 0
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


@pytest.mark.slow
@pytest.mark.vllm
def test_a_teacher_with_another_tokenizer_is_aligned_through_the_text(tmp_path, new_store, tiny_model_path):
    from rlexp.models.tiny_bpe import build_bpe_model

    teacher = build_bpe_model(tmp_path / "bpe_teacher")
    store = new_store(tmp_path / "run")
    res, uri = _run(store, "model=local", f"model.path={tiny_model_path}", "rollout.max_model_len=256",
                    "rollout.max_response_tokens=8", "teacher=local", f"teacher.model_path={teacher}",
                    "teacher.align=true", "recipe=distill", "trainer.total_steps=2")
    assert res.returncode == 0, res.stderr[-4000:]
    client, run = _the_run(uri)
    aligned = client.get_metric_history(run.info.run_id, "distill/aligned_frac")
    assert [x.step for x in aligned] == [1, 2] and min(x.value for x in aligned) >= 0.95
    assert run.data.metrics["teacher/failed"] == 0.0
    # a random teacher over 384 ids: its logprobs near log(1/384), far below the student's
    assert run.data.metrics["distill/reverse_kl"] > 2.0


def test_another_vocabulary_is_refused_without_align(tmp_path, tiny_model_path):
    from rlexp.models.tiny_bpe import build_bpe_model

    teacher = build_bpe_model(tmp_path / "bpe_teacher")
    res, _ = _run(tmp_path, "model=local", f"model.path={tiny_model_path}", "rollout.max_model_len=256",
                    "rollout.max_response_tokens=8", "teacher=local",
                  f"teacher.model_path={teacher}", "recipe=distill")
    line = _refused(res)
    assert str(teacher) in line and "vocabulary" in line and "teacher.align=true" in line


def test_an_unreachable_teacher_is_one_line(tmp_path, tiny_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    res, _ = _run(tmp_path, "model=local", f"model.path={tiny_model_path}", "rollout.max_model_len=256",
                    "rollout.max_response_tokens=8", "teacher=openai",
                  f"teacher.base_url=http://127.0.0.1:{port}/v1", "teacher.model=t", "recipe=distill")
    line = _refused(res)
    assert f"127.0.0.1:{port}" in line and "unreachable" in line


@pytest.mark.parametrize("overrides,said", [
    (["recipe=distill"], "advantage=distill needs a teacher"),
    (["trainer.distill.kl_coef=0.5"], "trainer.distill.kl_coef needs a teacher"),
    (["teacher=local", "teacher.model_path=MODEL", "trainer.distill.forward_kl_coef=1"], "teacher.top_k > 0"),
    (["teacher=local", "teacher.model_path=MODEL", "recipe=distill", "trainer.distill.kl_coef=1"],
     "advantage=distill is the reverse-KL advantage already"),
])
def test_a_distillation_term_needs_its_teacher(tmp_path, tiny_model_path, overrides, said):
    overrides = [o.replace("MODEL", tiny_model_path) for o in overrides]
    res, _ = _run(tmp_path, "model=local", f"model.path={tiny_model_path}", "rollout.max_model_len=256",
                    "rollout.max_response_tokens=8", *overrides)
    assert said in _refused(res)
