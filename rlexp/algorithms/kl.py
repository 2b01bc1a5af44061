"""KL to the frozen reference policy, estimated per token from the sampled tokens' logprobs
(Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html). With
log r = ref_logp - logp, clamped to [-20, 20] before `exp`:

    k1 = -log r                  unbiased, can be negative
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, >= 0 (DeepSeekMath's GRPO); computed as
                                 expm1(log r) - log r: exp(x) - 1 - x cancels near 0 in
                                 float32 (an error of ~1e-7 on values of ~1e-10, negative)
    low_var_kl = min(k3, 10)     k3 clamped (verl's low_var_kl)

`where: loss` adds coef * KL to each token's loss (differentiated); `where: reward` subtracts
coef * KL from each token's reward before the advantages (not differentiated: REINFORCE++,
PPO's original KL penalty, Ouyang et al. 2022)."""

from __future__ import annotations

from typing import Literal

import torch

from rlexp.algorithms.ratios import MAX_LOG_RATIO
from rlexp.constraints import NonNegative

Estimator = Literal["k1", "k2", "k3", "low_var_kl"]
LOW_VAR_KL_MAX = 10.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Estimator = "k3") -> torch.Tensor:
    log_r = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    k3 = torch.expm1(log_r) - log_r  # exp(x) - 1 without cancellation: >= 0 also near 0
    return k3.clamp(max=LOW_VAR_KL_MAX) if estimator == "low_var_kl" else k3


class KLTerm:
    """`coef` 0 keeps no KL in the objective; `train/kl` is still logged with `estimator`
    on the steps the trainer runs the reference (trainer.ref_kl_every_n_steps)."""

    def __init__(self, estimator: Estimator = "k3", coef: NonNegative = 0.0,
                 where: Literal["loss", "reward"] = "loss"):
        self.estimator, self.coef, self.where = estimator, coef, where

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        return kl_estimate(logp, ref_logp, self.estimator)

    @property
    def in_loss(self) -> bool:
        return self.coef > 0 and self.where == "loss"

    @property
    def in_reward(self) -> bool:
        return self.coef > 0 and self.where == "reward"

    def token_rewards(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[N, T] -coef * KL at each trained token: the penalty as per-token rewards."""
        return -self.coef * self(logp, ref_logp) * mask
