"""The learning-rate schedule, one step per fit (per RL step)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

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
