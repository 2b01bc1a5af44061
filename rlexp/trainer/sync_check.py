"""Every weight sync verified during the run, for free.

Each token carries the policy version that generated it, and the fit's first forward scores
the batch with the trainer's weights before any optimizer step. For the tokens generated at
the trainer's current version (all of them under the sync scheduler) the engine and the
trainer hold the same weights, so

    d_t = | log pi_trainer(y_t) - log pi_engine(y_t) |

is the numerical noise of two implementations of one model: ~1e-6 in float32, a few 1e-2 in
bfloat16 (docs/checks.md has the measured figures per model). A sync that did not land (a
tensor left out, LoRA not merged, a cache not reset, a kernel's repack skipped, another
dtype) shows as a difference orders of magnitude larger.

The check logs `sync/tokens` (how many tokens it had), `sync/logprob_diff_max`, `_p99` and
`_mean` every step; past the bound on the p99 it raises SyncMismatch before the optimizer
step. The p99, not the max: in bfloat16 a few tokens whose top logits nearly tie differ by
more than the rest, on a healthy sync too. The first forward is `old_logprobs`'s (update.py) when
it runs one (`old_logprobs=recompute`), else the first minibatch's training forward: then
only the first minibatch's tokens are checked. Exact over ranks (the differences gathered).

Tokens whose request reshaped the distribution (guided decoding, penalties, a logit bias:
`rlexp.sample.reshapes`) are left out: the engine's logprob is of the reshaped distribution,
which the trainer does not compute (a token a grammar forced has logprob 0 in the engine).

The comparison trusts the versions the tokens carry, which the engine gives them: a transport
that returns without reaching the engine (its reload never awaited) leaves the engine serving,
and tagging its tokens with, an older version, whose tokens the comparison leaves out as stale.
So the loop's step also checks the batch's own versions against the trainer's (`check_versions`,
before the fit: no trained token staler than the scheduler allows, `Scheduler.max_staleness`)
and, where no token may be stale, that the check compared some (`check_compared`, after it)."""

from __future__ import annotations

from typing import Literal

import torch

from rlexp.errors import SyncMismatch, SyncUnchecked
from rlexp.models.local import resolve_dtype
from rlexp.sample import Sample, Status, staleness
from rlexp.trainer import distributed

# The p99 bound per dtype when `bound: auto`: the looser of the trainer's compute dtype and
# the engine's. No healthy sync measured reached them (closest: SmolLM2 in bfloat16, p99 0.21);
# in bfloat16 two planted faults stay under 0.25 (docs/checks.md, "Planted faults").
AUTO_BOUNDS = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.25}
CAUSES = ("a tensor left out of the push (a tied lm_head), LoRA adapters not merged into the pushed "
          "weights, an engine cache not reset after the reload (prefix, image encoder), a reload that "
          "skipped a kernel's repack (MoE experts on CPU), weights pushed in another dtype, or a "
          "transport that returned without sending")
NOT_REACHED = ("the weight transport did not reach the engine: its transfer returned before the engine "
               "loaded the weights (a coroutine never awaited, a reload left to run in the background), "
               "so the engine kept its weights and announced no new version")


Bound = float | Literal["auto", "off", False]  # YAML reads a bare `off` as false: the same


def resolve_bound(bound: Bound, dtypes: list[str]) -> float | None:
    """The p99 bound in force: a number as given, `auto` by the loosest dtype, `off`: None."""
    if bound is False or bound == "off":
        return None
    if bound == "auto":
        return max(AUTO_BOUNDS[resolve_dtype(d)] for d in dtypes)
    return float(bound)


