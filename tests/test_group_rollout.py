"""A prompt group rolled out at once (`Agent.rollout_group`, `RolloutEngine.generate_group`)
gives every sample what its own `rollout` gives; failures stay per sample. Orchestration on a
seeded fake engine: the vLLM side (one request with n, the same replies) is
tests/test_engines.py::test_a_groups_requests_go_out_as_one_and_each_sample_gets_its_own_requests_tokens."""

from __future__ import annotations

import asyncio
import random

import pytest

from rlexp.agents.single_turn import SingleTurnAgent
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.guards import AgentGuard
from rlexp.judges.math_exact import MathExactJudge
from rlexp.protocols import Judge, RolloutEngine
from rlexp.rollout.accounting import BusyMeter
from rlexp.sample import Generation, Sample, SamplingConfig, Status
from rlexp.schedulers.sync import rollout_group


class SeededEngine(RolloutEngine):
    """A reply drawn from the request's seed (the same seed: the same reply, in any order);
    counts `generate_group` calls and the samples each asked for."""

    def __init__(self, tokenizer, fail: bool = False):
        self.sampling = SamplingConfig(1.0, 1.0, 6, 11)
        self.max_model_len, self.version, self.busy = 256, 0, BusyMeter()
        self.vocab = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
        self.groups: list[int] = []
        self.fail = fail

    async def generate(self, token_ids, sampling, images=None) -> Generation:
        if self.fail:
            raise ConnectionError("engine unreachable")
        rng = random.Random(sampling.seed)
        ids = [rng.choice(self.vocab) for _ in range(rng.randint(1, sampling.max_tokens))]
        return Generation(ids, [-rng.random() for _ in ids], "stop", [self.version] * len(ids))

    async def generate_group(self, token_ids, samplings):
        self.groups.append(len(samplings))
        return await super().generate_group(token_ids, samplings)


class RaisesFor(Judge):
    """MathExactJudge, raising for one sample uid."""

    def __init__(self, uid: int):
        self.uid, self.inner = uid, MathExactJudge()

    async def score(self, sample: Sample) -> Sample:
        if sample.uid == self.uid:
            raise ValueError(f"cannot grade sample {sample.uid}")
        return await self.inner.score(sample)


def _groups(n: int = 3) -> list[list[Sample]]:
    data = DataManager(ArithmeticSource(max_operand=9, ops="+", eval_size=10, seed=0),
                       prompts_per_step=n, samples_per_prompt=4, seed=0)
    return data.sample_groups(n)


def _outcome(s: Sample | BaseException):
    if isinstance(s, BaseException):
        return repr(s)
    return (s.uid, s.status, s.response_text, s.reward, s.finish_reason, s.tokens, s.loss_mask, s.logprobs)


def test_a_group_at_once_gives_each_sample_what_its_own_rollout_gives(tokenizer):
    engine = SeededEngine(tokenizer)
    agent = SingleTurnAgent(engine, tokenizer, MathExactJudge())

    async def both():
        at_once = [await agent.rollout_group(g) for g in _groups()]
        one_by_one = [[await agent.rollout(s) for s in g] for g in _groups()]
        return at_once, one_by_one

    at_once, one_by_one = asyncio.run(both())
    assert engine.groups == [4, 4, 4]  # one generate_group call per group, for all 4 samples
    assert [[_outcome(s) for s in g] for g in at_once] == [[_outcome(s) for s in g] for g in one_by_one]
    replies = {s.response_text for g in at_once for s in g}
    assert len(replies) > 3 and all(s.status == Status.COMPLETED for g in at_once for s in g)


def test_a_judge_failure_fails_its_sample_and_an_engine_failure_every_sample(tokenizer):
    group = _groups(1)[0]
    judged = SingleTurnAgent(SeededEngine(tokenizer), tokenizer, RaisesFor(group[1].uid))
    results = asyncio.run(judged.rollout_group(group))
    assert [type(r).__name__ for r in results] == ["Sample", "ValueError", "Sample", "Sample"]
    assert results[0] is group[0] and results[2] is group[2]

    down = SingleTurnAgent(SeededEngine(tokenizer, fail=True), tokenizer, MathExactJudge())
    results = asyncio.run(down.rollout_group(_groups(1)[0]))
    assert [repr(r) for r in results] == [repr(ConnectionError("engine unreachable"))] * 4


@pytest.mark.parametrize("timeout_s, at_once", [(None, True), (30.0, False)])
def test_the_scheduler_hands_the_guarded_agent_a_group_unless_its_timeout_is_per_sample(tokenizer, timeout_s,
                                                                                       at_once):
    engine = SeededEngine(tokenizer)
    agent = AgentGuard(SingleTurnAgent(engine, tokenizer, MathExactJudge()), timeout_s=timeout_s)
    meter = [0]
    done = asyncio.run(rollout_group(agent, _groups(1)[0], meter))
    assert agent.rolls_out_groups is at_once
    assert engine.groups == ([4] if at_once else [])
    assert len(done) == 4 and all(s.status == Status.COMPLETED for s in done)
