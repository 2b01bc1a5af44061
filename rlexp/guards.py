"""Guards that keep one bad sample from stopping a run.

Per sample, environment faults (the run goes on and counts them; the reason is in the
sample's trace, `error`):
- the agent raises             -> FAILED
- the agent hangs (timeout_s)  -> ABORTED
- the judge raises, hangs, or returns a reward that is not a finite number -> FAILED
Per run (`RunStopped`, see rlexp/errors.py): too many failed samples in a step, the rollout
engine died, or an agent or judge raised one of `PROGRAMMING_ERRORS`: those mean the code is
wrong, not the environment, and stop the run at once with their traceback.

Each guard is configured by the `guard` sub-node of its component's config group, whose keys
are the guard's arguments (`agent.guard.timeout_s=5`)."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from annotated_types import Gt

from rlexp.errors import JudgeError
from rlexp.protocols import Agent, Judge, RolloutEngine
from rlexp.rollout.accounting import conversation
from rlexp.sample import Sample, Status

Timeout = Annotated[float, Gt(0)] | None

# Errors that mean an agent's or judge's code is wrong. Everything else an agent or judge
# raises (timeouts, HTTP and tool errors, a reply it cannot parse) is an environment fault.
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, ImportError, SyntaxError, NotImplementedError)


class AgentGuard(Agent):
    """Wraps an agent: a rollout longer than `timeout_s` is cancelled and the sample ABORTED
    with the reason. Exceptions pass through (the scheduler marks the sample FAILED with them)."""

    def __init__(self, agent: Agent, timeout_s: Timeout = None):
        self.agent = agent
        self.timeout_s = timeout_s
        # A group at once where the agent can: a timeout is per sample (the samples one by one)
        self.rolls_out_groups = timeout_s is None and getattr(agent, "rolls_out_groups", False)

    async def rollout(self, sample: Sample) -> Sample | list[Sample]:
        conversation.set(sample)  # this task's requests are one conversation (a pool routes on it)
        if self.timeout_s is None:
            return await self.agent.rollout(sample)
        try:
            return await asyncio.wait_for(self.agent.rollout(sample), self.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            sample.status = Status.ABORTED
            sample.metadata["error"] = f"agent timed out after {self.timeout_s:g}s (agent.guard.timeout_s)"
            return sample

    async def rollout_group(self, samples: list[Sample]) -> list[Sample | list[Sample] | BaseException]:
        if not self.rolls_out_groups:
            return await super().rollout_group(samples)
        return await self.agent.rollout_group(samples)

    async def aclose(self) -> None:
        await self.agent.aclose()


class JudgeGuard(Judge):
    """Wraps a judge: a timeout, an exception or a NaN/inf reward raises JudgeError with the
    reason, which fails that sample (not the run). `PROGRAMMING_ERRORS` pass through."""

    def __init__(self, judge: Judge, timeout_s: Timeout = None):
        self.judge = judge
        self.timeout_s = timeout_s

    def bind(self, engine: RolloutEngine, tokenizer: Any) -> None:
        self.judge.bind(engine, tokenizer)

    async def score(self, sample: Sample) -> Sample:
        try:
            scored = await asyncio.wait_for(self.judge.score(sample), self.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            raise JudgeError(f"judge timed out after {self.timeout_s:g}s (judge.guard.timeout_s)") from None
        except PROGRAMMING_ERRORS:
            raise
        except Exception as e:
            raise JudgeError(f"judge raised {type(e).__name__}: {e}") from e
        if not isinstance(scored.reward, (int, float)) or not math.isfinite(scored.reward):
            raise JudgeError(f"judge returned a reward that is not a finite number: {scored.reward!r}")
        return scored


def fault_reason(e: BaseException) -> str:
    return str(e) if isinstance(e, JudgeError) else f"agent raised {type(e).__name__}: {e}"


GUARDS: dict[str, type] = {"agent": AgentGuard, "judge": JudgeGuard}  # group -> its `guard` sub-node's class
