"""The HTTP server driven by the real `openai` package, on a scripted engine (through real
vLLM: test_server_vllm.py)."""

import asyncio
import copy
import json

import httpx
import openai
import pytest

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.errors import EngineDead, SessionError
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


USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
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


async def _streamed_and_not(base_url, store, body):
    """The same request, streamed and not, each in a session of its own: (chunks, reply, the
    two sessions' branches as tokens, logprobs and text)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    out = []
    for stream in (True, False):
        sid = store.open()
        kw = dict(model="policy", extra_body={"session_id": sid}, **body)
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw)]
        else:
            reply = await client.chat.completions.create(**kw)
        branches = [(list(b.trace.tokens), list(b.trace.logprobs), b.text) for b in store.close(sid).branches]
        out.append(branches)
    return chunks, reply, out


def _joined(chunks, index):
    """A choice's content and tool calls, put together from its chunks as a client does."""
    parts = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
    content = "".join(d.content or "" for d in parts)
    calls = [t for d in parts for t in d.tool_calls or []]
    return content, calls


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


# ---- parallel_tool_calls=false under "auto", and stop strings: replies cut token-aligned --------
def merged_tokenizer(*pairs: tuple[str, str]):
    """The tiny model's character-level tokenizer plus BPE merges of `pairs`, so that one token
    can straddle the place where a reply is cut."""
    from transformers import Qwen2Tokenizer

    from rlexp.models.tiny import CHARS, CHAT_TEMPLATE, SPECIAL_TOKENS, _byte_level

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab |= {_byte_level(c): len(SPECIAL_TOKENS) + i for i, c in enumerate(CHARS)}
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(pairs)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(pairs), eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


CALL2 = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'


def _assistant_turns(sample):
    """The trained spans of a sample: (tokens, logprobs) of each turn the policy wrote."""
    return [(sample.tokens[a:b], sample.logprobs[a:b]) for t in sample.turns if t["mask"]
            for a, b in [t["span"]]]


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
