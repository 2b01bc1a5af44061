"""GRPO advantages: each sample's reward relative to the other samples of its prompt group."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import torch


def group_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable], norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps); a group whose rewards are all equal gets 0."""
    index: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        index[g].append(i)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for members in index.values():
        r = rewards[members].float()
        centered = r - r.mean()
        if norm_by_std and len(members) > 1:
            centered = centered / (r.std(unbiased=False) + eps)
        adv[members] = centered
    return adv
