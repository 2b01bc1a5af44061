"""On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines 2025,
"On-Policy Distillation"): the student samples, a teacher scores the student's own tokens, and
the per-token reverse KL at the sampled token x_t is the training signal:

    d_t = log p_student(x_t | x_<t) - log p_teacher(x_t | x_<t)        (student: its sampling logprob)

As an advantage (tinker-cookbook `distillation/train_on_policy.py`, `incorporate_kl_penalty`):

    A_t = -kl_coef * d_t                                      discount gamma = 0 (the default)
    A_t = -kl_coef * sum_{t' >= t} gamma^(t' - t) d_t'        gamma > 0: the discounted future
                                                              reverse KL over the sample's scored tokens

`advantage=distill` is that advantage alone (pure distillation); `trainer.distill.kl_coef`
adds it to any estimator's advantages (reward + teacher: slime's `--opd-kl-coef`).

Top-k forward KL (NeMo-RL's distillation loss, verl's top-k KL): the teacher returns its k
likeliest ids K_t per position with their logprobs; with the mass outside them as one more
bucket ("rest"), the forward KL of the two (k + 1)-bucket distributions is

    KL_t = sum_{v in K_t} p_T(v) (log p_T(v) - log p_S(v)) + p_T(rest) (log p_T(rest) - log p_S(rest)),
    p(rest) = 1 - sum_{v in K_t} p(v)

exact for the coarsened distributions (a lower bound of the full forward KL, 0 only where the
student matches the teacher on every bucket), never the top-k terms alone, which ignore the
mass the student puts elsewhere. A KL is >= 0, but its floating-point terms can sum to a
rounding below 0 where the student matches the teacher (-9e-9 seen in a run; a teacher's top-k
mass over 1 gives more), so each token's KL_t is clamped at 0: there the true value and its
gradient are 0 to within that rounding. `trainer.distill.forward_kl_coef` adds coef * KL_t to each
scored token's loss; its gradient reaches the student's logprobs of the k ids and of the rest."""

from __future__ import annotations

import torch

from rlexp.algorithms.advantages import AdvantageInputs, OutcomeEstimator
from rlexp.constraints import Fraction, NonNegative


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """d_t = (log p_student - log p_teacher) at the scored tokens, 0 elsewhere ([N, T])."""
    return (student - teacher) * scored


def discounted_future_sum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """y_t = sum_{t' >= t} gamma^(t' - t) x_t' along the last dimension (gamma = 0: x itself)."""
    if gamma == 0.0:
        return x.clone()
    out, running = torch.zeros_like(x), torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[..., t] + gamma * running
        out[..., t] = running
    return out


def distill_advantages(d: torch.Tensor, kl_coef: float, discount: float) -> torch.Tensor:
    """-kl_coef times the (discounted future) reverse KL `d` ([N, T], 0 where not scored)."""
    return -kl_coef * discounted_future_sum(d, discount)


def topk_forward_kl(student_top: torch.Tensor, teacher_top: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KL_t of the (k + 1)-bucket distributions: `student_top` / `teacher_top` [..., k] are the
    logprobs both give the teacher's top-k ids; the rest's mass is 1 - their sum (floored at
    `eps` so that its log stays finite). Returns [...], each value clamped at 0."""
    p_t = teacher_top.exp()
    rest_t = (1 - p_t.sum(-1)).clamp(min=eps)
    rest_s = (1 - student_top.exp().sum(-1)).clamp(min=eps)
    kl = (p_t * (teacher_top - student_top)).sum(-1) + rest_t * (rest_t.log() - rest_s.log())
    return kl.clamp(min=0.0)


class Distillation(OutcomeEstimator):
    """`advantage=distill`: A_t = -kl_coef * (discounted) d_t, the rewards unused (see the
    module docstring). Needs a teacher (`teacher=local | openai`)."""

    needs_teacher = True

    def __init__(self, kl_coef: NonNegative = 1.0, discount: Fraction = 0.0):
        self.kl_coef, self.discount = kl_coef, discount

    def __call__(self, x: AdvantageInputs) -> torch.Tensor:
        if x.reverse_kl is None:
            raise ValueError("advantage=distill needs the teacher's logprobs (teacher=local | openai)")
        return distill_advantages(x.reverse_kl, self.kl_coef, self.discount)


class DistillTerm:
    """`trainer.distill`: on-policy distillation beside any estimator. `kl_coef` > 0 adds
    -kl_coef * (discounted) d_t to the advantages; `forward_kl_coef` > 0 adds coef * the top-k
    forward KL to each scored token's loss (needs teacher.top_k > 0)."""

    def __init__(self, kl_coef: NonNegative = 0.0, discount: Fraction = 0.0,
                 forward_kl_coef: NonNegative = 0.0):
        self.kl_coef, self.discount, self.forward_kl_coef = kl_coef, discount, forward_kl_coef

    @property
    def on(self) -> bool:
        return bool(self.kl_coef or self.forward_kl_coef)

    def advantages(self, d: torch.Tensor) -> torch.Tensor:
        return distill_advantages(d, self.kl_coef, self.discount) if self.kl_coef else torch.zeros_like(d)
