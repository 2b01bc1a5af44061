"""GRPO TrainController: group advantages, clipped token-level loss, optimizer step.

`fit(batch, version)` = advantages -> the trained samples as one TokenBatch (padded tensors,
built once) -> proximal logprobs (the rollout's, or recomputed) -> reference logprobs (only
when the loss or this step's `train/kl` needs them) -> forward/backward per micro-batch ->
optimizer step; metrics stay tensors until one host transfer at the end."""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Literal, get_args

import torch
from annotated_types import Ge
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlexp.constraints import AtLeast0, AtLeast1, Dtype, NonNegative, Positive
from rlexp.models.local import resolve_dtype
from rlexp.rollout.weights import WEIGHTS_FILE, save_safetensors
from rlexp.sample import Sample, Status
from rlexp.trainer.advantages import group_advantages
from rlexp.trainer.losses import clipped_pg_loss, k3_kl, truncated_is_pg_loss
from rlexp.trainer.token_batch import TokenBatch

log = logging.getLogger(__name__)


LrSchedule = Literal["constant", "cosine"]


def lr_factor(schedule: LrSchedule, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base lr at RL step t: linear warm-up, then constant or cosine to 10%."""
    if schedule not in get_args(LrSchedule):
        raise ValueError(f"trainer.lr_schedule must be one of {get_args(LrSchedule)}, got {schedule!r}")

    def factor(t: int) -> float:
        if t < warmup_steps:
            return (t + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


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
    ):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_path,
                                                          dtype=getattr(torch, resolve_dtype(dtype)))
        self.model.to(self.device).train()  # type: ignore[arg-type]  # transformers' stub for .to
        self.ref = None
        if kl_coef > 0 or ref_kl_every_n_steps > 0:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = optimizer(self.model.parameters())
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
        return None if self.ref is None else self._per_sample(self.ref, batch)

    def compute_advantages(self, batch: list[Sample]) -> torch.Tensor:
        """Over each group's completed samples; a failed sample (never trained) gets 0 and
        does not shift its group's mean."""
        rewards = torch.tensor([s.reward for s in batch], dtype=torch.float32)
        groups = [s.group_id if s.status == Status.COMPLETED else ("excluded", i)
                  for i, s in enumerate(batch)]
        return group_advantages(rewards, groups, self.norm_adv_by_std)

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
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
        # One schedule step per fit (per RL step), on purpose also when a no-signal step skipped
        # the update: PyTorch's warning about that order does not apply.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.lr_scheduler.step()
        return metrics

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def save(self, directory: Path) -> None:
        """`model.safetensors` (the policy) and `trainer.pt` (optimizer, lr schedule)."""
        save_safetensors(self.weights(), directory)
        torch.save({"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()},
                   directory / "trainer.pt")

    def load(self, directory: Path) -> None:
        self.model.load_state_dict(load_file(str(directory / WEIGHTS_FILE), device=self.device))
        state = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
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
        return self.ref is not None and (self.kl_coef > 0 or logs_kl)

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

    @torch.no_grad()
    def _logprobs(self, model, tb: TokenBatch) -> torch.Tensor:
        """[N, L-1] logprobs of every row's predicted tokens (0 on padding)."""
        out = torch.zeros(tb.loss_mask.shape, device=self.device)
        for idx, width in tb.micro_batches(list(range(len(tb))), self.micro_batch_tokens):
            out[idx.to(self.device), :width - 1] = self._forward(model, tb, idx, width)[0]
        return out

    def _per_sample(self, model, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample token logprobs; samples with fewer than 2 tokens (e.g. failed) get zeros."""
        out = [torch.zeros(len(s.tokens)) for s in samples]
        scored = [i for i, s in enumerate(samples) if len(s.tokens) >= 2]
        if scored:
            tb = TokenBatch.build([samples[i] for i in scored], version=0)
            logp = self._logprobs(model, tb).cpu()
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
        behav = tb.behav_logprobs.to(dev)
        recompute = self.old_logprobs == "recompute" or self.correction == "decoupled"
        old = self._logprobs(self.model, tb) if recompute else behav
        ref = self._logprobs(self.ref, tb) if self._wants_ref() else None
        mask_all, adv = tb.loss_mask.to(dev), adv.to(dev)
        # staleness values present, read on the host from the samples: no device sync
        levels = sorted(set(tb.staleness[tb.loss_mask.bool()].tolist()))
        sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        n_mb = min(self.minibatches_per_step, len(tb))
        forwarded: list[tuple[torch.Tensor, int]] = []
        for m in range(n_mb):
            rows = list(range(m, len(tb), n_mb))
            pieces = tb.micro_batches(rows, self.micro_batch_tokens)
            forwarded += pieces
            n_tokens = float(tb.loss_mask[rows].sum())
            part: dict[str, torch.Tensor] = {}
            for idx, width in pieces:
                idx_d = idx.to(dev)
                cols = slice(0, width - 1)
                logp, ent = self._forward(self.model, tb, idx, width, entropy=True)
                mask, old_lp, behav_lp = mask_all[idx_d, cols], old[idx_d, cols], behav[idx_d, cols]
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
            _add(part, "grad_norm", grad_norm)
            for k, v in part.items():
                _add(sums, k, v)
        means = {f"train/{k}": v / (1 if k.startswith("offpolicy") or k == "mismatch_kl" else n_mb)
                 for k, v in sums.items()}
        names = list(means) + [f"train/{k}" for k in maxes]
        values = torch.stack([*means.values(), *maxes.values()]).tolist()  # the one host transfer
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
