"""One update of the policy, top to bottom. `fit` is the whole pipeline; each stage is a
function from records to records, and a loop of your own can call them one by one:

    batch   = TrainBatch.build(trained(samples), version, layout)  # the trained rows, frozen (batch.py)
    old     = old_logprobs(learner, batch)          # the rollout's, or the policy's before the update
    ref     = ref_logprobs(learner, batch)          # the reference's, when the loss or train/kl needs it
    values  = critic_values(learner, batch)         # the critic's (advantage=gae)
    signals = advantages(learner, batch, old, ref, values)
    for minibatch in batch.minibatches:
        forward_backward(learner, batch, minibatch, signals)  # per micro-batch: forward, loss, backward
        optimizer_step(learner)                     # clip the gradient norm, step
        critic.train_minibatch(...)                 # the critic's own step (advantage=gae)

The formulas are one click away: the per-token loss and its aggregation in
rlexp/algorithms/objective.py, the advantages in rlexp/algorithms/advantages.py (gae.py), the
policy's forward (temperature, chunked head, MoE routing) in policy.py. What a fit measures
is `FitObserver`'s (fit_metrics.py), fed the values the stages return; the weight-sync check
may stop the run in its `before_step`, before an optimizer step moves a weight.

Every rank calls `fit` with the whole batch (distributed: rlexp/trainer/distributed.py). Each
rank forwards its token-balanced share of each minibatch's rows; the aggregation divides by
totals counted over the whole minibatch (all ranks) and gradients are summed over ranks, so
the update equals one worker's on the same batch. Per-token tensors are [rows, L-1] on the
trainer's device, 0 outside this rank's rows; the advantages' inputs are gathered first."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from rlexp.algorithms.advantages import AdvantageInputs
from rlexp.algorithms.distill import reverse_kl, topk_forward_kl
from rlexp.algorithms.objective import Metrics, Objective, TokenInputs, Totals
from rlexp.sample import Sample
from rlexp.trainer import distributed
from rlexp.trainer.batch import Layout, MicroBatch, Minibatch, TrainBatch, trained
from rlexp.trainer.critic import Critic
from rlexp.trainer.fit_metrics import FitObserver, Laps
from rlexp.trainer.metric_sums import MetricSums
from rlexp.trainer.policy import Policy, PolicyOutput
from rlexp.trainer.sync_check import SyncCheck


@dataclass(frozen=True)
class Learner:
    """What an update works with. The TrainController builds it and keeps its lifecycle
    (weights, checkpoints)."""

    policy: Policy
    objective: Objective
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR  # one step per fit
    sync_check: SyncCheck
    critic: Critic | None  # advantage=gae's value model
    layout: Layout
    recompute: bool  # the ratio is taken against the policy's own logprobs before the update
    ref_kl_every_n_steps: int  # with kl.coef=0, log train/kl every n fits (0: never)
    max_grad_norm: float

    @property
    def fits_done(self) -> int:
        return self.lr_scheduler.last_epoch  # restored with the schedule by a checkpoint


@dataclass(frozen=True)
class Signals:
    """The loss's per-token inputs besides the policy's own forward, [rows, L-1] on the device."""

    old: torch.Tensor  # the logprobs the ratio is taken against
    ref: torch.Tensor | None  # the reference policy's (None: not needed this fit)
    advantages: torch.Tensor
    values: torch.Tensor | None  # the critic's before the update, every rank's rows (None: no critic)
    returns: torch.Tensor | None  # the critic's targets


def fit(learner: Learner, samples: list[Sample], version: int) -> dict[str, float]:
    """One RL step's update of policy `version` on `samples` (failed ones included: they are
    no row); its metrics, with each stage's seconds as `timing/fit/<stage>_s`."""
    laps = Laps()
    distributed.reset_peak_memory(learner.policy.device)
    rows = trained(samples)
    if not rows:  # nothing completed: no update, the lr schedule still steps
        return end_of_fit(learner, {"train/skipped_step": 1.0, "train/advantage_abs_mean": 0.0})
    batch = TrainBatch.build(rows, version, learner.layout, produced=len(samples))
    watch = FitObserver(batch, learner.sync_check)
    laps("prepare")
    old = old_logprobs(learner, batch)
    if learner.recompute:  # the fit's first forward measures the last weight sync
        watch.scored(old)
    laps("old_logprobs")
    ref = ref_logprobs(learner, batch)
    laps("ref_logprobs")
    values = critic_values(learner, batch)
    laps("values")
    signals = advantages(learner, batch, old, ref, values)
    laps("advantages")
    skip = no_signal(learner, batch, signals) or critic_warming_up(learner)
    for minibatch in batch.minibatches:
        forward_backward(learner, batch, minibatch, signals, watch)
        watch.before_step()  # may raise SyncMismatch: no weight has moved yet
        grad_norm = optimizer_step(learner, skip)
        watch.minibatch_done(grad_norm, critic_step(learner, batch, minibatch, signals))
    metrics = end_of_fit(learner, watch.report(signals.advantages, signals.values, signals.returns, skip))
    laps("train")
    return metrics | laps.seconds


