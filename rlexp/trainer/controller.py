"""TrainController: the policy, its optimizer and lr schedule, the distributed group, LoRA,
checkpoints and the weights the engine gets. It knows no algorithm: it runs the `Objective`
composed from the config groups (rlexp/algorithms/).

One update, as a reader follows it (docs/architecture.md, "One update"):
- `fit` (here) is `fit_call_by_call`: `prepare` (the trained samples as one TokenBatch, cut
  into minibatches and micro-batches) -> `compute_old_logprobs` (the rollout's, or
  recomputed) -> `compute_ref_logprobs` (only when the objective or this step's `train/kl`
  needs them) -> `compute_values` (the critic's) -> `compute_advantages` -> `train`, each
  call timed (`timing/fit/<call>_s`); `loop=low_level` makes the same calls from the loop.
- `train` runs `Update` (rlexp/trainer/update.py): forward/backward per micro-batch,
  optimizer steps; metrics stay tensors until one host transfer at the end.
- the per-token loss is the `Objective`'s (rlexp/algorithms/objective.py).

Distributed (a torch.distributed group is initialised, rlexp/trainer/distributed.py): every
rank gets the whole batch, shards the model with FSDP2 and trains its token-balanced share
of each minibatch's rows. The aggregation divides by totals counted over the whole minibatch
(all ranks) and gradients are summed over ranks, so the update equals one worker's on the
same batch. Ranks run equally many micro-batches (FSDP's collectives pair up): a rank with
fewer pads with a masked-out one. Metrics are summed (maxima: maxed) over ranks."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from rlexp.algorithms.advantages import AdvantageEstimator, AdvantageInputs, GroupNormalized
from rlexp.algorithms.aggregation import Aggregation, TokenMean
from rlexp.algorithms.kl import KLTerm
from rlexp.algorithms.mismatch import MismatchCorrection, NoCorrection
from rlexp.algorithms.objective import Objective
from rlexp.algorithms.policy_losses import PolicyLoss, PPOClip
from rlexp.constraints import AtLeast0, AtLeast1, Dtype, NonNegative, Positive
from rlexp.models.vlm import placeholder_ids
from rlexp.protocols import LowLevelTrainer
from rlexp.sample import Sample, Status
from rlexp.trainer import distributed
from rlexp.trainer.critic import Critic
from rlexp.trainer.lora import ADAPTER_FILE, adapters_off
from rlexp.trainer.policy import adapter_weights, build_policy, check_sharded_images, policy_weights
from rlexp.trainer.policy_forward import PolicyForward
from rlexp.trainer.routing_replay import MoERouting
from rlexp.trainer.schedule import LrSchedule, lr_factor
from rlexp.trainer.sync_check import SyncCheck
from rlexp.trainer.token_batch import TokenBatch
from rlexp.trainer.update import FitBatch, Update, plan_minibatches
from rlexp.weights.files import WEIGHTS_FILE


def fit_call_by_call(trainer: LowLevelTrainer, batch: list[Sample], version: int) -> dict[str, float]:
    """One update as the low-level calls in order, each call's seconds logged as
    `timing/fit/<call>_s`. It is `TrainController.fit`, and `loop=low_level` calls it from
    the loop; a loop of your own can read or replace what a call left in the FitBatch
    before the next one (rlexp/trainer/update.py)."""
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(call: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        seconds[f"timing/fit/{call}_s"] = now - t0
        t0 = now

    fb = trainer.prepare(batch, version)
    lap("prepare")
    trainer.compute_old_logprobs(fb)  # the rollout's, or a forward of the policy before the update
    lap("old_logprobs")
    trainer.compute_ref_logprobs(fb)  # the reference policy, when the objective or train/kl needs it
    lap("ref_logprobs")
    trainer.compute_values(fb)  # the critic, with advantage=gae
    lap("values")
    trainer.compute_advantages(fb)
    lap("advantages")
    metrics = trainer.train(fb)  # forward/backward, optimizer steps, the lr schedule's step
    lap("train")
    return metrics | seconds


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
        ref_kl_every_n_steps: AtLeast0 = 25,
        max_grad_norm: Positive = 1.0,
        old_logprobs: Literal["rollout", "recompute"] = "rollout",
        lr_schedule: LrSchedule = "constant",
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
        """advantage .. mismatch: the algorithm's pieces (None: the default's, GRPO with PPO-clip);
        logits_chunk_tokens: positions whose vocabulary logits are held at once (policy_forward.py);
        mixed_precision: bfloat16 computes in bf16 with fp32 master weights and optimizer state
        (FSDP2's policy over ranks, torch.autocast in one process);
        critic: for advantage=gae; routing_replay, router_aux_loss_coef: see routing_replay.py;
        freeze_vision: the VLM's vision encoder neither trains nor syncs (policy.py);
        sync_check: every sync verified on the fit's first forward (sync_check.py; None: default)."""
        self.rank, self.world = _rank_world(workers)
        self.objective = _objective(advantage, policy_loss, aggregation, kl, mismatch, entropy_coef, critic)
        self.device = distributed.device()
        self.ref_kl_every_n_steps = ref_kl_every_n_steps
        self.has_ref = self.objective.kl.coef > 0 or ref_kl_every_n_steps > 0
        self.model, self.ref, self.lora_scaling, self.unsynced = build_policy(
            model_path, dtype, gradient_checkpointing, mixed_precision, lora, self.device, self.has_ref,
            freeze_vision)
        self.critic = critic and critic(  # advantage=gae's value model
            policy_path=model_path, total_steps=total_steps, dtype=dtype,
            gradient_checkpointing=gradient_checkpointing, mixed_precision=mixed_precision)
        self.optimizer, self.lr_scheduler = _optimizer(optimizer, self.model, lr_schedule, warmup_steps,
                                                       total_steps)
        # which logprobs the ratio is taken against: the rollout's, or these weights' (a forward)
        self.recompute = old_logprobs == "recompute" or self.objective.needs_recompute
        self.minibatches_per_step = minibatches_per_step
        self.micro_batch_tokens = micro_batch_tokens
        self.forward = self._policy_forward(temperature, routing_replay, router_aux_loss_coef,
                                            logits_chunk_tokens, mixed_precision)
        self.sync_check = (sync_check or SyncCheck)(trainer_dtype=_compute_dtype(dtype, mixed_precision))
        self.update = Update(self.model, self.optimizer, self.objective, self.forward, max_grad_norm,
                             self.critic, self.sync_check)

    def _policy_forward(self, temperature: float, routing_replay: Literal["none", "rollout"],
                        router_aux_loss_coef: float, logits_chunk_tokens: int,
                        mixed_precision: str) -> PolicyForward:
        """The policy's forward as the engine samples: a VLM's image placeholders are never
        sampled (masked as the engine masks them); an MoE's routing replayed or compared; in
        one process, mixed precision is autocast (FSDP2's policy casts over ranks)."""
        if getattr(self.model.config.get_text_config(), "final_logit_softcapping", None):
            raise ValueError(f"{type(self.model).__name__}: final_logit_softcapping is not supported "
                             "(the chunked head scores the logits before the model would cap them)")
        moe = MoERouting(self.model, routing_replay, router_aux_loss_coef)
        autocast = "none" if distributed.sharded() else mixed_precision
        return PolicyForward(temperature, placeholder_ids(self.model.config), moe, self.device,
                             entropy_in_loss=bool(self.objective.entropy_coef),
                             logits_chunk_tokens=logits_chunk_tokens, autocast=autocast)

    # ---- the low-level API: `fit` is these calls in order (fit_call_by_call) ----------
    def prepare(self, batch: list[Sample], version: int) -> FitBatch:
        """The trained samples (completed, with a response) as one TokenBatch; its rows cut
        into `minibatches_per_step` minibatches, each dealt to the ranks in micro-batches.
        Every rank calls it with the whole batch."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        trained = [i for i, s in enumerate(batch) if s.status == Status.COMPLETED and s.response_length]
        fb = FitBatch(batch, version, trained)
        if not trained:
            return fb
        tb = fb.tokens = TokenBatch.build([batch[i] for i in trained], version)
        check_sharded_images(tb.pixels, self.world)  # a VLM's vision encoder runs on every rank or none
        fb.minibatches, fb.my_micro_batches = plan_minibatches(
            tb, self.minibatches_per_step, self.rank, self.world, self.micro_batch_tokens)
        fb.behav = tb.behav_logprobs.to(self.device)
        return fb

    @torch.no_grad()
    def compute_old_logprobs(self, fb: FitBatch) -> torch.Tensor | None:
        """The logprobs the ratio is taken against: the rollout's, or these weights' before the
        update (a forward) with `old_logprobs=recompute` or an objective that needs them; that
        forward also measures the last weight sync (`train` checks it before its optimizer step)."""
        if fb.tokens is None:
            return None
        if self.recompute:  # the fit's first forward: it measures the last sync (sync_check.py)
            staleness, mask = self._sync_inputs(fb)  # copied to the device before the forward's work
            fb.old = self.forward.logprobs(self.model, fb.tokens, fb.my_micro_batches)
            assert fb.behav is not None
            self.sync_check.add(fb.old, fb.behav, staleness, mask)
            fb.sync_measured = True
        else:
            fb.old = fb.behav
        return fb.old

    @torch.no_grad()
    def compute_ref_logprobs(self, fb: FitBatch) -> torch.Tensor | None:
        """The reference policy's logprobs (a forward), only when the objective uses them or
        this step logs `train/kl` (`ref_kl_every_n_steps`); else None."""
        if fb.tokens is not None and self._wants_ref():
            with self._reference() as ref:
                fb.ref = self.forward.logprobs(ref, fb.tokens, fb.my_micro_batches)
        return fb.ref

    @torch.no_grad()
    def compute_values(self, fb: FitBatch) -> torch.Tensor | None:
        """The critic's values (a forward of the critic), every rank's rows gathered: GAE runs
        over the whole batch. None without a critic."""
        if fb.tokens is not None and self.critic:
            fb.values = distributed.all_reduce_(self.critic.values(fb.tokens, fb.my_micro_batches), "sum")
        return fb.values

    def compute_advantages(self, fb: FitBatch) -> torch.Tensor | None:
        """Per-token advantages (and with a critic its targets, `fb.returns`) from the batch's
        rewards and groups, with the KL penalty in the reward and the critic's values where
        the algorithm has them. A failed sample is no row and shifts no baseline."""
        fb.require("old", *self._needs_before_advantages(), call="compute_advantages")
        if fb.tokens is not None:
            fb.advantages, fb.returns = self._advantages(fb)
        return fb.advantages

    def train(self, fb: FitBatch) -> dict[str, float]:
        """Forward/backward per micro-batch and one optimizer step per minibatch (none when
        nothing carries signal: `Update.run`), then the lr schedule's step; the step's metrics."""
        fb.require("old", "advantages", *(["ref"] if self.objective.kl.in_loss else []), call="train")
        metrics: dict[str, float] = {"train/skipped_step": 1.0, "train/advantage_abs_mean": 0.0}
        if fb.tokens is not None:
            critic_only = self.critic is not None and self.fits_done < self.critic.critic_only_steps
            metrics = self.update.run(fb, critic_only)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.critic:
            metrics["critic/lr"] = self.critic.step_lr()
        metrics[f"memory/rank_{self.rank}/peak_mb"] = distributed.peak_memory_mb(self.device)
        # One schedule step per fit (per RL step), on purpose also when a no-signal step skipped
        # the update: PyTorch's warning about that order does not apply.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.lr_scheduler.step()
        return metrics

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        """One RL step's update. Every rank calls it with the whole batch."""
        return fit_call_by_call(self, batch, version)

    @torch.no_grad()
    def sample_logprobs(self, samples: list[Sample], reference: bool = False) -> list[torch.Tensor] | None:
        """Each sample's token logprobs under the current policy (`reference`: the reference
        policy's; None when there is none), aligned to its tokens (entry 0 is 0)."""
        if reference and not self.has_ref:
            return None
        with self._reference() if reference else nullcontext(self.model) as model:
            return self._per_sample(model, samples)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full tensors for the engine, less a frozen vision encoder's (every rank iterates)."""
        yield from policy_weights(self.model, self.lora_scaling, skip=self.unsynced)

    def save(self, directory: Path) -> None:
        """`model.safetensors` (the policy, merged with LoRA), `adapter.safetensors` (LoRA's
        trained tensors) and `trainer.pt` (optimizer by parameter name, lr schedule); all
        whole, written by rank 0, so any number of workers can load them. Every rank calls it."""
        distributed.save_whole(policy_weights(self.model, self.lora_scaling), directory, WEIGHTS_FILE,
                               self.rank)
        if self.lora_scaling:
            distributed.save_whole(adapter_weights(self.model), directory, ADAPTER_FILE, self.rank)
        distributed.save_optimizer(self.model, self.optimizer, self.lr_scheduler, directory / "trainer.pt",
                                   self.rank)
        if self.critic:
            self.critic.save(directory, self.rank)

    def load(self, directory: Path) -> None:
        """A checkpoint saved by any number of workers (every rank reads the files)."""
        # LoRA: the frozen base is the model as built; only the adapters were trained
        name, strict = (ADAPTER_FILE, False) if self.lora_scaling else (WEIGHTS_FILE, True)
        distributed.load_model_state(self.model, load_file(str(directory / name)), strict=strict)
        state = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=False)
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.critic:
            self.critic.load(directory)

    # ---- internals -----------------------------------------------------------------
    @property
    def fits_done(self) -> int:
        return self.lr_scheduler.last_epoch  # one schedule step per fit; restored by `load`

    def _wants_ref(self) -> bool:
        """Run the reference forward (as costly as the policy's) if the loss or `train/kl` needs it."""
        every = self.ref_kl_every_n_steps
        logs_kl = every > 0 and (self.fits_done + 1) % every == 0
        return self.has_ref and (self.objective.kl.coef > 0 or logs_kl)

    @contextmanager
    def _reference(self):
        """The frozen reference policy: its own copy, or with LoRA the model, adapters off."""
        if self.lora_scaling:
            with adapters_off(self.model), torch.no_grad():
                yield self.model
        else:
            yield self.ref

    def _per_sample(self, model, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample token logprobs; samples with fewer than 2 tokens (e.g. failed) get zeros.
        Every rank computes every sample."""
        out = [torch.zeros(len(s.tokens)) for s in samples]
        scored = [i for i, s in enumerate(samples) if len(s.tokens) >= 2]
        if scored:
            tb = TokenBatch.build([samples[i] for i in scored], version=0)
            micro_batches = tb.micro_batches(list(range(len(tb))), self.micro_batch_tokens)
            logp = self.forward.logprobs(model, tb, micro_batches).cpu()
            for row, i in enumerate(scored):
                out[i] = torch.cat([torch.zeros(1), logp[row, :tb.lengths[row] - 1]])
        return out

    def _sync_inputs(self, fb: FitBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Staleness and the tokens to compare ([N, L-1]) on the device: this rank's trained
        tokens that the model sampled unreshaped."""
        assert fb.tokens is not None
        mine = torch.zeros(len(fb.tokens), 1)
        for micro in fb.my_micro_batches:
            mine[micro.rows] = float(micro.real)
        mask = fb.tokens.loss_mask * fb.tokens.model_sampled * mine
        return fb.tokens.staleness.to(self.device), mask.to(self.device)

    def _needs_before_advantages(self) -> list[str]:
        return (["ref"] if self.objective.kl.in_reward else []) + (["values"] if self.critic else [])

    def _advantages(self, fb: FitBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Advantages and the critic's targets (or None), [rows, T] on the device. With the KL
        in the reward, its per-token penalty (old vs reference logprobs, every rank's rows
        gathered) enters the advantages; so do the critic's values (gathered)."""
        assert fb.tokens is not None and fb.old is not None
        width = max(len(s.tokens) for s in fb.samples) - 1
        values_all = None
        if fb.values is not None:
            values_all = torch.zeros(len(fb.samples), width)
            values_all[fb.trained, :fb.values.shape[1]] = fb.values.cpu()
        token_rewards = self._kl_rewards(fb, width) if self.objective.kl.in_reward else None
        x = AdvantageInputs.from_samples(fb.samples, token_rewards, values_all)
        adv, returns = self.objective.advantages(x)
        rows = (fb.trained, slice(0, fb.tokens.loss_mask.shape[1]))
        return adv[rows].to(self.device), (returns[rows].to(self.device) if returns is not None else None)

    def _kl_rewards(self, fb: FitBatch, width: int) -> torch.Tensor:
        """The KL penalty per token (old vs reference logprobs, every rank's rows gathered),
        [samples, width]: the reward the advantages see beside the outcome's."""
        assert fb.tokens is not None and fb.old is not None and fb.ref is not None
        old_all = distributed.all_reduce_(fb.old.clone(), "sum") if self.recompute else fb.old
        ref_all = distributed.all_reduce_(fb.ref.clone(), "sum")
        mask = fb.tokens.loss_mask.to(fb.old.device)
        penalty = self.objective.kl.token_rewards(old_all, ref_all, mask).cpu()
        token_rewards = torch.zeros(len(fb.samples), width)
        token_rewards[fb.trained, :penalty.shape[1]] = penalty
        return token_rewards


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
               entropy_coef: float, critic: Callable[..., Critic] | None) -> Objective:
    """The algorithm from its pieces (None: the default's, GRPO with PPO-clip and a token mean);
    a critic comes with advantage=gae and only with it."""
    objective = Objective(advantage or GroupNormalized(), policy_loss or PPOClip(),
                          aggregation or TokenMean(), kl or KLTerm(), mismatch or NoCorrection(),
                          entropy_coef)
    _check_critic(objective.advantage, critic)
    return objective


def _optimizer(optimizer: Callable[..., torch.optim.Optimizer], model: torch.nn.Module,
               lr_schedule: LrSchedule, warmup_steps: int,
               total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer over the trained parameters, and its schedule (one step per fit)."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(lr_schedule, warmup_steps, total_steps))


def _check_critic(advantage: AdvantageEstimator, critic: Callable[..., Critic] | None) -> None:
    if advantage.needs_values != (critic is not None):
        raise ValueError("advantage=gae needs a critic (critic=value) and a critic needs advantage=gae: "
                         f"got trainer.advantage {type(advantage).__name__} with "
                         f"{'a' if critic else 'no'} critic")
