"""The policy the update trains, and its forward as the engine samples: each predicted
token's logprob (and the entropy of its distribution) under logits / temperature, the
never-sampled ids masked, without ever holding the vocabulary's logits of more than
`logits_chunk_tokens` positions.

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
its logits, which only this module sees (and, for on-policy distillation's top-k forward KL,
the logprobs of the teacher's k likeliest ids of each position after them).

A `Policy` owns that forward for the model, its frozen reference (its own copy, or with LoRA
the model with its adapters off), an MoE's routing replay and load-balancing loss
(routing_replay.py), and mixed precision in one process (torch.autocast): the update gets a
`PolicyOutput` and never reaches into any of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rlexp.trainer.batch import MicroBatch, TrainBatch
from rlexp.trainer.lora import adapters_off
from rlexp.trainer.routing_replay import MoERouting


@dataclass(frozen=True)
class PolicyOutput:
    """One micro-batch's forward, [n, width - 1] per token."""

    logprobs: torch.Tensor  # of the predicted tokens
    entropy: torch.Tensor | None  # of each position's distribution (None: not asked)
    aux: torch.Tensor | None  # MoE, with gradients: the load-balancing loss (routing_replay.py; None: off)
    aux_coef: float  # its weight in the loss (trainer.router_aux_loss_coef)
    routing_differs: torch.Tensor | None  # MoE with the engine's routing: share of layers that differ
    teacher_top: torch.Tensor | None = None  # [n, width - 1, k] logprobs of the teacher's top-k ids

    def aux_term(self, share: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | None]:
        """coef x the aux loss weighted by `share` (its micro-batch's part of the minibatch's
        trained tokens, so the minibatch's terms sum to a token-weighted mean), and that
        mean's part to log as `router_aux_loss` (None: no aux loss)."""
        if self.aux is None:
            return 0.0, None
        part = self.aux * share
        return self.aux_coef * part, part.detach()