@torch.no_grad()
def old_logprobs(learner: Learner, batch: TrainBatch) -> torch.Tensor:
    """The logprobs the ratio is taken against: the rollout's, or with `old_logprobs=recompute`
    (or an objective that needs them) the policy's before the update (a forward)."""
    if learner.recompute:
        return learner.policy.logprobs(batch)
    return batch.rollout_logprobs.to(learner.policy.device)


def ref_logprobs(learner: Learner, batch: TrainBatch) -> torch.Tensor | None:
    """The reference policy's logprobs (a forward as costly as the policy's), only when the
    loss uses them or this fit logs `train/kl` (every `ref_kl_every_n_steps`); else None."""
    every = learner.ref_kl_every_n_steps
    logs_kl = every > 0 and (learner.fits_done + 1) % every == 0
    if not learner.policy.reference or not (learner.objective.kl.coef > 0 or logs_kl):
        return None
    return learner.policy.reference.logprobs(batch)


def critic_values(learner: Learner, batch: TrainBatch) -> torch.Tensor | None:
    """The critic's values before the update, every rank's rows gathered (GAE runs over the
    whole batch); None without a critic."""
    if learner.critic is None:
        return None
    return distributed.all_reduce_(learner.critic.values(batch), "sum")


def advantages(learner: Learner, batch: TrainBatch, old: torch.Tensor, ref: torch.Tensor | None,
               values: torch.Tensor | None) -> Signals:
    """Per-token advantages (and a critic's targets) from the rows' rewards and groups, with
    the KL penalty in the reward (`kl.where=reward`: old vs reference logprobs, every rank's
    rows gathered), the critic's values where the algorithm has them, and the reverse KL to a
    teacher where one scored the rows (on-policy distillation: rlexp/algorithms/distill.py)."""
    objective, device = learner.objective, learner.policy.device
    token_rewards = None
    if objective.kl.in_reward:
        assert ref is not None, "kl.where=reward needs the reference's logprobs (ref_logprobs)"
        old_all = distributed.all_reduce_(old.clone(), "sum") if learner.recompute else old
        ref_all = distributed.all_reduce_(ref.clone(), "sum")
        token_rewards = objective.kl.token_rewards(old_all, ref_all, batch.loss_mask.to(device)).cpu()
    teacher = batch.teacher
    x = AdvantageInputs(batch.rewards, batch.groups, completed=torch.ones(len(batch), dtype=torch.bool),
                        mask=batch.loss_mask, token_rewards=token_rewards,
                        values=values.cpu() if values is not None else None,
                        reverse_kl=None if teacher is None else reverse_kl(
                            batch.rollout_logprobs, teacher.logprobs, teacher.scored * batch.loss_mask))
    adv, returns = objective.advantages(x)
    return Signals(old, ref, adv.to(device), values, returns.to(device) if returns is not None else None)


class Watch(Protocol):
    """What looks at each micro-batch's values (FitObserver; the Tinker server's outputs)."""

    def micro_batch(self, micro: MicroBatch, out: PolicyOutput, x: TokenInputs, terms: Metrics,
                    totals: Totals, aux_logged: torch.Tensor | None) -> None: ...


