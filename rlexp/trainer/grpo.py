"""GRPO TrainController: group advantages, clipped token-level loss, optimizer step.

`fit(batch, version)` = advantages -> the trained samples as one TokenBatch (padded tensors,
built once) -> proximal logprobs (the rollout's, or recomputed) -> reference logprobs (only
when the loss or this step's `train/kl` needs them) -> forward/backward per micro-batch ->
optimizer step; metrics stay tensors until one host transfer at the end.

Distributed (a torch.distributed group is initialised, rlexp/trainer/distributed.py): every
rank gets the whole batch, shards the model with FSDP2 and trains its token-balanced share
of each minibatch's rows. The loss is divided by the minibatch's GLOBAL trained-token count
and gradients are summed over ranks, so the update equals one worker's on the same batch.
Ranks run equally many micro-batches (FSDP's collectives pair up): a rank with fewer pads
with a masked-out one. Metrics are summed (maxima: maxed) over ranks before logging."""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlexp.constraints import AtLeast0, AtLeast1, Dtype, NonNegative, Positive
from rlexp.models.local import resolve_dtype
from rlexp.sample import Sample, Status
from rlexp.trainer import distributed
from rlexp.trainer.advantages import group_advantages
from rlexp.trainer.lora import (
    ADAPTER_FILE,
    adapters_off,
    add_adapters,
    check_spec,
    is_adapter,
    merged_weights,
)
from rlexp.trainer.losses import clipped_pg_loss, k3_kl, truncated_is_pg_loss
from rlexp.trainer.token_batch import TokenBatch
from rlexp.weights.files import WEIGHTS_FILE, save_safetensors

log = logging.getLogger(__name__)


LrSchedule = Literal["constant", "cosine"]


