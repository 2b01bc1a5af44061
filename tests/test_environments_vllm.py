"""agent=openenv on the module's shared OpenEnv server (scripted replies: the action schema,
feedback, `done` and the reward; an invalid action; more rollouts than sessions), then both
environment agents on one real vLLM engine, where every trace turn is its decoded span and the
reward trained on is the environment's own score of the same actions.

The scripted OpenEnv tests are here, not in test_openenv_server.py, so that the module's server
(`guess_server`) starts once. They need .venv-openenv (`make envs`); without it they fail,
saying so."""

import asyncio
import contextlib
import json
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from rlexp.chat.client import parse_tool_calls
from rlexp.envs import openenv_server, openenv_session
from rlexp.envs.openenv import OpenEnvEnvironment
from rlexp.envs.openenv_server import shared_server
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.loop import build_guarded
from rlexp.sample import Status
from tests.conftest import vllm_on_thread
from tests.environment_helpers import CONF, GUESS, SERVER_KW, SESSIONS, _call, _openenv_agent, _task
from tests.fakes import ScriptedEngine

HANG_FAILSAFE_S = 600


# ---- OpenEnv: the module's server, started from .venv-openenv, on scripted replies ------
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
    overrides = ["agent=environment", "agent.factory=tests.test_environments_vllm:PatternCounterEnv",
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
