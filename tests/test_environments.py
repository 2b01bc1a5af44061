"""agent=environment: an environment class in the shape of TRL's `environment_factory`, on
scripted replies (tools from its documented methods, the reward read from the instance, `done`,
the errors a class that cannot be used gives), and the config groups of both environment agents.

The OpenEnv server's lifetime and faults: test_openenv_server.py; both agents on the module's
OpenEnv server and one real vLLM engine: test_environments_vllm.py."""

import asyncio
import sys

import pytest
from hydra import compose, initialize_config_dir

from rlexp.agents.environment import EnvironmentAgent
from rlexp.config import check_arguments
from rlexp.errors import ConfigError, JudgeError
from rlexp.judges.math_exact import MathExactJudge
from rlexp.sample import Status
from tests.environment_helpers import CONF, GUESS, ROOT, _call, _task
from tests.fakes import ScriptedEngine


class Notebook:
    """A TRL-style environment: documented public methods are its tools, sync or async."""

    def __init__(self):
        self.lines: list[str] = []
        self.answer, self.reward = "", 0.0

    def reset(self, prompt, answer, **row):
        self.answer, self.lines, self.reward = answer, [], 0.0
        return f" (hint: {len(answer)} digits)"

    def write(self, text: str) -> str:
        """Write a line.

        Args:
            text: the line
        """
        self.lines.append(text)
        self.reward = float(text == self.answer)
        return f"{len(self.lines)} lines"

    async def read(self, line: int = 0) -> str:
        """Read a line back.

        Args:
            line: its number, from 0
        """
        await asyncio.sleep(0)
        return self.lines[line]

    def explode(self) -> str:
        """Raise, always."""
        raise RuntimeError("boom")

    def helper(self):  # no docstring: not a tool
        return 1

    def _private(self):
        """Private: not a tool."""

    @property
    def size(self) -> int:
        """A property: not a tool."""
        return len(self.lines)


class Once:
    """One move ends the episode (`done`); TRL's `get_reward()`; a `reset` that takes no row."""

    def __init__(self):
        self.done, self.score, self.closed = False, None, False

    def reset(self):
        return None

    async def move(self, text: str) -> str:
        """Make the one move.

        Args:
            text: any text
        """
        self.done, self.score = True, 0.5
        return "over"

    def get_reward(self):
        return self.score

    def close(self):
        Once.closed_ones = getattr(Once, "closed_ones", 0) + 1


class NoTools:
    def reset(self, **row):
        return None

    def undocumented(self, x: int) -> int:
        return x


class Untyped:
    def reset(self, **row):
        return None

    def act(self, x):
        """Act.

        Args:
            x: something
        """


class Broken:
    def __init__(self):
        raise OSError("no database here")


class NaNReward(Notebook):
    def reset(self, **row):
        self.reward = float("nan")


def _agent(tokenizer, replies, factory=Notebook, **kw):
    engine = ScriptedEngine(tokenizer, replies)
    return engine, EnvironmentAgent(engine, tokenizer, MathExactJudge(), factory, **kw)


def test_public_documented_methods_are_the_tools_with_transformers_schemas(tokenizer):
    _, agent = _agent(tokenizer, [])
    assert set(agent.specs) == {"write", "read", "explode"}
    assert agent.specs["write"][1] == {"type": "function", "function": {
        "name": "write", "description": "Write a line.",
        "parameters": {"type": "object", "required": ["text"],
                       "properties": {"text": {"type": "string", "description": "the line"}}}}}
    read = agent.specs["read"][1]["function"]["parameters"]
    assert read["properties"]["line"]["type"] == "integer" and "required" not in read


def test_reset_observation_tools_and_the_reward_read_from_the_instance(tokenizer):
    engine, agent = _agent(tokenizer, [_call("write", text="46"), _call("read", line=0), "46"],
                           "tests.test_environments:Notebook")
    (s,) = asyncio.run(agent.rollout(_task()))
    prompts = [tokenizer.decode(p) for p, _ in engine.calls]
    # reset's observation is appended to the last prompt message, as TRL does
    assert "<|im_start|>user\n12+34= (hint: 2 digits)<|im_end|>" in prompts[0]
    assert "<|im_start|>tool\n1 lines<|im_end|>" in prompts[1]  # a sync method's result
    assert "<|im_start|>tool\n46<|im_end|>" in prompts[2]  # an async method's
    assert s.status == Status.COMPLETED and s.reward == 1.0
    assert s.reward_components == {"environment": 1.0, "correct": 1.0}
    assert s.metadata["metrics"]["tool/calls_mean"] == 2.0 and s.metadata["metrics"]["tool/errors"] == 0.0
    assert sum(s.loss_mask) == sum(len(g) for _, g in engine.calls)