def forward_backward(learner: Learner, batch: TrainBatch, minibatch: Minibatch, signals: Signals,
                     watch: Watch | None = None, backward: bool = True) -> None:
    """Each of this rank's micro-batches of `minibatch`: the policy's forward, the objective's
    per-token loss, its share of the minibatch's loss, backward. The gradients add up to the
    minibatch's until `optimizer_step`. `backward` False: the forward and the loss only, no
    gradient kept (the values `watch` sees are the same)."""
    objective, device, totals = learner.objective, learner.policy.device, minibatch.totals
    for micro in minibatch.micro_batches:
        with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
            out = learner.policy(batch, micro)
            mask = micro.take(batch.loss_mask).to(device) if micro.real else torch.zeros_like(out.logprobs)
            old, adv = micro.take(signals.old), micro.take(signals.advantages)
            x = TokenInputs(out.logprobs, old, micro.take(batch.rollout_logprobs).to(device), adv, mask)
            ref = micro.take(signals.ref) if signals.ref is not None else None
            loss, terms = objective.token_loss(x, out.entropy, ref, teacher_forward_kl(batch, micro, out))
            aux, aux_logged = out.aux_term(mask.sum() / totals.tokens)  # 0 unless an MoE's aux loss is on
            if backward:
                (objective.aggregate(loss, mask, totals) + aux).backward()
        if watch is not None:
            watch.micro_batch(micro, out, x, terms, totals, aux_logged)


def teacher_forward_kl(batch: TrainBatch, micro: MicroBatch, out: PolicyOutput) -> torch.Tensor | None:
    """The top-k forward KL to the teacher at each of the micro-batch's tokens the teacher
    scored (distill.py), when the policy's forward scored the teacher's top-k ids; else None."""
    if out.teacher_top is None or batch.teacher is None or batch.teacher.top_logprobs is None:
        return None
    device = out.teacher_top.device
    teacher_top = batch.teacher.top_logprobs[micro.rows, micro.columns].to(device)
    return topk_forward_kl(out.teacher_top, teacher_top) * micro.take(batch.teacher.scored).to(device)


def optimizer_step(learner: Learner, skip: bool = False) -> torch.Tensor:
    """Clip the gradient norm, step (unless `skip`), zero the gradients; the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.policy.model.parameters(), learner.max_grad_norm)
    if not skip:
        learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def critic_step(learner: Learner, batch: TrainBatch, minibatch: Minibatch,
                signals: Signals) -> MetricSums | None:
    """The critic's optimizer step on the minibatch's rows toward the returns (None: no critic)."""
    if learner.critic is None or signals.values is None or signals.returns is None:
        return None
    return learner.critic.train_minibatch(batch, minibatch, signals.values, signals.returns,
                                          learner.objective.aggregation)


def no_signal(learner: Learner, batch: TrainBatch, signals: Signals) -> bool:
    """No advantage and no KL, entropy or aux term: the gradient is zero. An optimizer step
    would still move the weights on Adam's momentum, so it is skipped (the forwards still run
    and log)."""
    o, mask = learner.objective, batch.loss_mask.to(signals.advantages.device)
    return bool(not (signals.advantages * mask).abs().sum() and not o.kl.in_loss and not o.entropy_coef
                and not learner.policy.aux_loss_coef)


def critic_warming_up(learner: Learner) -> bool:
    """The critic's first `critic_only_steps` fits train it alone: the policy takes no step."""
    return learner.critic is not None and learner.fits_done < learner.critic.critic_only_steps


def end_of_fit(learner: Learner, metrics: dict[str, float]) -> dict[str, float]:
    """The lr schedules' step (one per fit, also when a no-signal fit skipped its update:
    PyTorch's warning about that order does not apply) and the fit's lr and peak memory."""
    metrics["train/lr"] = learner.optimizer.param_groups[0]["lr"]
    if learner.critic:
        metrics["critic/lr"] = learner.critic.step_lr()
    metrics[f"memory/rank_{learner.layout.rank}/peak_mb"] = distributed.peak_memory_mb(learner.policy.device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        learner.lr_scheduler.step()
    return metrics
