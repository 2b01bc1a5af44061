"""Tools, the sandbox, and the tool / multi-turn agents (scripted engine, real tokenizer)."""

import asyncio

import pytest

from rlexp.agents.multiturn import MultiTurnAgent
from rlexp.agents.tool import ToolAgent
from rlexp.judges.math_exact import MathExactJudge, MultiTurnJudge
from rlexp.sample import Sample
from rlexp.tools.calculator import calculate
from rlexp.tools.python_sandbox import run_sandboxed
from tests.fakes import ScriptedEngine

# Reach real `sys` from inside the sandbox through a class's function globals (a classic escape).
SYS = ("[c.__init__.__globals__ for c in ().__class__.__base__.__subclasses__() if "
       "c.__init__.__class__.__name__ == 'function' and 'sys' in c.__init__.__globals__][0]['sys']")


def test_calculator():
    assert calculate("(12 + 34) * 2 - 7 // 2") == 89
    for bad in ("__import__('os')", "x + 1", "2 ** 1000"):
        with pytest.raises(ValueError):
            calculate(bad)


@pytest.mark.parametrize("expression, expected", [
    ("2 ** 10 + sqrt(16)", "1028.0"),
    ("open('/etc/passwd').read()", "error: NameError"),
    (SYS + ".modules['io'].open('/etc/passwd').read()", "error: PermissionError: sandbox: open"),
    (SYS + ".modules['builtins'].__import__('socket').socket()", "error: PermissionError: sandbox: import"),
    (SYS + ".modules['posix'].listdir('/')", "error: PermissionError: sandbox: os.listdir"),
    ("sum(i for i in range(10 ** 12))", "error: timed out after 1.0s"),
    ("'a' * (10 ** 10)", "error: MemoryError"),
])
def test_python_sandbox_refuses_files_sockets_and_runaway_code(expression, expected):
    # A loaded machine may take seconds to start the child: only the runaway code gets the
    # short bound it is meant to hit (it would run for hours).
    timeout_s = 1.0 if "timed out" in expected else 60.0
    assert asyncio.run(run_sandboxed(expression, timeout_s=timeout_s)).startswith(expected)


def test_python_sandbox_limits_are_set_by_the_child_not_preexec_fn(monkeypatch):
    """`preexec_fn` runs Python between fork and exec, which can deadlock a process with
    threads (the loop's fit thread, MLflow's logging threads): the child sets its own limits."""
    calls = []
    real = asyncio.create_subprocess_exec

    async def recording(*args, **kwargs):
        calls.append(kwargs)
        return await real(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording)
    big = "len('a' * (300 << 20))"  # 300 MB
    assert asyncio.run(run_sandboxed(big, timeout_s=60.0, memory_mb=1024)) == str(300 << 20)
    assert asyncio.run(run_sandboxed(big, timeout_s=60.0, memory_mb=256)).startswith("error: MemoryError")
    assert calls and all("preexec_fn" not in kw for kw in calls)


def _task(answer="46"):
    return Sample(group_id=0, prompt=[{"role": "user", "content": "12+34="}], answer=answer,
                  metadata={"seed": 1})


def test_tool_agent_round_trip_and_masks(tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "46"])
    agent = ToolAgent(engine, tokenizer, MathExactJudge())
    (s,) = asyncio.run(agent.rollout(_task()))
    (p1, g1), (p2, g2) = engine.calls
    assert s.tokens == p2 + g2 and p2[: len(p1) + len(g1)] == p1 + g1
    tool_text = tokenizer.decode(p2[len(p1) + len(g1):])
    assert "<|im_start|>tool\n46<|im_end|>" in tool_text  # the tool result, mask 0
    assert sum(s.loss_mask) == len(g1) + len(g2)
    assert s.reward == 1.0 and s.metadata["metrics"]["tool/calls_mean"] == 1.0
    assert s.metadata["metrics"]["tool/errors"] == 0.0


def test_tool_agent_answers_bad_calls_with_errors(tokenizer):
    replies = ['<tool_call>{oops</tool_call>',
               '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "python", "arguments": {"expression": "1/0"}}</tool_call>',
               '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>']
    engine = ScriptedEngine(tokenizer, replies)
    agent = ToolAgent(engine, tokenizer, MathExactJudge(), max_turns=4, max_tool_calls=3)
    (s,) = asyncio.run(agent.rollout(_task()))
    prompts = [tokenizer.decode(p) for p, _ in engine.calls]
    assert "error: unknown tool 'invalid'" in prompts[1]
    assert "error: unknown tool 'nope'" in prompts[2]
    assert "ZeroDivisionError" in prompts[3]
    # three bad calls, then a fourth refused by max_tool_calls=3
    assert s.metadata["metrics"]["tool/errors"] == 4.0 and s.metadata["metrics"]["tool/calls_mean"] == 3.0
    assert s.status.value == "completed"


def test_multiturn_agent_feedback_and_discounted_reward(tokenizer):
    engine = ScriptedEngine(tokenizer, ["45", "47", "46"])
    agent = MultiTurnAgent(engine, tokenizer, MultiTurnJudge(discount=0.5), max_turns=3)
    (s,) = asyncio.run(agent.rollout(_task()))
    assert len(engine.calls) == 3
    assert tokenizer.decode(engine.calls[1][0]).count("Incorrect, try again.") == 1
    assert s.reward_components["turn_1"] == 0.0 and s.reward_components["turn_3"] == 1.0
    assert s.reward == pytest.approx(0.25)
    assert s.metadata["metrics"]["multiturn/turns_mean"] == 3.0


def test_multiturn_agent_stops_when_right(tokenizer):
    engine = ScriptedEngine(tokenizer, ["46", "0"])
    (s,) = asyncio.run(MultiTurnAgent(engine, tokenizer, MultiTurnJudge()).rollout(_task()))
    assert len(engine.calls) == 1 and s.reward == 1.0


class RuleJudge:
    """A judge with its own rule of correctness, recording what it was asked to score."""

    def __init__(self, correct_replies: set[str]):
        self.correct_replies = correct_replies
        self.seen: list[str] = []

    async def score(self, s):
        reply = s.response_text.removesuffix("<|im_end|>")  # a reply's text keeps its stop token
        self.seen.append(reply)
        s.reward = float(reply in self.correct_replies)
        s.reward_components = {"correct": s.reward}
        return s


@pytest.mark.parametrize("replies, correct, calls", [
    (["0.5", "1/2"], {"0.5"}, 1),  # right by the judge's rule, though not the reference's text
    (["1/2", "0.5"], {"0.5"}, 2),  # the reference's text, wrong by the judge's rule: feedback
])
def test_multiturn_agent_asks_its_judge_whether_an_answer_is_correct(tokenizer, replies, correct, calls):
    engine = ScriptedEngine(tokenizer, replies)
    judge = RuleJudge(correct)
    (s,) = asyncio.run(MultiTurnAgent(engine, tokenizer, judge, max_turns=3).rollout(_task(answer="1/2")))
    assert len(engine.calls) == calls and s.reward == 1.0
    assert judge.seen[:calls] == replies[:calls]  # each reply judged once as it came, then the sample
    feedback = [tokenizer.decode(prompt).count("Incorrect, try again.") for prompt, _ in engine.calls]
    assert feedback == list(range(calls))
