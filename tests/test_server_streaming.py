"""Streamed replies on the HTTP server, on a scripted engine: a streamed reply is the plain
reply and is recorded the same; stop strings are left out of the reply, streamed or not, and
kept in the session, whose next turn extends them."""

import asyncio
import json

import openai
import pytest

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine
from tests.server_helpers import (
    CALL,
    TOOL,
    USER,
    _assistant_turns,
    _joined,
    _streamed_and_not,
    merged_tokenizer,
)


def test_a_streamed_reply_is_the_reply_and_is_recorded_the_same(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, CALL, "46", "46"])
    store = SessionStore(engine, tokenizer, max_context=512)
    tools = [TOOL]

    async def go():
        server = ChatServer(store)
        await server.start()
        try:
            a = await _streamed_and_not(server.base_url, store, dict(messages=USER, tools=tools))
            b = await _streamed_and_not(server.base_url, store, dict(messages=USER))
            return a, b
        finally:
            await server.stop()

    (chunks, reply, (streamed, plain)), (chunks2, reply2, (streamed2, plain2)) = asyncio.run(go())
    assert streamed == plain and streamed2 == plain2  # the sessions are the same
    content, calls = _joined(chunks, 0)
    assert calls[0].function.name == "calculator" == reply.choices[0].message.tool_calls[0].function.name
    assert json.loads(calls[0].function.arguments) == {"expression": "12+34"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert _joined(chunks2, 0)[0] == reply2.choices[0].message.content == "46"
    assert chunks2[-1].choices == [] and chunks2[-1].usage.completion_tokens == reply2.usage.completion_tokens


def test_stop_strings_are_left_out_of_the_reply_and_kept_in_the_session():
    """`stop`: the reply is the text before the stop string (OpenAI's), streamed or not; the
    session keeps the whole tokens generated up to the one that completed it ("ok", one token
    here), and the next turn, which sends back the shortened content, extends them."""
    tok = merged_tokenizer(("o", "k"))
    reply = "Sure, ok then."
    engine = ScriptedEngine(tok, [reply, reply, reply, "46", reply, reply])
    store = SessionStore(engine, tok, max_context=512)
    kept = tok.encode("Sure, ok", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(kept[-1]) == "ok"

    async def go():
        server = ChatServer(store)
        await server.start()
        try:
            chunks, plain, (streamed_session, plain_session) = await _streamed_and_not(
                server.base_url, store, dict(messages=USER, stop=["o"]))
            sid = store.open()
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "12+34="}]
            r1 = await client.chat.completions.create(model="policy", messages=messages, stop="o",
                                                      extra_body={"session_id": sid})
            messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "Sure?"}]
            await client.chat.completions.create(model="policy", messages=messages, stop="o",
                                                 extra_body={"session_id": sid})
            completion = dict(model="policy", prompt="12+34=", stop=["then", ","])
            completions = [await client.completions.create(**completion)]
            completions.append([c async for c in await client.completions.create(**completion, stream=True)])
            return chunks, plain, streamed_session == plain_session, store.close(sid), r1, completions
        finally:
            await server.stop()

    chunks, plain, same, session, r1, (completion, completion_chunks) = asyncio.run(go())
    assert plain.choices[0].message.content == "Sure, " == _joined(chunks, 0)[0]
    assert plain.choices[0].model_extra["token_ids"] == kept and plain.choices[0].finish_reason == "stop"
    assert same  # streamed or not, the session holds the same tokens
    assert r1.choices[0].message.content == "Sure, " and r1.choices[0].model_extra["token_ids"] == kept
    assert session.prefix_breaks == 0
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    prompt2, gen2 = engine.calls[3]
    assert sample.tokens == prompt2 + gen2 and prompt2[len(engine.calls[2][0]):][:len(kept)] == kept
    assert [t for t, _ in _assistant_turns(sample)] == [kept, gen2]
    # /v1/completions: the text before the earliest stop string, streamed or not
    assert completion.choices[0].text == "Sure" == "".join(c.choices[0].text for c in completion_chunks)
    assert completion.choices[0].model_extra["token_ids"] == tok.encode("Sure,", add_special_tokens=False)


class RejectingEngine(ScriptedEngine):
    """Refuses every request, as an engine's own input check does (a ValueError)."""

    async def generate(self, token_ids, sampling, images=None):
        raise ValueError("no such request")


def test_a_streamed_request_the_engine_rejects_is_a_400_before_any_chunk(tokenizer):
    """Streamed through the Protocol's `generate_streaming` (this engine cannot stream): the
    stream starts at the first tokens, so the rejection is an ordinary error answer."""
    store = SessionStore(RejectingEngine(tokenizer, []), tokenizer, max_context=512)

    async def go():
        server = ChatServer(store)
        await server.start()
        try:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            sid = store.open()
            with pytest.raises(openai.BadRequestError, match="the engine rejected the request"):
                await client.chat.completions.create(model="policy", messages=USER, stream=True,
                                                     extra_body={"session_id": sid})
            return store.close(sid)
        finally:
            await server.stop()

    assert asyncio.run(go()).branches == []
