"""One update of the policy, top to bottom: what the TrainController's `train` call runs.

    for each minibatch (its rows over all ranks give the aggregation's totals):
        for each of this rank's micro-batches:
            logp, entropy = PolicyForward(policy, micro-batch)          # policy_forward.py
            loss, terms = objective.token_loss(TokenInputs(...))         # rlexp/algorithms/objective.py
            objective.aggregate(loss, mask, totals).backward()           # its share of the minibatch loss
        clip the gradient norm; optimizer.step()  (skipped when nothing carries signal)
        the critic's own step on the same micro-batches (advantage=gae)
    metrics: one host transfer at the end (StepMetrics, rlexp/trainer/fit_metrics.py)

What one fit carries from one low-level call to the next is a `FitBatch` (below): the
controller's `prepare` makes it, `compute_old_logprobs` .. `compute_advantages` fill it, and
`Update.run` reads it. Its tensors are this rank's, [rows, L-1] on the trainer's device, rows
in `tokens` order, 0 outside the rows this rank trains."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlexp.algorithms.aggregation import Totals
from rlexp.algorithms.kl import kl_estimate
from rlexp.algorithms.objective import Objective
from rlexp.algorithms.policy_losses import TokenInputs
from rlexp.sample import Sample
from rlexp.trainer import distributed
from rlexp.trainer.critic import Critic, critic_report
from rlexp.trainer.fit_metrics import MetricSums, StepMetrics
from rlexp.trainer.policy_forward import PolicyForward
from rlexp.trainer.sync_check import SyncCheck
from rlexp.trainer.token_batch import MicroBatch, TokenBatch


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimizer step, dealt to the ranks in micro-batches."""

    rows: list[int]  # every rank's rows: the aggregation's totals count them all
    mine: list[MicroBatch]  # this rank's micro-batches, fillers included (ranks run equally many)
    everyone: list[MicroBatch]  # every rank's real micro-batches (for train/pad_frac)

    def totals(self, tb: TokenBatch) -> Totals:
        mask = tb.loss_mask[self.rows]
        return Totals(tokens=float(mask.sum()), seqs=float((mask.sum(-1) > 0).sum()))


@dataclass
class FitBatch:
    samples: list[Sample]  # the batch as produced, failed samples included
    version: int  # the policy being trained
    trained: list[int]  # indexes into `samples` of the trained rows (completed, with a response)
    tokens: TokenBatch | None = None  # the trained samples; None when there are none
    minibatches: list[Minibatch] = field(default_factory=list)
    my_micro_batches: list[MicroBatch] = field(default_factory=list)  # this rank's, over all its rows
    behav: torch.Tensor | None = None  # the rollout's logprobs, on the trainer's device
    old: torch.Tensor | None = None  # the logprobs the ratio is taken against
    ref: torch.Tensor | None = None  # the reference policy's (None: not needed this step)
    values: torch.Tensor | None = None  # the critic's, every rank's rows (None: no critic)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # the critic's targets (None: no critic)
    sync_measured: bool = False  # a forward before the update gave the sync check its tokens

    def require(self, *fields: str, call: str) -> None:
        """A clear error when a low-level call comes before the ones it needs."""
        order = {"old": "compute_old_logprobs", "ref": "compute_ref_logprobs", "values": "compute_values",
                 "advantages": "compute_advantages"}
        missing = [order[f] for f in fields if getattr(self, f) is None]
        if missing and self.tokens is not None:
            raise RuntimeError(f"TrainController.{call} needs {', '.join(missing)} to have run on this "
                               "FitBatch first (order: prepare, compute_old_logprobs, compute_ref_logprobs, "
                               "compute_values, compute_advantages, train)")


def plan_minibatches(tb: TokenBatch, minibatches: int, rank: int, world: int,
                     max_tokens: int) -> tuple[list[Minibatch], list[MicroBatch]]:
    """The rows cut into `minibatches` (strided), each dealt to the ranks token-balanced and
    cut into micro-batches; and this rank's micro-batches over all its rows (the forwards
    before the update run over them)."""
    n = min(minibatches, len(tb))
    shares = [distributed.balanced_split(list(range(m, len(tb), n)), tb.lengths, world) for m in range(n)]
    planned = [Minibatch(sum(share, []), *_deal(tb, share, rank, max_tokens)) for share in shares]
    rows_of_rank = [sorted(i for share in shares for i in share[r]) for r in range(world)]
    return planned, _deal(tb, rows_of_rank, rank, max_tokens)[0]


def _deal(tb: TokenBatch, shares: list[list[int]], rank: int,
          max_tokens: int) -> tuple[list[MicroBatch], list[MicroBatch]]:
    """This rank's micro-batches of its share, padded with fillers to as many as the busiest
    rank has, and every rank's real ones."""
    per_rank = [tb.micro_batches(share, max_tokens) for share in shares]
    mine = list(per_rank[rank])
    filler = MicroBatch(torch.tensor([0]), 2, real=False)  # a masked-out 2-token row: collectives only
    mine += [filler] * (max(map(len, per_rank)) - len(mine))
    return mine, [mb for r in per_rank for mb in r]


@dataclass
class MicroBatchLoss:
    """What one micro-batch's forward/backward leaves to log."""

    terms: dict[str, torch.Tensor]  # the loss's per-token [n, T] or per-sequence [n] quantities
    mask: torch.Tensor  # [n, T] its trained tokens (zeros for a filler)
    logp: torch.Tensor  # [n, T] the trainer's logprobs, detached
    router_aux: torch.Tensor | None  # MoE: its share of the minibatch's router aux loss


