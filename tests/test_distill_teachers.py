"""Teachers in whole runs (`python -m rlexp.run`): one with another tokenizer, mapped onto the
student's tokens through the text; and the teachers a run refuses before any engine starts
(another vocabulary without align, an unreachable server, a distillation term without a
teacher), each in one line."""

import re
import socket

import pytest

from rlexp.config import validate
from rlexp.errors import ConfigError
from rlexp.models.tiny_bpe import build_bpe_model
from rlexp.teachers.serve import serve_command
from tests.distill_helpers import distill_run, mlflow_run, refused, student
from tests.test_config import _compose


@pytest.mark.slow
@pytest.mark.vllm
def test_a_teacher_with_another_tokenizer_is_aligned_through_the_text(tmp_path, new_store, tiny_model_path):
    teacher = build_bpe_model(tmp_path / "bpe_teacher")
    store = new_store(tmp_path / "run")
    res, uri = distill_run(store, *student(tiny_model_path), "teacher=local", f"teacher.model_path={teacher}",
                           "teacher.align=true", "recipe=distill", "trainer.total_steps=2")
    assert res.returncode == 0, res.stderr[-4000:]
    client, run = mlflow_run(uri)
    aligned = client.get_metric_history(run.info.run_id, "distill/aligned_frac")
    assert [x.step for x in aligned] == [1, 2] and min(x.value for x in aligned) >= 0.95
    assert run.data.metrics["teacher/failed"] == 0.0
    # a random teacher over 384 ids: its logprobs near log(1/384), far below the student's
    assert run.data.metrics["distill/reverse_kl"] > 2.0


def test_another_vocabulary_is_refused_without_align(tmp_path, tiny_model_path):
    teacher = build_bpe_model(tmp_path / "bpe_teacher")
    res, _ = distill_run(tmp_path, *student(tiny_model_path), "teacher=local",
                         f"teacher.model_path={teacher}", "recipe=distill")
    line = refused(res)
    assert str(teacher) in line and "vocabulary" in line and "teacher.align=true" in line


def test_an_unreachable_teacher_is_one_line(tmp_path, tiny_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    res, _ = distill_run(tmp_path, *student(tiny_model_path), "teacher=openai",
                         f"teacher.base_url=http://127.0.0.1:{port}/v1", "teacher.model=t", "recipe=distill")
    line = refused(res)
    assert f"127.0.0.1:{port}" in line and "unreachable" in line
    assert f"`{serve_command(name='t', port=port, max_model_len=257)}`" in line  # rollout.max_model_len + 1


def test_a_distillation_term_without_a_teacher_is_one_line(tmp_path, tiny_model_path):
    res, _ = distill_run(tmp_path, *student(tiny_model_path), "recipe=distill")
    assert "advantage=distill needs a teacher" in refused(res)


@pytest.mark.parametrize("overrides,said", [
    (["trainer.distill.kl_coef=0.5"], "trainer.distill.kl_coef needs a teacher"),
    (["teacher=local", "teacher.model_path=/tmp/x", "trainer.distill.forward_kl_coef=1"],
     "teacher.top_k > 0"),
    (["teacher=local", "teacher.model_path=/tmp/x", "recipe=distill", "trainer.distill.kl_coef=1"],
     "advantage=distill is the reverse-KL advantage already"),
])
def test_a_distillation_term_needs_its_teacher(overrides, said):
    cfg = _compose(["experiment=smoke", *student("/tmp/x"), *overrides])
    with pytest.raises(ConfigError, match=re.escape(said)):
        validate(cfg)
