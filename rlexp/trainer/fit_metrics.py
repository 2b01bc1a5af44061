"""Metrics of one fit, kept as device tensors until one host transfer.

A host read (`.item()`, `.tolist()`) waits for the device: one per micro-batch would stall a
GPU between every forward. So each micro-batch adds its share of a minibatch mean into a
`MetricSums` on the device, and `StepMetrics.report` reads them all in one transfer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlexp.algorithms.aggregation import Totals
from rlexp.algorithms.kl import kl_estimate
from rlexp.algorithms.ratios import clamped_exp
from rlexp.trainer import distributed

# measured in the first minibatch only (before the first optimizer step): not averaged over them
MEASURED_ONCE = ("offpolicy", "mismatch_kl", "routing_mismatch")


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

    def add_offpolicy(self, logp: torch.Tensor, behav_logp: torch.Tensor, staleness: torch.Tensor,
                      mask: torch.Tensor, levels: list[int]) -> None:
        """Trainer vs rollout per staleness value k (policy versions between the sample's
        generation and this fit): trained tokens, sum of pi/pi_behav, sum of the k3 KL."""
        ratio, kl = clamped_exp(logp - behav_logp), kl_estimate(logp, behav_logp, "k3")
        for k in levels:
            sel = ((staleness == k) & mask.bool()).float()
            self.add(f"offpolicy/{k}/tokens", sel.sum())
            self.add(f"offpolicy/{k}/ratio", (ratio * sel).sum())
            self.add(f"offpolicy/{k}/kl", (kl * sel).sum())

    def merge(self, other: MetricSums, prefix: str = "") -> None:
        for k, v in other.sums.items():
            self.add(prefix + k, v)


@dataclass
class StepMetrics:
    """One fit's metrics: sums over minibatches, maxima, and the gradient norms."""

    sums: MetricSums = field(default_factory=MetricSums)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norm_sum: torch.Tensor | None = None

    def add_maxima(self, terms: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """The largest ratio and importance weight over trained tokens (or sequences)."""
        for name, key in (("ratio_max", "ratio_mean"), ("is_weight_max", "is_weight_mean")):
            if key in terms:
                v = terms[key].detach()
                v_max = (v * (mask if v.dim() == 2 else (mask.sum(-1) > 0).float())).max()
                self.maxima[name] = torch.maximum(self.maxima[name], v_max) if name in self.maxima else v_max

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        self.grad_norm_sum = grad_norm if self.grad_norm_sum is None else self.grad_norm_sum + grad_norm

    def report(self, minibatches: int, levels: list[int]) -> dict[str, float]:
        """Means over minibatches, summed (maxima: maxed) over ranks, read in one transfer; the
        off-policy sums by staleness as their means."""
        means = {}
        for k, v in self.sums.sums.items():
            name = k if k.startswith("critic/") else f"train/{k}"
            means[name] = v / (1 if k.startswith(MEASURED_ONCE) else minibatches)
        summed = distributed.all_reduce_(torch.stack(list(means.values())), "sum")
        maxed = distributed.all_reduce_(torch.stack(list(self.maxima.values())), "max")
        assert self.grad_norm_sum is not None
        names = list(means) + [f"train/{k}" for k in self.maxima] + ["train/grad_norm"]
        grad_norm = (self.grad_norm_sum / minibatches)[None]
        values = torch.cat([summed, maxed, grad_norm]).tolist()  # the one host transfer
        return _offpolicy_means(dict(zip(names, values)), levels)


def _offpolicy_means(out: dict[str, float], levels: list[int]) -> dict[str, float]:
    """Trainer vs rollout, by staleness, measured before the first optimizer step."""
    for k in levels:
        n = out.pop(f"train/offpolicy/{k}/tokens")
        ratio_sum = out.pop(f"train/offpolicy/{k}/ratio")
        kl_sum = out.pop(f"train/offpolicy/{k}/kl")
        if n:
            out[f"offpolicy/tokens/staleness_{k}"] = n
            out[f"offpolicy/ratio_mean/staleness_{k}"] = ratio_sum / n
            out[f"offpolicy/mismatch_kl/staleness_{k}"] = kl_sum / n
    return out
