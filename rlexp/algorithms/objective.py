"""The per-token loss: everything a GRPO update computes from the advantages (advantages.py) on,
each piece chosen by a Hydra config group and composed by `Objective`.

Per trained token t of a micro-batch (`Objective.token_loss`):

    l_t = keep_t * (w_t * pg_t - entropy_coef * H_t + kl.coef * KL_t)

pg_t the policy loss, w_t and keep_t the mismatch correction's importance weight and mask
(mismatch.py; 1 without one: `mismatch` None), H_t the policy's entropy, KL_t the estimate
against the reference policy (in the loss only with `kl.where=loss`, in the reward otherwise).
`Objective.aggregate` turns the l_t into the micro-batch's share of the minibatch's scalar loss,
so the micro-batches' gradients sum to the minibatch's. The pieces, in this file's order:

Ratios. Importance ratios between two policies' logprobs of the same tokens, kept finite: every
`exp` of a log-ratio goes through `clamped_exp`.

Policy losses (conf/policy_loss: PPOClip, GSPO, CISPO here; TIS and Decoupled, built on the
token-level importance weight, in mismatch.py): per-token loss of one micro-batch, to be weighted
by `mismatch` and reduced by `aggregation`. Each returns (loss [n, T], metrics): a metric of shape
[n, T] is a per-token value (logged as its token mean), of shape [n] a per-sequence one (logged
as its sequence mean). The ratio r = pi / pi_old is against the proximal policy `old_logp`: the
rollout engine's logprobs, or the trainer's own before the update
(`trainer.old_logprobs=recompute`, and always for a loss with `needs_recompute`).

KL (conf/kl) to the frozen reference policy, estimated per token from the sampled tokens'
logprobs (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).
With log r = ref_logp - logp, clamped to [-20, 20] before `exp`:

    k1 = -log r                  unbiased, can be negative
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, >= 0 (DeepSeekMath's GRPO); computed as
                                 expm1(log r) - log r: exp(x) - 1 - x cancels near 0 in
                                 float32 (an error of ~1e-7 on values of ~1e-10, negative)
    low_var_kl = min(k3, 10)     k3 clamped (verl's low_var_kl)

`where: loss` adds coef * KL to each token's loss (differentiated); `where: reward` subtracts
coef * KL from each token's reward before the advantages (not differentiated: REINFORCE++,
PPO's original KL penalty, Ouyang et al. 2022).

Aggregation (conf/aggregation): one micro-batch's per-token loss -> its share of the minibatch's
scalar loss. Each mode is a sum of per-token (or per-sequence) terms divided by a denominator
counted over the whole minibatch on every rank (`Totals`), so summing the micro-batches' values
and the ranks' gradients gives exactly the loss of the minibatch taken at once. With T_i the
trained tokens of sequence i, S the sequences and N = sum_i T_i the tokens of the minibatch:

    token_mean               sum_i,t l_it / N          (DAPO, arXiv:2503.14476; the default)
    seq_mean_token_sum       sum_i,t l_it / S
    seq_mean_token_mean      sum_i (sum_t l_it / T_i) / S     (the original GRPO objective)
    seq_mean_token_sum_norm  sum_i,t l_it / (S * norm_length)  (Dr.GRPO, arXiv:2503.20783:
                             a constant, the generation budget, instead of each T_i)
    token_sum                sum_i,t l_it              (the Tinker API's losses: the caller
                             normalises through its advantages or weights)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Protocol

import torch
from annotated_types import Gt

from rlexp.algorithms.advantages import AdvantageEstimator, AdvantageInputs
from rlexp.algorithms.distill import DistillTerm
from rlexp.constraints import AtLeast1, NonNegative

# ---- ratios -------------------------------------------------------------------------------------

# |log ratio| above this is clamped before `exp` (as verl and OpenRLHF do): exp(20) ~ 5e8 is
# finite in fp32 and bf16, and so is every product with it; tokens that far apart get no
# gradient through the ratio.
MAX_LOG_RATIO = 20.0


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(clamp(log_ratio, -20, 20)): a ratio that is never inf, nor 0."""
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def seq_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """[rows]: sum over each row's trained tokens of the token log-ratios (the log of the
    sequence's ratio, the product of its token ratios), or their mean (the log of the geometric
    mean ratio). A row with no trained token gets 0."""
    total = (log_ratio * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if mean else total


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# ---- inputs, metrics and the pieces' protocols --------------------------------------------------

Metrics = dict[str, torch.Tensor]
# a mismatch correction's (weight [n, T] or None, keep [n, T] or None, metrics)
Correction = tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]


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