def test_a_raising_method_or_bad_arguments_answer_the_call_with_an_error(tokenizer):
    replies = [_call("explode"), _call("read", line=5), _call("write", words="46"), "0"]
    engine, agent = _agent(tokenizer, replies, max_tool_calls=4)
    (s,) = asyncio.run(agent.rollout(_task()))
    prompts = [tokenizer.decode(p) for p, _ in engine.calls]
    assert "error: RuntimeError: boom" in prompts[1]
    assert "error: IndexError: list index out of range" in prompts[2]
    assert "error: bad arguments for write" in prompts[3]
    assert s.status == Status.COMPLETED and s.metadata["metrics"]["tool/errors"] == 3.0
    assert s.reward == 0.0 and s.correct == 0.0


def test_done_ends_the_episode_trl_get_reward_and_close(tokenizer):
    engine, agent = _agent(tokenizer, [_call("move", text="x"), "never asked"], Once,
                           reward_attribute="get_reward")
    assert set(agent.specs) == {"move"}  # get_reward and close are not tools
    (s,) = asyncio.run(agent.rollout(_task()))
    assert len(engine.calls) == 1  # done after the first call: no second reply
    assert s.reward == 0.5 and s.reward_components == {"environment": 0.5, "correct": 0.0}
    assert Once.closed_ones >= 1


def test_reward_judge_scores_the_last_reply_instead(tokenizer):
    _, agent = _agent(tokenizer, [_call("write", text="1"), "46"], reward="judge")
    (s,) = asyncio.run(agent.rollout(_task()))
    assert s.reward == 1.0 and "environment" not in s.reward_components  # the judge's, not the notebook's


def test_a_reward_that_is_not_a_number_fails_the_sample(tokenizer):
    _, agent = _agent(tokenizer, ["46"], NaNReward)
    with pytest.raises(JudgeError, match="NaNReward.reward is not a finite number after the episode: nan"):
        asyncio.run(agent.rollout(_task()))


def test_a_factory_given_as_a_file_path(tokenizer):
    engine, agent = _agent(tokenizer, [_call("calculator", expression="12+34"), "46"],
                           str(ROOT / "examples/environments/counter_env.py") + ":CounterEnv")
    (s,) = asyncio.run(agent.rollout(_task()))
    assert "<|im_start|>tool\n46<|im_end|>" in tokenizer.decode(engine.calls[1][0])
    assert s.reward == 1.0


@pytest.mark.parametrize("factory, says", [
    ("tests.no_such_module:Env", "cannot be loaded: ModuleNotFoundError"),
    ("tests.test_environments:Missing", "cannot be loaded: AttributeError"),
    ("tests.test_environments", "must look like 'package.module:Class'"),
    ("tests.test_environments:NoTools", "has no tools"),
    ("tests.test_environments:Untyped", "Untyped.act: no tool spec can be made of it"),
    ("tests.test_environments:Broken", "Broken() raised OSError: no database here"),
])
def test_a_class_that_cannot_be_used_is_a_one_line_config_error_when_built(tokenizer, factory, says):
    with pytest.raises(ConfigError) as e:
        _agent(tokenizer, [], factory)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_config_groups_compose_and_check_and_openenv_is_never_imported():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for overrides in (["agent=environment", "agent.factory=examples.environments.counter_env:CounterEnv"],
                          ["agent=openenv", f"agent.environment={GUESS}"]):
            cfg = compose("config", overrides=overrides)
            check_arguments(cfg)  # every key an argument, every value one its signature allows
            assert cfg.agent.guard.timeout_s is None
    assert "openenv" not in sys.modules  # rlexp speaks OpenEnv's protocol; it never imports it
