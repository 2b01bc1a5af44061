"""tool_choice on the HTTP server, on a scripted engine: "none" never yields a call, a forced
call follows its tool's schema (and the training data records the constraint), strict schemas
that no pattern can enforce are refused, and parallel_tool_calls=false under "auto" ends the
reply after its first call, token-aligned."""

import asyncio
import json

import openai
import pytest

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.errors import SessionError
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine
from tests.server_helpers import CALL, CALL2, TOOL, USER, _assistant_turns, merged_tokenizer


class ConstraintRecorder(ScriptedEngine):
    """Scripted replies; keeps the sampling each request was made with."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.sampling_seen = []

    async def generate(self, token_ids, sampling, images=None):
        self.sampling_seen.append(sampling)
        return await super().generate(token_ids, sampling)


def test_tool_choice_none_never_yields_a_call_and_forced_calls_follow_the_schema(tokenizer):
    import re

    engine = ConstraintRecorder(tokenizer, [CALL, CALL])
    store = SessionStore(engine, tokenizer, max_context=512)
    schema = {"type": "object", "required": ["expression"], "additionalProperties": False,
              "properties": {"expression": {"type": "string", "maxLength": 20}}}
    tools = [{"type": "function", "function": {"name": "calculator", "strict": True, "parameters": schema}}]
    sid = store.open()
    none = asyncio.run(store.chat(sid, {"messages": USER, "tools": tools, "tool_choice": "none"}))
    message = none["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == CALL  # the text, never parsed as a call
    assert engine.sampling_seen[0].constraint is None
    forced = asyncio.run(store.chat(sid, {"messages": USER, "tools": tools, "tool_choice": "required"}))
    assert forced["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "calculator"
    pattern = engine.sampling_seen[1].constraint.spec
    assert re.fullmatch(pattern, CALL)  # the scripted call is one the constraint allows...
    too_long = '{"expression": "' + "1" * 21 + '"}'
    for bad in ('{"expression": 12}', '{}', '{"expression": "1", "x": 1}', too_long):
        call = f'<tool_call>{{"name": "calculator", "arguments": {bad}}}</tool_call>'
        assert not re.fullmatch(pattern, call), bad
    records = [s.turns[-1].get("sampling") for s in store.close(sid).to_samples(Sample(0, [], ""))]
    assert records == [None, {"constraint": {"kind": "regex", "spec": pattern}}]  # ...and the data says so


def test_a_strict_schema_with_a_keyword_no_pattern_enforces_is_refused(tokenizer):
    store = SessionStore(ScriptedEngine(tokenizer, []), tokenizer, max_context=512)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}]
    where = r"tools.\[0\].function.parameters.properties.n.minimum"
    with pytest.raises(SessionError, match=where + ": a strict tool's schema may not use 'minimum'"):
        asyncio.run(store.chat(store.open(), {"messages": USER, "tools": tools, "tool_choice": "required"}))
    tools[0]["function"]["strict"] = False  # not strict: the schema as far as a pattern goes
    store.engine.replies = ['<tool_call>{"name": "f", "arguments": {"n": 0}}</tool_call>']
    r = asyncio.run(store.chat(store.open(), {"messages": USER, "tools": tools, "tool_choice": "required"}))
    assert r["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": ["n"]},  # found by the fuzz test: properties as a list
    {"type": "object", "anyOf": 7},
    {"type": "object", "allOf": {"a": {"type": "integer"}}},
])
def test_a_strict_schema_of_the_wrong_shape_is_a_400(tokenizer, parameters):
    store = SessionStore(ScriptedEngine(tokenizer, []), tokenizer, max_context=512)
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}]
    with pytest.raises(SessionError) as refused:
        asyncio.run(store.chat(store.open(), {"messages": USER, "tools": tools, "tool_choice": "required"}))
    assert refused.value.status == 400 and refused.value.param == "tools.[0].function.parameters"


# ---- parallel_tool_calls=false under "auto": the reply cut token-aligned ----------------
def test_parallel_tool_calls_false_under_auto_ends_the_reply_after_its_first_call():
    """The engine writes two calls; the reply is the first, cut right after its `</tool_call>`
    (">o" is one token here: kept whole), and only the kept tokens are recorded and trained.
    The next turn, through the `openai` package over HTTP, extends them without a prefix break."""
    tok = merged_tokenizer((">", "o"))
    first = "Sure. " + CALL + "ok " + CALL2
    engine = ScriptedEngine(tok, [first, "46", CALL])
    store = SessionStore(engine, tok, max_context=512)
    sid = store.open()

    async def go():
        server = ChatServer(store)
        await server.start()
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        try:
            messages = [{"role": "user", "content": "12+34="}]
            r1 = await client.chat.completions.create(
                model="policy", messages=messages, tools=[TOOL], tool_choice="auto",
                parallel_tool_calls=False, extra_body={"session_id": sid})
            msg = r1.choices[0].message
            messages += [msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                         {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "46"}]
            r2 = await client.chat.completions.create(  # tools without tool_choice: "auto"
                model="policy", messages=messages, tools=[TOOL], parallel_tool_calls=False,
                extra_body={"session_id": sid})
            # forced, as before: one call, the engine's reply whole (its end token included)
            r3 = await client.chat.completions.create(
                model="policy", messages=messages[:1], tools=[TOOL], tool_choice="required",
                parallel_tool_calls=False, extra_body={"session_id": store.open()})
            return r1, r2, r3
        finally:
            await server.stop()

    r1, r2, r3 = asyncio.run(go())
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and len(c1.message.tool_calls) == 1
    call = c1.message.tool_calls[0].function
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "12+34"}
    assert c1.message.content == "Sure."
    generated = engine.calls[0][1]
    kept = tok.encode("Sure. " + CALL + "o", add_special_tokens=False)  # ...</tool_call + ">o"
    assert tok.convert_ids_to_tokens(kept[-1]) == ">o" and generated[:len(kept)] == kept
    assert c1.model_extra["token_ids"] == kept and len(c1.logprobs.content) == len(kept)
    assert r1.usage.completion_tokens == len(kept)
    assert r2.choices[0].message.content == "46" and r2.choices[0].finish_reason == "stop"
    assert r3.choices[0].finish_reason == "tool_calls" and len(r3.choices[0].message.tool_calls) == 1
    assert r3.choices[0].model_extra["token_ids"] == engine.calls[2][1]  # not cut: ends with its end token
    session = store.close(sid)
    assert session.prefix_breaks == 0
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    prompt2, gen2 = engine.calls[1]
    assert sample.tokens == prompt2 + gen2
    assert prompt2[len(engine.calls[0][0]):][:len(kept)] == kept  # turn 2 extends the kept tokens
    assert _assistant_turns(sample) == [(kept, [-0.5] * len(kept)), (gen2, [-0.5] * len(gen2))]
    assert sum(sample.loss_mask) == len(kept) + len(gen2)  # the cut tokens are nowhere
    assert "<|im_start|>tool\n46<|im_end|>" in tok.decode(sample.tokens)
