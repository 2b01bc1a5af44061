"""agent=environment (an environment class in the shape of TRL's `environment_factory`) and
agent=openenv (an OpenEnv environment served by OpenEnv's own server, in its own venv): the
class shape on scripted replies; the OpenEnv server's lifetime and faults (does not start,
killed mid-run, rlexp killed); both on one real vLLM engine, where every trace turn is its
decoded span and the reward trained on is the environment's own score of the same actions.

The OpenEnv tests need .venv-openenv (`make envs`); without it they fail, saying so."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from rlexp.agents.environment import EnvironmentAgent, OpenEnvAgent
from rlexp.chat.client import parse_tool_calls
from rlexp.config import check_arguments
from rlexp.envs import openenv_server, openenv_session
from rlexp.envs.openenv import OpenEnvEnvironment
from rlexp.envs.openenv_server import OpenEnvServer, shared_server
from rlexp.errors import ConfigError, JudgeError
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.judges.math_exact import MathExactJudge
from rlexp.loop import build_guarded
from rlexp.sample import Sample, Status
from rlexp.schedulers.sync import collect
from tests.conftest import vllm_on_thread
from tests.fakes import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
GUESS = "examples.environments.openenv_guess:GuessEnvironment"
SESSIONS = 4  # the module's OpenEnv server: episodes at once
HANG_FAILSAFE_S = 600


def _call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _task(answer="46", uid=0):
    return Sample(group_id=0, prompt=[{"role": "user", "content": "12+34="}], answer=answer,
                  uid=uid, metadata={"seed": 1 + uid})


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


# ---- OpenEnv: a real server, started from .venv-openenv ----------------------------------
@pytest.fixture(scope="module")
def openenv_python() -> str:
    if not OPENENV_PYTHON.is_file():
        pytest.fail(f"{OPENENV_PYTHON} is missing: run `make envs` (scripts/install_envs.sh openenv) "
                    "to create OpenEnv's venv", pytrace=False)
    return str(OPENENV_PYTHON)


SERVER_KW = dict(max_sessions=SESSIONS, start_timeout_s=120.0, step_timeout_s=60.0, max_restarts=3)


@pytest.fixture(scope="module")
def guess_server(openenv_python):
    """The module's OpenEnv server (agents built with the same settings share it)."""
    server = shared_server(GUESS, openenv_python, **SERVER_KW)
    yield server
    openenv_server.release(server)
    assert server.proc is None


async def _rollouts_then_close(agent, samples):
    """The samples rolled out at once, then the agent closed, on one event loop."""
    try:
        return [s for r in await asyncio.gather(*(agent.rollout(s) for s in samples)) for s in r]
    finally:
        await agent.aclose()


def _openenv_agent(engine, tokenizer, python, **kw):
    return OpenEnvAgent(engine, tokenizer, MathExactJudge(), GUESS, python=python, tool_name="calculator",
                        **{k: v for k, v in SERVER_KW.items() if k not in kw}, **kw)


class Episodes:
    """Counts the OpenEnv episodes under way at once (the most, how many in all) and the
    sessions (connections) opened for them."""

    def __init__(self, monkeypatch):
        self.now = self.most = self.total = self.connections = 0
        reset = OpenEnvEnvironment.reset
        close = OpenEnvEnvironment.close
        open_ = openenv_session.OpenEnvSession.open

        async def counted_reset(env, **row):
            observation = await reset(env, **row)  # it holds a session from here on
            self.now, self.total = self.now + 1, self.total + 1
            self.most = max(self.most, self.now)
            return observation

        async def counted_close(env):
            self.now -= env._session is not None
            await close(env)

        async def counted_open(session):
            self.connections += 1
            await open_(session)

        monkeypatch.setattr(OpenEnvEnvironment, "reset", counted_reset)
        monkeypatch.setattr(OpenEnvEnvironment, "close", counted_close)
        monkeypatch.setattr(openenv_session.OpenEnvSession, "open", counted_open)


class SlowEngine(ScriptedEngine):
    """Scripted replies, each after a pause (rollouts overlap), the same for every rollout."""

    def __init__(self, tokenizer, replies, pause_s=0.05):
        super().__init__(tokenizer, [])
        self.script, self.pause_s = replies, pause_s

    async def generate(self, token_ids, sampling, images=None):
        await asyncio.sleep(self.pause_s)
        starts = token_ids.count(self.tokenizer.convert_tokens_to_ids("<|im_start|>"))
        turn = (starts - 2) // 2  # user + assistant, then tool + assistant per turn
        self.replies = [self.script[min(turn, len(self.script) - 1)]]
        return await super().generate(token_ids, sampling, images)