class MismatchCorrection(Protocol):
    """The corrections themselves are in mismatch.py."""

    needs_recompute: bool

    def __call__(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                 mask: torch.Tensor) -> Correction: ...


# ---- policy losses ------------------------------------------------------------------------------

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


# ---- KL to the reference policy -----------------------------------------------------------------

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


# ---- aggregation --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Totals:
    tokens: float  # trained tokens of the minibatch, all ranks
    seqs: float  # sequences with at least one trained token, all ranks


class Aggregation(Protocol):
    def __call__(self, loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor: ...


class TokenMean:
    def __call__(self, loss, mask, totals: Totals) -> torch.Tensor:
        return (loss * mask).sum() / totals.tokens


class SeqMeanTokenSum:
    def __call__(self, loss, mask, totals: Totals) -> torch.Tensor:
        return (loss * mask).sum() / totals.seqs


class SeqMeanTokenMean:
    def __call__(self, loss, mask, totals: Totals) -> torch.Tensor:
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / totals.seqs


class TokenSum:
    def __call__(self, loss, mask, totals: Totals) -> torch.Tensor:
        return (loss * mask).sum()


class SeqMeanTokenSumNorm:
    def __init__(self, norm_length: AtLeast1):
        self.norm_length = norm_length

    def __call__(self, loss, mask, totals: Totals) -> torch.Tensor:
        return (loss * mask).sum() / (totals.seqs * self.norm_length)


# ---- the composition ----------------------------------------------------------------------------

class Objective:
    """The composition the trainer runs: advantage estimator, policy loss, mismatch correction
    (None: none, and no call), KL term, entropy bonus and aggregation."""

    def __init__(self, advantage: AdvantageEstimator, policy_loss: PolicyLoss, aggregation: Aggregation,
                 kl: KLTerm, mismatch: MismatchCorrection | None, entropy_coef: float = 0.0,
                 distill: DistillTerm | None = None):
        self.advantage = advantage
        self.distill = distill or DistillTerm()
        self.policy_loss = policy_loss
        self.aggregation = aggregation
        self.kl = kl
        self.mismatch = mismatch
        self.entropy_coef = entropy_coef

    @property
    def needs_recompute(self) -> bool:
        """The trainer's own logprobs before the update are needed (one more forward)."""
        mismatch = self.mismatch is not None and self.mismatch.needs_recompute
        return self.policy_loss.needs_recompute or mismatch

    def advantages(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-token advantages, the critic's targets: GAE's returns, None without a critic);
        with `distill.kl_coef`, the teacher's reverse-KL advantage added (distill.py)."""
        adv, returns = self.advantage.advantages_and_returns(x)
        if self.distill.kl_coef:
            if x.reverse_kl is None:
                raise ValueError("trainer.distill.kl_coef > 0 needs the teacher's logprobs "
                                 "(teacher=local | openai)")
            adv = adv + self.distill.advantages(x.reverse_kl)
        return adv, returns

    def token_loss(self, x: TokenInputs, entropy: torch.Tensor | None, ref_logp: torch.Tensor | None,
                   forward_kl: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
        """The per-token loss, and every per-token (or per-sequence) quantity logged with it.
        `ref_logp` None: no reference this step (then the KL must not be in the loss);
        `forward_kl`: the top-k forward KL to the teacher at each token (distill.py), or None."""
        loss, metrics = self.policy_loss(x)
        weight, keep, corrections = (None, None, {}) if self.mismatch is None else self.mismatch(
            x.old_logp, x.rollout_logp, x.mask)
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
        if forward_kl is not None:
            metrics["distill_forward_kl"] = forward_kl
            loss = loss + self.distill.forward_kl_coef * forward_kl
        if keep is not None:  # a masked token takes no part in the loss at all
            loss = loss * keep
            metrics["pg_loss"] = metrics["pg_loss"] * keep
        return loss, metrics | {"loss": loss}

    def aggregate(self, loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
        return self.aggregation(loss, mask, totals)
