"""What the algorithm tests (tests/test_algorithms.py, test_algorithms_advantages.py) share:
float32 tensors from lists, and an estimator's inputs with one group of completed samples and
two trained tokens each unless told otherwise."""

import torch

from rlexp.algorithms.advantages import AdvantageInputs


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def adv_inputs(rewards, groups=None, completed=None, mask=None, token_rewards=None) -> AdvantageInputs:
    n = len(rewards)
    return AdvantageInputs(
        rewards=t(rewards), groups=[0] * n if groups is None else groups,
        completed=torch.ones(n, dtype=torch.bool) if completed is None else torch.tensor(completed),
        mask=torch.ones(n, 2) if mask is None else t(mask),
        token_rewards=None if token_rewards is None else t(token_rewards))
