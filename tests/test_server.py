"""The HTTP server driven by the real `openai` package, on a scripted engine: a conversation
with a tool call, bad requests answered as OpenAI answers them (a table), template and engine
errors, and the API key. tool_choice and strict schemas: test_server_tool_choice.py; streamed
replies and stop strings: test_server_streaming.py; through real vLLM: tests/server_vllm/."""

import asyncio
import copy
import json

import httpx
import pytest

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.errors import EngineDead, SessionError
from tests.fakes import ScriptedEngine
from tests.server_helpers import CALL, TOOL, USER, _check_stitching, three_turns_with_a_tool_call


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


# name, path, body (dict: JSON; bytes: sent as is), status, param, a phrase of the message
BAD_REQUESTS = [
    ("max_tokens < 1", "/chat/completions", {"messages": USER, "max_tokens": -3}, 400, "max_tokens",
     "greater than or equal to 1"),
    ("max_tokens a string", "/chat/completions", {"messages": USER, "max_tokens": "lots"}, 400,
     "max_tokens", "valid integer"),
    ("max_tokens beyond the context", "/chat/completions", {"messages": USER, "max_tokens": 10**9}, 400,
     "max_tokens", "at most"),
    ("max_completion_tokens beyond the context", "/chat/completions",
     {"messages": USER, "max_completion_tokens": 10**9}, 400, "max_completion_tokens", "at most"),
    ("temperature a string", "/chat/completions", {"messages": USER, "temperature": "hot"}, 400,
     "temperature", "valid number"),
    ("temperature < 0", "/chat/completions", {"messages": USER, "temperature": -0.5}, 400, "temperature",
     "greater than or equal to 0"),
    ("top_p = 0", "/chat/completions", {"messages": USER, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("top_p > 1", "/chat/completions", {"messages": USER, "top_p": 1.5}, 400, "top_p", "less than or equal"),
    ("n = 0", "/chat/completions", {"messages": USER, "n": 0}, 400, "n", "greater than or equal to 1"),
    ("seed a float", "/chat/completions", {"messages": USER, "seed": 1.5}, 400, "seed", "valid integer"),
    ("stop of 5 strings", "/chat/completions", {"messages": USER, "stop": list("abcde")}, 400, "stop",
     "at most 4"),
    ("message without content", "/chat/completions", {"messages": [{"role": "user"}]}, 400,
     "messages.[0].content", "needs 'content'"),
    ("message without role", "/chat/completions", {"messages": [{"content": "hi"}]}, 400,
     "messages.[0].role", "Field required"),
    ("unknown role", "/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.[0].role", "'user'"),
    ("content a number", "/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400,
     "messages.[0].content", "valid string"),
    ("no messages", "/chat/completions", {}, 400, "messages", "Field required"),
    ("messages empty", "/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("tool without a name", "/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {}}]}, 400, "tools.[0].function.name",
     "Field required"),
    ("tool_choice not in tools", "/chat/completions",
     {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "calc"}}}, 400,
     "tool_choice", "not in 'tools'"),
    ("stream_options without stream", "/chat/completions",
     {"messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when"),
    ("unknown model", "/chat/completions", {"messages": USER, "model": "no-such-model"}, 404, "model",
     "does not exist"),
    ("unknown session", "/chat/completions", {"messages": USER, "session_id": "zzz"}, 404, "session_id",
     "zzz"),
    ("no session", "/chat/completions", {"messages": USER, "session_id": None}, 400, "session_id",
     "X-Session-Id"),
    ("prompt over the context", "/chat/completions",
     {"messages": [{"role": "user", "content": "x" * 60}]}, 400, "messages", "context is 40"),
    ("not JSON", "/chat/completions", b"{oops", 400, None, "not valid JSON"),
    ("JSON nested too deep", "/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None,
     "not valid JSON"),
    ("body not an object", "/chat/completions", [1, 2], 400, None, "JSON object"),
    ("body over the size limit", "/chat/completions", {"messages": USER, "pad": "x" * 300_000}, 413, None,
     "over the limit"),
    ("completion: empty prompt", "/completions", {"prompt": ""}, 400, "prompt", "at least 1 character"),
    ("completion: token id out of vocabulary", "/completions", {"prompt": [1, 10**6]}, 400, "prompt",
     "not in the vocabulary"),
    ("completion: max_tokens beyond the context", "/completions", {"prompt": "1+1=", "max_tokens": 10**9},
     400, "max_tokens", "at most"),
    ("tokenize: neither messages nor prompt", "/../tokenize", {}, 400, None, "give one of"),
    ("a field rlexp does not know", "/chat/completions", {"messages": USER, "reasoning_effort": "high"}, 400,
     "reasoning_effort", "not a field rlexp knows"),
    ("a deprecated field that changes the reply", "/chat/completions",
     {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions", "not a field rlexp knows"),
    ("parallel_tool_calls not a boolean", "/chat/completions",
     {"messages": USER, "tools": [TOOL], "parallel_tool_calls": "false"}, 400, "parallel_tool_calls",
     "valid boolean"),
    ("json_schema format without its schema", "/chat/completions",
     {"messages": USER, "response_format": {"type": "json_schema"}}, 400, "response_format", "goes with"),
    ("unknown response_format type", "/chat/completions",
     {"messages": USER, "response_format": {"type": "yaml"}}, 400, "response_format.type", "'text'"),
    ("logit_bias key not a token id", "/chat/completions", {"messages": USER, "logit_bias": {"a": 1}}, 400,
     "logit_bias", "not a token id"),
    ("logit_bias token id out of vocabulary", "/chat/completions",
     {"messages": USER, "logit_bias": {"1000000": 1}}, 400, "logit_bias", "not in the vocabulary"),
    ("logit_bias beyond 100", "/chat/completions", {"messages": USER, "logit_bias": {"5": 101}}, 400,
     "logit_bias.5", "less than or equal to 100"),
    ("frequency_penalty beyond 2", "/chat/completions", {"messages": USER, "frequency_penalty": 2.5}, 400,
     "frequency_penalty", "less than or equal to 2"),
    ("top_logprobs beyond 20", "/chat/completions", {"messages": USER, "top_logprobs": 21}, 400,
     "top_logprobs", "less than or equal to 20"),
    ("completion: echo", "/completions", {"prompt": "1+1=", "echo": True}, 400, "echo", "False"),
    ("completion: best_of", "/completions", {"prompt": "1+1=", "best_of": 2}, 400, "best_of", "1"),
    ("completion: suffix", "/completions", {"prompt": "1+1=", "suffix": "x"}, 400, "suffix", "None"),
    ("unknown path", "/embeddings", {"input": "x"}, 404, None, "Not Found"),
]


def test_bad_requests_get_openai_style_4xx_and_leave_the_session_as_it_was(tokenizer):
    store = SessionStore(ScriptedEngine(tokenizer, ["7"]), tokenizer, max_context=40)

    async def go():
        server = ChatServer(store, max_body_bytes=200_000)
        await server.start()
        out = {}
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                sid = (await http.post("/sessions")).json()["session_id"]
                out["ok"] = await http.post("/chat/completions", json={"messages": USER, "model": "policy",
                                                                        "max_tokens": 5, "session_id": sid})
                for name, path, body, *_ in BAD_REQUESTS:
                    if isinstance(body, dict):
                        body = {"session_id": sid} | body
                    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                    out[name] = await http.post(path, **kw)
                root = server.base_url.removesuffix("/v1")
                out["models"] = await http.get("/models")
                out["tokenize"] = await http.post(f"{root}/tokenize", json={"messages": USER})
                out["health"] = await http.get(f"{root}/health")
        finally:
            await server.stop()
        return sid, out

    sid, out = asyncio.run(go())
    for name, _, _, status, param, needle in BAD_REQUESTS:
        r = out[name]
        print(f"| {name} | {r.status_code} | `{r.text}` |")
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param), name
        assert needle in error["message"] and error["type"] == "invalid_request_error", (name, error)
    assert out["unknown model"].json()["error"]["code"] == "model_not_found"
    # none of those touched the session (each would have been a prefix break): the valid
    # request before them is its only turn
    session = store.get(sid)
    assert out["ok"].status_code == 200 and out["ok"].json()["choices"][0]["message"]["content"] == "7"
    assert len(session.branches) == 1 and session.calls == 1 and session.prefix_breaks == 0
    assert out["models"].json()["data"][0]["id"] == "policy"
    assert out["tokenize"].json()["count"] == len(out["tokenize"].json()["tokens"]) > 0
    assert out["health"].json()["status"] == "ok"


def test_a_chat_template_error_is_a_400(tokenizer):
    """Templates raise on input they do not accept (jinja2's raise_exception, a missing key):
    that is the caller's error."""
    strict = copy.copy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('no system messages') }}{% endif %}"
                            "{{ m['content'] + m['extra'] }}{% endfor %}")
    store = SessionStore(ScriptedEngine(strict, []), strict, max_context=64)
    sid = store.open()
    for message, needle in [({"role": "system", "content": "x"}, "no system messages"),
                            ({"role": "user", "content": "x"}, "extra")]:
        with pytest.raises(SessionError, match=needle) as e:
            asyncio.run(store.chat(sid, {"messages": [message]}))
        assert e.value.status == 400 and "chat template" in str(e.value)
    assert store.get(sid).branches == []


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


def test_engine_errors_are_a_400_for_bad_input_and_a_503_for_a_dead_engine(tokenizer):
    class FailingEngine(ScriptedEngine):
        async def generate(self, token_ids, sampling, images=None):
            raise self.error

    engine = FailingEngine(tokenizer, [])
    store = SessionStore(engine, tokenizer, max_context=64)

    async def go():
        server = ChatServer(store)
        await server.start()
        out = []
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                for engine.error in (ValueError("token id 5000 is out of vocabulary"), EngineDead("it died")):
                    sid = (await http.post("/sessions")).json()["session_id"]
                    body = {"messages": USER, "session_id": sid}
                    out.append(await http.post("/chat/completions", json=body))
        finally:
            await server.stop()
        return out

    rejected, dead = asyncio.run(go())
    assert rejected.status_code == 400 and "out of vocabulary" in rejected.json()["error"]["message"]
    assert dead.status_code == 503 and dead.json()["error"]["type"] == "server_error"
    assert all(not s.branches for s in store.sessions.values())  # neither changed its session
