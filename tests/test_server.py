"""The HTTP server driven by the real `openai` package."""

import asyncio
import copy
import json
import threading
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    ("stream=true", "/chat/completions", {"messages": USER, "stream": True}, 400, "stream", "not supported"),
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


@pytest.fixture(scope="module")
def vllm_server(tiny_model_path, tokenizer):
    """One real vLLM engine behind the HTTP server for the module, on an event loop in a
    background thread, so that tests can call it with blocking clients."""
    from rlexp.rollout.vllm_engine import VLLMEngine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def start():
        engine = VLLMEngine(tiny_model_path, seed=0, max_model_len=512, kv_cache_gb=0.25, max_num_seqs=8)
        store = SessionStore(RecordingEngine(engine), tokenizer, max_context=512)
        server = ChatServer(store, max_body_bytes=1 << 20)
        await server.start()
        return engine, store, server

    engine, store, server = run(start())
    yield SimpleNamespace(run=run, store=store, recorder=store.engine, server=server)
    run(server.stop())
    engine.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


@pytest.mark.vllm
def test_openai_package_over_http_with_real_vllm(vllm_server, tokenizer):
    recorder = vllm_server.recorder
    recorder.calls.clear()
    chat = three_turns_with_a_tool_call(vllm_server.store, vllm_server.server.base_url)
    session, replies = vllm_server.run(chat)
    assert len(recorder.calls) == 3
    first = replies[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "calculator"
    sample = _check_stitching(session, recorder.calls, tokenizer)
    # the logprobs in the sample are the ones vLLM returned, token for token
    for r, (prompt, gen) in zip(replies, recorder.calls):
        got = [sample.logprobs[len(prompt) + i] for i in range(len(gen))]
        assert got == [c.logprob for c in r.choices[0].logprobs.content]
        assert all(lp <= 0.0 for lp in got)


# ---- random requests against the real server (property-based) ----------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10)
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
          "stop", "stream", "tools", "tool_choice", "session_id", "prompt", "add_generation_prompt"]
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | st.text(max_size=8)
    | JSON,
    "content": st.text(max_size=30) | JSON, "tool_calls": JSON, "name": st.text(max_size=8)})
NUMBERS = [0, 1, -1, 2, 16, 17, 490, 491, 10**9, 2**63 - 1, 2**63, 2**64, 0.5, 1e-9, 2.0, 2.5, True]
VALID_CHAT = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4}
VALID_COMPLETION = {"model": "policy", "prompt": "12+34=", "max_tokens": 4}


@st.composite
def requests(draw):
    """(path, JSON body or raw bytes): whole random bodies, and valid requests with one field
    replaced by a random value or random messages."""
    path = draw(st.sampled_from(["/chat/completions"] * 4 + ["/completions", "/../tokenize"]))
    kind = draw(st.sampled_from(["random", "field", "number", "number", "messages", "bytes"]))
    base = dict(VALID_COMPLETION if path == "/completions" else VALID_CHAT)
    if kind == "random":
        return path, draw(JSON)
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "messages":
        return path, base | {"messages": draw(st.lists(MESSAGE, max_size=3))}
    if kind == "number":  # a sampling field at or around its bounds
        field = draw(st.sampled_from(["max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                                      "seed"]))
        value = draw(st.sampled_from(NUMBERS) | st.integers(-(10**20), 10**20) | st.floats())
        return path, base | {field: value}
    return path, base | {draw(st.sampled_from(FIELDS) | st.text(max_size=8)): draw(JSON)}


def _snapshot(store):
    return {sid: (s.calls, s.prefix_breaks, [(b.text, b.open, list(b.trace.tokens)) for b in s.branches])
            for sid, s in store.sessions.items()}


@pytest.mark.vllm
def test_random_requests_never_get_a_5xx_nor_corrupt_a_session(vllm_server, tokenizer):
    store, base_url = vllm_server.store, vllm_server.server.base_url
    statuses: Counter[int] = Counter()
    with httpx.Client(base_url=base_url, timeout=120) as http:
        sid = http.post("/sessions").json()["session_id"]

        @settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(request):
            path, body = request
            if isinstance(body, dict) and "session_id" not in body:
                body = body | {"session_id": sid}
            before = _snapshot(store)
            # json.dumps, unlike httpx, also writes NaN and Infinity, which Python's parser reads
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
            assert r.status_code < 500, r.text
            if r.status_code >= 400:
                error = r.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error", r.text
                assert _snapshot(store) == before, "a rejected request changed a session"
            elif path == "/chat/completions":
                for choice in r.json()["choices"]:
                    tokens = choice["token_ids"]
                    assert len(choice["logprobs"]["content"]) == len(tokens) <= (body["max_tokens"] or 512)
                    assert all(t["logprob"] <= 0 for t in choice["logprobs"]["content"])

        one()
        print(f"random requests: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
        assert statuses[200] >= 20 and statuses[400] >= 100  # both valid and invalid bodies were tried
        assert http.get(base_url.removesuffix("/v1") + "/health").json()["status"] == "ok"

        # The fuzzed session still stitches: a two-turn chat extends its own first turn.
        messages = [{"role": "user", "content": "1+2="}]
        first = http.post("/chat/completions",
                          json={"messages": messages, "session_id": sid, "seed": 0}).json()
        breaks = store.get(sid).prefix_breaks
        messages += [first["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
        http.post("/chat/completions", json={"messages": messages, "session_id": sid, "seed": 1})
        assert store.get(sid).prefix_breaks == breaks
        last_prompt, last_gen = vllm_server.recorder.calls[-1]
        samples = store.close(sid).to_samples(Sample(group_id=0, prompt=[], answer="3"))
        assert last_prompt + last_gen in [s.tokens for s in samples]
    # ...and a new conversation through the openai package is still served exactly
    test_openai_package_over_http_with_real_vllm(vllm_server, tokenizer)


def test_engine_errors_are_a_400_for_bad_input_and_a_503_for_a_dead_engine(tokenizer):
    class FailingEngine(ScriptedEngine):
        async def generate(self, token_ids, sampling):
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
