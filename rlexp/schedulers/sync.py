"""SyncScheduler: every trajectory of a step is generated concurrently, then training.
Also the pieces every scheduler shares: rolling out one group, filtering, accounting."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from rlexp.constraints import AtLeast1, Fraction
from rlexp.data.manager import DataManager
from rlexp.errors import EngineDead
from rlexp.guards import fault_reason
from rlexp.protocols import Agent, RolloutEngine
from rlexp.rollout.accounting import generated_tokens
from rlexp.sample import Sample, Status

log = logging.getLogger(__name__)


def collect(samples: list[Sample], results: list) -> list[list[Sample]]:
    """Agent results back into prompt groups. An agent returns one Sample, or several (a
    conversation that branched or was split at a prefix break); an exception marks the
    sample FAILED with the reason (kept, counted, never trained); a dead engine stops the run."""
    groups: dict[int, list[Sample]] = {}
    for s, r in zip(samples, results):
        if isinstance(r, (EngineDead, asyncio.CancelledError)):
            raise r
        if isinstance(r, BaseException):
            s.status = Status.FAILED
            s.metadata["error"] = fault_reason(r)
            log.warning("sample %d failed: %s", s.uid, s.metadata["error"])
            r = s
        for out in r if isinstance(r, list) else [r]:
            groups.setdefault(out.group_id, []).append(out)
    return list(groups.values())


async def rollout_group(agent: Agent, group: list[Sample], meter: list[int]) -> list[Sample]:
    """Roll out one prompt group; engines add every token they generate for it to `meter`.
    Run it as its own task: the meter is set in the task's context."""
    generated_tokens.set(meter)
    results = await asyncio.gather(*(agent.rollout(s) for s in group), return_exceptions=True)
    return [s for g in collect(group, results) for s in g]


def has_no_signal(group: list[Sample]) -> bool:
    """True when the group's completed samples all got the same reward: its GRPO advantages
    are all zero, so training on it only dilutes the batch."""
    return len({s.reward for s in group if s.status == Status.COMPLETED}) <= 1


def trained_tokens(group: list[Sample]) -> int:
    return sum(s.response_length for s in group if s.status == Status.COMPLETED)


class SyncScheduler:
    """`filter_zero_variance`: drop groups without reward variance (status FILTERED) and
    roll out replacements, up to `max_filter_rounds` rounds per step (DAPO's dynamic sampling)."""

    def __init__(self, filter_zero_variance: bool = False, max_filter_rounds: AtLeast1 = 4,
                 max_failure_fraction: Fraction = 0.5):
        self.filter_zero_variance = filter_zero_variance
        self.max_filter_rounds = max_filter_rounds
        self.max_failure_fraction = max_failure_fraction  # the loop stops past it (checked per step)
        self.counts: Counter[str] = Counter()

    async def produce_batch(self, data: DataManager, agent: Agent, version: int) -> list[Sample]:
        kept: list[list[Sample]] = []
        for _ in range(self.max_filter_rounds if self.filter_zero_variance else 1):
            groups = data.sample_groups(data.prompts_per_step - len(kept))
            meters = [[0] for _ in groups]
            done = await asyncio.gather(*(rollout_group(agent, g, m) for g, m in zip(groups, meters)))
            for group, meter in zip(done, meters):
                if self.filter_zero_variance and has_no_signal(group):
                    self.reject(group, Status.FILTERED, meter[0])
                else:
                    self.counts["rollout/untrained_tokens"] += meter[0] - trained_tokens(group)
                    kept.append(group)
            if len(kept) == data.prompts_per_step:
                break
        return [s for group in kept for s in group]

    def reject(self, group: list[Sample], status: Status, generated: int) -> None:
        for s in group:
            if s.status in (Status.COMPLETED, Status.INIT):
                s.status = status
        self.counts[f"samples/{status.value}"] += len(group)
        self.counts["rollout/untrained_tokens"] += generated

    async def sync_weights(self, engine: RolloutEngine, publish: Callable[[], Awaitable[None]],
                           version: int) -> None:
        """Nothing is generating between batches: publish right away."""
        await publish()

    def pop_counts(self) -> dict[str, float]:
        """Counts since the last call: samples rejected before reaching a batch, tokens
        generated but never trained."""
        out = {k: float(v) for k, v in self.counts.items()}
        self.counts.clear()
        return out

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state["counts"])

    async def aclose(self) -> None:
        """Nothing runs between calls."""
