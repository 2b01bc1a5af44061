"""On-policy distillation's pieces (rlexp/algorithms/distill.py, rlexp/teachers/scoring.py,
the TrainBatch's TeacherTokens, the update's advantages stage): hand-computed values and
gradients, tinker-cookbook's formula on fixed batches, the scores' alignment with the tokens,
and a teacher's failures failing their samples."""

import asyncio
import math

import pytest
import torch

from rlexp.algorithms.advantages import AdvantageInputs, GroupNormalized
from rlexp.algorithms.distill import (
    Distillation,
    DistillTerm,
    discounted_future_sum,
    reverse_kl,
    topk_forward_kl,
)
from rlexp.algorithms.objective import KLTerm, Objective, PPOClip, TokenMean
from rlexp.errors import TeacherError
from rlexp.sample import PromptLogprobs, Sample, Status, TeacherScores, TokenTrace
from rlexp.teachers.scoring import TeacherScoring, own_tokens
from rlexp.trainer.batch import Layout, TrainBatch
from tests.dist_fit import make_batch


def cookbook_advantages(sampled_logprobs, teacher_logprobs, mask, kl_coef, discount):
    """tinker-cookbook's `incorporate_kl_penalty` (distillation/train_on_policy.py), written out
    per datum: reverse_kl = (sampled - teacher) * mask; advantages += -coef * mask * reverse_kl,
    or with a discount -coef * discounted_future_sum(reverse_kl, discount)."""
    out = []
    for s, t, m in zip(sampled_logprobs, teacher_logprobs, mask):
        rk = [(a - b) * c for a, b, c in zip(s, t, m)]
        if discount > 0:
            acc, summed = 0.0, []
            for x in reversed(rk):
                acc = x + discount * acc
                summed.append(acc)
            out.append([-kl_coef * x for x in reversed(summed)])
        else:
            out.append([-kl_coef * c * x for x, c in zip(rk, m)])
    return torch.tensor(out)


def _inputs(student, teacher, mask, rewards=(1.0, 0.0)):
    d = reverse_kl(torch.tensor(student), torch.tensor(teacher), torch.tensor(mask))
    return AdvantageInputs(torch.tensor(rewards), [0, 0], torch.ones(2, dtype=torch.bool),
                           torch.tensor(mask), reverse_kl=d)