def lr_factor(schedule: LrSchedule, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base lr at RL step t: linear warm-up, then constant or cosine to 10%."""
    def factor(t: int) -> float:
        if t < warmup_steps:
            return (t + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


Piece = tuple[torch.Tensor, int, bool]  # rows, padded width, real (False: a masked-out filler)


class GRPOTrainer:
    min_samples_per_prompt = 2  # advantages compare the samples of one prompt

    def __init__(
        self,
        model_path: str,
        temperature: Positive,
        optimizer: Callable[..., torch.optim.Optimizer],
        total_steps: AtLeast1,
        clip_ratio_low: NonNegative = 0.2,
        clip_ratio_high: NonNegative = 0.2,
        kl_coef: NonNegative = 0.0,
        ref_kl_every_n_steps: AtLeast0 = 25,
        entropy_coef: float = 0.0,
        max_grad_norm: Positive = 1.0,
        norm_adv_by_std: bool = True,
        old_logprobs: Literal["rollout", "recompute"] = "rollout",
        off_policy_correction: Literal["none", "decoupled", "tis"] = "none",
        is_cap: Annotated[float, Ge(1)] = 2.0,
        lr_schedule: LrSchedule = "constant",
        warmup_steps: int = 0,
        minibatches_per_step: AtLeast1 = 1,
        micro_batch_tokens: AtLeast1 = 8192,
        dtype: Dtype = "float32",
        workers: AtLeast1 = 1,
        gradient_checkpointing: bool = False,
        mixed_precision: Literal["none", "bfloat16"] = "none",
        lora: dict | None = None,
    ):
        self.rank, self.world = distributed.rank_world()
        if workers != self.world:
            raise ValueError(f"trainer.workers={workers}, but this process group has {self.world} rank(s): "
                             "several workers run as a Ray trainer group (cluster=ray)")
        if mixed_precision != "none" and not distributed.sharded():
            raise ValueError("trainer.mixed_precision is FSDP2's: it needs a torch.distributed group")
        self.device = distributed.device()
        torch_dtype = getattr(torch, resolve_dtype(dtype))
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        if gradient_checkpointing:  # recompute each layer's activations in backward: memory for time
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        spec: dict[str, Any] = {"rank": 0, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        spec |= dict(lora or {})
        check_spec(spec["rank"], spec["alpha"], spec["target_modules"])
        self.lora_scaling = spec["alpha"] / spec["rank"] if spec["rank"] else None
        if self.lora_scaling:  # the reference policy is then the model with its adapters off
            model = add_adapters(model, spec["rank"], spec["alpha"], spec["target_modules"])
        model.to(self.device).train()
        self.model = model
        self.has_ref = kl_coef > 0 or ref_kl_every_n_steps > 0
        self.ref = None
        if self.has_ref and not self.lora_scaling:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        if distributed.sharded():
            for m in (self.model, self.ref):
                if m is not None:
                    distributed.shard(m, None if mixed_precision == "none" else mixed_precision)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer(trained)
        total = sum(p.numel() for p in self.model.parameters())
        log.info("trainer: rank %d of %d, %s, %d of %d parameters trained%s", self.rank, self.world,
                 self.device, sum(p.numel() for p in trained), total,
                 f" (LoRA rank {spec['rank']})" if self.lora_scaling else "")
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(lr_schedule, warmup_steps, total_steps))
        self.temperature, self.max_grad_norm = temperature, max_grad_norm
        # the loss
        self.clip = (clip_ratio_low, clip_ratio_high)
        self.kl_coef, self.entropy_coef = kl_coef, entropy_coef
        self.ref_kl_every_n_steps = ref_kl_every_n_steps
        self.norm_adv_by_std = norm_adv_by_std
        # off-policy data: which logprobs the ratio is taken against, and how it is corrected
        self.old_logprobs, self.correction, self.is_cap = old_logprobs, off_policy_correction, is_cap
        # how the batch is cut: optimizer steps per fit, tokens per packed row
        self.minibatches_per_step, self.micro_batch_tokens = minibatches_per_step, micro_batch_tokens

    # ---- low-level API -------------------------------------------------------------
    @torch.no_grad()
    def compute_old_logprobs(self, batch: list[Sample]) -> list[torch.Tensor]:
        """Logprobs of the batch's tokens under the current policy (before this update),
        one tensor per sample aligned to its tokens (entry 0 is 0)."""
        return self._per_sample(self.model, batch)

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: list[Sample]) -> list[torch.Tensor] | None:
        if not self.has_ref:
            return None
        with self._reference() as ref:
            return self._per_sample(ref, batch)

    def compute_advantages(self, batch: list[Sample]) -> torch.Tensor:
        """Over each group's completed samples; a failed sample (never trained) gets 0 and
        does not shift its group's mean."""
        rewards = torch.tensor([s.reward for s in batch], dtype=torch.float32)
        groups = [s.group_id if s.status == Status.COMPLETED else ("excluded", i)
                  for i, s in enumerate(batch)]
        return group_advantages(rewards, groups, self.norm_adv_by_std)

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        """Every rank calls it with the whole batch."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        adv = self.compute_advantages(batch)
        # Every group's rewards equal and no KL/entropy term: the gradient is zero. An optimizer
        # step would still move the weights on Adam's momentum from earlier steps, so skip it
        # (the forward still runs: loss, entropy and KL are logged as on any step).
        no_signal = not adv.abs().sum() and self.kl_coef == 0 and self.entropy_coef == 0
        trained = [i for i, s in enumerate(batch) if s.status == Status.COMPLETED and s.response_length]
        metrics: dict[str, float] = {}
        if trained:
            tb = TokenBatch.build([batch[i] for i in trained], version)
            metrics = self._update(tb, adv[trained], version, step=not no_signal)
        metrics["train/skipped_step"] = float(no_signal)
        metrics["train/advantage_abs_mean"] = adv.abs().mean().item() if len(adv) else 0.0
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics[f"memory/rank_{self.rank}/peak_mb"] = distributed.peak_memory_mb(self.device)
        # One schedule step per fit (per RL step), on purpose also when a no-signal step skipped
        # the update: PyTorch's warning about that order does not apply.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.lr_scheduler.step()
        return metrics

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full tensors one at a time (when sharded, each is gathered as it is
        reached: every rank must iterate); with LoRA, the adapted weights merged."""
        named = ((name, distributed.full_tensor(t)) for name, t in self.model.state_dict().items())
        yield from merged_weights(named, self.lora_scaling) if self.lora_scaling else named

    def save(self, directory: Path) -> None:
        """`model.safetensors` (the policy, merged with LoRA), `adapter.safetensors` (LoRA's
        trained tensors) and `trainer.pt` (optimizer by parameter name, lr schedule); all
        whole, written by rank 0, so any number of workers can load them. Every rank calls it."""
        weights = self.weights()
        if self.rank == 0:
            save_safetensors(weights, directory)
        else:
            for _ in weights:  # the gathers are collectives
                pass
        if self.lora_scaling:
            adapter = ((n, distributed.full_tensor(t)) for n, t in self.model.state_dict().items()
                       if is_adapter(n))
            if self.rank == 0:
                save_safetensors(adapter, directory, ADAPTER_FILE)
            else:
                for _ in adapter:
                    pass
        optimizer = distributed.optimizer_state(self.model, self.optimizer)
        if self.rank == 0:
            torch.save({"optimizer": optimizer, "lr_scheduler": self.lr_scheduler.state_dict()},
                       directory / "trainer.pt")

    def load(self, directory: Path) -> None:
        """A checkpoint saved by any number of workers (every rank reads the files)."""
        if self.lora_scaling:  # the frozen base is the model as built; only adapters were trained
            distributed.load_model_state(self.model, load_file(str(directory / ADAPTER_FILE)), strict=False)
        else:
            distributed.load_model_state(self.model, load_file(str(directory / WEIGHTS_FILE)))
        state = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=False)
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    # ---- internals -----------------------------------------------------------------
    @property
    def fits_done(self) -> int:
        return self.lr_scheduler.last_epoch  # one schedule step per fit; restored by `load`

    def _wants_ref(self) -> bool:
        """The reference forward costs as much as the policy's: run it only when the loss
        uses it, or on the steps that log `train/kl`."""
        every = self.ref_kl_every_n_steps
        logs_kl = every > 0 and (self.fits_done + 1) % every == 0
        return self.has_ref and (self.kl_coef > 0 or logs_kl)

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
        ids = tb.input_ids[idx, :width].to(self.device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / self.temperature
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
        ent = None
        if entropy:  # logged every step; differentiated only when the loss has an entropy term
            src = logp_all if self.entropy_coef else logp_all.detach()
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

    def _token_terms(self, logp, ent, old_lp, behav_lp, adv, ref_lp):
        """The per-token loss, and every per-token quantity logged with it."""
        if self.correction == "tis":
            pg, ratio, clipped = truncated_is_pg_loss(logp, behav_lp, adv, self.is_cap)
            weight, truncated = torch.clamp(ratio, max=self.is_cap), clipped
        else:
            pg, ratio, clipped = clipped_pg_loss(logp, old_lp, adv, *self.clip)
        if self.correction == "decoupled":  # AReaL: PPO around the proximal policy,
            behav_weight = torch.exp(old_lp - behav_lp)  # reweighted to it
            weight = behav_weight.clamp(max=self.is_cap)
            truncated = (behav_weight > self.is_cap).float()
            pg = pg * weight
        loss_tok = pg - self.entropy_coef * ent if self.entropy_coef else pg
        terms = {"pg_loss": pg, "entropy": ent, "clip_frac": clipped, "ratio_mean": ratio}
        if ref_lp is not None:
            terms["kl"] = kl = k3_kl(logp, ref_lp)
            if self.kl_coef > 0:
                loss_tok = loss_tok + self.kl_coef * kl
        if self.correction != "none":
            terms |= {"is_weight_mean": weight, "is_truncated_frac": truncated}
        return loss_tok, terms | {"loss": loss_tok}

    def _update(self, tb: TokenBatch, adv: torch.Tensor, version: int, step: bool) -> dict[str, float]:
        """Optimizer steps (none if not `step`) over `minibatches_per_step` slices of the
        rows. The PPO ratio is clipped around the proximal logprobs (the rollout's, or
        recomputed with these weights); metrics are summed as tensors and read once."""
        dev = self.device
        n_mb = min(self.minibatches_per_step, len(tb))
        # each minibatch's rows dealt to the ranks; per minibatch: its rows, this rank's pieces,
        # every rank's real pieces
        shares = [distributed.balanced_split(list(range(m, len(tb), n_mb)), tb.lengths, self.world)
                  for m in range(n_mb)]
        plan = [(sum(share, []), *self._pieces(tb, share)) for share in shares]
        # the logprobs taken before the update: of every row this rank trains in any minibatch
        my_pieces = self._pieces(tb, [sorted(i for share in shares for i in share[r])
                                      for r in range(self.world)])[0]
        behav = tb.behav_logprobs.to(dev)
        recompute = self.old_logprobs == "recompute" or self.correction == "decoupled"
        old = self._logprobs(self.model, tb, my_pieces) if recompute else behav
        ref = None
        if self._wants_ref():
            with self._reference() as ref_model:
                ref = self._logprobs(ref_model, tb, my_pieces)
        mask_all, adv = tb.loss_mask.to(dev), adv.to(dev)
        # staleness values present, read on the host from the samples: no device sync
        levels = sorted(set(tb.staleness[tb.loss_mask.bool()].tolist()))
        sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        grad_norm_sum = torch.zeros((), device=dev)
        forwarded: list[tuple[torch.Tensor, int]] = []
        for m, (rows, mine, everyone) in enumerate(plan):
            forwarded += [(idx, width) for idx, width, _ in everyone]
            n_tokens = float(tb.loss_mask[rows].sum())  # over all ranks: the global token-mean
            part: dict[str, torch.Tensor] = {}
            for idx, width, real in mine:
                idx_d = idx.to(dev)
                cols = slice(0, width - 1)
                logp, ent = self._forward(self.model, tb, idx, width, entropy=True)
                mask = mask_all[idx_d, cols] if real else torch.zeros_like(logp)
                old_lp, behav_lp = old[idx_d, cols], behav[idx_d, cols]
                ref_lp = ref[idx_d, cols] if ref is not None else None
                loss_tok, tok = self._token_terms(logp, ent, old_lp, behav_lp, adv[idx_d, None], ref_lp)
                ((loss_tok * mask).sum() / n_tokens).backward()
                _max(maxes, "ratio_max", (tok["ratio_mean"] * mask).max())
                if "is_weight_mean" in tok:
                    _max(maxes, "is_weight_max", (tok["is_weight_mean"] * mask).max())
                # Before the first optimizer step the trainer holds the rollout policy, so this
                # is the trainer/engine numerical mismatch (0 up to float error when on-policy).
                if m == 0:
                    tok["mismatch_kl"] = k3_kl(logp, old_lp)
                    stale = tb.staleness[idx, cols].to(dev)
                    _offpolicy_sums(part, logp.detach(), behav_lp, stale, mask, levels)
                for k, v in tok.items():
                    _add(part, k, (v.detach() * mask).sum() / n_tokens)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            if step:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            grad_norm_sum = grad_norm_sum + distributed.full_tensor(grad_norm)  # the same on every rank
            for k, v in part.items():
                _add(sums, k, v)
        means = {f"train/{k}": v / (1 if k.startswith("offpolicy") or k == "mismatch_kl" else n_mb)
                 for k, v in sums.items()}
        summed = distributed.all_reduce_(torch.stack(list(means.values())), "sum")
        maxed = distributed.all_reduce_(torch.stack(list(maxes.values())), "max")
        names = list(means) + [f"train/{k}" for k in maxes] + ["train/grad_norm"]
        values = torch.cat([summed, maxed, (grad_norm_sum / n_mb)[None]]).tolist()  # the one host transfer
        out = dict(zip(names, values))
        out["train/response_tokens"] = float(tb.loss_mask.sum()) / n_mb
        out["train/pad_frac"] = tb.pad_frac(forwarded)
        return _offpolicy_report(out, levels)


def _add(acc: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    acc[key] = acc[key] + value if key in acc else value


def _max(acc: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    acc[key] = torch.maximum(acc[key], value) if key in acc else value


def _offpolicy_sums(acc, logp, behav_lp, staleness, mask, levels) -> None:
    """Per staleness value: token count, sum of pi/pi_behav, sum of k3 KL between them."""
    ratio, kl = torch.exp(logp - behav_lp), k3_kl(logp, behav_lp)
    for k in levels:
        sel = ((staleness == k) & mask.bool()).float()
        _add(acc, f"offpolicy/{k}/tokens", sel.sum())
        _add(acc, f"offpolicy/{k}/ratio", (ratio * sel).sum())
        _add(acc, f"offpolicy/{k}/kl", (kl * sel).sum())


def _offpolicy_report(out: dict[str, float], levels: list[int]) -> dict[str, float]:
    """Trainer vs rollout, by staleness, measured before the first optimizer step."""
    for k in levels:
        n = out.pop(f"train/offpolicy/{k}/tokens")
        ratio_sum, kl_sum = out.pop(f"train/offpolicy/{k}/ratio"), out.pop(f"train/offpolicy/{k}/kl")
        if n:
            out[f"offpolicy/tokens/staleness_{k}"] = n
            out[f"offpolicy/ratio_mean/staleness_{k}"] = ratio_sum / n
            out[f"offpolicy/mismatch_kl/staleness_{k}"] = kl_sum / n
    return out
