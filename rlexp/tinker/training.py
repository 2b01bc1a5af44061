"""One training model of the Tinker API: rlexp's TrainController, driven call by call. Each
call is a stage of rlexp's own update (rlexp/trainer/update.py), on the batch record the
datums make (`TrainBatch.of_tokens`):

    forward           update.forward_backward(..., backward=False)
    forward_backward  update.forward_backward: the gradients add up until
    optim_step        update.optimizer_step, with the Adam parameters the call sends

Calls run one at a time, in the order they arrived (the server's queue per model)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from rlexp.algorithms.objective import Metrics, Objective, TokenInputs, Totals
from rlexp.tinker import datums, losses
from rlexp.trainer import update
from rlexp.trainer.batch import Layout, MicroBatch, TrainBatch
from rlexp.trainer.controller import TrainController
from rlexp.trainer.policy import PolicyOutput
from rlexp.weights.adapter_file import write_adapter
from rlexp.weights.files import WEIGHTS_FILE


class Outputs:
    """Watches a call's micro-batches: each position's logprob of its target, and the loss (the
    objective's own sum of it: the loss the backward differentiates)."""

    def __init__(self, batch: TrainBatch, objective: Objective):
        self.logprobs = torch.zeros(batch.loss_mask.shape)
        self.loss = 0.0
        self.objective = objective

    def micro_batch(self, micro: MicroBatch, out: PolicyOutput, x: TokenInputs, terms: Metrics,
                    totals: Totals, aux_logged: torch.Tensor | None) -> None:
        if micro.real:
            self.logprobs[micro.rows, micro.columns] = x.logp.detach().float().cpu()
            self.loss += float(self.objective.aggregate(terms["loss"].detach(), x.mask, totals))


@dataclass(frozen=True)
class Forward:
    """A forward's outputs: per datum the logprob of each target, the loss, its size and time."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float]  # the SDK's "name:reduction" keys
    tokens: int
    seconds: float


@dataclass(frozen=True)
class ServedAdapter:
    """How a LoRA model's sampler weights reach the engine as an adapter: peft's config."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]


@dataclass
class AdamStep:
    """The Tinker API's AdamParams (decoupled weight decay: torch's AdamW)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


class TrainingModel:
    """A TrainController and what the API knows of it: its id, base model, LoRA rank, the
    optimizer steps taken; `served_adapter`: its sampler weights are its LoRA adapter (else
    the whole model, merged)."""

    def __init__(self, model_id: str, trainer: TrainController, base_model: str, lora_rank: int,
                 vocab_size: int, max_tokens: int, micro_batch_tokens: int,
                 served_adapter: ServedAdapter | None = None):
        self.model_id, self.trainer, self.base_model = model_id, trainer, base_model
        self.served_adapter = served_adapter
        self.lora_rank, self.vocab_size, self.max_tokens = lora_rank, vocab_size, max_tokens
        self.layout = Layout(micro_batch_tokens=micro_batch_tokens)
        self.steps = 0  # optimizer steps taken
        self.pending_tokens = 0  # tokens whose gradients wait for the next optim_step

    def forward(self, rows: datums.Rows, loss_fn: str, values: dict[str, float], backward: bool) -> Forward:
        """forward (backward False) or forward_backward of checked datums (datums.rows) under
        `loss_fn` with its config `values` (losses.spec)."""
        t0 = time.perf_counter()
        batch = TrainBatch.of_tokens(rows.inputs, rows.targets, rows.mask, rows.logprobs, self.layout,
                                     version=self.steps)
        learner = replace(self.trainer.learner, objective=losses.objective(loss_fn, values))
        device = learner.policy.device
        signals = update.Signals(batch.rollout_logprobs.to(device), None,
                                 _padded(rows.advantages, batch.loss_mask.shape).to(device), None, None)
        outputs = Outputs(batch, learner.objective)
        for minibatch in batch.minibatches:
            update.forward_backward(learner, batch, minibatch, signals, outputs, backward)
        if backward:
            self.pending_tokens += rows.tokens
        logprobs = [outputs.logprobs[i, :len(r)].numpy() for i, r in enumerate(rows.inputs)]
        return Forward(logprobs, {"loss:sum": outputs.loss}, rows.tokens, time.perf_counter() - t0)

    def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """One optimizer step on the gradients summed since the last one."""
        learner = self.trainer.learner
        for group in learner.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        clip = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        grad_norm = update.optimizer_step(replace(learner, max_grad_norm=clip))
        self.steps += 1
        tokens, self.pending_tokens = self.pending_tokens, 0
        return {"grad_norm:mean": float(grad_norm), "tokens:sum": float(tokens)}

    def save(self, directory: Path) -> None:
        """The whole state: weights (LoRA: adapters), optimizer, steps (TrainController.save)."""
        self.trainer.save(directory)
        (directory / "tinker_steps").write_text(str(self.steps))

    def load(self, directory: Path, optimizer: bool) -> None:
        """A state saved by `save`; without `optimizer`, the weights only (Adam's moments reset)."""
        self.trainer.load(directory, optimizer)
        if optimizer:
            self.steps = int((directory / "tinker_steps").read_text())

    def save_sampler_weights(self, directory: Path) -> None:
        """What the engine loads to sample this model: its LoRA adapter as peft's files (where
        `served_adapter`), else the policy's full tensors (LoRA merged)."""
        from rlexp.trainer import distributed

        if (a := self.served_adapter) is not None:
            write_adapter(directory, self.trainer.adapter_weights(), a.rank, a.alpha, list(a.target_modules))
            return
        directory.mkdir(parents=True, exist_ok=True)
        distributed.save_whole(self.trainer.weights(), directory, WEIGHTS_FILE, 0)


def _padded(rows: list[list[float]], shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
    return out
