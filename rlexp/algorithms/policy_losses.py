"""Policy losses: per-token loss of one micro-batch, to be weighted by `mismatch` and reduced
by `aggregation`. Each returns (loss [n, T], metrics): a metric of shape [n, T] is a per-token
value (logged as its token mean), of shape [n] a per-sequence one (logged as its sequence mean).

The ratio r = pi / pi_old is against the proximal policy `old_logp`: the rollout engine's
logprobs, or the trainer's own before the update (`trainer.old_logprobs=recompute`, and
always for a loss with `needs_recompute`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Protocol

import torch
from annotated_types import Gt

from rlexp.algorithms.mismatch import TokenTIS
from rlexp.algorithms.ratios import clamped_exp, seq_log_ratio
from rlexp.constraints import NonNegative

Metrics = dict[str, torch.Tensor]


@dataclass
class TokenInputs:
    logp: torch.Tensor  # [n, T] the policy being trained (differentiable)
    old_logp: torch.Tensor  # [n, T] the proximal policy (no gradient)
    rollout_logp: torch.Tensor  # [n, T] the rollout engine's, the behaviour policy (no gradient)
    adv: torch.Tensor  # [n, T]
    mask: torch.Tensor  # [n, T] 1.0 at trained tokens


class PolicyLoss(Protocol):
    needs_recompute: bool  # its proximal policy must be the trainer's own logprobs

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]: ...


def _clip_objective(ratio, adv, low, high):
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


class PPOClip:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347) per token, with asymmetric bounds
    (DAPO's clip-higher, arXiv:2503.14476): max(-A r, -A clip(r, 1 - low, 1 + high)),
    r = exp(logp - old_logp). `dual_clip` c > 1 (Ye et al. 2020, arXiv:1912.09729) also bounds
    the loss of negative-advantage tokens by -A c, so a huge ratio cannot blow it up."""

    needs_recompute = False

    def __init__(self, clip_ratio_low: NonNegative = 0.2, clip_ratio_high: NonNegative = 0.2,
                 dual_clip: Annotated[float, Gt(1)] | None = None):
        self.low, self.high, self.dual_clip = clip_ratio_low, clip_ratio_high, dual_clip

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        ratio = clamped_exp(x.logp - x.old_logp)
        loss, clipped = _clip_objective(ratio, x.adv, self.low, self.high)
        metrics = {"clip_frac": clipped, "ratio_mean": ratio.detach()}
        if self.dual_clip is not None:
            bound = -x.adv * self.dual_clip
            dual = (x.adv < 0) & (loss > bound)
            loss = torch.where(dual, bound, loss)
            metrics["dual_clip_frac"] = dual.float()
        return loss, {"pg_loss": loss.detach()} | metrics


class GSPO:
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071): the
    clipped objective on the sequence's geometric-mean ratio
    s_i = exp(mean_t (logp - old_logp)), applied per token as s_i,t = sg(s_i) pi_t / sg(pi_t)
    (equal to s_i in value; its gradient is s_i grad log pi_t): max(-A s, -A clip(s, 1 - low,
    1 + high)). The paper's bounds are small (3e-4, 4e-4); pair with seq_mean_token_mean."""

    needs_recompute = False

    def __init__(self, clip_ratio_low: NonNegative = 3e-4, clip_ratio_high: NonNegative = 4e-4):
        self.low, self.high = clip_ratio_low, clip_ratio_high

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        log_s = seq_log_ratio(x.logp.detach() - x.old_logp, x.mask, mean=True)
        ratio = clamped_exp(x.logp - x.logp.detach() + log_s[:, None])
        loss, clipped = _clip_objective(ratio, x.adv, self.low, self.high)
        return loss, {"pg_loss": loss.detach(), "clip_frac": clipped, "ratio_mean": ratio.detach()}


class CISPO:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE with a clipped importance weight held
    constant, -sg(clip(r, 1 - low, 1 + high)) A logp: every token keeps a gradient (PPO's
    clipping drops them). The paper sets no lower bound (low = 1: r is clipped at 0 only)."""

    needs_recompute = False

    def __init__(self, clip_ratio_low: NonNegative = 1.0, clip_ratio_high: NonNegative = 0.28):
        self.low, self.high = clip_ratio_low, clip_ratio_high

    def __call__(self, x: TokenInputs) -> tuple[torch.Tensor, Metrics]:
        ratio = clamped_exp(x.logp - x.old_logp).detach()
        weight = torch.clamp(ratio, 1.0 - self.low, 1.0 + self.high)
        loss = -weight * x.adv * x.logp
        return loss, {"pg_loss": loss.detach(), "clip_frac": (weight != ratio).float(), "ratio_mean": ratio}


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
