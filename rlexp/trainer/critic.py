"""The critic of PPO: a value model trained beside the policy, never sent to the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from rlexp.algorithms.gae import ClippedValueLoss
from rlexp.algorithms.objective import Aggregation
from rlexp.constraints import AtLeast0, Positive
from rlexp.models.local import resolve_dtype
from rlexp.trainer import distributed
from rlexp.trainer.batch import MicroBatch, Minibatch, TrainBatch
from rlexp.trainer.metric_sums import MetricSums
from rlexp.trainer.schedule import LrSchedule, lr_factor

log = logging.getLogger(__name__)

CRITIC_FILE, CRITIC_STATE = "critic.safetensors", "critic.pt"


class Critic:
    """transformers' `AutoModelForTokenClassification` with one label: the policy's network
    (or `model_path`'s) with a new scalar head on every position. Entry t of its values is
    the estimate at the token predicted at t, aligned like the policy's logprobs: the head
    reads the hidden state that predicts that token. Its own optimizer and lr schedule (one
    step per fit); sharded like the policy when distributed; `critic_only_steps` fits train
    it alone before the policy starts updating (the controller skips the policy's step)."""

    def __init__(self, policy_path: str, total_steps: int, optimizer: Callable[..., torch.optim.Optimizer],
                 model_path: str | None = None, lr_schedule: LrSchedule = "cosine",
                 warmup_steps: AtLeast0 = 0, critic_only_steps: AtLeast0 = 0,
                 value_clip: Positive | None = 0.2, max_grad_norm: Positive = 1.0, dtype: str = "float32",
                 gradient_checkpointing: bool = False, mixed_precision: str = "none"):
        self.device = distributed.device()
        path = model_path or policy_path
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "score.weight ... newly initialized": the head, by design
        try:
            config = AutoConfig.from_pretrained(path, num_labels=1)
            config.classifier_dropout = 0.0  # transformers' default 0.1 would make every value noisy
            model: Any = AutoModelForTokenClassification.from_pretrained(
                path, config=config, dtype=getattr(torch, resolve_dtype(dtype)))
        finally:
            hf_logging.set_verbosity(verbosity)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model.to(self.device).train()
        if distributed.sharded():
            distributed.shard(self.model, None if mixed_precision == "none" else mixed_precision)
        # in one process mixed precision is autocast; over ranks FSDP2's policy casts
        self.autocast = None if distributed.sharded() or mixed_precision == "none" else mixed_precision
        self.optimizer = optimizer(self.model.parameters())
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(lr_schedule, warmup_steps, total_steps))
        self.value_loss = ClippedValueLoss(value_clip)
        self.critic_only_steps, self.max_grad_norm = critic_only_steps, max_grad_norm
        log.info("critic: %s with a value head, %d parameters", path,
                 sum(p.numel() for p in self.model.parameters()))

    def _forward(self, batch: TrainBatch, micro: MicroBatch) -> torch.Tensor:
        ids = batch.input_ids[micro.rows, :micro.width].to(self.device)
        with torch.autocast(self.device.type, dtype=getattr(torch, self.autocast or "float32"),
                            enabled=self.autocast is not None):
            return self.model(input_ids=ids, use_cache=False).logits[:, :-1, 0].float()

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """[N, L-1] values of this rank's rows (0 elsewhere), before the update."""
        out = torch.zeros(batch.loss_mask.shape, device=self.device)
        for micro in batch.micro_batches:
            v = self._forward(batch, micro)
            if micro.real:
                out[micro.rows.to(self.device), micro.columns] = v
        return out

    def train_minibatch(self, batch: TrainBatch, minibatch: Minibatch, old_values: torch.Tensor,
                        returns: torch.Tensor, aggregation: Aggregation) -> MetricSums:
        """One optimizer step of the value loss over this rank's micro-batches of a minibatch,
        aggregated like the policy loss; the sums of its metrics (token means over all ranks)."""
        part, totals = MetricSums(), minibatch.totals
        for micro in minibatch.micro_batches:
            v = self._forward(batch, micro)
            mask = micro.take(batch.loss_mask).to(self.device) if micro.real else torch.zeros_like(v)
            loss, terms = self.value_loss(v, micro.take(old_values), micro.take(returns))
            aggregation(loss, mask, totals).backward()
            part.add_terms(terms | {"vf_loss": loss, "value_mean": v}, mask, totals)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        part.add("grad_norm", distributed.full_tensor(grad_norm) / max(1, distributed.rank_world()[1]))
        return part

    def step_lr(self) -> float:
        """One schedule step per fit; the lr the fit used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        return lr

    def save(self, directory: Path, rank: int) -> None:
        """The value model whole and its optimizer by parameter name (rank 0 writes; every
        rank calls it: the gathers are collectives)."""
        weights = ((n, distributed.full_tensor(t)) for n, t in self.model.state_dict().items())
        distributed.save_whole(weights, directory, CRITIC_FILE, rank)
        distributed.save_optimizer(self.model, self.optimizer, self.lr_scheduler, directory / CRITIC_STATE,
                                   rank)

    def load(self, directory: Path) -> None:
        distributed.load_model_state(self.model, load_file(str(directory / CRITIC_FILE)))
        state = torch.load(directory / CRITIC_STATE, map_location="cpu", weights_only=False)
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
