"""TrainController: the model, its optimizer and lr schedule, micro-batching, the distributed
group, LoRA, checkpoints and the weights the engine gets. It knows no algorithm: it runs the
`Objective` composed from the config groups (rlexp/algorithms/).

`fit(batch, version)` is its public low-level API called in order (rlexp/trainer/fit_batch.py):
`prepare` (the trained samples as one TokenBatch, padded tensors built once) ->
`compute_old_logprobs` (the rollout's, or recomputed) -> `compute_ref_logprobs` (only when
the objective or this step's `train/kl` needs them) -> `compute_values` (the critic's) ->
`compute_advantages` -> `train` (forward/backward per micro-batch, optimizer steps; metrics
stay tensors until one host transfer at the end).

Distributed (a torch.distributed group is initialised, rlexp/trainer/distributed.py): every
rank gets the whole batch, shards the model with FSDP2 and trains its token-balanced share
of each minibatch's rows. The aggregation divides by totals counted over the whole minibatch
(all ranks) and gradients are summed over ranks, so the update equals one worker's on the
same batch. Ranks run equally many micro-batches (FSDP's collectives pair up): a rank with
fewer pads with a masked-out one. Metrics are summed (maxima: maxed) over ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from rlexp.algorithms.advantages import AdvantageEstimator, AdvantageInputs, GroupNormalized
from rlexp.algorithms.aggregation import Aggregation, TokenMean, Totals
from rlexp.algorithms.kl import KLTerm, kl_estimate
from rlexp.algorithms.mismatch import MismatchCorrection, NoCorrection
from rlexp.algorithms.objective import Objective
from rlexp.algorithms.policy_losses import PolicyLoss, PPOClip, TokenInputs
from rlexp.constraints import AtLeast0, AtLeast1, Dtype, NonNegative, Positive
from rlexp.models.vlm import placeholder_ids
from rlexp.sample import Sample, Status
from rlexp.trainer import distributed, fit_metrics
from rlexp.trainer.critic import Critic, critic_report
from rlexp.trainer.fit_batch import FitBatch, Piece
from rlexp.trainer.lora import ADAPTER_FILE, adapters_off
from rlexp.trainer.policy import adapter_weights, build_policy, check_sharded_images, policy_weights
from rlexp.trainer.routing_replay import MoERouting
from rlexp.trainer.schedule import LrSchedule, lr_factor
from rlexp.trainer.token_batch import TokenBatch
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
        ref_kl_every_n_steps: AtLeast0 = 25,
        max_grad_norm: Positive = 1.0,
        old_logprobs: Literal["rollout", "recompute"] = "rollout",
        lr_schedule: LrSchedule = "constant",
        warmup_steps: int = 0,
        minibatches_per_step: AtLeast1 = 1,
        micro_batch_tokens: AtLeast1 = 8192,
        dtype: Dtype = "float32",
        workers: AtLeast1 = 1,
        gradient_checkpointing: bool = False,
        mixed_precision: Literal["none", "bfloat16"] = "none",
        lora: dict | None = None,
        critic: Callable[..., Critic] | None = None,
        routing_replay: Literal["none", "rollout"] = "none",
        router_aux_loss_coef: NonNegative = 0.0,
        freeze_vision: bool = False,
    ):
        """advantage .. mismatch: the algorithm's pieces (None: the default's, GRPO with PPO-clip);
        critic: for advantage=gae; routing_replay, router_aux_loss_coef: see routing_replay.py;
        freeze_vision: a vision-language model's vision encoder neither trains nor syncs (policy.py)."""
        self.rank, self.world = distributed.rank_world()
        if workers != self.world:
            raise ValueError(f"trainer.workers={workers}, but this process group has {self.world} rank(s): "
                             "several workers run as a Ray trainer group (cluster=ray)")
        if mixed_precision != "none" and not distributed.sharded():
            raise ValueError("trainer.mixed_precision is FSDP2's: it needs a torch.distributed group")
        self.objective = Objective(advantage or GroupNormalized(), policy_loss or PPOClip(),
                                   aggregation or TokenMean(), kl or KLTerm(), mismatch or NoCorrection(),
                                   entropy_coef)
        self.device, self.ref_kl_every_n_steps = distributed.device(), ref_kl_every_n_steps
        self.has_ref = self.objective.kl.coef > 0 or ref_kl_every_n_steps > 0
        needs_values = getattr(self.objective.advantage, "needs_values", False)
        if needs_values != (critic is not None):
            raise ValueError("advantage=gae needs a critic (critic=value) and a critic needs advantage=gae: "
                             f"got trainer.advantage {type(self.objective.advantage).__name__} with "
                             f"{'a' if critic else 'no'} critic")
        self.model, self.ref, self.lora_scaling, self.unsynced = build_policy(
            model_path, dtype, gradient_checkpointing, mixed_precision, lora, self.device, self.has_ref,
            freeze_vision)
        self.unsampled = placeholder_ids(self.model.config)  # a VLM's image placeholders: never sampled
        self.critic = critic(policy_path=model_path, total_steps=total_steps, dtype=dtype,
                             gradient_checkpointing=gradient_checkpointing,
                             mixed_precision=mixed_precision) if critic else None
        self.optimizer = optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(lr_schedule, warmup_steps, total_steps))
        self.temperature, self.max_grad_norm = temperature, max_grad_norm
        # which logprobs the ratio is taken against: the rollout's, or these weights' (a forward)
        self.recompute = old_logprobs == "recompute" or self.objective.needs_recompute
        self.minibatches_per_step, self.micro_batch_tokens = minibatches_per_step, micro_batch_tokens  # cuts
        self.moe = MoERouting(self.model, routing_replay, router_aux_loss_coef)  # MoE models' routing

    # ---- low-level API: `fit` is these calls in order (rlexp/trainer/fit_batch.py) ------
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
        n_mb = min(self.minibatches_per_step, len(tb))
        shares = [distributed.balanced_split(list(range(m, len(tb), n_mb)), tb.lengths, self.world)
                  for m in range(n_mb)]
        fb.minibatches = [(sum(share, []), *self._pieces(tb, share)) for share in shares]
        # every row this rank trains in any minibatch: the forwards before the update run over them
        fb.my_pieces = self._pieces(tb, [sorted(i for share in shares for i in share[r])
                                         for r in range(self.world)])[0]
        return fb

    @torch.no_grad()
    def compute_old_logprobs(self, fb: FitBatch) -> torch.Tensor | None:
        """The logprobs the ratio is taken against: the rollout's, or these weights' before the
        update (a forward) with `old_logprobs=recompute` or an objective that needs them."""
        if fb.tokens is not None:
            fb.old = (self._logprobs(self.model, fb.tokens, fb.my_pieces) if self.recompute
                      else fb.tokens.behav_logprobs.to(self.device))
        return fb.old

    @torch.no_grad()
    def compute_ref_logprobs(self, fb: FitBatch) -> torch.Tensor | None:
        """The reference policy's logprobs (a forward), only when the objective uses them or
        this step logs `train/kl` (`ref_kl_every_n_steps`); else None."""
        if fb.tokens is not None and self._wants_ref():
            with self._reference() as ref:
                fb.ref = self._logprobs(ref, fb.tokens, fb.my_pieces)
        return fb.ref

    @torch.no_grad()
    def compute_values(self, fb: FitBatch) -> torch.Tensor | None:
        """The critic's values (a forward of the critic), every rank's rows gathered: GAE runs
        over the whole batch. None without a critic."""
        if fb.tokens is not None and self.critic:
            fb.values = distributed.all_reduce_(self.critic.values(fb.tokens, fb.my_pieces), "sum")
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
        nothing carries signal), then the lr schedule's step; the step's metrics."""
        fb.require("old", "advantages", *(["ref"] if self.objective.kl.in_loss else []), call="train")
        metrics: dict[str, float] = {"train/skipped_step": 1.0, "train/advantage_abs_mean": 0.0}
        if fb.tokens is not None:
            metrics = self._update(fb)
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
        fb = self.prepare(batch, version)
        self.compute_old_logprobs(fb)
        self.compute_ref_logprobs(fb)
        self.compute_values(fb)
        self.compute_advantages(fb)
        return self.train(fb)

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

    def _forward(self, model, tb: TokenBatch, idx: torch.Tensor, width: int, entropy: bool = False):
        """Logprobs (and entropies) of the predicted tokens of rows `idx`, [n, width-1]."""
        inputs = tb.model_inputs(idx, width, self.device)
        routed = tb.routed[idx, :width].to(self.device) if tb.routed is not None else None
        real = torch.arange(width)[None] < torch.tensor(tb.lengths)[idx, None] - 1  # predicting positions
        out, ids = self.moe.forward(model, inputs, routed, real.to(self.device)), inputs["input_ids"]
        logits = out.logits[:, :-1].float() / self.temperature
        logits[..., self.unsampled] = torch.finfo(logits.dtype).min  # as the engine masks them
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
        ent = None
        if entropy:  # logged every step; differentiated only when the loss has an entropy term
            src = logp_all if self.objective.entropy_coef else logp_all.detach()
            ent = -(src.exp() * src).sum(-1)
        return logp, ent

    def _pieces(self, tb: TokenBatch, shares: list[list[int]]) -> tuple[list[Piece], list[Piece]]:
        """This rank's micro-batches of its share of the rows, padded to as many as the busiest
        rank has, and every rank's real ones (for pad_frac)."""
        per_rank = [[(idx, width, True) for idx, width in tb.micro_batches(share, self.micro_batch_tokens)]
                    for share in shares]
        mine = per_rank[self.rank]
        filler = (torch.tensor([0]), 2, False)  # a masked-out 2-token piece: collectives only
        mine += [filler] * (max(map(len, per_rank)) - len(mine))
        return mine, [p for r in per_rank for p in r]

    @torch.no_grad()
    def _logprobs(self, model, tb: TokenBatch, pieces: list[Piece]) -> torch.Tensor:
        """[N, L-1] logprobs of the predicted tokens of the rows in `pieces` (0 elsewhere)."""
        out = torch.zeros(tb.loss_mask.shape, device=self.device)
        for idx, width, real in pieces:
            logp = self._forward(model, tb, idx, width)[0]
            if real:
                out[idx.to(self.device), :width - 1] = logp
        return out

    def _per_sample(self, model, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample token logprobs; samples with fewer than 2 tokens (e.g. failed) get zeros.
        Every rank computes every sample."""
        out = [torch.zeros(len(s.tokens)) for s in samples]
        scored = [i for i, s in enumerate(samples) if len(s.tokens) >= 2]
        if scored:
            tb = TokenBatch.build([samples[i] for i in scored], version=0)
            rows = list(range(len(tb)))
            pieces = [(idx, w, True) for idx, w in tb.micro_batches(rows, self.micro_batch_tokens)]
            logp = self._logprobs(model, tb, pieces).cpu()
            for row, i in enumerate(scored):
                out[i] = torch.cat([torch.zeros(1), logp[row, :tb.lengths[row] - 1]])
        return out

    def _needs_before_advantages(self) -> list[str]:
        return (["ref"] if self.objective.kl.in_reward else []) + (["values"] if self.critic else [])

    def _advantages(self, fb: FitBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Advantages and the critic's targets (or None), [rows, T] on the device. With the KL
        in the reward, its per-token penalty (old vs reference logprobs, every rank's rows
        gathered) enters the advantages; so do the critic's values (gathered)."""
        assert fb.tokens is not None and fb.old is not None
        batch, trained, tb = fb.samples, fb.trained, fb.tokens
        token_rewards = values_all = None
        width = max(len(s.tokens) for s in batch) - 1
        if fb.values is not None:
            values_all = torch.zeros(len(batch), width)
            values_all[trained, :fb.values.shape[1]] = fb.values.cpu()
        if self.objective.kl.in_reward:
            assert fb.ref is not None
            old_all = distributed.all_reduce_(fb.old.clone(), "sum") if self.recompute else fb.old
            ref_all = distributed.all_reduce_(fb.ref.clone(), "sum")
            penalty = self.objective.kl.token_rewards(old_all, ref_all, tb.loss_mask.to(fb.old.device)).cpu()
            token_rewards = torch.zeros(len(batch), width)
            token_rewards[trained, :penalty.shape[1]] = penalty
        x = AdvantageInputs.from_samples(batch, token_rewards, values_all)
        adv, returns = self.objective.advantages(x)
        rows = (trained, slice(0, tb.loss_mask.shape[1]))
        return adv[rows].to(self.device), (returns[rows].to(self.device) if returns is not None else None)

    def _update(self, fb: FitBatch) -> dict[str, float]:
        """Optimizer steps over the minibatches (none when nothing carries signal); metrics are
        summed as tensors and read once."""
        tb, plan, adv, values, returns = fb.tokens, fb.minibatches, fb.advantages, fb.values, fb.returns
        assert tb is not None and adv is not None and fb.old is not None
        n_mb = len(plan)
        behav = tb.behav_logprobs.to(self.device)
        frozen = self.critic is not None and self.fits_done < self.critic.critic_only_steps
        # No advantage and no KL, entropy or aux term: the gradient is zero. An optimizer step would
        # still move the weights on Adam's momentum, so skip it (the forwards still run and log).
        no_signal = (not (adv * tb.loss_mask.to(self.device)).abs().sum() and not self.objective.kl.in_loss
                     and not self.objective.entropy_coef and not self.moe.aux_coef)
        levels = sorted(set(tb.staleness[tb.loss_mask.bool()].tolist()))  # read on the host: no sync
        sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        grad_norm_sum = torch.zeros((), device=self.device)
        forwarded: list[tuple[torch.Tensor, int]] = []
        for m, (rows, mine, everyone) in enumerate(plan):
            forwarded += [(idx, width) for idx, width, _ in everyone]
            mask_rows = tb.loss_mask[rows]  # over all ranks: the aggregation's global totals
            totals = Totals(tokens=float(mask_rows.sum()), seqs=float((mask_rows.sum(-1) > 0).sum()))
            logprobs = (fb.old, behav, fb.ref, adv)
            part = self._minibatch(tb, mine, totals, logprobs, levels, maxes, first=m == 0)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            if not no_signal and not frozen:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            grad_norm_sum = grad_norm_sum + distributed.full_tensor(grad_norm)  # the same on every rank
            if self.critic and values is not None and returns is not None:
                part |= {f"critic/{k}": v for k, v in self.critic.train_minibatch(
                    tb, mine, totals, values, returns, self.objective.aggregation).items()}
            for k, v in part.items():
                fit_metrics.add(sums, k, v)
        out = fit_metrics.reduce_metrics(sums, maxes, grad_norm_sum, n_mb)
        out["train/response_tokens"] = float(tb.loss_mask.sum()) / n_mb
        out["train/pad_frac"] = tb.pad_frac(forwarded)
        out["train/skipped_step"] = float(no_signal or frozen)
        mask = tb.loss_mask.to(self.device)
        if self.critic and values is not None and returns is not None:
            out |= critic_report(values, returns, mask)
        per_sample = (adv.abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        out["train/advantage_abs_mean"] = per_sample.sum().item() / len(fb.samples)
        return fit_metrics.offpolicy_report(out, levels)

    def _minibatch(self, tb: TokenBatch, mine: list[Piece], totals: Totals, logprobs, levels,
                   maxes: dict[str, torch.Tensor], first: bool) -> dict[str, torch.Tensor]:
        """Forward/backward of this rank's micro-batches of one minibatch; their metric sums."""
        (old, behav, ref, adv), dev = logprobs, self.device
        part: dict[str, torch.Tensor] = {}
        for idx, width, real in mine:
            idx_d, cols = idx.to(dev), slice(0, width - 1)
            logp, ent = self._forward(self.model, tb, idx, width, entropy=True)
            mask = tb.loss_mask[idx, cols].to(dev) if real else torch.zeros_like(logp)
            x = TokenInputs(logp, old[idx_d, cols], behav[idx_d, cols], adv[idx_d, cols], mask)
            loss_tok, terms = self.objective.token_loss(x, ent, ref[idx_d, cols] if ref is not None else None)
            aux = self.moe.loss_term(part, mask.sum() / totals.tokens)  # 0 unless an MoE's aux loss is on
            (self.objective.aggregate(loss_tok, mask, totals) + aux).backward()
            self.moe.release()  # its routers' recomputation (checkpointing) is done
            fit_metrics.add_maxima(maxes, terms, mask)
            # Before the first optimizer step the trainer holds the rollout policy, so this is
            # the trainer/engine numerical mismatch (0 up to float error when on-policy).
            if first:
                terms["mismatch_kl"] = kl_estimate(logp, x.old_logp, "k3")
                if (differs := self.moe.differs) is not None:
                    terms["routing_mismatch_frac"] = differs
                stale = tb.staleness[idx, cols].to(dev)
                fit_metrics.offpolicy_sums(part, logp.detach(), x.behav_logp, stale, mask, levels)
            fit_metrics.add_terms(part, terms, mask, totals.tokens, totals.seqs)
        return part
