"""What may go wrong during a run, and the guards that keep one bad sample from stopping it.

Per sample (the run goes on and counts them; the reason is in the sample's trace, `error`):
- the agent raises             -> FAILED
- the agent hangs (timeout_s)  -> ABORTED
- the judge raises, hangs, or returns a reward that is not a finite number -> FAILED
Per run (the run stops with a clear message; it can be resumed from its last checkpoint):
- `RunStopped`: too many failed samples in a step, or the rollout engine died."""

from __future__ import annotations

import asyncio
import math

from rlexp.sample import Sample, Status


class RunStopped(RuntimeError):
    """The run cannot usefully go on; the message says why and how to resume."""


class EngineDead(RunStopped):
    """The rollout engine's process died; every request from now on would fail."""


class AgentGuard:
    """Wraps an agent: a run longer than `timeout_s` is cancelled and the sample ABORTED with
    the reason. Exceptions pass through (the scheduler marks the sample FAILED with them)."""

    def __init__(self, agent, timeout_s: float | None = None):
        self.agent = agent
        self.timeout_s = timeout_s

    async def run(self, sample: Sample):
        if self.timeout_s is None:
            return await self.agent.run(sample)
        try:
            return await asyncio.wait_for(self.agent.run(sample), self.timeout_s)
        except TimeoutError:
            sample.status = Status.ABORTED
            sample.metadata["error"] = f"agent timed out after {self.timeout_s:g}s (agent.timeout_s)"
            return sample

    def __getattr__(self, name):  # aclose, sampling, ... of the wrapped agent
        return getattr(self.agent, name)


class JudgeError(RuntimeError):
    """The judge could not score a sample (raised, hung, or returned a non-finite reward)."""


class JudgeGuard:
    """Wraps a judge: a timeout, an exception or a NaN/inf reward raises JudgeError with the
    reason, which fails that sample (not the run)."""

    def __init__(self, judge, timeout_s: float | None = None):
        self.judge = judge
        self.timeout_s = timeout_s

    async def score(self, sample: Sample) -> Sample:
        try:
            scored = await asyncio.wait_for(self.judge.score(sample), self.timeout_s)
        except TimeoutError:
            raise JudgeError(f"judge timed out after {self.timeout_s:g}s (judge.timeout_s)") from None
        except Exception as e:
            raise JudgeError(f"judge raised {type(e).__name__}: {e}") from e
        if not isinstance(scored.reward, (int, float)) or not math.isfinite(scored.reward):
            raise JudgeError(f"judge returned a reward that is not a finite number: {scored.reward!r}")
        return scored

    def __getattr__(self, name):
        return getattr(self.judge, name)


def fault_reason(e: BaseException) -> str:
    return str(e) if isinstance(e, JudgeError) else f"agent raised {type(e).__name__}: {e}"
