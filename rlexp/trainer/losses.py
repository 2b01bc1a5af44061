"""Token-level loss pieces. All take flat per-token tensors of one micro-batch."""

from __future__ import annotations

import torch


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                    clip_low: float, clip_high: float):
    """PPO-clip objective per token: max(-A*r, -A*clip(r, 1-low, 1+high)), r = exp(logp - old)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, ratio.detach(), (clipped > unclipped).float()


def truncated_is_pg_loss(logp: torch.Tensor, behav_logp: torch.Tensor, adv: torch.Tensor, cap: float):
    """Policy gradient with a truncated importance weight against the behaviour policy:
    -min(r, cap) * A * logp with r = exp(logp - behav) held constant (no trust region, no
    recomputed proximal policy; the gradient equals PPO's where r = 1)."""
    ratio = torch.exp(logp - behav_logp).detach()
    weight = torch.clamp(ratio, max=cap)
    return -weight * adv * logp, ratio, (ratio > cap).float()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative estimate of KL(policy || ref) (Schulman's k3)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
