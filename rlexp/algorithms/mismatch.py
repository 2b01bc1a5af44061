"""Rollout/training mismatch corrections: the rollout engine's logprobs (`rollout_logp`) and the
trainer's own before the update (`old_logp`, recomputed) differ, by kernels and precision and,
under the async scheduler, by policy versions. A correction turns rho = pi_old / pi_behav into
a weight on each token's loss and a mask of the tokens kept:

    (weight [n, T] or None, keep [n, T] or None, metrics)

A masked token's loss is 0, and it still counts in the aggregation's denominator (IcePop's
objective is normalised by every token), so masking never rescales the tokens kept. Every
correction except `NoCorrection` needs the trainer's recomputed logprobs (one more forward).
`NoCorrection` is `mismatch=none`: the trainer runs no correction at all for it
(`Objective.mismatch` None).

Two policy losses (conf/policy_loss) are built on `TokenTIS` and so live here: `TIS` (truncated
importance sampling against the behaviour policy, no trust region) and `Decoupled` (AReaL's
PPO-clip around the recomputed proximal policy times the truncated behaviour weight). The
`MismatchCorrection` protocol, its `Correction`, the ratios and the other policy losses are in
objective.py."""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge, Gt, Lt

from rlexp.algorithms.objective import (
    Correction,
    Metrics,
    PPOClip,
    TokenInputs,
    clamped_exp,
    seq_log_ratio,
)
from rlexp.constraints import NonNegative

Cap = Annotated[float, Ge(1)]
Below1 = Annotated[float, Ge(0), Lt(1)]  # a band [low, high] around ratio 1
Above1 = Annotated[float, Gt(1)]


class NoCorrection:
    needs_recompute = False

    def __call__(self, old_logp, rollout_logp, mask) -> Correction:
        return None, None, {}


class TokenTIS:
    """Token-level truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; Espeholt et al. 2018): w_t = min(rho_t, cap)."""

    needs_recompute = True

    def __init__(self, is_cap: Cap = 2.0):
        self.cap = is_cap

    def __call__(self, old_logp, rollout_logp, mask) -> Correction:
        ratio = clamped_exp(old_logp - rollout_logp).detach()
        weight = ratio.clamp(max=self.cap)
        return weight, None, {"is_weight_mean": weight, "is_truncated_frac": (ratio > self.cap).float()}


class SeqTIS:
    """Sequence-level truncated importance sampling: one weight per sequence,
    w_i = min(prod_t rho_t, cap) = min(exp(sum_t log rho_t), cap), on all its tokens
    (verl's rollout_is=sequence)."""

    needs_recompute = True

    def __init__(self, is_cap: Cap = 2.0):
        self.cap = is_cap

    def __call__(self, old_logp, rollout_logp, mask) -> Correction:
        ratio = clamped_exp(seq_log_ratio(old_logp - rollout_logp, mask)).detach()
        weight = ratio.clamp(max=self.cap)
        return (weight[:, None].expand_as(mask), None,
                {"is_weight_mean": weight, "is_truncated_frac": (ratio > self.cap).float()})


class IcePop:
    """IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
    Trillion-Scale Thinking Model", Ring-1T, arXiv:2510.18855, eq. 4-5): each token's loss is
    weighted by M(k_t), k_t = rho_t = pi_old(y_t) / pi_rollout(y_t) (held constant), with

        M(k) = k  if low <= k <= high,  else 0

    so a token inside the band is importance-weighted by rho_t and a token outside it is
    masked out of the loss (and of the gradient)."""

    needs_recompute = True

    def __init__(self, low: Below1 = 0.5, high: Above1 = 2.0):
        self.low, self.high = low, high

    def __call__(self, old_logp, rollout_logp, mask) -> Correction:
        ratio = clamped_exp(old_logp - rollout_logp).detach()
        keep = ((ratio >= self.low) & (ratio <= self.high)).float()
        weight = ratio * keep
        return weight, keep, {"is_weight_mean": weight, "masked_token_frac": 1.0 - keep}


class SeqMask:
    """Masked importance sampling at sequence level (MIS; Liu et al. 2025, "When speed kills
    stability: demystifying RL collapse from the training-inference mismatch"): a sequence whose
    ratio lies outside [low, high] is masked out whole. The ratio is prod_t rho_t, or with
    `geometric` its geometric mean exp(mean_t log rho_t), which does not grow with length."""

    needs_recompute = True

    def __init__(self, low: Below1 = 0.5, high: Above1 = 2.0, geometric: bool = True):
        self.low, self.high, self.geometric = low, high, geometric

    def __call__(self, old_logp, rollout_logp, mask) -> Correction:
        ratio = clamped_exp(seq_log_ratio(old_logp - rollout_logp, mask, mean=self.geometric)).detach()
        keep = ((ratio >= self.low) & (ratio <= self.high)).float()
        keep_tokens = keep[:, None].expand_as(mask)
        return None, keep_tokens, {"masked_seq_frac": 1.0 - keep, "masked_token_frac": 1.0 - keep_tokens}


# ---- policy losses built on TokenTIS ------------------------------------------------------------

class TIS:
    """Truncated importance sampling against the behaviour policy, no trust region and no
    recomputed proximal policy: -min(r, cap) A logp, r = exp(logp - rollout_logp) held constant
    (Espeholt et al. 2018 IMPALA's truncation; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"). Its gradient equals PPO's where r = 1."""

    needs_recompute = False

    def __init__(self, is_cap: float = 2.0):
        self.tis = TokenTIS(is_cap)

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        weight, _, metrics = self.tis(x.logp.detach(), x.rollout_logp, x.mask)
        assert weight is not None
        ratio = clamped_exp(x.logp.detach() - x.rollout_logp)
        loss = -weight * x.adv * x.logp
        return loss, {"pg_loss": loss.detach(), "clip_frac": metrics["is_truncated_frac"],
                      "ratio_mean": ratio} | metrics


class Decoupled:
    """AReaL's decoupled PPO (Fu et al. 2025, arXiv:2505.24298): PPO-clip around the proximal
    policy (the trainer's weights before this update, recomputed), times the behaviour
    importance weight min(pi_prox / pi_behav, cap) (= PPOClip with mismatch=token_tis)."""

    needs_recompute = True

    def __init__(self, clip_ratio_low: NonNegative = 0.2, clip_ratio_high: NonNegative = 0.2,
                 is_cap: float = 2.0):
        self.ppo, self.tis = PPOClip(clip_ratio_low, clip_ratio_high), TokenTIS(is_cap)

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = self.ppo(x)
        weight, _, weights = self.tis(x.old_logp, x.rollout_logp, x.mask)
        assert weight is not None
        loss = loss * weight
        return loss, metrics | weights | {"pg_loss": loss.detach()}