class SyncCheck:
    """`bound`: the largest p99 of d_t allowed (`auto`: by dtype, AUTO_BOUNDS; `off`: only
    measured and logged). `engine_dtype`: the rollout engine's (the trainer adds its own)."""

    def __init__(self, bound: Bound = "auto", engine_dtype: str = "float32",
                 trainer_dtype: str = "float32"):
        self.bound = resolve_bound(bound, [engine_dtype, trainer_dtype])
        self.dtypes = sorted({resolve_dtype(engine_dtype), resolve_dtype(trainer_dtype)})
        self.diffs: list[torch.Tensor] = []

    def add(self, logp: torch.Tensor, rollout_logp: torch.Tensor, staleness: torch.Tensor,
            mask: torch.Tensor) -> None:
        """The trained tokens of one forward ([n, T] each, on the device) that were generated at
        the current version. Kept dense (no boolean indexing): nothing waits for the device."""
        current = (mask.bool() & (staleness == 0)).flatten()
        diff = (logp.detach().float() - rollout_logp.float()).abs().flatten()
        self.diffs.append(torch.where(current, diff, -1.0))  # -1: not counted (a |diff| is >= 0)

    def finish(self, version: int) -> dict[str, float]:
        """The step's figures over every rank's tokens, read in one host transfer; SyncMismatch
        past the bound."""
        device = self.diffs[0].device if self.diffs else distributed.device()
        d = torch.cat(self.diffs) if self.diffs else torch.zeros(0, device=device)
        self.diffs = []
        if distributed.rank_world()[1] > 1:
            d = distributed.all_gather_1d(d[d >= 0])
        n, stats = _figures(d)
        if not n:
            return {"sync/tokens": 0.0}
        out = {"sync/tokens": float(n), "sync/logprob_diff_max": stats[0], "sync/logprob_diff_p99": stats[1],
               "sync/logprob_diff_mean": stats[2]}
        if self.bound is not None and out["sync/logprob_diff_p99"] > self.bound:
            raise SyncMismatch(self.message(version, out))
        return out

    def message(self, version: int, figures: dict[str, float]) -> str:
        p99, top, mean = (figures[f"sync/logprob_diff_{k}"] for k in ("p99", "max", "mean"))
        return (f"the weight sync to policy version {version} did not land: on the "
                f"{figures['sync/tokens']:.0f} tokens the engine generated at version {version}, "
                f"|logprob(trainer) - logprob(engine)| has p99 {p99:.3g}, max {top:.3g} and mean {mean:.3g} "
                f"(a mean within 10x of the p99: most tokens are off, the engine holds other weights; far "
                f"under it: a few are, e.g. from a stale cache), over the bound {self.bound:g} "
                f"({' / '.join(self.dtypes)}; healthy syncs measure far under it, docs/checks.md). "
                f"Likely causes: {CAUSES}. Stopped before the optimizer step. Certify the setup with "
                "`python -m rlexp.check <this run's overrides>`; trainer.sync_check.bound sets the bound "
                "(off: log only)")


def check_versions(batch: list[Sample], version: int, max_staleness: int) -> int:
    """Before the fit of policy `version`: SyncMismatch if a trained token (a completed
    sample's, in its loss mask) was generated more than `max_staleness` versions before it.
    Returns how many trained tokens the sync check must compare when none may be stale
    (`max_staleness` 0: every one the model sampled unreshaped), else 0."""
    trained = [s for s in batch if s.status == Status.COMPLETED]
    versions = [v for s in trained for v, m in zip(s.versions, s.loss_mask) if m]
    stale = [v for v in versions if staleness(version, v) > max_staleness]
    if stale:
        raise SyncMismatch(f"policy version {version} was trained on tokens the engine generated at version "
                           f"{min(stale)} ({len(stale)} of the batch's {len(versions)} trained tokens are "
                           f"more than the scheduler's {max_staleness} versions old, staleness up to "
                           f"{staleness(version, min(stale))}). Likely cause: {NOT_REACHED}. Stopped "
                           "before the fit")
    if max_staleness:
        return 0
    return sum(m * k for s in trained for m, k in zip(s.loss_mask, s.trace.model_sampled()))


def check_compared(figures: dict[str, float], version: int, expected: int) -> None:
    """After the fit of policy `version`: SyncUnchecked if its batch held `expected` > 0 tokens
    to compare (`check_versions`) and the trainer's check, which reports `sync/tokens`,
    compared none. A trainer without the check (no `sync/tokens`) is not asked."""
    if expected and figures.get("sync/tokens", -1.0) == 0.0:
        raise SyncUnchecked(f"the weight sync to policy version {version} was not checked: the batch held "
                            f"{expected} tokens generated at version {version} to compare and the trainer's "
                            f"sync check compared none (sync/tokens 0). The update of version {version} "
                            "ran; nothing after the last checkpoint is saved. Likely causes: a trainer whose "
                            "check is not given the batch's trained tokens, or an engine that tags its "
                            "tokens with the version it was told, not the one it loaded")


def _figures(d: torch.Tensor) -> tuple[int, list[float]]:
    """Count, then max, p99 (torch.quantile's linear interpolation) and mean of the entries
    >= 0 of `d`, computed on its device and read in one transfer."""
    counted = d >= 0
    n = counted.sum()
    ranked = torch.sort(d).values  # the uncounted (-1) first
    pos = (d.numel() - n.double()) + 0.99 * (n.double() - 1).clamp(min=0)  # float64: exact fraction
    lo, hi = pos.floor().long().clamp(max=d.numel() - 1), pos.ceil().long().clamp(max=d.numel() - 1)
    p99 = ranked[lo] + (pos - lo) * (ranked[hi] - ranked[lo]) if d.numel() else pos
    mean = torch.where(counted, d, 0.0).sum() / n.clamp(min=1)
    values = torch.stack([n.double(), d.max().double() if d.numel() else pos, p99.double(),
                          mean.double()]).tolist()
    return int(values[0]), values[1:]
