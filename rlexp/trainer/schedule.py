"""The learning-rate schedule, one step per fit (per RL step).

Not transformers' schedules, because they give other factors and a run's lr must stay what
it was (fingerprints, resumed runs). Compared step by step (t = 0..total, float `==`) on
2026-11-26 with transformers 5.19, warm-up/total in (0,100) (10,110) (5,50) (3,1000) (0,1)
(7,7) (1,2) (20,137): `_get_cosine_with_min_lr_schedule_with_warmup_lr_rate_lambda`
(num_cycles=0.5, min_lr_rate=0.1, what `get_cosine_with_min_lr_schedule_with_warmup` uses)
equals `lr_factor("cosine", ...)` in warm-up only and differs at every step after it (its
progress is one step ahead and is not held at `total_steps`): max |difference| 0.0141 at
(10,110), 0.9 at (0,1); `_get_constant_schedule_with_warmup_lr_lambda` warms up from 0
(t / warm-up, not (t + 1) / warm-up): max |difference| 1 / warm-up steps, e.g. 0.1 at
(10,110). (Importing transformers.optimization took 10.1 s on a 2-core CPU machine; the
trainer pays for it anyway, so that is not the reason.)"""

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
