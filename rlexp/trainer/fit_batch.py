"""What one fit carries from call to call of the TrainController's low-level API.

    fb = trainer.prepare(batch, version)   # the trained samples as a TokenBatch, cut into minibatches
    trainer.compute_old_logprobs(fb)       # fb.old
    trainer.compute_ref_logprobs(fb)       # fb.ref
    trainer.compute_values(fb)             # fb.values
    trainer.compute_advantages(fb)         # fb.advantages, fb.returns
    metrics = trainer.train(fb)            # optimizer steps; the lr schedule's step

`fit(batch, version)` is exactly these calls. Between them a loop may read or replace a
field (e.g. reshape `fb.advantages`); the tensors are this rank's, [rows, L-1] on the
trainer's device, rows in `tokens` order, 0 outside the rows this rank trains."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlexp.sample import Sample
from rlexp.trainer.token_batch import TokenBatch

Piece = tuple[torch.Tensor, int, bool]  # rows, padded width, real (False: a masked-out filler)
Minibatch = tuple[list[int], list[Piece], list[Piece]]  # its rows, this rank's pieces, everyone's real ones


@dataclass
class FitBatch:
    samples: list[Sample]  # the batch as produced, failed samples included
    version: int  # the policy being trained
    trained: list[int]  # indexes into `samples` of the trained rows (completed, with a response)
    tokens: TokenBatch | None = None  # the trained samples; None when there are none
    minibatches: list[Minibatch] = field(default_factory=list)
    my_pieces: list[Piece] = field(default_factory=list)  # this rank's micro-batches over all its rows
    old: torch.Tensor | None = None  # the logprobs the ratio is taken against
    ref: torch.Tensor | None = None  # the reference policy's (None: not needed this step)
    values: torch.Tensor | None = None  # the critic's, every rank's rows (None: no critic)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # the critic's targets (None: no critic)

    def require(self, *fields: str, call: str) -> None:
        """A clear error when a low-level call comes before the ones it needs."""
        order = {"old": "compute_old_logprobs", "ref": "compute_ref_logprobs", "values": "compute_values",
                 "advantages": "compute_advantages"}
        missing = [order[f] for f in fields if getattr(self, f) is None]
        if missing and self.tokens is not None:
            raise RuntimeError(f"TrainController.{call} needs {', '.join(missing)} to have run on this "
                               "FitBatch first (order: prepare, compute_old_logprobs, compute_ref_logprobs, "
                               "compute_values, compute_advantages, train)")
