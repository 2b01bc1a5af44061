"""Importance ratios between two policies' logprobs of the same tokens, kept finite."""

from __future__ import annotations

import torch

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
