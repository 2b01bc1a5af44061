"""The Tinker API's `loss_fn` names as rlexp's own objective pieces (rlexp/algorithms): which
policy loss, which `loss_fn_inputs` each needs, and which `loss_fn_config` keys it reads.
Every loss is a sum over the datums' positions (`TokenSum`), as Tinker defines them
(https://tinker-docs.thinkingmachines.ai/losses): the caller normalises. With r = pi / q,
q the sampler's logprobs (`logprobs`), A the `advantages`:

    cross_entropy        -sum_t w_t log pi(target_t)             weights w (the mask)
    importance_sampling  -sum_t r_t A_t                          unclipped.ImportanceSampling
    ppo                  -sum_t min(r A, clip(r, lo, hi) A)       objective.PPOClip
    cispo                -sum_t sg(clip(r, lo, hi)) A log pi      objective.CISPO
    dro                  -sum_t (A log pi - beta/2 (log pi - log q)^2)   unclipped.DRO
    gspo                 PPO's clip on the sequence's geometric-mean ratio   objective.GSPO
                         (over the `sequence_ratio_mask` tokens, the mask; the sum runs over
                         every position: `EveryPosition`)

lo, hi are Tinker's thresholds on r itself (`clip_low_threshold`, `clip_high_threshold`); rlexp's
pieces take distances from 1 (`clip_ratio_low` = 1 - lo, `clip_ratio_high` = hi - 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlexp.algorithms.advantages import GroupNormalized
from rlexp.algorithms.objective import CISPO, GSPO, KLTerm, Objective, PolicyLoss, PPOClip, TokenSum, Totals
from rlexp.algorithms.unclipped import DRO, CrossEntropy, ImportanceSampling
from rlexp.tinker.errors import BadRequest


@dataclass(frozen=True)
class LossSpec:
    inputs: tuple[str, ...]  # loss_fn_inputs every datum must carry, besides target_tokens
    optional: tuple[str, ...]  # loss_fn_inputs it may carry
    config: dict[str, float]  # loss_fn_config keys and their defaults


RL_INPUTS = ("logprobs", "advantages")
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES = {
    "cross_entropy": LossSpec(("weights",), (), {}),
    "importance_sampling": LossSpec(RL_INPUTS, (), {}),
    "ppo": LossSpec(RL_INPUTS, (), CLIP),
    "cispo": LossSpec(RL_INPUTS, (), CLIP),
    "dro": LossSpec(RL_INPUTS, (), {"beta": 0.05}),
    "gspo": LossSpec(RL_INPUTS, ("sequence_ratio_mask",), {"clip_low_threshold": 1 - 3e-4,
                                                            "clip_high_threshold": 1 + 4e-4}),
}
NOT_SERVED = {
    "stable_reinforce": "its formula is Tinker's own and not published (and it needs the sampler's "
                        "stability records)",
    "custom": "a custom loss runs on the client (forward_backward_custom sends a forward, then a "
              "cross_entropy-shaped backward), never by name",
}


def spec(loss_fn: str, config: dict[str, Any] | None) -> tuple[LossSpec, dict[str, float]]:
    """The loss's spec and its config with defaults; BadRequest (400) naming what is wrong."""
    if loss_fn in NOT_SERVED:
        raise BadRequest(f"loss_fn {loss_fn!r} is not served by rlexp: {NOT_SERVED[loss_fn]}; "
                         f"served: {', '.join(LOSSES)}", "loss_fn")
    if loss_fn not in LOSSES:
        raise BadRequest(f"unknown loss_fn {loss_fn!r}; served: {', '.join(LOSSES)}", "loss_fn")
    known = LOSSES[loss_fn]
    given = dict(config or {})
    unknown = sorted(set(given) - set(known.config))
    if unknown:
        raise BadRequest(f"loss_fn_config key {unknown[0]!r} is not read by {loss_fn!r} (it reads: "
                         f"{', '.join(known.config) or 'nothing'})", f"loss_fn_config.{unknown[0]}")
    values = dict(known.config)
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise BadRequest(f"loss_fn_config.{key} must be a number, not {value!r}", f"loss_fn_config.{key}")
        values[key] = float(value)
    if "clip_low_threshold" in values and not (
            0 <= values["clip_low_threshold"] <= 1 <= values["clip_high_threshold"]):
        raise BadRequest(f"{loss_fn}: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                         f"{values['clip_low_threshold']} and {values['clip_high_threshold']}",
                         "loss_fn_config")
    if values.get("beta", 0.0) < 0:
        raise BadRequest(f"dro: beta must be >= 0, got {values['beta']}", "loss_fn_config.beta")
    return known, values


class EveryPosition:
    """gspo's sum: over every position, as Tinker's formula has it; its mask (the datum's
    `sequence_ratio_mask`) only picks the tokens of the sequence ratio. A padded position adds 0
    (its advantage is 0)."""

    def __call__(self, loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
        return loss.sum()


def objective(loss_fn: str, values: dict[str, float]) -> Objective:
    """The Objective that computes `loss_fn` (its advantages are the caller's: the estimator is
    never called)."""
    aggregation = EveryPosition() if loss_fn == "gspo" else TokenSum()
    return Objective(GroupNormalized(), _policy_loss(loss_fn, values), aggregation, KLTerm(), None)


def _policy_loss(loss_fn: str, v: dict[str, float]) -> PolicyLoss:
    if loss_fn == "cross_entropy":
        return CrossEntropy()
    if loss_fn == "importance_sampling":
        return ImportanceSampling()
    if loss_fn == "dro":
        return DRO(v["beta"])
    low, high = 1.0 - v["clip_low_threshold"], v["clip_high_threshold"] - 1.0
    return {"ppo": PPOClip, "cispo": CISPO, "gspo": GSPO}[loss_fn](low, high)