def test_an_openenv_episode_action_schema_feedback_done_and_reward(tokenizer, guess_server, openenv_python):
    engine = ScriptedEngine(tokenizer, [_call("calculator", expression="12+33"),
                                        _call("calculator", expression="12+34"), "never asked"])
    agent = _openenv_agent(engine, tokenizer, openenv_python)
    assert agent.server is guess_server  # shared, not a second process
    spec = agent.agent.specs["calculator"][1]["function"]
    assert spec["description"] == "Guess the hidden number."
    assert list(spec["parameters"]["properties"]) == ["expression"]  # the Action's, less `metadata`
    (s,) = asyncio.run(_rollouts_then_close(agent, [_task()]))
    prompts = [tokenizer.decode(p) for p, _ in engine.calls]
    assert len(prompts) == 2 and "<|im_start|>tool\n45 is too low; 2 left<|im_end|>" in prompts[1]
    assert s.reward == 1.0 and s.correct == 1.0 and s.metadata["metrics"]["tool/calls_mean"] == 2.0
    assert guess_server.alive()  # the module still holds it


def test_an_invalid_action_is_the_tool_result_not_a_failure(tokenizer, guess_server, openenv_python):
    engine = ScriptedEngine(tokenizer, [_call("calculator", expression="twelve"), "0"])
    agent = _openenv_agent(engine, tokenizer, openenv_python)
    (s,) = asyncio.run(_rollouts_then_close(agent, [_task()]))
    assert "error: ValueError: Invalid message: expression: String should match pattern" in \
        tokenizer.decode(engine.calls[1][0])
    assert s.status == Status.COMPLETED and s.reward == 0.0 and s.metadata["metrics"]["tool/errors"] == 1.0


def test_rollouts_beyond_max_sessions_wait_for_one(tokenizer, guess_server, openenv_python, monkeypatch):
    episodes = Episodes(monkeypatch)
    engine = SlowEngine(tokenizer, [_call("calculator", expression="12+34"), "46"])
    agent = _openenv_agent(engine, tokenizer, openenv_python)
    samples = [_task(uid=i) for i in range(3 * SESSIONS)]
    results = asyncio.run(asyncio.wait_for(_rollouts_then_close(agent, samples), 120))
    assert all(s.reward == 1.0 for s in results)
    assert episodes.total == 3 * SESSIONS and episodes.most == SESSIONS and episodes.now == 0
    assert episodes.connections == SESSIONS  # a session that ended well serves the next episode


def test_a_server_that_does_not_start_is_a_one_line_error(tokenizer, openenv_python, tmp_path):
    with pytest.raises(ConfigError) as e:
        OpenEnvServer("examples.environments.no_such_env:Env", openenv_python, start_timeout_s=120).start()
    message = str(e.value)
    assert "did not start: ModuleNotFoundError: No module named 'examples.environments.no_such_env'" \
        in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="make envs") as e:
        _openenv_agent(ScriptedEngine(tokenizer, []), tokenizer, str(tmp_path / "no-venv/bin/python"))
    assert "\n" not in str(e.value)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # built as a run builds it
        cfg = compose("config", overrides=["agent=openenv", f"agent.environment={GUESS}",
                                           f"agent.python={tmp_path / 'no-venv/bin/python'}"])
    with pytest.raises(ConfigError, match="make envs"):  # its one line, not Hydra's wrapper
        build_guarded(cfg, "agent", AgentGuard, engine=ScriptedEngine(tokenizer, []), tokenizer=tokenizer,
                      judge=MathExactJudge())