class Update:
    """The optimizer steps of one fit over a FitBatch whose advantages are computed."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, objective: Objective,
                 forward: PolicyForward, max_grad_norm: float, critic: Critic | None, sync_check: SyncCheck):
        self.model = model
        self.optimizer = optimizer
        self.objective = objective
        self.forward = forward
        self.max_grad_norm = max_grad_norm
        self.critic = critic
        self.sync_check = sync_check
        self.moe = forward.moe
        self.device = forward.device

    def run(self, fb: FitBatch, critic_only: bool) -> dict[str, float]:
        """One optimizer step per minibatch (none when nothing carries signal, or `critic_only`:
        the critic's warm-up steps); the fit's metrics."""
        tb, adv = fb.tokens, fb.advantages
        assert tb is not None and adv is not None
        skip = self._no_signal(tb, adv) or critic_only
        levels = sorted(set(tb.staleness[tb.loss_mask.bool()].tolist()))  # read on the host: no sync
        step = StepMetrics()
        sync: dict[str, float] = {}
        for m, minibatch in enumerate(fb.minibatches):
            sync |= self._minibatch(fb, minibatch, step, levels, first=m == 0, skip=skip)
        n_mb = len(fb.minibatches)
        out = step.report(n_mb, levels)
        out["train/response_tokens"] = float(tb.loss_mask.sum()) / n_mb
        out["train/pad_frac"] = tb.pad_frac([mb for minibatch in fb.minibatches for mb in minibatch.everyone])
        out["train/skipped_step"] = float(skip)
        out |= sync
        mask = tb.loss_mask.to(self.device)
        if self.critic and fb.values is not None and fb.returns is not None:
            out |= critic_report(fb.values, fb.returns, mask)
        per_sample = (adv.abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        out["train/advantage_abs_mean"] = per_sample.sum().item() / len(fb.samples)
        return out

    def _no_signal(self, tb: TokenBatch, adv: torch.Tensor) -> bool:
        """No advantage and no KL, entropy or aux term: the gradient is zero. An optimizer step
        would still move the weights on Adam's momentum, so it is skipped (the forwards still
        run and log)."""
        return bool(not (adv * tb.loss_mask.to(self.device)).abs().sum() and not self.objective.kl.in_loss
                    and not self.objective.entropy_coef and not self.moe.aux_coef)

    def _minibatch(self, fb: FitBatch, minibatch: Minibatch, step: StepMetrics, levels: list[int],
                   first: bool, skip: bool) -> dict[str, float]:
        """Forward/backward of this rank's micro-batches, one optimizer step (unless `skip`), the
        critic's step; their metrics into `step`. The first minibatch also measures the
        trainer against the rollout (before any optimizer step the trainer holds its policy) and
        checks the last sync (on these forwards unless one before the update measured it): its
        figures, or SyncMismatch before the optimizer step."""
        assert fb.tokens is not None and fb.behav is not None
        totals = minibatch.totals(fb.tokens)
        part = MetricSums()
        for micro in minibatch.mine:
            out = self._micro_batch(fb, micro, totals, first)
            if out.router_aux is not None:
                part.add("router_aux_loss", out.router_aux)
            step.add_maxima(out.terms, out.mask)
            if first:
                rows, cols = micro.rows.to(self.device), micro.columns
                staleness = fb.tokens.staleness[micro.rows, cols].to(self.device)
                part.add_offpolicy(out.logp, fb.behav[rows, cols], staleness, out.mask, levels)
                if not fb.sync_measured:
                    comparable = out.mask * fb.tokens.model_sampled[micro.rows, cols].to(self.device)
                    self.sync_check.add(out.logp, fb.behav[rows, cols], staleness, comparable)
            part.add_terms(out.terms, out.mask, totals)
        # One host read, here rather than right after the forward that measured: a GPU keeps
        # the CPU's work in between overlapped (measured 1.33x a bf16 fit when read earlier).
        sync = self.sync_check.finish(fb.version) if first else {}  # SyncMismatch: no optimizer step
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if not skip:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step.add_grad_norm(distributed.full_tensor(grad_norm))  # the same on every rank
        if self.critic and fb.values is not None and fb.returns is not None:
            critic_sums = self.critic.train_minibatch(fb.tokens, minibatch.mine, totals, fb.values,
                                                      fb.returns, self.objective.aggregation)
            part.merge(critic_sums, prefix="critic/")
        step.sums.merge(part)
        return sync

    def _micro_batch(self, fb: FitBatch, micro: MicroBatch, totals: Totals, first: bool) -> MicroBatchLoss:
        """Forward, the objective's per-token loss, its share of the minibatch loss, backward."""
        assert fb.tokens is not None and fb.old is not None and fb.behav is not None
        assert fb.advantages is not None
        rows, cols = micro.rows.to(self.device), micro.columns
        logp, entropy = self.forward(self.model, fb.tokens, micro, entropy=True)
        mask = fb.tokens.loss_mask[micro.rows, cols].to(self.device) if micro.real else torch.zeros_like(logp)
        x = TokenInputs(logp, fb.old[rows, cols], fb.behav[rows, cols], fb.advantages[rows, cols], mask)
        ref_logp = fb.ref[rows, cols] if fb.ref is not None else None
        loss, terms = self.objective.token_loss(x, entropy, ref_logp)
        aux, aux_logged = self.moe.loss_term(mask.sum() / totals.tokens)  # 0 unless an MoE's aux loss is on
        (self.objective.aggregate(loss, mask, totals) + aux).backward()
        self.moe.release()  # its routers' recomputation (checkpointing) is done
        if first:  # before the first optimizer step: the trainer/engine numerical mismatch
            terms["mismatch_kl"] = kl_estimate(logp, x.behav_logp, "k3")  # trainer vs engine
            if (differs := self.moe.differs) is not None:
                terms["routing_mismatch_frac"] = differs
        return MicroBatchLoss(terms, mask, logp.detach(), aux_logged)
