"""agent=openai: user code with an OpenAI client, in process and over HTTP."""

import asyncio

import pytest

from rlexp.agents.openai_agent import OpenAIAgent, load_entrypoint
from rlexp.judges.math_exact import MathExactJudge
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine


async def returns_info(client, task):
    r = await client.chat.completions.create(model="policy", messages=task["messages"])
    return {"reply": r.choices[0].message.content}


async def no_calls(client, task):
    return 1.0


def _task():
    return Sample(group_id=5, prompt=[{"role": "user", "content": "12+34="}], answer="46",
                  metadata={"seed": 3})


@pytest.mark.parametrize("transport", ["inprocess", "http"])
def test_example_agent_traces_become_samples(tokenizer, transport):
    engine = ScriptedEngine(tokenizer, ["45", "46"])
    agent = OpenAIAgent(engine, tokenizer, MathExactJudge(), "rlexp.examples.openai_agent:solve",
                        transport=transport)

    async def go():
        try:
            return await agent.rollout(_task())
        finally:
            await agent.aclose()

    (s,) = asyncio.run(go())
    assert s.reward == 0.5  # right at the second attempt
    assert s.tokens == engine.calls[1][0] + engine.calls[1][1] and s.group_id == 5
    assert sum(s.loss_mask) == len(engine.calls[0][1]) + len(engine.calls[1][1])
    assert s.metadata["metrics"]["multiturn/turns_mean"] == 2.0


def test_dict_result_goes_to_the_judge(tokenizer):
    agent = OpenAIAgent(ScriptedEngine(tokenizer, ["46"]), tokenizer, MathExactJudge(),
                        "tests.test_openai_agent:returns_info")
    (s,) = asyncio.run(agent.rollout(_task()))
    assert s.metadata["info"] == {"reply": "46"} and s.reward == 1.0


def test_agent_that_never_calls_the_policy_fails_clearly(tokenizer):
    agent = OpenAIAgent(ScriptedEngine(tokenizer, []), tokenizer, MathExactJudge(),
                        "tests.test_openai_agent:no_calls")
    with pytest.raises(RuntimeError, match="made no policy calls"):
        asyncio.run(agent.rollout(_task()))


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "must look like"), ("nope.module:fn", "cannot be loaded"),
    ("tests.test_openai_agent:missing", "cannot be loaded"), ("json:dumps", "must be an async function"),
])
def test_bad_entrypoints(spec, message):
    with pytest.raises(ValueError, match=message):
        load_entrypoint(spec)