def test_a_server_killed_mid_run_fails_the_rollouts_it_held_then_restarts(tokenizer, openenv_python):
    server = OpenEnvServer(GUESS, openenv_python, max_sessions=SESSIONS, max_restarts=1, step_timeout_s=30)
    server.start()
    gate = asyncio.Event()

    class GatedEngine(ScriptedEngine):
        async def generate(self, token_ids, sampling, images=None):
            await gate.wait()
            self.replies = [_call("calculator", expression="12+34")]
            return await super().generate(token_ids, sampling, images)

    engine = GatedEngine(tokenizer, [])
    agent = EnvironmentAgent(engine, tokenizer, MathExactJudge(),
                             partial(OpenEnvEnvironment, server, "calculator"))
    samples = [_task(uid=i) for i in range(3)]

    async def go():
        tasks = [asyncio.create_task(AgentGuard(agent).rollout(s)) for s in samples]
        while server.proc is None or not server.alive():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # every rollout holds its session, waiting for its reply
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        (failed,) = collect(samples, results)
        after = await agent.rollout(_task(uid=9))  # the server is started again for it
        await server.aclose_idle()
        return failed, after

    try:
        started = time.monotonic()
        failed, (after,) = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        server.stop()
    assert time.monotonic() - started < 90  # never a hang
    assert [s.status for s in failed] == [Status.FAILED] * 3
    assert all("session failed" in s.error and "exited with code -9" in s.error for s in failed), \
        failed[0].error
    assert server.restarts == 1 and after.status == Status.COMPLETED and after.reward == 1.0


CHILD = """
import sys, time
from rlexp.envs.openenv_server import OpenEnvServer
server = OpenEnvServer(sys.argv[1], sys.argv[2])
server.start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_server_exits_when_rlexp_is_killed(openenv_python):
    parent = subprocess.Popen([sys.executable, "-c", CHILD, GUESS, openenv_python], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.kill()  # SIGKILL: no cleanup runs in rlexp
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), f"the OpenEnv server (pid {pid}) outlived a killed rlexp"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# ---- one real vLLM engine ---------------------------------------------------------------
class PatternCounterEnv:
    """examples/environments/counter_env.py's CounterEnv, its tool's argument given a pattern
    (`tool_schemas`): under guided decoding the tiny model writes one or two digits there."""

    def __init__(self):
        from examples.environments.counter_env import CounterEnv

        self.inner = CounterEnv()
        self.tool_schemas = {"calculator": {"type": "function", "function": {
            "name": "calculator", "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "pattern": "^[0-9]{1,2}$"}},
                "required": ["expression"]}}}}

    def reset(self, **row):
        return self.inner.reset(**row)

    def calculator(self, expression: str) -> str:
        return self.inner.calculator(expression)

    @property
    def reward(self):  # graded, so that the rewards compared below differ from sample to sample
        return max(0.0, 1.0 - abs(self.inner.counter - self.inner.target) / 100)


@pytest.fixture(scope="module")
def vllm(tiny_model_path, tokenizer):
    with vllm_on_thread(tiny_model_path, HANG_FAILSAFE_S, seed=0, max_model_len=512, kv_cache_gb=0.25,
                        max_num_seqs=16, max_response_tokens=96) as (engine, run):
        yield SimpleNamespace(engine=engine, run=run, tokenizer=tokenizer)


def _rollouts(vllm, overrides, samples):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)

    async def go():
        judge = build_guarded(cfg, "judge", JudgeGuard)
        agent = build_guarded(cfg, "agent", AgentGuard, engine=vllm.engine, tokenizer=vllm.tokenizer,
                              judge=judge)
        try:
            results = await asyncio.gather(*(agent.rollout(s) for s in samples))
        finally:
            await agent.aclose()
        return [s for r in results for s in (r if isinstance(r, list) else [r])]

    return vllm.run(go())


def _samples(n):
    from rlexp.data.manager import DataManager
    from rlexp.data.sources import ArithmeticSource

    data = DataManager(ArithmeticSource(max_operand=29, ops="+", eval_size=10, seed=0),
                       prompts_per_step=n, samples_per_prompt=2, seed=0)
    return [s for group in data.sample_groups(n) for s in group]


def _check_trace(s, tokenizer):
    line = s.to_trace(tokenizer.decode)
    spans = [t["span"] for t in line["turns"]]
    assert spans[0][0] == 0 and spans[-1][1] == len(line["token_ids"])
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for turn in line["turns"]:
        start, end = turn["span"]
        assert turn["text"] == tokenizer.decode(line["token_ids"][start:end]), turn


def _actions(s):
    """The tool calls the policy made, in order, from its turns' text."""
    return [json.loads(c["function"]["arguments"]) for t in s.turns if t["mask"]
            for c in parse_tool_calls(t["text"])[1]]


def _row(s):
    return {"prompt": s.prompt, "answer": s.answer, **{k: v for k, v in s.metadata.items() if k == "seed"}}


