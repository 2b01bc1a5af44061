"""The policy's forward as the engine samples: each predicted token's logprob (and the
entropy of its distribution) under logits / temperature, the never-sampled ids masked, without
ever holding the vocabulary's logits of more than `logits_chunk_tokens` positions.

For position t of a row, with hidden state h_t (the model's output before its head), head
weight W and sampling temperature T:

    z_t = W h_t / T,    log p_t(y) = z_t[y] - logsumexp(z_t),    H_t = -sum_v p_t(v) log p_t(v)

The head is run chunk by chunk over the flattened positions: the model's own head module is
called per chunk (so LoRA, FSDP2's gathered weights and a tied embedding are whatever the model
holds), and in a forward that records gradients each chunk is checkpointed
(`torch.utils.checkpoint`): its logits are freed after the forward and recomputed in its own
backward, one chunk at a time. The [positions, vocab] buffers of a step are then
O(chunk x vocab) instead of O(rows x width x vocab): the chunked-logprob method of Liger
Kernel's fused linear losses and prime-rl, here with autograd's exact gradient. A micro-batch
of at most `logits_chunk_tokens` positions is one chunk, computed as it always was (no
recomputation). The head is reached by calling the model with its output module's `forward`
replaced for that one call: the model returns [rows, width, 2] (logprob, entropy) in place of
its logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rlexp.trainer.routing_replay import MoERouting
from rlexp.trainer.token_batch import MicroBatch, TokenBatch


class PolicyForward:
    """Logprobs (and entropies) of the predicted tokens of a micro-batch's rows, as the engine
    sampled them."""

    def __init__(self, temperature: float, unsampled: list[int], moe: MoERouting, device: torch.device,
                 entropy_in_loss: bool, logits_chunk_tokens: int = 256, autocast: str = "none"):
        self.temperature = temperature
        self.unsampled = unsampled  # a VLM's image placeholders: masked as the engine masks them
        self.moe = moe
        self.device = device
        self.entropy_in_loss = entropy_in_loss  # else the entropy is only logged: no gradient
        self.chunk = logits_chunk_tokens
        self.autocast = autocast  # "bfloat16": compute under torch.autocast (fp32 master weights)

    def __call__(self, model: torch.nn.Module, tb: TokenBatch, micro: MicroBatch,
                 entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropies) of the predicted tokens of `micro`'s rows, [n, width - 1]."""
        rows, width = micro.rows, micro.width
        inputs = tb.model_inputs(rows, width, self.device)
        routed = tb.routed[rows, :width].to(self.device) if tb.routed is not None else None
        predicting = torch.arange(width)[None] < torch.tensor(tb.lengths)[rows, None] - 1
        targets = torch.cat([inputs["input_ids"][:, 1:], torch.zeros_like(inputs["input_ids"][:, :1])], 1)
        head = _output_module(model)
        score = partial(self._score, head, targets.flatten(), entropy)
        with self._precision(), _head_replaced(head, score):
            out = self.moe.forward(model, inputs, routed, predicting.to(self.device)).logits
        out = out[:, :-1].float()
        return out[..., 0], (out[..., 1] if entropy else None)

    def _score(self, head: torch.nn.Module, targets: torch.Tensor, entropy: bool,
               hidden: torch.Tensor) -> torch.Tensor:
        """[rows, width, 2]: each position's (logprob of its target, entropy or 0), from the
        hidden states [rows, width, hidden] in chunks of `self.chunk` positions."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        chunk = partial(self._chunk, head, entropy)
        if len(flat) <= self.chunk:
            out = chunk(flat, targets)
        else:
            pieces = zip(flat.split(self.chunk), targets.split(self.chunk))
            if torch.is_grad_enabled():
                out = torch.cat([checkpoint(chunk, h, t, use_reentrant=False) for h, t in pieces])
            else:
                out = torch.cat([chunk(h, t) for h, t in pieces])
        return out.reshape(*hidden.shape[:-1], 2)

    def _chunk(self, head: torch.nn.Module, entropy: bool, hidden: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
        """[n, 2] (logprob, entropy) of `n` positions: the only place logits exist."""
        logits = type(head).forward(head, hidden).float() / self.temperature
        logits[..., self.unsampled] = torch.finfo(logits.dtype).min  # as the engine masks them
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, targets[:, None])[:, 0]
        if not entropy:
            return torch.stack([logp, torch.zeros_like(logp)], -1)
        src = logp_all if self.entropy_in_loss else logp_all.detach()
        return torch.stack([logp, -(src.exp() * src).sum(-1)], -1)

    def _precision(self) -> contextlib.AbstractContextManager:
        if self.autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.autocast))

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, tb: TokenBatch,
                 micro_batches: list[MicroBatch]) -> torch.Tensor:
        """[N, L-1] logprobs of the predicted tokens of the rows in `micro_batches` (0 elsewhere)."""
        out = torch.zeros(tb.loss_mask.shape, device=self.device)
        for micro in micro_batches:
            logp = self(model, tb, micro)[0]
            if micro.real:
                out[micro.rows.to(self.device), micro.columns] = logp
        return out


def _output_module(model: Any) -> torch.nn.Module:
    """The module that turns hidden states into the vocabulary's logits (transformers'
    `get_output_embeddings`: `lm_head`, tied or not)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head) to score with")
    return head


@contextlib.contextmanager
def _head_replaced(head: torch.nn.Module, score) -> Iterator[None]:
    """The model's output module computes `score(hidden)` for the calls inside the block: the
    module itself, its parameters and its hooks stay in place."""
    head.forward = score
    try:
        yield
    finally:
        del head.forward
