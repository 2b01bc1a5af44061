"""Advantage estimators: the batch's rewards -> an advantage per trained token, [N, T].

Every estimator sees the whole batch (every rank computes the same advantages). A sample that
did not complete (`completed` False) gets 0 and takes no part in any baseline or statistic.
Outcome rewards are per sample; `token_rewards` (the KL penalty when it is in the reward, see
objective.py's KLTerm) adds per-token rewards, which the group estimators sum into the sample's
score and REINFORCE++ turns into per-token returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from rlexp.sample import Sample, Status


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # [N] the judge's reward of each sample
    groups: Sequence[Hashable]  # [N] the prompt group of each sample
    completed: torch.Tensor  # [N] bool
    mask: torch.Tensor  # [N, T] 1.0 at trained tokens (a row of zeros: nothing trained)
    token_rewards: torch.Tensor | None = None  # [N, T] e.g. -beta * KL per token, or None
    values: torch.Tensor | None = None  # [N, T] a critic's values (advantage=gae), or None
    reverse_kl: torch.Tensor | None = None  # [N, T] student - teacher logprob at scored tokens (distill.py)

    @classmethod
    def from_samples(cls, batch: list[Sample], token_rewards: torch.Tensor | None = None,
                     values: torch.Tensor | None = None) -> AdvantageInputs:
        """A batch's inputs, T its longest sample's tokens - 1 (aligned like a TrainBatch): a
        failed sample, or one with no response, has a row of zeros and no group."""
        width = max((len(s.tokens) for s in batch), default=1)
        mask = torch.zeros(len(batch), max(width - 1, 0))
        for i, s in enumerate(batch):
            if s.status == Status.COMPLETED and s.response_length:
                mask[i, :len(s.tokens) - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        return cls(rewards=torch.tensor([s.reward for s in batch], dtype=torch.float32),
                   groups=[s.group_id for s in batch],
                   completed=torch.tensor([s.status == Status.COMPLETED for s in batch]),
                   mask=mask, token_rewards=token_rewards, values=values)

    def scores(self) -> torch.Tensor:
        """[N] each sample's return: its reward plus its per-token rewards."""
        r = self.rewards.float()
        return r if self.token_rewards is None else r + (self.token_rewards * self.mask).sum(-1)

    def group_members(self) -> list[list[int]]:
        index: dict[Hashable, list[int]] = defaultdict(list)
        for i, (g, ok) in enumerate(zip(self.groups, self.completed.tolist())):
            if ok:
                index[g].append(i)
        return list(index.values())


class AdvantageEstimator(Protocol):
    needs_values: bool  # its advantages come from a critic's values (trainer.critic must be set)
    needs_teacher: bool  # its advantages come from a teacher's logprobs (advantage=distill)
    min_samples_per_prompt: int  # e.g. 2 for a group baseline (checked against data.samples_per_prompt)

    def __call__(self, x: AdvantageInputs) -> torch.Tensor:
        """[N, T] advantages (only the trained tokens' entries are used)."""
        ...

    def advantages_and_returns(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The advantages and, when `needs_values`, the critic's targets (else None)."""
        ...


class OutcomeEstimator(ABC):
    """An estimator from the rewards alone: no critic, so no targets for one."""

    needs_values = False
    needs_teacher = False
    min_samples_per_prompt = 1

    @abstractmethod
    def __call__(self, x: AdvantageInputs) -> torch.Tensor: ...

    def advantages_and_returns(self, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
        return self(x), None


def _per_token(adv: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
    return adv[:, None].expand_as(x.mask)


class GroupNormalized(OutcomeEstimator):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): A_i = (r_i - mean_g) / (std_g + eps)
    over the completed samples of sample i's prompt group g. `std`: "population" (divide by n,
    the default), "sample" (Bessel, n-1, as verl and TRL) or "none": A_i = r_i - mean_g, Dr.GRPO
    (Liu et al. 2025, Understanding R1-Zero-Like Training, arXiv:2503.20783). A group whose
    rewards are all equal, or of one sample, gets 0."""

    min_samples_per_prompt = 2  # compares the samples of one prompt

    def __init__(self, std: Literal["population", "sample", "none"] = "population", eps: float = 1e-6):
        self.std, self.eps = std, eps

    def __call__(self, x: AdvantageInputs) -> torch.Tensor:
        scores = x.scores()
        adv = torch.zeros_like(scores, dtype=torch.float32)
        for members in x.group_members():
            r = scores[members].float()
            centered = r - r.mean()
            if self.std != "none" and len(members) > 1:
                centered = centered / (r.std(unbiased=self.std == "sample") + self.eps)
            adv[members] = centered
        return _per_token(adv, x)


class LeaveOneOut(OutcomeEstimator):
    """RLOO (Ahmadian et al. 2024, Back to Basics, arXiv:2402.14740; Kool et al. 2019):
    A_i = r_i - mean_{j != i} r_j over the completed samples of the group = n/(n-1) (r_i - mean_g).
    A group of one sample has no baseline and gets 0."""

    min_samples_per_prompt = 2

    def __call__(self, x: AdvantageInputs) -> torch.Tensor:
        scores = x.scores()
        adv = torch.zeros_like(scores, dtype=torch.float32)
        for members in x.group_members():
            n = len(members)
            if n > 1:
                r = scores[members].float()
                adv[members] = r - (r.sum() - r) / (n - 1)
        return _per_token(adv, x)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / sqrt(var + eps) over the masked entries, var with Bessel's correction
    (verl's masked_whiten); 0 elsewhere, and 0 everywhere when fewer than 2 entries."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


class ReinforcePP(OutcomeEstimator):
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): the return of token t is the sample's
    reward plus the per-token rewards from t on (gamma = 1), G_t = r + sum_{t' >= t} r_t';
    advantages are the returns whitened over every trained token of the batch (no critic, no
    group baseline). `baseline=True` is REINFORCE++-baseline: the group's mean reward is
    subtracted from each outcome reward first, then the same returns and whitening."""

    def __init__(self, baseline: bool = False):
        self.baseline = baseline

    def __call__(self, x: AdvantageInputs) -> torch.Tensor:
        mask = x.mask * x.completed[:, None].float()
        outcome = x.rewards.float()
        if self.baseline:
            centered = torch.zeros_like(outcome)
            for members in x.group_members():
                centered[members] = outcome[members] - outcome[members].mean()
            outcome = centered
        per_token = torch.zeros_like(mask) if x.token_rewards is None else x.token_rewards * mask
        to_go = per_token.flip(-1).cumsum(-1).flip(-1)  # sum over t' >= t
        return whiten((outcome[:, None] + to_go) * mask, mask)


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): see ReinforcePP."""

    min_samples_per_prompt = 2

    def __init__(self):
        super().__init__(baseline=True)
