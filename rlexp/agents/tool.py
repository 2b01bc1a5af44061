"""ToolAgent: the policy may call tools (JSON tool specs, Hermes-style `<tool_call>` blocks);
each result goes back as a `tool` message (loss mask 0) until it answers without a call,
or `max_turns` / `max_tool_calls` is reached. A malformed or failing call is answered with
an error message as the tool result, never a crash. A tool may return an image (`zoom`, for
a vision-language model): the tool message's content parts carry it to the engine.
The turn loop (`converse`) is shared with agent=environment (rlexp/agents/environment.py),
whose tools are an environment instance's methods."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from rlexp.agents.single_turn import request_seed
from rlexp.chat.client import Recording, SessionStore
from rlexp.chat.images import images_of
from rlexp.chat.session import PrefixBreak
from rlexp.chat.tool_prompt import ToolPrompt
from rlexp.constraints import AtLeast0, AtLeast1, Positive
from rlexp.protocols import Agent, ImageTool, Judge, RolloutEngine, Tool
from rlexp.sample import Sample, SamplingConfig
from rlexp.tools import build_tools


class ToolAgent(Agent):
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

    async def rollout(self, sample: Sample) -> list[Sample]:
        messages = list(sample.prompt)
        async with self.store.record(self.sampling) as rec:
            calls, errors = await converse(rec, sample, messages, self.tools, self.sampling,
                                           self.max_turns, self.max_tool_calls)
        samples = rec.samples(sample)
        for s in samples:
            s.metadata["metrics"] |= {"tool/calls_mean": float(calls), "tool/errors": float(errors)}
            await self.judge.score(s)
        return samples

    async def aclose(self) -> None:
        """Nothing held between rollouts (tool calls run per call)."""


async def call_tool(tools: Mapping[str, Tool], name: str, arguments: str,
                    images: Sequence[Any] = ()) -> tuple[Any, bool]:
    """Call the tool `name` of `tools` with `arguments` (its call's JSON text): (result: text,
    or content parts with images; ok). An unknown tool, bad arguments or an error the tool
    raises for its input is answered as "error: ..." text, never raised."""
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; available: {', '.join(tools)}", False
    try:
        result = await (cast(ImageTool, tool)(arguments, images=images)
                        if tool.reads_images else tool(arguments))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, OverflowError) as e:
        return f"error: {type(e).__name__}: {e}", False
    return result, not (isinstance(result, str) and result.startswith("error:"))


async def converse(rec: Recording, sample: Sample, messages: list[dict[str, Any]], tools: Mapping[str, Tool],
                   sampling: SamplingConfig, max_turns: int, max_tool_calls: int,
                   ended: Callable[[], bool] = lambda: False, tool_choice: str = "auto") -> tuple[int, int]:
    """THE tool-calling turn loop (agent=tool, agent=environment): the policy replies to
    `messages` through `rec`'s client with `tools`' specs; each call's result goes back as a
    `tool` message, until a reply makes no call, is cut at the length limit, `max_turns`
    replies were made, or `ended()` (an environment's episode is over) after a reply's calls.
    `tool_choice` "required": every reply is one call (the engine's guided decoding).
    `messages` grows in place. Returns (tool calls made, calls answered with an error)."""
    specs = [t.spec for t in tools.values()]
    choice = {} if tool_choice == "auto" else {"tool_choice": tool_choice}
    calls = errors = 0
    for turn in range(max_turns):
        seed = request_seed(sampling.seed, sample, turn)
        reply = await rec.client.chat.completions.create(messages=messages, tools=specs, seed=seed, **choice)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not msg.tool_calls or reply.choices[0].finish_reason == "length":
            break
        for call in msg.tool_calls:
            if calls >= max_tool_calls:
                result, ok = f"error: tool call limit ({max_tool_calls}) reached", False
            else:
                result, ok = await call_tool(tools, call.function.name, call.function.arguments,
                                             images_of(messages))
                calls += 1
            errors += not ok
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": result})
        if ended():
            break
    return calls, errors
