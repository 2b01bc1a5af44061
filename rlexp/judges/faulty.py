"""A judge that fails on purpose, for tests and fire drills (see rlexp/agents/faulty.py):

    python -m rlexp.run judge=faulty judge.raise_rate=0.1 judge.nan_rate=0.05 \\
        judge.hang_rate=0.05 judge.guard.timeout_s=1

It wraps a real judge and, per sample, raises, hangs (sleeps `hang_s`) or returns a NaN
reward at the given rates, fixed by `seed` and the sample's own seed."""

from __future__ import annotations

import asyncio

from rlexp.constraints import Fraction
from rlexp.errors import InjectedFault
from rlexp.faults import fault_draw
from rlexp.protocols import Judge
from rlexp.sample import Sample


class FaultyJudge(Judge):
    def __init__(self, inner: Judge, raise_rate: Fraction = 0.0, hang_rate: Fraction = 0.0,
                 nan_rate: Fraction = 0.0, hang_s: float = 3600.0, seed: int = 0):
        self.inner = inner
        self.rates = (raise_rate, hang_rate, nan_rate)
        self.hang_s = hang_s
        self.seed = seed

    async def score(self, sample: Sample) -> Sample:
        u = fault_draw(self.seed, sample, "judge")
        raise_rate, hang_rate, nan_rate = self.rates
        if u < raise_rate:
            raise InjectedFault("injected judge fault")
        if u < raise_rate + hang_rate:
            await asyncio.sleep(self.hang_s)
        sample = await self.inner.score(sample)
        if u < raise_rate + hang_rate + nan_rate:
            sample.reward = float("nan")
        return sample
