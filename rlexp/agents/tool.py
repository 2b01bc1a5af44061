"""ToolAgent: the policy may call tools (JSON tool specs, Hermes-style `<tool_call>` blocks);
each result goes back as a `tool` message (loss mask 0) until it answers without a call,
or `max_turns` / `max_tool_calls` is reached. A malformed or failing call is answered with
an error message as the tool result, never a crash. A tool may return an image (`zoom`, for
a vision-language model): the tool message's content parts carry it to the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from rlexp.agents.single_turn import request_seed
from rlexp.chat.client import SessionStore
from rlexp.chat.images import images_of
from rlexp.chat.session import PrefixBreak
from rlexp.chat.tool_prompt import ToolPrompt
from rlexp.constraints import AtLeast0, AtLeast1, Positive
from rlexp.protocols import ImageTool, Judge, RolloutEngine
from rlexp.sample import Sample, SamplingConfig
from rlexp.tools import build_tools


class ToolAgent:
    sends_images = True  # a prompt's images reach the engine (config.py checks it for image data)

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, sampling: SamplingConfig | None = None,
                 max_turns: AtLeast1 = 4, max_tool_calls: AtLeast0 = 3,
                 tools: tuple[str, ...] = ("calculator", "python"), tool_timeout_s: Positive = 2.0,
                 on_prefix_break: PrefixBreak = "split", tool_prompt: ToolPrompt = "auto"):
        self.tools = build_tools(tools, timeout_s=tool_timeout_s)
        self.judge = judge
        self.sampling = sampling or engine.sampling
        self.max_turns, self.max_tool_calls = max_turns, max_tool_calls
        self.store = SessionStore(engine, tokenizer, engine.max_model_len, on_prefix_break,
                                  tool_prompt=tool_prompt)

    async def call_tool(self, name: str, arguments: str, images: Sequence[Any] = ()) -> tuple[Any, bool]:
        """(result: text, or content parts with images; ok). `images`: the conversation's so far,
        for a tool that reads them."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available: {', '.join(self.tools)}", False
        try:
            result = await (cast(ImageTool, tool)(arguments, images=images)
                            if getattr(tool, "reads_images", False) else tool(arguments))
        except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, OverflowError) as e:
            return f"error: {type(e).__name__}: {e}", False
        return result, not (isinstance(result, str) and result.startswith("error:"))

    async def rollout(self, sample: Sample) -> list[Sample]:
        messages = list(sample.prompt)
        specs = [t.spec for t in self.tools.values()]
        calls = errors = 0
        async with self.store.record(self.sampling) as rec:
            for turn in range(self.max_turns):
                seed = request_seed(self.sampling.seed, sample, turn)
                reply = await rec.client.chat.completions.create(messages=messages, tools=specs, seed=seed)
                msg = reply.choices[0].message
                messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
                if not msg.tool_calls or reply.choices[0].finish_reason == "length":
                    break
                for call in msg.tool_calls:
                    if calls >= self.max_tool_calls:
                        result, ok = f"error: tool call limit ({self.max_tool_calls}) reached", False
                    else:
                        result, ok = await self.call_tool(call.function.name, call.function.arguments,
                                                          images_of(messages))
                        calls += 1
                    errors += not ok
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": result})
        samples = rec.samples(sample)
        for s in samples:
            s.metadata["metrics"] |= {"tool/calls_mean": float(calls), "tool/errors": float(errors)}
            await self.judge.score(s)
        return samples

    async def aclose(self) -> None:
        """Nothing held between rollouts (tool calls run per call)."""
