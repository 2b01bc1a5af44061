"""An agent that fails on purpose, for tests and fire drills (its judge twin:
rlexp/judges/faulty.py):

    python -m rlexp.run agent=faulty agent.raise_rate=0.1 agent.hang_rate=0.05 agent.guard.timeout_s=2

It wraps a real agent and, per sample, raises or hangs (sleeps `hang_s`) at the given rates.
Which samples fail is fixed by `seed` and the sample's own seed, so a rerun (or a resumed
run) fails the same samples."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlexp.constraints import Fraction
from rlexp.errors import InjectedFault
from rlexp.faults import fault_draw
from rlexp.protocols import Agent, Judge, RolloutEngine
from rlexp.sample import Sample, SamplingConfig


class FaultyAgent(Agent):
    """`inner`: the wrapped agent's class or a partial of it (built with the same runtime
    arguments as any agent)."""

    sends_images = False

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, inner: Callable[..., Agent],
                 sampling: SamplingConfig | None = None, raise_rate: Fraction = 0.0,
                 hang_rate: Fraction = 0.0, hang_s: float = 3600.0, seed: int = 0):
        self.agent = inner(engine=engine, tokenizer=tokenizer, judge=judge, sampling=sampling)
        self.raise_rate, self.hang_rate = raise_rate, hang_rate
        self.hang_s = hang_s
        self.seed = seed

    async def rollout(self, sample: Sample) -> Sample | list[Sample]:
        u = fault_draw(self.seed, sample, "agent")
        if u < self.raise_rate:
            raise InjectedFault("injected agent fault")
        if u < self.raise_rate + self.hang_rate:
            await asyncio.sleep(self.hang_s)
        return await self.agent.rollout(sample)

    async def aclose(self) -> None:
        await self.agent.aclose()
