"""What one fit measures, kept apart from what it computes: `FitObserver` is fed the values
the update's stages return (rlexp/trainer/update.py) and is the one place the fit's metrics
are made, the weight-sync check included.

A host read (`.item()`, `.tolist()`) waits for the device: one per micro-batch would stall a
GPU between every forward. So each micro-batch adds its share of a minibatch mean into a
`MetricSums` on the device, and `StepMetrics.report` reads them all in one transfer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rlexp.algorithms.objective import Metrics, TokenInputs, Totals, kl_estimate
from rlexp.trainer import distributed
from rlexp.trainer.batch import MicroBatch, TrainBatch
from rlexp.trainer.metric_sums import MetricSums
from rlexp.trainer.policy import PolicyOutput
from rlexp.trainer.sync_check import SyncCheck

# measured in the first minibatch only (before the first optimizer step): not averaged over them
MEASURED_ONCE = ("offpolicy", "mismatch_kl", "routing_mismatch")


@dataclass
class StepMetrics:
    """One fit's metrics: sums over minibatches, maxima, and the gradient norms."""

    sums: MetricSums = field(default_factory=MetricSums)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norm_sum: torch.Tensor | None = None

    def add_maxima(self, terms: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """The largest ratio and importance weight over trained tokens (or sequences)."""
        for name, key in (("ratio_max", "ratio_mean"), ("is_weight_max", "is_weight_mean")):
            if key in terms:
                v = terms[key].detach()
                v_max = (v * (mask if v.dim() == 2 else (mask.sum(-1) > 0).float())).max()
                self.maxima[name] = torch.maximum(self.maxima[name], v_max) if name in self.maxima else v_max

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        self.grad_norm_sum = grad_norm if self.grad_norm_sum is None else self.grad_norm_sum + grad_norm

    def report(self, minibatches: int, levels: list[int]) -> dict[str, float]:
        """Means over minibatches, summed (maxima: maxed) over ranks, read in one transfer; the
        off-policy sums by staleness as their means."""
        means = {}
        for k, v in self.sums.sums.items():
            name = k if k.startswith("critic/") else f"train/{k}"
            means[name] = v / (1 if k.startswith(MEASURED_ONCE) else minibatches)
        summed = distributed.all_reduce_(torch.stack(list(means.values())), "sum")
        maxed = distributed.all_reduce_(torch.stack(list(self.maxima.values())), "max")
        assert self.grad_norm_sum is not None
        names = list(means) + [f"train/{k}" for k in self.maxima] + ["train/grad_norm"]
        grad_norm = (self.grad_norm_sum / minibatches)[None]
        values = torch.cat([summed, maxed, grad_norm]).tolist()  # the one host transfer
        return _offpolicy_means(dict(zip(names, values)), levels)


def _offpolicy_means(out: dict[str, float], levels: list[int]) -> dict[str, float]:
    """Trainer vs rollout, by staleness, measured before the first optimizer step."""
    for k in levels:
        n = out.pop(f"train/offpolicy/{k}/tokens")
        ratio_sum = out.pop(f"train/offpolicy/{k}/ratio")
        kl_sum = out.pop(f"train/offpolicy/{k}/kl")
        if n:
            out[f"offpolicy/tokens/staleness_{k}"] = n
            out[f"offpolicy/ratio_mean/staleness_{k}"] = ratio_sum / n
            out[f"offpolicy/mismatch_kl/staleness_{k}"] = kl_sum / n
    return out


class FitObserver:
    """One fit's metrics from what its stages return. The first minibatch runs before any
    optimizer step, when the trainer still holds the policy that generated the batch: its
    forwards measure the trainer against the rollout (`offpolicy/*`, `train/mismatch_kl`,
    `train/routing_mismatch_frac`) and give the weight-sync check its tokens, unless a forward
    before the update (`old_logprobs=recompute`) gave them (`scored`). `before_step` is where
    the check may stop the run (SyncMismatch), before the optimizer step moves a weight."""

    def __init__(self, batch: TrainBatch, sync_check: SyncCheck):
        self.batch, self.sync_check = batch, sync_check
        self.levels = sorted(set(batch.staleness[batch.loss_mask.bool()].tolist()))  # on the host: no sync
        self.step, self.part = StepMetrics(), MetricSums()
        self.first, self.sync_measured = True, False
        self.sync: dict[str, float] = {}

    def scored(self, old: torch.Tensor) -> None:
        """The forward before the update (`old`, this rank's rows) gives the sync check its tokens."""
        b = self.batch
        mine = torch.zeros(len(b), 1)
        for micro in b.micro_batches:
            mine[micro.rows] = float(micro.real)
        mask = (b.loss_mask * b.model_sampled * mine).to(old.device)
        self.sync_check.add(old, b.rollout_logprobs.to(old.device), b.staleness.to(old.device), mask)
        self.sync_measured = True

    def micro_batch(self, micro: MicroBatch, out: PolicyOutput, x: TokenInputs, terms: Metrics,
                    totals: Totals, aux_logged: torch.Tensor | None) -> None:
        """A micro-batch's forward and loss terms (`x.mask`: its trained tokens, 0 for a filler)."""
        if aux_logged is not None:
            self.part.add("router_aux_loss", aux_logged)
        if self.first:  # before the first optimizer step: the trainer/engine numerical mismatch
            terms = terms | {"mismatch_kl": kl_estimate(x.logp, x.rollout_logp, "k3")}
            if out.routing_differs is not None:
                terms["routing_mismatch_frac"] = out.routing_differs
            staleness = micro.take(self.batch.staleness).to(x.mask.device)
            logp = x.logp.detach()
            self.part.add_offpolicy(logp, x.rollout_logp, staleness, x.mask, self.levels)
            if not self.sync_measured:
                comparable = x.mask * micro.take(self.batch.model_sampled).to(x.mask.device)
                self.sync_check.add(logp, x.rollout_logp, staleness, comparable)
        self.step.add_maxima(terms, x.mask)
        self.part.add_terms(terms, x.mask, totals)

    def before_step(self) -> None:
        """After a minibatch's backward, before its optimizer step: the first one reads the
        sync check's figures (one host read) and raises SyncMismatch past its bound."""
        if self.first:
            self.sync = self.sync_check.finish(self.batch.version)

    def minibatch_done(self, grad_norm: torch.Tensor, critic_sums: MetricSums | None) -> None:
        self.step.add_grad_norm(distributed.full_tensor(grad_norm))  # the same on every rank
        if critic_sums is not None:
            self.part.merge(critic_sums, prefix="critic/")
        self.step.sums.merge(self.part)
        self.part, self.first = MetricSums(), False

    def report(self, advantages: torch.Tensor, values: torch.Tensor | None, returns: torch.Tensor | None,
               skipped: bool) -> dict[str, float]:
        """The fit's metrics: means over minibatches, summed over ranks, one host transfer."""
        b, n_mb = self.batch, len(self.batch.minibatches)
        out = self.step.report(n_mb, self.levels)
        out["train/response_tokens"] = float(b.loss_mask.sum()) / n_mb
        out["train/pad_frac"] = b.pad_frac()
        out["train/skipped_step"] = float(skipped)
        out |= self.sync
        mask = b.loss_mask.to(advantages.device)
        if values is not None and returns is not None:
            out |= critic_report(values, returns, mask)
        per_sample = (advantages.abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        out["train/advantage_abs_mean"] = per_sample.sum().item() / b.produced
        return out | teacher_report(b)


def teacher_report(batch: TrainBatch) -> dict[str, float]:
    """On-policy distillation: the mean reverse KL log p_student - log p_teacher over the
    trained tokens the teacher scored (the student's sampling logprobs), and their share."""
    if batch.teacher is None:
        return {}
    scored = batch.teacher.scored * batch.loss_mask
    n = scored.sum()
    d = (batch.rollout_logprobs - batch.teacher.logprobs) * scored
    return {"distill/reverse_kl": float(d.sum() / n.clamp(min=1)),
            "distill/scored_frac": float(n / batch.loss_mask.sum().clamp(min=1))}


def critic_report(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How well the values before a fit predicted the returns it trains them toward."""
    return {"critic/returns_mean": float((returns * mask).sum() / mask.sum().clamp(min=1)),
            "critic/explained_var": explained_variance(values, returns, mask)}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the trained tokens: 1 when the critic predicts the returns,
    0 when it does no better than their mean, negative when worse (NaN: returns constant)."""
    n = mask.sum()
    if n < 2:
        return float("nan")

    def var(x):
        mean = (x * mask).sum() / n
        return (((x - mean) * mask) ** 2).sum() / (n - 1)

    v_ret = var(returns)
    return float(1 - var(returns - values) / v_ret) if v_ret > 0 else float("nan")


class Laps:
    """Seconds between calls, by the name of the stage each call ends."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[f"timing/fit/{stage}_s"] = now - self.t0
        self.t0 = now
