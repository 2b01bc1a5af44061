"""Request fields the server accepts and ignores as harmless (docs/agents.md's table): with
them the engine is asked the same and the session records the same, on a scripted engine
over HTTP with the real `openai` package."""

import asyncio

import openai

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from tests.fakes import ScriptedEngine
from tests.test_server import USER

IGNORED = {"user": "u-1", "safety_identifier": "s-1", "metadata": {"team": "rl"}, "store": True,
           "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
           "prediction": {"type": "content", "content": "46"}, "logprobs": True}


def test_fields_ignored_as_harmless_change_nothing_the_engine_is_asked_or_the_session_records(tokenizer):
    """docs/agents.md lists these as accepted and ignored: the engine gets the same prompt and
    sampling with them as without, and the sessions are the same."""
    engine = ScriptedEngine(tokenizer, ["46", "46"])
    store = SessionStore(engine, tokenizer, max_context=512)

    async def go():
        server = ChatServer(store)
        await server.start()
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        try:
            sessions = []
            for extra in ({}, IGNORED):
                sid = store.open()
                await client.chat.completions.create(model="policy", messages=USER, seed=3, max_tokens=20,
                                                     extra_body={"session_id": sid, **extra})
                sessions.append([(list(b.trace.tokens), list(b.trace.logprobs), b.text, b.trace.turns)
                                 for b in store.close(sid).branches])
            return sessions
        finally:
            await server.stop()

    plain, with_ignored = asyncio.run(go())
    assert plain == with_ignored
    assert engine.calls[0][0] == engine.calls[1][0] and engine.samplings[0] == engine.samplings[1]
