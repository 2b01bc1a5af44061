"""Sums of a fit's metric shares by name, kept on the device until the one host read
(fit_metrics.py): each micro-batch adds its share of a minibatch mean."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlexp.algorithms.objective import Totals, clamped_exp, kl_estimate


@dataclass
class MetricSums:
    """Sums of metric shares by name, on the device."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add_terms(self, terms: dict[str, torch.Tensor], mask: torch.Tensor, totals: Totals) -> None:
        """Sum each term over this micro-batch: a [n, T] term as its share of the minibatch's
        token mean, a [n] (per-sequence) term as its share of the sequence mean."""
        has_tokens = (mask.sum(-1) > 0).float()
        for k, v in terms.items():
            v = v.detach()
            if v.dim() == 2:
                self.add(k, (v * mask).sum() / totals.tokens)
            else:
                self.add(k, (v * has_tokens).sum() / totals.seqs)

    def add_offpolicy(self, logp: torch.Tensor, rollout_logp: torch.Tensor, staleness: torch.Tensor,
                      mask: torch.Tensor, levels: list[int]) -> None:
        """Trainer vs rollout per staleness value k (policy versions between the sample's
        generation and this fit): trained tokens, sum of pi/pi_behav, sum of the k3 KL."""
        ratio, kl = clamped_exp(logp - rollout_logp), kl_estimate(logp, rollout_logp, "k3")
        for k in levels:
            sel = ((staleness == k) & mask.bool()).float()
            self.add(f"offpolicy/{k}/tokens", sel.sum())
            self.add(f"offpolicy/{k}/ratio", (ratio * sel).sum())
            self.add(f"offpolicy/{k}/kl", (kl * sel).sum())

    def merge(self, other: MetricSums, prefix: str = "") -> None:
        for k, v in other.sums.items():
            self.add(prefix + k, v)
