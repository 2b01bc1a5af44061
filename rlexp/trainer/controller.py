"""TrainController: the lifecycle of what an update works with. It builds the policy
(model, reference, LoRA, routing replay, chunked head: policy.py), the critic, the optimizer
and its lr schedule and the algorithm's `Objective` from the config groups; `fit` runs the
update pipeline on them (rlexp/trainer/update.py, docs/architecture.md "One update"); it
publishes the weights to the engine and saves and loads checkpoints. It knows no algorithm.

The update's stages are the low-level API: `update.fit(trainer.learner, samples, version)` is
`fit`, and each stage is a function of `trainer.learner` a loop of its own can call.

Distributed (a torch.distributed group is initialised, rlexp/trainer/distributed.py): every
rank gets the whole batch, shards the model with FSDP2 and trains its token-balanced share
of each minibatch's rows; metrics are summed (maxima: maxed) over ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LambdaLR

from rlexp.algorithms.advantages import AdvantageEstimator, GroupNormalized
from rlexp.algorithms.distill import DistillTerm
from rlexp.algorithms.mismatch import NoCorrection
from rlexp.algorithms.objective import (
    Aggregation,
    KLTerm,
    MismatchCorrection,
    Objective,
    PolicyLoss,
    PPOClip,
    TokenMean,
)
from rlexp.constraints import AtLeast0, AtLeast1, Dtype, NonNegative, Positive
from rlexp.models.vlm import placeholder_ids
from rlexp.sample import Sample
from rlexp.trainer import distributed, update
from rlexp.trainer.batch import Layout, TrainBatch
from rlexp.trainer.critic import Critic
from rlexp.trainer.lora import ADAPTER_FILE
from rlexp.trainer.models import adapter_weights, build_policy, policy_weights
from rlexp.trainer.policy import Policy
from rlexp.trainer.routing_replay import MoERouting, routers
from rlexp.trainer.schedule import LrSchedule, lr_factor
from rlexp.trainer.sync_check import SyncCheck
from rlexp.weights.files import WEIGHTS_FILE


class TrainController:
    def __init__(
        self,
        model_path: str,
        temperature: Positive,
        optimizer: Callable[..., torch.optim.Optimizer],
        total_steps: AtLeast1,
        advantage: AdvantageEstimator | None = None,
        policy_loss: PolicyLoss | None = None,
        aggregation: Aggregation | None = None,
        kl: KLTerm | None = None,
        mismatch: MismatchCorrection | None = None,
        entropy_coef: float = 0.0,
        distill: DistillTerm | None = None,
        ref_kl_every_n_steps: AtLeast0 = 25,
        max_grad_norm: Positive = 1.0,
        old_logprobs: Literal["rollout", "recompute"] = "rollout",
        lr_schedule: LrSchedule = "cosine",
        warmup_steps: int = 0,
        minibatches_per_step: AtLeast1 = 1,
        micro_batch_tokens: AtLeast1 = 8192,
        logits_chunk_tokens: AtLeast1 = 256,
        dtype: Dtype = "float32",
        workers: AtLeast1 = 1,
        gradient_checkpointing: bool = False,
        mixed_precision: Literal["none", "bfloat16"] = "none",
        lora: dict | None = None,
        critic: Callable[..., Critic] | None = None,
        routing_replay: Literal["none", "rollout"] = "none",
        router_aux_loss_coef: NonNegative = 0.0,
        freeze_vision: bool = False,
        sync_check: Callable[..., SyncCheck] | None = None,
    ):
        """The keys of conf/trainer/default.yaml, whose values are the defaults here too.
        advantage .. mismatch: the algorithm's pieces (None: the default's, GRPO with PPO-clip);
        distill: on-policy distillation's terms beside the advantage (None: off; distill.py);
        logits_chunk_tokens: positions whose vocabulary logits are held at once (policy.py);
        mixed_precision: bfloat16 computes in bf16 with fp32 master weights and optimizer state
        (FSDP2's policy over ranks, torch.autocast in one process);
        critic: for advantage=gae; routing_replay, router_aux_loss_coef: see routing_replay.py;
        freeze_vision: the VLM's vision encoder neither trains nor syncs (models.py);
        sync_check: every sync verified on the fit's first forward (sync_check.py; None: default)."""
        self.rank, self.world = _rank_world(workers)
        objective = _objective(advantage, policy_loss, aggregation, kl, mismatch, entropy_coef, critic,
                               distill)
        device = distributed.device()
        keep_ref = objective.kl.coef > 0 or ref_kl_every_n_steps > 0
        model, ref, self.lora_scaling, self.unsynced = build_policy(
            model_path, dtype, gradient_checkpointing, mixed_precision, lora, device, keep_ref, freeze_vision)
        lora_reference = bool(self.lora_scaling) and keep_ref  # the reference: the model, adapters off
        policy = _policy(model, ref, lora_reference, temperature, device, routing_replay,
                         router_aux_loss_coef, logits_chunk_tokens, mixed_precision, objective)
        value_model = _value_model(critic, model_path, total_steps, dtype, gradient_checkpointing,
                                   mixed_precision)
        opt, schedule = _optimizer(optimizer, model, lr_factor(lr_schedule, warmup_steps, total_steps))
        checker = (sync_check or SyncCheck)(trainer_dtype=_compute_dtype(dtype, mixed_precision))
        self.learner = update.Learner(
            policy, objective, opt, schedule, checker, value_model or None,
            Layout(minibatches_per_step, micro_batch_tokens, self.rank, self.world),
            recompute=old_logprobs == "recompute" or objective.needs_recompute,
            ref_kl_every_n_steps=ref_kl_every_n_steps, max_grad_norm=max_grad_norm)

    @property
    def model(self) -> torch.nn.Module:
        """The policy's model (LoRA: with its adapters; distributed: this rank's shards)."""
        return self.learner.policy.model

    @property
    def critic(self) -> Critic | None:
        return self.learner.critic

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        """One RL step's update (rlexp/trainer/update.py). Every rank calls it with the whole batch."""
        return update.fit(self.learner, batch, version)

    @torch.no_grad()
    def sample_logprobs(self, samples: list[Sample], reference: bool = False) -> list[torch.Tensor] | None:
        """Each sample's token logprobs under the current policy (`reference`: the reference
        policy's; None when there is none), aligned to its tokens (entry 0 is 0); samples with
        fewer than 2 tokens (e.g. failed) get zeros. Every rank computes every sample."""
        policy = self.learner.policy
        if reference and not policy.reference:
            return None
        out = [torch.zeros(len(s.tokens)) for s in samples]
        scored = [i for i, s in enumerate(samples) if len(s.tokens) >= 2]
        if scored:
            layout = Layout(micro_batch_tokens=self.learner.layout.micro_batch_tokens)
            batch = TrainBatch.build([samples[i] for i in scored], 0, layout)
            logp = (policy.reference.logprobs(batch) if reference else policy.logprobs(batch)).cpu()
            for row, i in enumerate(scored):
                out[i] = torch.cat([torch.zeros(1), logp[row, :batch.lengths[row] - 1]])
        return out

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full tensors for the engine, less a frozen vision encoder's (every rank iterates)."""
        yield from policy_weights(self.model, self.lora_scaling, skip=self.unsynced)

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA's trained tensors by the trainer's names (weight_transfer=lora_adapter)."""
        if not self.lora_scaling:
            raise ValueError("adapter weights asked of a trainer without LoRA (trainer.lora.rank=0)")
        yield from adapter_weights(self.model)

    def save(self, directory: Path) -> None:
        """`model.safetensors` (the policy, merged with LoRA), `adapter.safetensors` (LoRA's
        trained tensors) and `trainer.pt` (optimizer by parameter name, lr schedule); all
        whole, written by rank 0, so any number of workers can load them. Every rank calls it."""
        learner = self.learner
        distributed.save_whole(policy_weights(self.model, self.lora_scaling), directory, WEIGHTS_FILE,
                               self.rank)
        if self.lora_scaling:
            distributed.save_whole(adapter_weights(self.model), directory, ADAPTER_FILE, self.rank)
        distributed.save_optimizer(self.model, learner.optimizer, learner.lr_scheduler,
                                   directory / "trainer.pt", self.rank)
        if learner.critic:
            learner.critic.save(directory, self.rank)

    def load(self, directory: Path, optimizer: bool = True) -> None:
        """A checkpoint saved by any number of workers (every rank reads the files);
        `optimizer` False: the weights only (the optimizer and lr schedule as they are)."""
        learner = self.learner
        # LoRA: the frozen base is the model as built; only the adapters were trained
        name, strict = (ADAPTER_FILE, False) if self.lora_scaling else (WEIGHTS_FILE, True)
        distributed.load_model_state(self.model, load_file(str(directory / name)), strict=strict)
        if not optimizer:
            return
        state = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=False)
        distributed.load_optimizer_state(self.model, learner.optimizer, state["optimizer"])
        learner.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if learner.critic:
            learner.critic.load(directory)


def _policy(model: Any, ref: torch.nn.Module | None, lora_reference: bool, temperature: float,
            device: torch.device, routing_replay: str, router_aux_loss_coef: float, logits_chunk_tokens: int,
            mixed_precision: str, objective: Objective) -> Policy:
    """The policy's forward as the engine samples: a VLM's image placeholders are never
    sampled (masked as the engine masks them); an MoE's routing replayed or compared; in
    one process, mixed precision is autocast (FSDP2's policy casts over ranks)."""
    if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__}: final_logit_softcapping is not supported "
                         "(the chunked head scores the logits before the model would cap them)")
    moe = None
    if routers(model) or router_aux_loss_coef:  # a dense model with an aux loss: MoERouting refuses it
        moe = MoERouting(model, routing_replay, router_aux_loss_coef)
    autocast = "none" if distributed.sharded() else mixed_precision
    return Policy(model, ref, lora_reference, temperature, placeholder_ids(model.config), moe, device,
                  entropy_in_loss=bool(objective.entropy_coef), logits_chunk_tokens=logits_chunk_tokens,
                  autocast=autocast, teacher_top=bool(objective.distill.forward_kl_coef))


