"""Model judges (rlexp/judges/llm.py): a grader asked through an engine, a local reward model,
and their weighted sum with a rule."""

import asyncio

import pytest
import torch

from rlexp.errors import JudgeError
from rlexp.guards import JudgeGuard
from rlexp.judges.llm import LLMJudge, RewardModelJudge, WeightedJudge
from rlexp.judges.math_exact import MathExactJudge
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine


def _sample(response="12+34 is 46", answer="46"):
    return Sample(group_id=0, prompt=[{"role": "user", "content": "12+34="}], answer=answer,
                  response_text=response)


def test_the_grader_reply_becomes_a_scaled_reward_and_is_kept(tokenizer):
    engine = ScriptedEngine(tokenizer, ["7", "15", "no idea"])
    judge = LLMJudge(max_score=10)
    judge.bind(engine, tokenizer)
    s = asyncio.run(judge.score(_sample()))
    assert s.reward == pytest.approx(0.7) and s.reward_components == {"grade": pytest.approx(0.7)}
    asked = tokenizer.decode(engine.calls[0][0])
    assert "Reference answer: 46" in asked and "12+34 is 46" in asked  # the template, filled
    assert s.metadata["judge"] == {"prompt": s.metadata["judge"]["prompt"], "reply": "7"}
    assert s.metadata["metrics"]["judge/tokens"] == len(engine.calls[0][1])
    assert asyncio.run(judge.score(_sample())).reward == 1.0  # 15 is clipped to the top
    with pytest.raises(JudgeError, match="the grader's reply has no score"):  # fails the sample
        asyncio.run(JudgeGuard(judge).score(_sample()))


def test_weighted_judge_sums_and_takes_correct_from_the_rule(tokenizer):
    grader = LLMJudge()
    grader.bind(ScriptedEngine(tokenizer, ["4", "10"]), tokenizer)
    judge = WeightedJudge({"rule": MathExactJudge(), "grader": grader}, {"rule": 1.0, "grader": 0.5},
                          correct_from="rule")
    right = asyncio.run(judge.score(_sample()))
    assert right.reward == pytest.approx(1.0 + 0.5 * 0.4) and right.correct == 1.0
    assert right.reward_components["rule/correct"] == 1.0
    assert right.reward_components["grader/grade"] == pytest.approx(0.4)
    wrong = asyncio.run(judge.score(_sample(response="47")))
    assert wrong.reward == pytest.approx(0.5 * 1.0)
    assert wrong.correct == 0.0  # the grader's 10 is not correctness
    with pytest.raises(ValueError, match="name no judge"):
        WeightedJudge({"rule": MathExactJudge()}, {"rul": 1.0})


def test_reward_model_judge_scores_with_a_local_classifier(tiny_model_path, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1)
    config.pad_token_id = 0
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(config)
    rm.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.save_pretrained(tmp_path)
    judge = RewardModelJudge(str(tmp_path), weight=2.0, sigmoid=False)
    a, b = asyncio.run(judge.score(_sample("46"))), asyncio.run(judge.score(_sample("9")))
    text = tok.apply_chat_template([*a.prompt, {"role": "assistant", "content": "46"}], tokenize=False)
    with torch.no_grad():
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        direct = rm.eval()(input_ids=ids).logits
    assert a.reward_components["reward_model"] == pytest.approx(direct[0, 0].item(), abs=1e-5)
    assert a.reward == pytest.approx(2.0 * a.reward_components["reward_model"])
    assert a.reward != b.reward  # the reply is what it scores
    assert 0 < asyncio.run(RewardModelJudge(str(tmp_path), sigmoid=True).score(_sample())).reward < 1


def test_the_graders_calls_stay_out_of_the_training_sample(tokenizer):
    from rlexp.agents.single_turn import SingleTurnAgent

    engine = ScriptedEngine(tokenizer, ["46", "9"])  # the policy's reply, then the grader's
    grader = LLMJudge()
    grader.bind(engine, tokenizer)
    agent = SingleTurnAgent(engine, tokenizer, WeightedJudge({"rule": MathExactJudge(), "grader": grader},
                                                             correct_from="rule"))
    s = asyncio.run(agent.rollout(_sample(response="")))
    (policy_prompt, policy_reply), (grader_prompt, _) = engine.calls
    assert s.tokens == policy_prompt + policy_reply  # the sample: the policy's call alone
    assert sum(s.loss_mask) == len(policy_reply) and grader_prompt != policy_prompt
    assert s.reward == pytest.approx(1.0 + 0.9) and "Reference answer: 46" in s.metadata["judge"]["prompt"]


def test_an_endpoint_by_url_grades_through_the_openai_package(tokenizer):
    """`base_url`: the grader is any OpenAI-compatible endpoint. A minimal one here (FastAPI
    on a free port) records what it was asked and answers a grade; the judge sends the filled
    template with its sampling, and scores the reply."""
    import uvicorn
    from fastapi import FastAPI, Request

    asked: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        asked.append(await request.json())
        return {"id": "c", "object": "chat.completion", "created": 0, "model": "grader",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "Grade: 6"}}],
                "usage": {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}}

    async def go():
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            judge = LLMJudge(base_url=f"http://127.0.0.1:{port}/v1", model="grader", max_tokens=5)
            return await judge.score(_sample())
        finally:
            server.should_exit = True
            await task

    s = asyncio.run(go())
    (body,) = asked
    assert body["model"] == "grader" and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert "Reference answer: 46" in body["messages"][0]["content"]
    assert s.reward == pytest.approx(0.6) and s.metadata["judge"]["reply"] == "Grade: 6"
    assert s.metadata["metrics"]["judge/tokens"] == 3.0
