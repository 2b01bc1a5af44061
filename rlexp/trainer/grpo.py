"""GRPO TrainController: old/ref logprobs, group advantages, clipped token-level loss, sync.

`fit(batch, version)` = compute_old_logprobs (or the rollout's behaviour logprobs)
                      -> compute_ref_logprobs -> compute_advantages -> update.
Per-token tensors are aligned to `Sample.tokens`; entry k is log p(token k | tokens < k),
entry 0 is unused (0)."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Literal, get_args

import torch
from annotated_types import Ge
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlexp.constraints import AtLeast1, NonNegative, Positive
from rlexp.rollout.weights import WEIGHTS_FILE, save_safetensors
from rlexp.sample import Sample, Status
from rlexp.trainer.advantages import group_advantages
from rlexp.trainer.losses import clipped_pg_loss, entropy_from_logits, k3_kl, truncated_is_pg_loss
from rlexp.trainer.packer import PackedRow, pack

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
        track_ref_kl: bool = True,
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
        dtype: str = "float32",
    ):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).train()  # type: ignore[arg-type]  # transformers' stub for .to
        self.ref = None
        if kl_coef > 0 or track_ref_kl:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = optimizer(self.model.parameters())
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(lr_schedule, warmup_steps, total_steps))
        self.temperature, self.max_grad_norm = temperature, max_grad_norm
        # the loss
        self.clip = (clip_ratio_low, clip_ratio_high)
        self.kl_coef, self.entropy_coef = kl_coef, entropy_coef
        self.norm_adv_by_std = norm_adv_by_std
        # off-policy data: which logprobs the ratio is taken against, and how it is corrected
        self.old_logprobs, self.correction, self.is_cap = old_logprobs, off_policy_correction, is_cap
        # how the batch is cut: optimizer steps per fit, tokens per packed row
        self.minibatches_per_step, self.micro_batch_tokens = minibatches_per_step, micro_batch_tokens

    # ---- low-level API -------------------------------------------------------------
    @torch.no_grad()
    def compute_old_logprobs(self, batch: list[Sample]) -> list[torch.Tensor]:
        """Logprobs of the batch's tokens under the current policy (before this update)."""
        return self._logprobs(self.model, batch)

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: list[Sample]) -> list[torch.Tensor] | None:
        return None if self.ref is None else self._logprobs(self.ref, batch)

    def compute_advantages(self, batch: list[Sample]) -> torch.Tensor:
        """Over each group's completed samples; a failed sample (never trained) gets 0 and
        does not shift its group's mean."""
        rewards = torch.tensor([s.reward for s in batch], dtype=torch.float32)
        groups = [s.group_id if s.status == Status.COMPLETED else ("excluded", i)
                  for i, s in enumerate(batch)]
        return group_advantages(rewards, groups, self.norm_adv_by_std)

    def update(self, batch: list[Sample], version: int, old: list[torch.Tensor], adv: torch.Tensor,
               ref: list[torch.Tensor] | None = None, step: bool = True,
               behav: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Optimizer steps (none if not `step`) over `minibatches_per_step` slices of the
        batch. `old`: the proximal logprobs the PPO ratio is clipped around; `behav`: the
        rollout's (default `old`); `version`: the policy version being trained."""
        behav = old if behav is None else behav
        idx = [i for i, s in enumerate(batch) if s.status == Status.COMPLETED and s.response_length]
        stats: dict[str, list[float]] = {}
        offpolicy: dict[int, list[float]] = {}  # staleness -> [tokens, sum of ratios, sum of k3]
        n_mb = min(self.minibatches_per_step, max(len(idx), 1))
        for m in range(n_mb):
            part = idx[m::n_mb]
            if not part:
                continue
            self._update_minibatch([batch[i] for i in part], version, [old[i] for i in part],
                                   adv[part], None if ref is None else [ref[i] for i in part],
                                   stats, first=m == 0, step=step, behav=[behav[i] for i in part],
                                   offpolicy=offpolicy)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        # Trainer vs rollout, by staleness, measured before the first optimizer step.
        for k, (n, ratio_sum, kl_sum) in sorted(offpolicy.items()):
            out[f"offpolicy/tokens/staleness_{k}"] = n
            out[f"offpolicy/ratio_mean/staleness_{k}"] = ratio_sum / n
            out[f"offpolicy/mismatch_kl/staleness_{k}"] = kl_sum / n
        return out

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        behav = [torch.tensor(s.logprobs, dtype=torch.float32) for s in batch]
        if self.old_logprobs == "recompute" or self.correction == "decoupled":
            old = self.compute_old_logprobs(batch)  # the proximal policy: these weights
        else:
            old = behav
        ref = self.compute_ref_logprobs(batch)
        adv = self.compute_advantages(batch)
        # Every group's rewards equal and no KL/entropy term: the gradient is zero. An optimizer
        # step would still move the weights on Adam's momentum from earlier steps, so skip it
        # (the forward still runs: loss, entropy and KL are logged as on any step).
        no_signal = not adv.abs().sum() and self.kl_coef == 0 and self.entropy_coef == 0
        metrics = self.update(batch, version, old, adv, ref, step=not no_signal, behav=behav)
        metrics["train/skipped_step"] = float(no_signal)
        metrics["train/advantage_abs_mean"] = adv.abs().mean().item() if len(adv) else 0.0
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()  # one schedule step per fit (per RL step)
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
    def _rows(self, samples: list[Sample]) -> list[PackedRow]:
        return pack([s.tokens for s in samples], self.micro_batch_tokens)

    def _row_forward(self, model, row: PackedRow, samples: list[Sample], entropy: bool = False):
        """Logprobs (and entropies) of every predicted token of a packed row, in member order."""
        logits = model(input_ids=row.input_ids.to(self.device),
                       position_ids=row.position_ids.to(self.device), use_cache=False).logits[0]
        logits = logits.float() / self.temperature
        pred = torch.cat([torch.arange(o, o + len(samples[i].tokens) - 1)
                          for i, o in zip(row.members, row.offsets)]).to(self.device)
        targets = row.input_ids[0, 1:].to(self.device)[pred]
        logp = torch.log_softmax(logits[pred], -1).gather(-1, targets[:, None])[:, 0]
        ent = entropy_from_logits(logits[pred]) if entropy else None
        return logp, ent

    def _logprobs(self, model, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample token logprobs; samples with fewer than 2 tokens (e.g. failed) get zeros."""
        out = [torch.zeros(len(s.tokens)) for s in samples]
        scored = [i for i, s in enumerate(samples) if len(s.tokens) >= 2]
        subset = [samples[i] for i in scored]
        for row in self._rows(subset):
            logp, _ = self._row_forward(model, row, subset)
            start = 0
            for j in row.members:
                n = len(subset[j].tokens) - 1
                out[scored[j]] = torch.cat([torch.zeros(1), logp[start:start + n].cpu()])
                start += n
        return out

    def _update_minibatch(self, samples, version, old, adv, ref, stats, offpolicy, first: bool,
                          step: bool = True, behav=None) -> None:
        n_tokens = sum(s.response_length for s in samples)
        low, high = self.clip
        acc = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0,
               "ratio_mean": 0.0, "ratio_max": 0.0, "mismatch_kl": 0.0}
        if self.correction != "none":
            acc |= {"is_weight_mean": 0.0, "is_weight_max": 0.0, "is_truncated_frac": 0.0}
        masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
        advs = [torch.full((len(s.tokens),), adv[i].item()) for i, s in enumerate(samples)]
        # Samples built by hand may carry no versions: count them as on-policy.
        stale = [torch.tensor(s.token_staleness(version) if s.versions else [0] * len(s.tokens))
                 for s in samples]
        for row in self._rows(samples):
            logp, ent = self._row_forward(self.model, row, samples, entropy=True)
            members = row.members

            def cat(xs, members=members):  # per-sample token tensors -> this row's predictions
                return torch.cat([xs[i][1:] for i in members]).to(self.device)

            mask, old_lp, behav_lp = cat(masks), cat(old), cat(behav)
            if self.correction == "tis":
                pg, ratio, clipped = truncated_is_pg_loss(logp, behav_lp, cat(advs), self.is_cap)
                weight, truncated = torch.clamp(ratio, max=self.is_cap), clipped
            else:
                pg, ratio, clipped = clipped_pg_loss(logp, old_lp, cat(advs), low, high)
            if self.correction == "decoupled":  # AReaL: PPO around the proximal policy,
                behav_weight = torch.exp(old_lp - behav_lp)  # reweighted to it
                weight = behav_weight.clamp(max=self.is_cap)
                truncated = (behav_weight > self.is_cap).float()
                pg = pg * weight
            loss_tok = pg - self.entropy_coef * ent
            kl = k3_kl(logp, cat(ref)) if ref is not None else None
            if kl is not None and self.kl_coef > 0:
                loss_tok = loss_tok + self.kl_coef * kl
            loss = (loss_tok * mask).sum() / n_tokens
            loss.backward()

            def masked_mean(x, mask=mask):  # share of this minibatch's token-mean
                return (x.detach() * mask).sum().item() / n_tokens

            acc["loss"] += loss.item()
            acc["pg_loss"] += masked_mean(pg)
            acc["entropy"] += masked_mean(ent)
            acc["clip_frac"] += masked_mean(clipped)
            acc["ratio_mean"] += masked_mean(ratio)
            acc["ratio_max"] = max(acc["ratio_max"], (ratio * mask).max().item())
            if kl is not None:
                acc["kl"] += masked_mean(kl)
            if self.correction != "none":
                acc["is_weight_mean"] += masked_mean(weight)
                acc["is_weight_max"] = max(acc["is_weight_max"], (weight * mask).max().item())
                acc["is_truncated_frac"] += masked_mean(truncated)
            # Before the first optimizer step the trainer holds the rollout policy, so this
            # is the trainer/engine numerical mismatch (0 up to float error when on-policy).
            if first:
                acc["mismatch_kl"] += masked_mean(k3_kl(logp, old_lp))
                self._offpolicy_by_staleness(offpolicy, logp.detach(), behav_lp, cat(stale), mask.bool())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        acc["grad_norm"] = grad_norm.item()
        acc["response_tokens"] = float(n_tokens)
        if ref is None:
            del acc["kl"]  # no reference model: nothing measured, log nothing
        if not first:
            del acc["mismatch_kl"]
        for k, v in acc.items():
            stats.setdefault(f"train/{k}", []).append(v)

    @staticmethod
    def _offpolicy_by_staleness(acc: dict[int, list[float]], logp, behav_lp, staleness, mask) -> None:
        """Per staleness value: token count, sum of pi/pi_behav, sum of k3 KL between them."""
        ratio, kl = torch.exp(logp - behav_lp), k3_kl(logp, behav_lp)
        for k in staleness[mask].unique().tolist():
            sel = (staleness == k) & mask
            totals = acc.setdefault(k, [0.0, 0.0, 0.0])
            totals[0] += sel.sum().item()
            totals[1] += ratio[sel].sum().item()
            totals[2] += kl[sel].sum().item()
