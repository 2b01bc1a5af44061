"""Allowed values of constructor arguments, stated once, in the signature:

    def __init__(self, total_steps: AtLeast1, lr_schedule: Literal["constant", "cosine"] = ...)

`rlexp.config.check_arguments` checks a config node against its `_target_`'s signature with
these (before anything expensive starts), and a type checker checks Python callers."""

from __future__ import annotations

from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le

AtLeast0 = Annotated[int, Ge(0)]
AtLeast1 = Annotated[int, Ge(1)]
AtLeast2 = Annotated[int, Ge(2)]
Positive = Annotated[float, Gt(0)]
NonNegative = Annotated[float, Ge(0)]
Fraction = Annotated[float, Ge(0), Le(1)]
Temperature = Annotated[float, Gt(0)]
TopP = Annotated[float, Gt(0), Le(1)]
# "auto": bfloat16 on a GPU, float32 on a CPU (rlexp.models.local.resolve_dtype)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# Ray placement: rollout and trainer on separate devices (split) or sharing them (colocate)
Placement = Literal["split", "colocate"]
# Ray's placement group strategies (cluster.strategy)
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


# What a rollout engine does with its running generations at a weight update (scheduler.update_mode)
UpdateMode = Literal["keep", "abort", "wait"]
# scheduler.update_mode: one of those, or auto (keep where the engine can, else abort)
UpdateModeSetting = Literal["auto", "keep", "abort", "wait"]