@pytest.mark.vllm
def test_an_environment_class_on_vllm(vllm):
    overrides = ["agent=environment", "agent.factory=tests.test_environments:PatternCounterEnv",
                 "agent.tool_choice=required", "agent.max_turns=2", "agent.max_tool_calls=2"]
    samples = _rollouts(vllm, overrides, _samples(4))
    assert len(samples) == 8 and all(s.status == Status.COMPLETED for s in samples)
    for s in samples:
        _check_trace(s, vllm.tokenizer)
        actions = _actions(s)
        assert actions, s.turns  # every reply is a call (guided decoding)
        env = PatternCounterEnv()  # the environment's own score of the same actions
        env.reset(**_row(s))
        for action in actions:
            with contextlib.suppress(Exception):  # a call that raises was answered with its error
                env.calculator(**action)
        assert s.reward == env.reward and s.reward_components["correct"] == float(env.reward >= 1.0)
    assert len({s.reward for s in samples}) > 1  # not one constant


@pytest.mark.vllm
def test_an_openenv_server_on_vllm_with_concurrent_sessions(vllm, guess_server, monkeypatch):
    episodes = Episodes(monkeypatch)
    overrides = ["agent=openenv", f"agent.environment={GUESS}", f"agent.python={guess_server.python}",
                 "agent.tool_name=calculator", "agent.tool_choice=required", "agent.max_turns=3",
                 f"agent.max_sessions={SESSIONS}"]
    samples = _rollouts(vllm, overrides, _samples(8))
    assert len(samples) == 16 and all(s.status == Status.COMPLETED for s in samples)
    assert episodes.total == 16 and 1 < episodes.most <= SESSIONS and episodes.now == 0
    assert episodes.connections <= SESSIONS
    assert guess_server.alive()  # the agent gave it back; the module still holds it

    async def rescore(s):  # a fresh episode on the same server, the same row, the same actions
        env = OpenEnvEnvironment(guess_server, "calculator")
        await env.reset(**_row(s))
        observations = []
        try:
            for action in _actions(s):
                if env.done:
                    break
                observations.append(await env.step(**action))
        finally:
            await env.close()
        return env.reward, observations

    async def rescore_all():
        return await asyncio.gather(*(rescore(s) for s in samples))

    for s, (score, observations) in zip(samples, vllm.run(rescore_all())):
        _check_trace(s, vllm.tokenizer)
        assert s.reward == score, (s.turns, score)
        # every observation the policy was shown is the one the fresh episode gives
        shown = [t["text"] for t in s.turns[1:] if not t["mask"]]  # each before the next reply
        assert len(shown) == sum(t["mask"] for t in s.turns) - 1 and len(observations) >= len(shown)
        for text, observation in zip(shown, observations):
            assert f"<|im_start|>tool\n{observation}<|im_end|>" in text, (text, observation)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_whole_run_with_an_openenv_environment(tmp_path, tiny_model_path, openenv_python):
    from mlflow.tracking import MlflowClient

    from tests.conftest import TINY_KW

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    model = [f"model.{k}={v}" for k, v in TINY_KW.items() if not k.startswith("task_")]
    cmd = [sys.executable, "-m", "rlexp.run", "agent=openenv", f"agent.environment={GUESS}",
           f"agent.python={openenv_python}", "agent.tool_name=calculator", "agent.tool_choice=required",
           "agent.max_turns=2", "trainer.total_steps=2", "data.prompts_per_step=4",
           "data.samples_per_prompt=2",
           "data.source.max_operand=29", "evaluator.prompts=8", "evaluator.every_n_steps=2",
           "rollout.max_response_tokens=112", "rollout.max_model_len=512", "checkpoint.every_n_steps=0",
           f"model.cache_dir={Path(tiny_model_path).parent}", *model, f"logger.tracking_uri={uri}",
           f"logger.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/out"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    assert run.info.status == "FINISHED" and "eval/accuracy" in run.data.metrics
    assert run.data.metrics["samples/failed_frac"] == 0.0
    log = res.stdout + res.stderr
    started = [line for line in log.splitlines() if "OpenEnv server for" in line and ": pid " in line]
    assert len(started) == 1, log[-3000:]  # one server for the run: training and evaluation share it
    pid = int(started[0].split(": pid ")[1].split()[0])
    assert not _running(pid)  # gone with the run