def _optimizer(optimizer: Callable[..., torch.optim.Optimizer], model: torch.nn.Module,
               factor: Callable[[int], float]) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The optimizer over the trained parameters (LoRA: the adapters), and its lr schedule."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _value_model(critic: Callable[..., Critic] | None, policy_path: str, total_steps: int, dtype: str,
                 gradient_checkpointing: bool, mixed_precision: str) -> Critic | None:
    """advantage=gae's critic, built from the policy's directory with the trainer's precision."""
    if critic is None:
        return None
    return critic(policy_path=policy_path, total_steps=total_steps, dtype=dtype,
                  gradient_checkpointing=gradient_checkpointing, mixed_precision=mixed_precision)


def _compute_dtype(dtype: str, mixed_precision: str) -> str:
    return dtype if mixed_precision == "none" else mixed_precision


def _rank_world(workers: int) -> tuple[int, int]:
    """This process's rank and the group's size, which must be `workers`."""
    rank, world = distributed.rank_world()
    if workers != world:
        raise ValueError(f"trainer.workers={workers}, but this process group has {world} rank(s): "
                         "several workers run as a Ray trainer group (cluster=ray)")
    return rank, world


def _objective(advantage: AdvantageEstimator | None, policy_loss: PolicyLoss | None,
               aggregation: Aggregation | None, kl: KLTerm | None, mismatch: MismatchCorrection | None,
               entropy_coef: float, critic: Callable[..., Critic] | None,
               distill: DistillTerm | None) -> Objective:
    """The algorithm from its pieces (None: the default's, GRPO with PPO-clip and a token mean);
    `mismatch=none`'s NoCorrection reaches the Objective as None: no correction is called.
    A critic comes with advantage=gae and only with it."""
    no_correction = mismatch is None or isinstance(mismatch, NoCorrection)
    objective = Objective(advantage or GroupNormalized(), policy_loss or PPOClip(),
                          aggregation or TokenMean(), kl or KLTerm(), None if no_correction else mismatch,
                          entropy_coef, distill)
    _check_critic(objective.advantage, critic)
    return objective


def _check_critic(advantage: AdvantageEstimator, critic: Callable[..., Critic] | None) -> None:
    if advantage.needs_values != (critic is not None):
        raise ValueError("advantage=gae needs a critic (critic=value) and a critic needs advantage=gae: "
                         f"got trainer.advantage {type(advantage).__name__} with "
                         f"{'a' if critic else 'no'} critic")
