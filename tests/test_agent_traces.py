"""Every agent through real vLLM, built from its config group as the loop builds it: each
trace turn's text is exactly what its token span decodes to (the trace artifact shows both),
and the multi-turn agent's "try again" follows its judge (agent=multiturn judge=math)."""

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.judges.math_exact import extract_answer, normalize
from rlexp.judges.math_verify import judge_text
from rlexp.loop import build_guarded
from rlexp.sample import Sample, SamplingConfig, Status
from tests.conftest import vllm_on_thread

pytestmark = pytest.mark.vllm
CONF = Path(__file__).resolve().parents[1] / "conf"
HANG_FAILSAFE_S = 600  # turns a rollout that never returns into a failure
FEEDBACK = "Incorrect, try again."
AGENTS = ["single_turn", "multiturn", "tool", "openai"]


@pytest.fixture(scope="module")
def vllm(tiny_model_path, tokenizer):
    """One real vLLM engine for the module, on an event loop in a background thread (the
    engine belongs to the loop it was made on); `run(coro)` runs a test's coroutine there."""
    with vllm_on_thread(tiny_model_path, HANG_FAILSAFE_S, seed=0, max_model_len=256, kv_cache_gb=0.25,
                        max_num_seqs=32, max_response_tokens=16) as (engine, run):
        yield SimpleNamespace(engine=engine, run=run, tokenizer=tokenizer)


def _rollouts(vllm, overrides: list[str], samples: list[Sample], **runtime) -> list[Sample]:
    """`samples` rolled out by the agent and judge the config groups name, guarded and built
    as in a run (`runtime`: more keyword arguments for the agent, such as `sampling`)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)

    async def go():
        judge = build_guarded(cfg, "judge", JudgeGuard)
        agent = build_guarded(cfg, "agent", AgentGuard, engine=vllm.engine, tokenizer=vllm.tokenizer,
                              judge=judge, **runtime)
        try:
            results = await asyncio.gather(*(agent.rollout(s) for s in samples))
        finally:
            await agent.aclose()
        return [s for r in results for s in (r if isinstance(r, list) else [r])]

    return vllm.run(go())


def _samples(prompts: int) -> list[Sample]:
    data = DataManager(ArithmeticSource(max_operand=29, ops="+", eval_size=10, seed=0),
                       prompts_per_step=prompts, samples_per_prompt=2, seed=0)
    return [s for group in data.sample_groups(prompts) for s in group]


@pytest.mark.parametrize("agent", AGENTS)
def test_every_trace_turn_is_its_decoded_span(vllm, agent):
    samples = _rollouts(vllm, [f"agent={agent}"], _samples(4))
    assert samples and all(s.status == Status.COMPLETED for s in samples)
    for s in samples:
        line = s.to_trace(vllm.tokenizer.decode)  # what the trace artifact holds
        spans = [t["span"] for t in line["turns"]]
        assert spans[0][0] == 0 and spans[-1][1] == len(line["token_ids"])
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # the turns tile the tokens
        assert line["turns"][0]["role"] == "prompt" and line["turns"][0]["text"]
        for turn in line["turns"]:
            start, end = turn["span"]
            assert turn["text"] == vllm.tokenizer.decode(line["token_ids"][start:end]), (agent, turn)


def _as_fraction(s: Sample) -> Sample:
    """The reference written as a LaTeX fraction of the same value: equivalent for math-verify,
    never equal as text."""
    s.answer = f"\\frac{{{2 * int(s.answer)}}}{{2}}"
    return s


def test_multiturn_feedback_follows_the_configured_judge(vllm):
    max_turns = 3
    # cooler than the engine's default, so that more answers are right (the case that differs)
    sampling = SamplingConfig(temperature=0.5, max_tokens=16, seed=0)
    samples = _rollouts(vllm, ["agent=multiturn", "judge=math", f"agent.max_turns={max_turns}"],
                        [_as_fraction(s) for s in _samples(16)], sampling=sampling)
    assert all(s.status == Status.COMPLETED for s in samples)
    stopped_by_equivalence = told_wrong = 0
    for s in samples:
        turns = s.turns
        replies = [i for i, t in enumerate(turns) if t["mask"]]
        verdicts = [judge_text(turns[i]["text"], s.answer)[0] for i in replies]
        for i, correct in zip(replies[:-1], verdicts):  # every reply but the last was answered
            assert not correct and FEEDBACK in turns[i + 1]["text"], (s.answer, turns[i]["text"])
        told_wrong += len(replies) - 1
        assert verdicts[-1] or len(replies) == max_turns or s.finish_reason == "length"
        if verdicts[-1] and len(replies) < max_turns:  # stopped at an answer math-verify takes as right
            plain = re.sub(r"<\|[^|]*\|>", "", turns[replies[-1]]["text"])
            stopped_by_equivalence += extract_answer(plain) != normalize(s.answer)
        assert s.reward_components["correct"] == float(verdicts[-1])
    # Exact matching would have answered those "Incorrect, try again." (so this test can tell),
    # and answers math-verify rejects were told so: both sides of the rule were exercised.
    seen = [(s.answer, [t["text"] for t in s.turns if t["mask"]]) for s in samples]
    assert stopped_by_equivalence > 0 and told_wrong > 0, seen
