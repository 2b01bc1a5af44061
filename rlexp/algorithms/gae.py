"""Generalized advantage estimation with a critic, and the critic's clipped value loss.

Positions are the trainer's: entry t of a row belongs to the token predicted at t (like the
logprobs), and `values[:, t]` is the critic's estimate of the return from that token on. The
steps of the policy are its trained tokens (`mask` 1). Tokens the policy did not write (the
prompt, a tool's output, the environment's reply between turns) are not steps: GAE passes
over them, carrying the next step's value and advantage, and they are neither rewarded nor
discounted. A tool reply of 300 tokens then costs no more discount than one of 3, and the
credit of the reward flows from the last turn to the first as across any other step."""

from __future__ import annotations

import torch

from rlexp.algorithms.advantages import AdvantageInputs, whiten
from rlexp.algorithms.objective import Metrics
from rlexp.constraints import Positive


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, arXiv:1506.02438) over the steps of each row ([N, T] each):

        delta_t = r_t + gamma * V_next(t) - V_t,    A_t = delta_t + gamma * lam * A_next(t)

    where next(t) is the row's next step after t (V and A are 0 after the last one: the episode
    ends there). Returns (advantages, returns = A + V), 0 off the steps. lam = 1 gives the
    discounted return minus V (Monte Carlo); lam = 0 the one-step TD error."""
    mask = mask.float()
    adv = torch.zeros_like(values, dtype=torch.float32)
    next_value = torch.zeros(values.shape[0])
    next_adv = torch.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        step = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(step, a, 0.0)
        next_value = torch.where(step, values[:, t].float(), next_value)
        next_adv = torch.where(step, a, next_adv)
    return adv, (adv + values) * mask


def outcome_on_last_step(x: AdvantageInputs) -> torch.Tensor:
    """[N, T] token rewards: each completed sample's reward on its last trained token, plus
    the per-token rewards (the KL penalty when it is in the reward)."""
    mask = x.mask * x.completed[:, None].float()
    rewards = torch.zeros_like(mask) if x.token_rewards is None else x.token_rewards * mask
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # index of each row's last 1
    has = mask.sum(-1) > 0
    rows = torch.arange(len(mask))[has]
    rewards[rows, last[has]] += x.rewards.float()[has]
    return rewards


class GAE:
    """PPO's advantages from a critic (Ouyang et al. 2022 use this for RLHF, arXiv:2203.02155):
    `gae` over token rewards = the outcome reward on the last trained token (+ per-token
    rewards), advantages whitened over the batch's trained tokens (`whiten`: Bessel's variance,
    as verl); the value target is the un-whitened return A + V. A failed sample gets 0."""

    needs_values = True
    needs_teacher = False
    min_samples_per_prompt = 1  # no group baseline: one sample per prompt is enough

    def __init__(self, gamma: Positive = 1.0, lam: float = 0.95, whiten: bool = True):
        if not 0.0 <= lam <= 1.0 or gamma > 1.0:
            raise ValueError(f"GAE needs 0 <= lam <= 1 and 0 < gamma <= 1, got lam={lam}, gamma={gamma}")
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def advantages_and_returns(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if x.values is None:
            raise ValueError("advantage=gae needs a critic's values (trainer.critic)")
        mask = x.mask * x.completed[:, None].float()
        adv, returns = gae(outcome_on_last_step(x), x.values.float() * mask, mask, self.gamma, self.lam)
        return (whiten(adv, mask) if self.whiten else adv), returns

    def __call__(self, x: AdvantageInputs) -> torch.Tensor:
        return self.advantages_and_returns(x)[0]


class ClippedValueLoss:
    """PPO's value loss (Schulman et al. 2017, arXiv:1707.06347, as in OpenAI's baselines):

        l_t = 1/2 max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, -c, c) - R_t)^2)

    with R the returns and V_old the critic's values before the update. Per token, aggregated
    like the policy loss. `clip` None: the unclipped 1/2 (V - R)^2."""

    def __init__(self, clip: Positive | None = 0.2):
        self.clip = clip

    def __call__(self, values: torch.Tensor, old_values: torch.Tensor,
                 returns: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        err = (values - returns) ** 2
        if self.clip is None:
            return 0.5 * err, {"vf_clip_frac": torch.zeros_like(err)}
        clipped = old_values + (values - old_values).clamp(-self.clip, self.clip)
        err_clipped = (clipped - returns) ** 2
        return 0.5 * torch.maximum(err, err_clipped), {"vf_clip_frac": (err_clipped > err).float()}
