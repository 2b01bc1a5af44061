"""OpenAIAgent (`agent=openai agent.entrypoint=package.module:function`): runs your own
agent code against the policy through an OpenAI-compatible client.

Your function is `async def fn(client, task) -> float | dict`. `client` behaves like
`openai.AsyncOpenAI` (in process, or the real package talking to rlexp's HTTP server with
`transport: http`); `task` has `messages` (OpenAI's format: an image is an `image_url` part
with a PNG data URL), `answer` and `metadata`. Return a float (the
reward) or a dict (kept as `metadata["info"]`, and the judge scores the last reply).
Every call your code makes is recorded token by token and becomes the training Sample(s)."""

from __future__ import annotations

import importlib
import inspect
from typing import Literal

import openai

from rlexp.chat.client import SessionStore
from rlexp.chat.images import openai_messages
from rlexp.chat.server import ChatServer
from rlexp.chat.session import PrefixBreak
from rlexp.chat.tool_prompt import ToolPrompt
from rlexp.protocols import Agent, Judge, RolloutEngine
from rlexp.sample import Sample, SamplingConfig


def load_entrypoint(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"agent.entrypoint must look like 'package.module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"agent.entrypoint {spec!r} cannot be loaded: {e}") from e
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.entrypoint {spec!r} must be an async function (client, task)")
    return fn


class OpenAIAgent(Agent):
    sends_images = True  # a prompt's images reach the engine (config.py checks it for image data)

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, entrypoint: str,
                 sampling: SamplingConfig | None = None,
                 transport: Literal["inprocess", "http"] = "inprocess", host: str = "127.0.0.1",
                 port: int = 0, api_key: str | None = None,
                 on_prefix_break: PrefixBreak = "split", tool_prompt: ToolPrompt = "auto"):
        self.fn = load_entrypoint(entrypoint)
        self.judge = judge
        self.sampling = sampling or engine.sampling
        self.transport, self.host, self.port, self.api_key = transport, host, port, api_key
        self.store = SessionStore(engine, tokenizer, engine.max_model_len, on_prefix_break,
                                  tool_prompt=tool_prompt)
        self.server: ChatServer | None = None
        self._http: openai.AsyncOpenAI | None = None  # one client for all sessions (transport=http)

    async def _http_client(self, sid: str):
        """The real `openai` package, against rlexp's server, for session `sid`."""
        if self._http is None:
            self.server = ChatServer(self.store, self.host, self.port, self.api_key)
            await self.server.start()
            self._http = openai.AsyncOpenAI(base_url=self.server.base_url, api_key=self.api_key or "unused",
                                            max_retries=0)
        # with_options shares the connection pool: no new connection per session
        return self._http.with_options(default_headers={"X-Session-Id": sid})

    async def rollout(self, sample: Sample) -> list[Sample]:
        task = {"messages": openai_messages(sample.prompt), "answer": sample.answer,
                "metadata": dict(sample.metadata)}
        async with self.store.record(self.sampling) as rec:
            client = rec.client if self.transport == "inprocess" else await self._http_client(rec.session_id)
            result = await self.fn(client, task)
        samples = rec.samples(sample)
        if not samples:
            raise RuntimeError(f"agent.entrypoint made no policy calls for sample {sample.uid}")
        for s in samples:
            if isinstance(result, (int, float)) and not isinstance(result, bool):
                s.reward = float(result)
                s.reward_components = {"agent_reward": float(result)}
            else:
                s.metadata["info"] = result
                await self.judge.score(s)
        return samples

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.server is not None:
            await self.server.stop()
            self.server = None