STUDENT = [[-0.5, -1.0, -2.0, 0.0], [-0.1, -0.3, 0.0, 0.0]]
TEACHER = [[-0.2, -1.5, -0.5, -9.0], [-0.4, -0.3, -7.0, -7.0]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


def test_reverse_kl_advantage_by_hand():
    adv = Distillation(kl_coef=2.0)(_inputs(STUDENT, TEACHER, MASK))
    # -2 * (s - t): row 0: -2*(-0.3), -2*(0.5), -2*(-1.5); row 1: -2*(0.3), -2*0
    expected = torch.tensor([[0.6, -1.0, 3.0, 0.0], [-0.6, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_discounted_reverse_kl_by_hand():
    adv = Distillation(kl_coef=1.0, discount=0.5)(_inputs(STUDENT, TEACHER, MASK))
    # row 0: d = [-0.3, 0.5, -1.5, 0]; future sums: t2 -1.5, t1 0.5 + 0.5*-1.5 = -0.25,
    # t0 -0.3 + 0.5*-0.25 = -0.425
    torch.testing.assert_close(adv[0], torch.tensor([0.425, 0.25, 1.5, 0.0]))
    torch.testing.assert_close(discounted_future_sum(torch.tensor([1.0, 1.0, 1.0]), 0.5),
                               torch.tensor([1.75, 1.5, 1.0]))


@pytest.mark.parametrize("coef,discount", [(1.0, 0.0), (0.3, 0.0), (1.0, 0.9), (0.5, 0.25)])
def test_advantages_equal_tinker_cookbooks_formula(coef, discount):
    g = torch.Generator().manual_seed(int(coef * 100 + discount * 10))
    student = -torch.rand(6, 9, generator=g) * 3
    teacher = -torch.rand(6, 9, generator=g) * 3
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    x = AdvantageInputs(torch.zeros(6), list(range(6)), torch.ones(6, dtype=torch.bool), mask,
                        reverse_kl=reverse_kl(student, teacher, mask))
    ours = Distillation(coef, discount)(x)
    theirs = cookbook_advantages(student.tolist(), teacher.tolist(), mask.tolist(), coef, discount)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_the_term_adds_to_any_estimators_advantages():
    x = _inputs(STUDENT, TEACHER, MASK, rewards=(1.0, 0.0))
    grpo = GroupNormalized()(x)
    objective = Objective(GroupNormalized(), PPOClip(), TokenMean(), KLTerm(), None,
                          distill=DistillTerm(kl_coef=0.5))
    adv, returns = objective.advantages(x)
    torch.testing.assert_close(adv, grpo - 0.5 * x.reverse_kl)
    assert returns is None
    no_teacher = AdvantageInputs(x.rewards, x.groups, x.completed, x.mask)
    with pytest.raises(ValueError, match="teacher"):
        objective.advantages(no_teacher)
    with pytest.raises(ValueError, match="teacher"):
        Distillation()(no_teacher)


def test_topk_forward_kl_value_and_gradient_by_hand():
    # teacher top-1 id with p 0.5, the rest 0.5; the student gives that id 0.25, the rest 0.75
    student = torch.tensor([[math.log(0.25)]], requires_grad=True)
    teacher = torch.tensor([[math.log(0.5)]])
    kl = topk_forward_kl(student, teacher)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    kl.sum().backward()
    # d/ds [-p_T s - rest_T log(1 - e^s)] = -p_T + rest_T e^s / (1 - e^s) = -0.5 + 0.5 / 3
    assert student.grad.item() == pytest.approx(-0.5 + 0.5 / 3, abs=1e-6)


def test_topk_forward_kl_is_zero_only_where_the_student_matches():
    teacher = torch.log(torch.tensor([[0.6, 0.3]]))
    assert topk_forward_kl(teacher.clone(), teacher).item() == pytest.approx(0.0, abs=1e-6)
    # the same top-k mass but spread otherwise: the top-k terms alone would be negative here
    other = torch.log(torch.tensor([[0.3, 0.6]]))
    assert topk_forward_kl(other, teacher).item() > 0.1
    # the student puts mass outside the teacher's top-k: only the rest's bucket sees it
    assert topk_forward_kl(torch.log(torch.tensor([[0.3, 0.15]])), teacher).item() > 0.0


def test_topk_forward_kl_is_never_below_zero():
    # a teacher whose top-2 mass is 1.01 (rest floored at eps): the formula's terms give
    # 0.31 * log(0.31 / 0.32) + eps * (log eps - log eps) = -0.0098; a KL is clamped at 0
    teacher = torch.log(torch.tensor([[0.7, 0.31]]))
    student = torch.log(torch.tensor([[0.7, 0.32]])).requires_grad_()
    kl = topk_forward_kl(student, teacher)
    assert kl.item() == 0.0
    kl.sum().backward()
    assert student.grad.abs().max().item() == 0.0
    # a student within float rounding of the teacher, at 3,200 positions: no value below 0
    logits = torch.randn(64, 50, 50, generator=torch.Generator().manual_seed(0)) * 3
    near = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)) * 1e-6
    top = torch.log_softmax(logits, -1).topk(4, -1)
    kl = topk_forward_kl(torch.log_softmax(near, -1).gather(-1, top.indices), top.values)
    assert kl.min().item() >= 0.0 and kl.max().item() < 1e-6


def test_own_tokens_keeps_the_trained_tokens_and_checks_the_reply():
    scores = PromptLogprobs([-1.0, -2.0, -3.0, -4.0], [{7: -1.0, 8: -1.5}, {1: -2.0, 2: -0.5},
                                                      {3: -3.0, 4: -0.1}, {5: -4.0, 6: -0.2}])
    mask = [0, 0, 1, 1, 0]
    t = own_tokens(PromptLogprobs(scores.logprobs), mask, top_k=0)
    assert t.logprobs == [0.0, 0.0, -2.0, -3.0, 0.0] and t.scored == [0, 0, 1, 1, 0]
    t = own_tokens(scores, mask, top_k=2)
    assert t.top_ids[2] == [2, 1] and t.top_logprobs[2] == [-0.5, -2.0]  # by rank, for token 2
    with pytest.raises(TeacherError, match="3 positions of 5 tokens"):
        own_tokens(PromptLogprobs([-1.0, -2.0, -3.0]), mask, top_k=0)
    with pytest.raises(TeacherError, match="top-3"):
        own_tokens(scores, mask, top_k=3)


def _scored_batch(k=0):
    samples = make_batch(seed=3, groups=2, per_group=2)
    for s in samples:
        n = len(s.tokens)
        s.teacher = TeacherScores([0.0] + [-0.01 * i for i in range(1, n)], [0] + s.loss_mask[1:],
                                  [[i, i + 1] for i in range(n)] if k else None,
                                  [[-0.1, -0.2]] * n if k else None)
    return samples


def test_the_batch_shifts_the_teachers_scores_like_the_rollouts():
    samples = _scored_batch(k=2)
    batch = TrainBatch.build(samples, 0, Layout())
    for row, s in enumerate(samples):
        n = len(s.tokens)
        # column c predicts token c + 1
        assert batch.teacher.logprobs[row, :n - 1].tolist() == pytest.approx(s.teacher.logprobs[1:])
        assert batch.teacher.scored[row, :n - 1].tolist() == s.loss_mask[1:]
        assert batch.teacher.top_ids[row, :n - 1, 0].tolist() == list(range(1, n))
    assert TrainBatch.build(make_batch(seed=3, groups=2, per_group=2), 0, Layout()).teacher is None


class FakeTeacher:
    """An orchestration fake: scores each token -0.5, or raises for sequences of 6 tokens."""

    top_k, tokenizer_path, align = 0, None, False

    async def score(self, token_ids):
        if len(token_ids) == 6:
            raise TeacherError("reply truncated")
        return PromptLogprobs([-0.5] * (len(token_ids) - 1))

    def shutdown(self):
        pass


class PassThrough:
    async def rollout(self, sample):
        return sample

    async def aclose(self):
        pass


def test_a_teacher_failure_fails_its_sample_and_is_counted():
    scoring = TeacherScoring(PassThrough(), FakeTeacher())
    good = Sample(0, [], "", TokenTrace([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0.0] * 5, [0] * 5),
                  status=Status.COMPLETED)
    bad = Sample(0, [], "", TokenTrace([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], [0.0] * 6, [0] * 6),
                 status=Status.COMPLETED)
    asyncio.run(scoring.rollout(good))
    asyncio.run(scoring.rollout(bad))
    assert good.status == Status.COMPLETED and good.teacher.logprobs == [0.0, 0.0, -0.5, -0.5, -0.5]
    assert bad.status == Status.FAILED and bad.teacher is None
    assert bad.error == "teacher: reply truncated"
    metrics = scoring.pop_metrics()
    assert metrics["teacher/failed"] == 1.0 and metrics["teacher/scored_samples"] == 1.0
    assert metrics["teacher/tokens"] == 11.0
    assert scoring.pop_metrics()["teacher/failed"] == 0.0  # since the last call


def _controller(path, **kw):
    from functools import partial

    from rlexp.trainer.controller import TrainController
    from tests.fakes import UNCHECKED

    torch.manual_seed(0)
    return TrainController(path, temperature=1.0, total_steps=2, optimizer=partial(torch.optim.SGD, lr=0.1),
                           ref_kl_every_n_steps=0, sync_check=UNCHECKED, logits_chunk_tokens=16, **kw)


def test_the_update_advantages_are_the_teachers_reverse_kl(tiny_model_path):
    from rlexp.trainer import update

    trainer = _controller(tiny_model_path, advantage=Distillation(kl_coef=0.7))
    samples = _scored_batch()
    batch = TrainBatch.build(samples, 0, Layout())
    learner = trainer.learner
    signals = update.advantages(learner, batch, update.old_logprobs(learner, batch), None, None)
    expected = -0.7 * (batch.rollout_logprobs - batch.teacher.logprobs) * batch.loss_mask
    torch.testing.assert_close(signals.advantages * batch.loss_mask, expected)
    metrics = trainer.fit(samples, 0)
    d = ((batch.rollout_logprobs - batch.teacher.logprobs) * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert metrics["distill/reverse_kl"] == pytest.approx(d.item(), rel=1e-6)
    assert metrics["distill/scored_frac"] == 1.0


def test_the_policys_top_k_logprobs_and_the_forward_kls_gradient(tiny_model_path):
    """The chunked head's logprobs of the teacher's top-k ids equal a plain log_softmax of the
    model's logits gathered at them, and the forward-KL loss's gradient is the plain one's."""
    from rlexp.trainer import update

    trainer = _controller(tiny_model_path, distill=DistillTerm(forward_kl_coef=1.0))
    samples = _scored_batch(k=2)
    batch = TrainBatch.build(samples, 0, Layout(micro_batch_tokens=10**9))
    micro, policy = batch.micro_batches[0], trainer.learner.policy
    out = policy(batch, micro)
    kl = update.teacher_forward_kl(batch, micro, out)
    kl.sum().backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)

    ids = batch.input_ids[micro.rows, :micro.width]
    logp_all = torch.log_softmax(trainer.model(input_ids=ids).logits[:, :-1].float(), -1)
    top = batch.teacher.top_ids[micro.rows, :micro.width - 1]
    plain_top = logp_all.gather(-1, top)
    torch.testing.assert_close(out.teacher_top, plain_top, rtol=1e-5, atol=1e-6)
    plain = topk_forward_kl(plain_top, batch.teacher.top_logprobs[micro.rows, :micro.width - 1])
    (plain * micro.take(batch.teacher.scored)).sum().backward()
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6)
    assert kl.abs().sum() > 0
