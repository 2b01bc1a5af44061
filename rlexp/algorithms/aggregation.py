"""Loss aggregation: one micro-batch's per-token loss -> its share of the minibatch's scalar loss.

Each mode is a sum of per-token (or per-sequence) terms divided by a denominator counted over
the whole minibatch on every rank (`Totals`), so summing the micro-batches' values and the
ranks' gradients gives exactly the loss of the minibatch taken at once. With T_i the trained
tokens of sequence i, S the sequences and N = sum_i T_i the tokens of the minibatch:

    token_mean               sum_i,t l_it / N          (DAPO, arXiv:2503.14476; the default)
    seq_mean_token_sum       sum_i,t l_it / S
    seq_mean_token_mean      sum_i (sum_t l_it / T_i) / S     (the original GRPO objective)
    seq_mean_token_sum_norm  sum_i,t l_it / (S * norm_length)  (Dr.GRPO, arXiv:2503.20783:
                             a constant, the generation budget, instead of each T_i)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlexp.constraints import AtLeast1


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


class SeqMeanTokenSumNorm:
    def __init__(self, norm_length: AtLeast1):
        self.norm_length = norm_length

    def __call__(self, loss, mask, totals: Totals) -> torch.Tensor:
        return (loss * mask).sum() / (totals.seqs * self.norm_length)
