"""EnvironmentAgent (`agent=environment agent.factory=package.module:Class`): the policy acts
in an environment written as a class, the shape TRL's `GRPOTrainer(environment_factory=...)`
takes; OpenEnvAgent (`agent=openenv`): the same, the class being an OpenEnv environment served
by OpenEnv's own server in its own venv (rlexp/envs/openenv.py).

Per rollout, one new instance of the class (`factory()`, no arguments):
- `reset(**row)` starts the episode from the dataset row: `prompt` (the messages), `answer`,
  and the row's metadata (`seed`: the sample's own); a `reset` that names its parameters gets
  only those. What it returns (text, or None) is appended to the last prompt message's
  content, as TRL does.
- Its public methods with a docstring are the tools (`reset`, `close`, `get_reward` and the
  reward attribute excepted): the OpenAI spec of each is `transformers.utils.get_json_schema`
  of the method (type-hinted arguments, a Google-style `Args:` section), as TRL builds them;
  an instance with a `tool_schemas` dict (method name -> spec) names its tools itself. The
  policy calls them through rlexp's tool loop (rlexp/agents/tool.py `converse`); sync methods
  run in a worker thread, async ones on the loop. A method that raises answers the call with
  "error: ..." (counted in `tool/errors`), except an OpenEnv session failure, which fails the
  rollout.
- The episode ends when a reply makes no call, at `max_turns` / `max_tool_calls`, or when the
  instance's `done` attribute (if it has one) turns true after a call. `tool_choice: required`:
  every reply is a call (guided decoding, rollout=vllm), as for an environment that is only
  ever acted in.
- Reward (`reward: environment`): the instance's `reward_attribute` after the episode (a number,
  or a method returning one, e.g. TRL's `get_reward`; None counts 0.0, a bool 0 or 1), component
  `environment`; `correct` is the instance's `correct` attribute if it has one, else whether
  the reward is at least 1.0. `reward: judge`: the run's judge scores the final reply instead.
- `close()`, if it has one, is called after the episode, whatever happened.

A class that does not import, cannot be built, or has no tools is a ConfigError when the agent
is built, before any rollout."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

from rlexp.agents.tool import converse
from rlexp.chat.client import SessionStore
from rlexp.chat.session import PrefixBreak
from rlexp.chat.tool_prompt import ToolPrompt
from rlexp.constraints import AtLeast0, AtLeast1, Positive
from rlexp.envs.openenv import OpenEnvEnvironment
from rlexp.envs.openenv_server import OpenEnvServer, release, shared_server
from rlexp.envs.openenv_session import OpenEnvError
from rlexp.errors import ConfigError, JudgeError
from rlexp.protocols import Agent, Judge, RolloutEngine, Tool
from rlexp.sample import Sample, SamplingConfig

log = logging.getLogger(__name__)
NOT_TOOLS = {"reset", "close", "get_reward", "tool_schemas"}
FAILS_THE_ROLLOUT = (OpenEnvError,)  # raised by a method: the rollout fails (else: error text)


def load_factory(spec: str) -> Callable[[], Any]:
    """`package.module:Class` (or `path/to/file.py:Class`) -> the class (any callable that
    makes an instance with no arguments); ConfigError naming what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"agent.factory must look like 'package.module:Class', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"no Python file at {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[path.stem] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except Exception as e:  # whatever importing the user's module raises
        raise ConfigError(f"agent.factory {spec!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if not callable(factory):
        raise ConfigError(f"agent.factory {spec!r} is not a class (got {type(factory).__name__})")
    return factory


class MethodTool:
    """An environment instance's method as a Tool: the call's JSON arguments as keywords, the
    result as text (a string as is, None as "", anything else as JSON)."""

    reads_images = False

    def __init__(self, method: Callable[..., Any], spec: dict[str, Any]):
        self.method, self.spec = method, spec
        self.signature = inspect.signature(method)

    async def __call__(self, arguments: str) -> str:
        try:
            kwargs = json.loads(arguments or "{}")
            if not isinstance(kwargs, dict):
                raise ValueError(f"arguments must be a JSON object, got {arguments!r}")
            self.signature.bind(**kwargs)
        except (ValueError, TypeError) as e:
            return f"error: bad arguments for {self.spec['function']['name']}: {e}"
        try:
            if inspect.iscoroutinefunction(self.method):
                result = await self.method(**kwargs)
            else:
                result = await asyncio.to_thread(self.method, **kwargs)
        except FAILS_THE_ROLLOUT:
            raise
        except Exception as e:  # the environment's answer to this call (TRL answers it the same way)
            return f"error: {type(e).__name__}: {e}"
        if result is None:
            return ""
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


def tool_specs(instance: Any, reward_attribute: str = "reward") -> dict[str, tuple[str, dict[str, Any]]]:
    """Tool name -> (method name, OpenAI spec) of an environment instance; ConfigError when a
    documented method's spec cannot be built."""
    explicit = getattr(instance, "tool_schemas", None)
    if explicit is not None:
        for method in explicit:
            if not callable(getattr(instance, method, None)):
                raise ConfigError(f"{type(instance).__name__}.tool_schemas names {method!r}, which is not "
                                  "one of its methods")
        return {spec["function"]["name"]: (method, spec) for method, spec in explicit.items()}
    from transformers.utils import get_json_schema

    out = {}
    for name in dir(type(instance)):
        if name.startswith("_") or name in NOT_TOOLS or name == reward_attribute:
            continue
        attr = inspect.getattr_static(instance, name)
        if not inspect.isfunction(attr) or not attr.__doc__:  # methods only (no properties), documented
            continue
        try:
            spec = get_json_schema(getattr(instance, name))
        except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(f"{type(instance).__name__}.{name}: no tool spec can be made of it "
                              f"({type(e).__name__}: {e}); give every argument a type hint and a line "
                              "in the docstring's Args: section") from None
        spec["function"].pop("return", None)  # not part of an OpenAI tool spec
        out[name] = (name, spec)
    return out


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A sync or async method's result (a sync one in a worker thread)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def _takes(fn: Callable[..., Any], row: dict[str, Any]) -> dict[str, Any]:
    """The keys of `row` that `fn` takes (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return row
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in row.items() if k in names}


def with_observation(prompt: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """The prompt with `reset`'s observation appended to its last message's content (TRL's
    rule: text to text; text or parts to parts)."""
    if observation is None or observation == "":
        return list(prompt)
    *before, last = prompt
    content = last["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [*before, {**last, "content": content + observation}]


class EnvironmentAgent(Agent):
    sends_images = True  # a prompt's images reach the engine (config.py checks it for image data)

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, factory: str | Callable[[], Any],
                 sampling: SamplingConfig | None = None, max_turns: AtLeast1 = 4,
                 max_tool_calls: AtLeast0 = 3, reward: Literal["environment", "judge"] = "environment",
                 reward_attribute: str = "reward", tool_choice: Literal["auto", "required"] = "auto",
                 on_prefix_break: PrefixBreak = "split", tool_prompt: ToolPrompt = "auto"):
        self.factory = load_factory(factory) if isinstance(factory, str) else factory
        self.judge, self.reward, self.reward_attribute = judge, reward, reward_attribute
        self.sampling = sampling or engine.sampling
        self.max_turns, self.max_tool_calls, self.tool_choice = max_turns, max_tool_calls, tool_choice
        self.store = SessionStore(engine, tokenizer, engine.max_model_len, on_prefix_break,
                                  tool_prompt=tool_prompt)
        self.name = getattr(self.factory, "__qualname__", repr(self.factory))
        try:  # a probe instance: its tools are every instance's
            probe = self.factory()
        except Exception as e:
            raise ConfigError(f"agent.factory: {self.name}() raised {type(e).__name__}: {e}") from None
        self.specs = tool_specs(probe, reward_attribute)
        if not self.specs:
            raise ConfigError(f"agent.factory: {self.name} has no tools: give it public methods with "
                              "docstrings (type-hinted arguments, an Args: section), as TRL's environments")
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"agent.factory: {self.name} has no reset(**row) method")
        log.info("environment %s: tools %s", self.name, ", ".join(self.specs))

    def tools(self, env: Any) -> dict[str, Tool]:
        return {name: MethodTool(getattr(env, method), spec) for name, (method, spec) in self.specs.items()}

    async def rollout(self, sample: Sample) -> list[Sample]:
        env = self.factory()
        try:
            row = {"prompt": sample.prompt, "answer": sample.answer, **sample.metadata}
            observation = await _call(env.reset, **_takes(env.reset, row))
            messages = with_observation(sample.prompt, observation)
            async with self.store.record(self.sampling) as rec:
                calls, errors = await converse(rec, sample, messages, self.tools(env), self.sampling,
                                               self.max_turns, self.max_tool_calls,
                                               ended=lambda: bool(getattr(env, "done", False)),
                                               tool_choice=self.tool_choice)
            samples = rec.samples(sample)
            components = await self.read_reward(env) if self.reward == "environment" else None
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    await _call(close)
        for s in samples:
            s.metadata["metrics"] |= {"tool/calls_mean": float(calls), "tool/errors": float(errors)}
            if components is None:
                await self.judge.score(s)
            else:
                s.reward, s.reward_components = components["environment"], dict(components)
        return samples

    async def read_reward(self, env: Any) -> dict[str, float]:
        """The episode's reward components as the instance holds them."""
        value = getattr(env, self.reward_attribute, None)
        if callable(value):
            value = await _call(value)
        value = 0.0 if value is None else float(value) if isinstance(value, bool) else value
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise JudgeError(f"{self.name}.{self.reward_attribute} is not a finite number after the "
                             f"episode: {value!r}")
        correct = getattr(env, "correct", None)
        correct = float(value >= 1.0) if correct is None or callable(correct) else float(bool(correct))
        return {"environment": float(value), "correct": correct}

    async def aclose(self) -> None:
        """Nothing held between rollouts (an instance lives for one)."""


class OpenEnvAgent(Agent):
    """An EnvironmentAgent over an OpenEnv environment (`environment`: "package.module:Class" of
    an OpenEnv `Environment` subclass, or "package.module:app" of a FastAPI app made with
    OpenEnv's `create_app`), served by OpenEnv's own server run by `python` (OpenEnv's venv),
    started when the agent is built and shared with the run's other agent (evaluation).
    `max_sessions`: episodes at once (rollouts beyond wait for one to end). `tool_name`: what
    the policy calls the step tool."""

    sends_images = False

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, environment: str,
                 python: str = ".venv-openenv/bin/python", max_sessions: AtLeast1 = 256,
                 start_timeout_s: Positive = 120.0, step_timeout_s: Positive = 60.0,
                 max_restarts: AtLeast0 = 3, tool_name: str = "step", sampling: SamplingConfig | None = None,
                 max_turns: AtLeast1 = 4, max_tool_calls: AtLeast0 = 3,
                 reward: Literal["environment", "judge"] = "environment",
                 tool_choice: Literal["auto", "required"] = "auto",
                 on_prefix_break: PrefixBreak = "split", tool_prompt: ToolPrompt = "auto"):
        server = shared_server(environment, python, max_sessions=max_sessions,
                               start_timeout_s=start_timeout_s, step_timeout_s=step_timeout_s,
                               max_restarts=max_restarts)
        self.server: OpenEnvServer | None = server
        try:
            episode = partial(OpenEnvEnvironment, server, tool_name)
            self.agent = EnvironmentAgent(engine, tokenizer, judge, episode, sampling, max_turns,
                                          max_tool_calls, reward, "reward", tool_choice, on_prefix_break,
                                          tool_prompt)
        except BaseException:
            release(server)
            raise
        self.agent.name = environment

    async def rollout(self, sample: Sample) -> list[Sample]:
        return await self.agent.rollout(sample)

    async def aclose(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.aclose_idle()
            await asyncio.to_thread(release, server)
