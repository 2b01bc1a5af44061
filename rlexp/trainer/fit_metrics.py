"""Metrics of one fit, kept as device tensors until one host transfer."""

from __future__ import annotations

import torch

from rlexp.algorithms.kl import kl_estimate
from rlexp.algorithms.ratios import clamped_exp
from rlexp.trainer import distributed


def add(acc: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    acc[key] = acc[key] + value if key in acc else value


def maximum(acc: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    acc[key] = torch.maximum(acc[key], value) if key in acc else value


def add_terms(acc: dict[str, torch.Tensor], terms: dict[str, torch.Tensor], mask: torch.Tensor,
              tokens: float, seqs: float) -> None:
    """Sum each term over this micro-batch: a [n, T] term as its share of the minibatch's
    token mean, a [n] (per-sequence) term as its share of the sequence mean."""
    has_tokens = (mask.sum(-1) > 0).float()
    for k, v in terms.items():
        v = v.detach()
        add(acc, k, (v * mask).sum() / tokens if v.dim() == 2 else (v * has_tokens).sum() / seqs)


def add_maxima(acc: dict[str, torch.Tensor], terms: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    for name, key in (("ratio_max", "ratio_mean"), ("is_weight_max", "is_weight_mean")):
        if key in terms:
            v = terms[key].detach()
            maximum(acc, name, (v * (mask if v.dim() == 2 else (mask.sum(-1) > 0).float())).max())


def offpolicy_sums(acc, logp, behav_lp, staleness, mask, levels) -> None:
    """Per staleness value: token count, sum of pi/pi_behav, sum of k3 KL between them."""
    ratio, kl = clamped_exp(logp - behav_lp), kl_estimate(logp, behav_lp, "k3")
    for k in levels:
        sel = ((staleness == k) & mask.bool()).float()
        add(acc, f"offpolicy/{k}/tokens", sel.sum())
        add(acc, f"offpolicy/{k}/ratio", (ratio * sel).sum())
        add(acc, f"offpolicy/{k}/kl", (kl * sel).sum())


def offpolicy_report(out: dict[str, float], levels: list[int]) -> dict[str, float]:
    """Trainer vs rollout, by staleness, measured before the first optimizer step."""
    for k in levels:
        n = out.pop(f"train/offpolicy/{k}/tokens")
        ratio_sum, kl_sum = out.pop(f"train/offpolicy/{k}/ratio"), out.pop(f"train/offpolicy/{k}/kl")
        if n:
            out[f"offpolicy/tokens/staleness_{k}"] = n
            out[f"offpolicy/ratio_mean/staleness_{k}"] = ratio_sum / n
            out[f"offpolicy/mismatch_kl/staleness_{k}"] = kl_sum / n
    return out


def reduce_metrics(sums, maxes, grad_norm_sum, n_mb) -> dict[str, float]:
    """Means over minibatches, summed (maxima: maxed) over ranks, read in one transfer."""
    once = ("offpolicy", "mismatch_kl", "routing_mismatch")  # measured in the first minibatch only
    means = {(k if k.startswith("critic/") else f"train/{k}"): v / (1 if k.startswith(once) else n_mb)
             for k, v in sums.items()}
    summed = distributed.all_reduce_(torch.stack(list(means.values())), "sum")
    maxed = distributed.all_reduce_(torch.stack(list(maxes.values())), "max")
    names = list(means) + [f"train/{k}" for k in maxes] + ["train/grad_norm"]
    values = torch.cat([summed, maxed, (grad_norm_sum / n_mb)[None]]).tolist()  # the one host transfer
    return dict(zip(names, values))