class Policy:
    """Logprobs (and entropies) of the predicted tokens of a batch's rows, as the engine
    sampled them. `unsampled`: a VLM's image placeholders, masked as the engine masks them;
    `entropy_in_loss`: else the entropy is only logged (no gradient); `autocast`: "bfloat16"
    computes under torch.autocast (fp32 master weights)."""

    def __init__(self, model: torch.nn.Module, reference: torch.nn.Module | None, lora: bool,
                 temperature: float, unsampled: list[int], moe: MoERouting | None, device: torch.device,
                 entropy_in_loss: bool, logits_chunk_tokens: int, autocast: str, teacher_top: bool = False):
        self.model = model
        self.reference = Reference(self, reference, lora)
        self.temperature = temperature
        self.unsampled = unsampled
        self.moe = moe  # an MoE's routing replay and aux loss (None: a dense model)
        self.device = device
        self.entropy_in_loss = entropy_in_loss
        self.chunk = logits_chunk_tokens
        self.autocast = autocast
        self.teacher_top = teacher_top  # the forward with gradients also scores the teacher's top-k ids

    @property
    def router_layers(self) -> int:
        """An MoE's layers with a router (0: a dense model)."""
        return self.moe.n_layers if self.moe else 0

    @property
    def aux_loss_coef(self) -> float:
        """> 0: every forward with gradients adds an MoE's load-balancing loss."""
        return self.moe.aux_coef if self.moe else 0.0

    def __call__(self, batch: TrainBatch, micro: MicroBatch, entropy: bool = True) -> PolicyOutput:
        """The policy's forward of `micro`'s rows (with gradients where they are enabled)."""
        return self.forward(self.model, batch, micro, entropy, self.teacher_top)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[N, L-1] logprobs of the predicted tokens of this rank's rows (0 elsewhere)."""
        return self.scores(self.model, batch)

    def scores(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        out = torch.zeros(batch.loss_mask.shape, device=self.device)
        for micro in batch.micro_batches:
            logp = self.forward(model, batch, micro, entropy=False).logprobs
            if micro.real:
                out[micro.rows.to(self.device), micro.columns] = logp
        return out

    def forward(self, model: torch.nn.Module, batch: TrainBatch, micro: MicroBatch,
                entropy: bool, teacher_top: bool = False) -> PolicyOutput:
        rows, width = micro.rows, micro.width
        inputs = {"input_ids": batch.input_ids[rows, :width].to(self.device)}
        if batch.images is not None:
            inputs |= batch.images.inputs(rows, self.device)
        routed = batch.routed.rows(rows, width, self.device) if batch.routed is not None else None
        predicting = torch.arange(width)[None] < torch.tensor(batch.lengths)[rows, None] - 1
        ids = inputs["input_ids"]
        predicted = ids[:, 1:] if batch.targets is None else batch.targets[rows, :width - 1].to(self.device)
        targets = torch.cat([predicted, torch.zeros_like(ids[:, :1])], 1)[..., None]
        if teacher_top:  # the teacher's top-k ids of each position, gathered beside the target
            assert batch.teacher is not None and batch.teacher.top_ids is not None, "no teacher top-k"
            top = batch.teacher.top_ids[rows, :width - 1].to(self.device)
            targets = torch.cat([targets, torch.cat([top, torch.zeros_like(top[:, :1])], 1)], -1)
        head = _output_module(model)
        score = partial(self._score, head, targets.flatten(0, 1), entropy)
        with self._precision(), _head_replaced(head, score):
            if self.moe is None:
                out = model(**inputs, use_cache=False).logits
            else:
                out = self.moe.forward(model, inputs, routed, predicting.to(self.device)).logits
        out = out[:, :-1].float()
        aux, differs = (self.moe.aux, self.moe.differs) if self.moe else (None, None)
        return PolicyOutput(out[..., 0], out[..., 1] if entropy else None, aux, self.aux_loss_coef, differs,
                            out[..., 2:] if teacher_top else None)

    def _score(self, head: torch.nn.Module, targets: torch.Tensor, entropy: bool,
               hidden: torch.Tensor) -> torch.Tensor:
        """[rows, width, 1 + targets]: each position's (logprob of its target, entropy or 0,
        logprobs of its other targets: the teacher's top-k ids), from the hidden states [rows,
        width, hidden] in chunks of `self.chunk` positions; `targets` [rows * width, targets]."""
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
        return out.reshape(*hidden.shape[:-1], out.shape[-1])

    def _chunk(self, head: torch.nn.Module, entropy: bool, hidden: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
        """[n, 1 + targets] (logprob of the first target, entropy, logprobs of the others) of `n`
        positions: the only place logits exist."""
        logits = type(head).forward(head, hidden).float()
        if self.temperature != 1.0:  # x / 1.0 is x: the pass over [n, vocab] is skipped, not rounded
            logits = logits / self.temperature
        if self.unsampled:
            logits[..., self.unsampled] = torch.finfo(logits.dtype).min  # as the engine masks them
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, targets)
        if not entropy:
            return torch.cat([logp[:, :1], torch.zeros_like(logp[:, :1]), logp[:, 1:]], -1)
        src = logp_all if self.entropy_in_loss else logp_all.detach()
        return torch.cat([logp[:, :1], -(src.exp() * src).sum(-1, keepdim=True), logp[:, 1:]], -1)

    def _precision(self) -> contextlib.AbstractContextManager:
        if self.autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.autocast))


class Reference:
    """The frozen reference policy: its own copy, or with LoRA the policy's model with its
    adapters off (no copy kept). None of either: the algorithm needs no reference."""

    def __init__(self, policy: Policy, model: torch.nn.Module | None, lora: bool):
        self.policy, self.model, self.lora = policy, model, lora

    def __bool__(self) -> bool:
        return self.lora or self.model is not None

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[N, L-1] the reference's logprobs of this rank's rows (0 elsewhere)."""
        with self.frozen() as model:
            return self.policy.scores(model, batch)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[torch.nn.Module]:
        if self.lora:
            with adapters_off(self.policy.model), torch.no_grad():
                yield self.policy.model
        else:
            assert self.model is not None, "no reference kept (trainer.kl.coef=0, ref_kl_every_n_steps=0)"
            yield self.model


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
