"""The composition the trainer runs: advantage estimator, policy loss, mismatch correction,
KL term, entropy bonus and aggregation (each from its config group).

Per trained token t of a micro-batch (`token_loss`):

    l_t = keep_t * (w_t * pg_t - entropy_coef * H_t + kl.coef * KL_t)

pg_t the policy loss (policy_losses.py), w_t and keep_t the mismatch correction's importance
weight and mask (mismatch.py; 1 without one), H_t the policy's entropy, KL_t the estimate
against the reference policy (kl.py; in the loss only with `kl.where=loss`, in the reward
otherwise). `aggregate` turns the l_t into the micro-batch's share of the minibatch's scalar
loss (aggregation.py), so the micro-batches' gradients sum to the minibatch's."""

from __future__ import annotations

import torch

from rlexp.algorithms.advantages import AdvantageEstimator, AdvantageInputs
from rlexp.algorithms.aggregation import Aggregation, Totals
from rlexp.algorithms.kl import KLTerm
from rlexp.algorithms.mismatch import MismatchCorrection
from rlexp.algorithms.policy_losses import Metrics, PolicyLoss, TokenInputs


class Objective:
    def __init__(self, advantage: AdvantageEstimator, policy_loss: PolicyLoss, aggregation: Aggregation,
                 kl: KLTerm, mismatch: MismatchCorrection, entropy_coef: float = 0.0):
        self.advantage = advantage
        self.policy_loss = policy_loss
        self.aggregation = aggregation
        self.kl = kl
        self.mismatch = mismatch
        self.entropy_coef = entropy_coef

    @property
    def needs_recompute(self) -> bool:
        """The trainer's own logprobs before the update are needed (one more forward)."""
        return self.policy_loss.needs_recompute or self.mismatch.needs_recompute

    def advantages(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-token advantages, the critic's targets: GAE's returns, None without a critic)."""
        return self.advantage.advantages_and_returns(x)

    def token_loss(self, x: TokenInputs, entropy: torch.Tensor | None,
                   ref_logp: torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
        """The per-token loss, and every per-token (or per-sequence) quantity logged with it.
        `ref_logp` None: no reference this step (then the KL must not be in the loss)."""
        loss, metrics = self.policy_loss(x)
        weight, keep, corrections = self.mismatch(x.old_logp, x.rollout_logp, x.mask)
        if weight is not None:  # an importance weight: of the policy gradient
            loss = loss * weight
            metrics["pg_loss"] = loss.detach()
        metrics = metrics | corrections
        if entropy is not None:
            metrics["entropy"] = entropy
            if self.entropy_coef:
                loss = loss - self.entropy_coef * entropy
        if ref_logp is not None:
            metrics["kl"] = kl = self.kl(x.logp, ref_logp)
            if self.kl.in_loss:
                loss = loss + self.kl.coef * kl
        if keep is not None:  # a masked token takes no part in the loss at all
            loss = loss * keep
            metrics["pg_loss"] = metrics["pg_loss"] * keep
        return loss, metrics | {"loss": loss}

    def aggregate(self, loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
        return self.aggregation(loss, mask, totals)
