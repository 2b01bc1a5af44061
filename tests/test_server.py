"""The HTTP server driven by the real `openai` package."""

import asyncio
import json

import httpx
import openai
import pytest

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'


async def three_turns_with_a_tool_call(store: SessionStore, base_url: str, api_key: str = "unused"):
    """user -> assistant (tool call: forced with tool_choice="required") -> tool -> assistant
    -> user -> assistant."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    sid = (await client.post("/sessions", cast_to=httpx.Response)).json()["session_id"]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "12+34="}]
    replies = []
    for turn in range(3):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=tools, max_tokens=120, seed=turn,
            tool_choice="required" if turn == 0 else "auto", extra_body={"session_id": sid})
        replies.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if msg.tool_calls:
            call = msg.tool_calls[0]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "46"})
        elif turn < 2:
            messages.append({"role": "user", "content": "Are you sure?"})
    session = store.close(sid)
    return session, replies


def _check_stitching(session, engine_calls, tokenizer):
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    last_prompt, last_gen = engine_calls[-1]
    assert sample.tokens == last_prompt + last_gen  # exactly what the engine was given and made
    generated = set()
    for prompt, gen in engine_calls:  # every generation sits in the sample where it was made
        assert sample.tokens[len(prompt):len(prompt) + len(gen)] == gen
        generated |= set(range(len(prompt), len(prompt) + len(gen)))
    assert {i for i, m in enumerate(sample.loss_mask) if m} == generated
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    assert session.prefix_breaks == 0
    text = tokenizer.decode(sample.tokens)
    assert "<|im_start|>tool\n46<|im_end|>" in text
    return sample


def test_openai_package_three_turns_with_a_tool_call(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "46", "Yes, 46"])
    store = SessionStore(engine, tokenizer, max_context=512)

    async def go():
        server = ChatServer(store)
        await server.start()
        try:
            return await three_turns_with_a_tool_call(store, server.base_url)
        finally:
            await server.stop()

    session, replies = asyncio.run(go())
    assert replies[0].choices[0].finish_reason == "tool_calls"
    call = replies[0].choices[0].message.tool_calls[0].function
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "12+34"}
    assert replies[1].choices[0].message.content == "46"
    sample = _check_stitching(session, engine.calls, tokenizer)
    # logprobs line up: -0.5 on every generated token (the scripted engine's value), 0 elsewhere
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [-0.5] * sum(sample.loss_mask)
    # the response carries the token-level fields the verifiers library reads
    r = replies[2]
    assert r.prompt_token_ids == engine.calls[2][0] and r.choices[0].token_ids == engine.calls[2][1]


def test_bad_requests_get_openai_style_4xx(tokenizer):
    store = SessionStore(ScriptedEngine(tokenizer, []), tokenizer, max_context=40)

    async def go():
        server = ChatServer(store)
        await server.start()
        out = {}
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                sid = (await http.post("/sessions")).json()["session_id"]
                user = [{"role": "user", "content": "hi"}]
                out["no messages"] = await http.post("/chat/completions", json={"session_id": sid})
                out["unknown session"] = await http.post("/chat/completions",
                                                         json={"session_id": "zzz", "messages": user})
                out["no session"] = await http.post("/chat/completions", json={"messages": user})
                out["too long"] = await http.post("/chat/completions", headers={"X-Session-Id": sid},
                                                  json={"messages": [{"role": "user", "content": "x" * 60}]})
                out["not json"] = await http.post("/chat/completions", content=b"{oops")
                out["models"] = await http.get("/models")
                root = server.base_url.removesuffix("/v1")
                out["tokenize"] = await http.post(f"{root}/tokenize", json={"messages": user})
                out["health"] = await http.get(f"{root}/health")
        finally:
            await server.stop()
        return out

    out = asyncio.run(go())
    for name, status, needle in [("no messages", 400, "non-empty list"), ("unknown session", 404, "zzz"),
                                 ("no session", 400, "session_id"), ("too long", 400, "context is 40"),
                                 ("not json", 400, "not valid JSON")]:
        r = out[name]
        assert r.status_code == status, name
        assert needle in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    assert out["models"].json()["data"][0]["id"] == "policy"
    assert out["tokenize"].json()["count"] == len(out["tokenize"].json()["tokens"]) > 0
    assert out["health"].json()["status"] == "ok"


def test_non_loopback_needs_an_api_key_and_checks_it(tokenizer):
    store = SessionStore(ScriptedEngine(tokenizer, ["7"]), tokenizer, max_context=128)
    with pytest.raises(ValueError, match="without an api_key"):
        ChatServer(store, host="0.0.0.0")

    async def go():
        server = ChatServer(store, host="127.0.0.1", api_key="s3cret")
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                denied = await http.get("/models")
                allowed = await http.get("/models", headers={"Authorization": "Bearer s3cret"})
        finally:
            await server.stop()
        return denied, allowed

    denied, allowed = asyncio.run(go())
    assert denied.status_code == 401 and allowed.status_code == 200


class RecordingEngine:
    """Wraps a real engine; records exactly the tokens it was given and generated."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.sampling, self.max_model_len = engine.sampling, engine.max_model_len

    @property
    def version(self):
        return self.engine.version

    async def generate(self, token_ids, sampling):
        gen = await self.engine.generate(token_ids, sampling)
        self.calls.append((list(token_ids), list(gen.token_ids)))
        return gen


@pytest.mark.vllm
def test_openai_package_over_http_with_real_vllm(tiny_model_path, tokenizer):
    from rlexp.rollout.vllm_engine import VLLMEngine

    async def go():
        engine = VLLMEngine(tiny_model_path, seed=0, max_model_len=512, kv_cache_gb=0.25, max_num_seqs=8)
        recorder = RecordingEngine(engine)
        store = SessionStore(recorder, tokenizer, max_context=512)
        server = ChatServer(store)
        await server.start()
        try:
            session, replies = await three_turns_with_a_tool_call(store, server.base_url)
        finally:
            await server.stop()
            engine.shutdown()
        return recorder, session, replies

    recorder, session, replies = asyncio.run(go())
    assert len(recorder.calls) == 3
    first = replies[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "calculator"
    sample = _check_stitching(session, recorder.calls, tokenizer)
    # the logprobs in the sample are the ones vLLM returned, token for token
    for r, (prompt, gen) in zip(replies, recorder.calls):
        got = [sample.logprobs[len(prompt) + i] for i in range(len(gen))]
        assert got == [c.logprob for c in r.choices[0].logprobs.content]
        assert all(lp <= 0.0 for lp in got)
