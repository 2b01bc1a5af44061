"""SyncScheduler: every trajectory of a step is generated concurrently, then training.
Also what every scheduler uses to roll out one group (filtering and counts: ledger.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from rlexp.constraints import AtLeast1
from rlexp.data.manager import DataManager
from rlexp.errors import EngineDead, ProgrammingError
from rlexp.guards import PROGRAMMING_ERRORS, fault_reason
from rlexp.protocols import Agent, RolloutEngine
from rlexp.rollout.accounting import generated_tokens
from rlexp.sample import Sample, Status
from rlexp.schedulers.ledger import GroupLedger

log = logging.getLogger(__name__)
T = TypeVar("T")


def collect(samples: list[Sample], results: list) -> list[list[Sample]]:
    """Agent results back into prompt groups. An agent returns one Sample, or several (a
    conversation that branched or was split at a prefix break); an exception marks the
    sample FAILED with the reason (kept, counted, never trained). A dead engine stops the
    run, and so does a programming error (`guards.PROGRAMMING_ERRORS`), with its traceback."""
    groups: dict[int, list[Sample]] = {}
    for s, r in zip(samples, results):
        if isinstance(r, (EngineDead, asyncio.CancelledError)):
            raise r
        if isinstance(r, PROGRAMMING_ERRORS):
            raise ProgrammingError(f"sample {s.uid}: {fault_reason(r)}. A programming error in an "
                                   "agent or judge stops the run (environment faults are counted "
                                   "instead; see docs/checkpoints-and-faults.md)") from r
        if isinstance(r, BaseException):
            s.status = Status.FAILED
            s.metadata["error"] = fault_reason(r)
            log.warning("sample %d failed: %s", s.uid, s.metadata["error"])
            r = s
        for out in r if isinstance(r, list) else [r]:
            groups.setdefault(out.group_id, []).append(out)
    return list(groups.values())


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """`asyncio.gather`, except that the first exception cancels the others (and waits for
    them to end) before it propagates: a dead engine must not leave groups running."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # also when this is cancelled: the tasks go with it
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


async def rollout_group(agent: Agent, group: list[Sample], meter: list[int]) -> list[Sample]:
    """Roll out one prompt group; engines add every token they generate for it to `meter`.
    Run it as its own task: the meter is set in the task's context."""
    generated_tokens.set(meter)
    results = await asyncio.gather(*(agent.rollout(s) for s in group), return_exceptions=True)
    return [s for g in collect(group, results) for s in g]


class SyncScheduler:
    """`filter_zero_variance`: drop groups without reward variance (status FILTERED) and
    roll out replacements, up to `max_filter_rounds` rounds per step (DAPO's dynamic sampling)."""

    def __init__(self, filter_zero_variance: bool = False, max_filter_rounds: AtLeast1 = 4):
        self.max_filter_rounds = max_filter_rounds
        self.ledger = GroupLedger(filter_zero_variance)

    async def produce_batch(self, data: DataManager, agent: Agent, version: int) -> list[Sample]:
        kept: list[list[Sample]] = []
        for _ in range(self.max_filter_rounds if self.ledger.filter_zero_variance else 1):
            groups = data.sample_groups(data.prompts_per_step - len(kept))
            meters = [[0] for _ in groups]
            done = await gather_or_cancel(*(rollout_group(agent, g, m) for g, m in zip(groups, meters)))
            for group, meter in zip(done, meters):
                if self.ledger.keeps(group, meter[0]):
                    self.ledger.trains(group, meter[0])
                    kept.append(group)
            if len(kept) == data.prompts_per_step:
                break
        return [s for group in kept for s in group]

    async def sync_weights(self, engine: RolloutEngine, publish: Callable[[], Awaitable[None]],
                           version: int) -> None:
        """Nothing is generating between batches: publish right away."""
        await publish()

    def pop_counts(self) -> dict[str, float]:
        """Counts since the last call: samples rejected before reaching a batch, tokens
        generated but never trained."""
        return self.ledger.pop()

    def evaluating(self) -> AbstractAsyncContextManager[None]:
        """Nothing generates between batches: evaluation has the engine to itself."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state)

    async def aclose(self) -> None:
        """Nothing runs between calls."""
