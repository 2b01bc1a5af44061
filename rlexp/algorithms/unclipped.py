"""Per-token losses without a clip (the Tinker API's `cross_entropy`, `importance_sampling` and
`dro`; also conf/policy_loss for rlexp's own runs). Each has `PolicyLoss`'s shape (objective.py):
a per-token loss [n, T] and its metrics, reduced by the aggregation. With r = pi / q the
ratio of the policy being trained to the proximal one (the sampler's logprobs `old_logp`),
kept finite by `clamped_exp`:

    importance_sampling   -r A                                 (REINFORCE with an importance
                          weight; its gradient -r A grad log pi; Tinker's "importance_sampling")
    dro                   -(A log pi - beta/2 (log pi - log q)^2)
                          (Richemond et al. 2024, "Offline Regularised Reinforcement Learning
                          for Large Language Models Alignment", arXiv:2405.19107; Kimi k1.5,
                          arXiv:2501.12599: the quadratic penalty keeps pi near the sampler)
    cross_entropy         -log pi                              (supervised: the negative
                          log-likelihood of the target; weights, if any, are the mask)

Tinker's losses are sums over every position of a datum (`TokenSum`, objective.py): the caller
normalises through its advantages or weights."""

from __future__ import annotations

import torch

from rlexp.algorithms.objective import Metrics, TokenInputs, clamped_exp
from rlexp.constraints import NonNegative


class ImportanceSampling:
    """-r A, r = exp(logp - old_logp) unclipped (exp clamped)."""

    needs_recompute = False

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        ratio = clamped_exp(x.logp - x.old_logp)
        loss = -ratio * x.adv
        return loss, {"pg_loss": loss.detach(), "ratio_mean": ratio.detach()}


class DRO:
    """-(A logp - beta/2 (logp - old_logp)^2): the quadratic penalty is on the log-ratio itself,
    so no `exp` is taken."""

    needs_recompute = False

    def __init__(self, beta: NonNegative = 0.05):
        self.beta = beta

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        log_ratio = x.logp - x.old_logp
        loss = -(x.adv * x.logp - 0.5 * self.beta * log_ratio**2)
        return loss, {"pg_loss": loss.detach(), "log_ratio_sq": log_ratio.detach() ** 2}


class CrossEntropy:
    """-logp of each target token: supervised learning (advantages unused)."""

    needs_recompute = False

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        loss = -x.logp
        return loss, {"pg_loss": loss.detach()}
