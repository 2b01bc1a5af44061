"""Agents and judges that fail on purpose, for tests and fire drills:

    python -m rlexp.run judge=faulty judge.raise_rate=0.1 judge.nan_rate=0.05 \\
        judge.hang_rate=0.05 judge.timeout_s=1 agent=faulty agent.raise_rate=0.1

Each wraps a real component and, per sample, raises, hangs (sleeps `hang_s`) or returns a
NaN reward at the given rates. Which samples fail is fixed by `seed` and the sample's own
seed, so a rerun (or a resumed run) fails the same samples."""

from __future__ import annotations

import asyncio
import random

from rlexp.sample import Sample


class InjectedFault(RuntimeError):
    """The error a faulty agent or judge raises on purpose."""


def _draw(seed: int, sample: Sample, salt: str) -> float:
    return random.Random(f"{seed}:{salt}:{sample.metadata.get('seed', sample.uid)}").random()


class FaultyJudge:
    def __init__(self, inner, raise_rate: float = 0.0, hang_rate: float = 0.0, nan_rate: float = 0.0,
                 hang_s: float = 3600.0, seed: int = 0):
        self.inner = inner
        self.rates = (raise_rate, hang_rate, nan_rate)
        self.hang_s = hang_s
        self.seed = seed

    async def score(self, sample: Sample) -> Sample:
        u = _draw(self.seed, sample, "judge")
        raise_rate, hang_rate, nan_rate = self.rates
        if u < raise_rate:
            raise InjectedFault("injected judge fault")
        if u < raise_rate + hang_rate:
            await asyncio.sleep(self.hang_s)
        sample = await self.inner.score(sample)
        if u < raise_rate + hang_rate + nan_rate:
            sample.reward = float("nan")
        return sample


class FaultyAgent:
    """`inner`: the wrapped agent's class or a partial of it (built with the same runtime
    arguments as any agent)."""

    def __init__(self, engine, tokenizer, judge, inner, sampling=None, raise_rate: float = 0.0,
                 hang_rate: float = 0.0, hang_s: float = 3600.0, seed: int = 0):
        self.agent = inner(engine=engine, tokenizer=tokenizer, judge=judge, sampling=sampling)
        self.raise_rate, self.hang_rate = raise_rate, hang_rate
        self.hang_s = hang_s
        self.seed = seed

    async def run(self, sample: Sample):
        u = _draw(self.seed, sample, "agent")
        if u < self.raise_rate:
            raise InjectedFault("injected agent fault")
        if u < self.raise_rate + self.hang_rate:
            await asyncio.sleep(self.hang_s)
        return await self.agent.run(sample)
