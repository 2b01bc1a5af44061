"""The HTTP server on real vLLM, driven by the real `openai` package and by random requests
(hypothesis): never a 5xx, never a corrupted session."""

import asyncio
import dataclasses
import json
import threading
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.sample import Sample
from tests.fuzz_requests import requests
from tests.test_server import _check_stitching, _joined, _streamed_and_not, three_turns_with_a_tool_call


class RecordingEngine:
    """Wraps a real engine; records exactly the tokens it was given and generated. `force`: a
    Constraint for the next generation in place of the request's, for a test to have vLLM
    write what a tiny model would not on its own (two tool calls)."""

    def __init__(self, engine):
        self.engine, self.calls, self.force = engine, [], None
        self.sampling, self.max_model_len = engine.sampling, engine.max_model_len

    @property
    def version(self):
        return self.engine.version

    async def generate(self, token_ids, sampling, images=None):
        return await self.generate_streaming(token_ids, sampling, None)

    async def generate_streaming(self, token_ids, sampling, on_tokens, images=None):
        if self.force is not None:
            sampling, self.force = dataclasses.replace(sampling, constraint=self.force), None
        gen = await self.engine.generate_streaming(token_ids, sampling, on_tokens)
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
def _snapshot(store):
    return {sid: (s.calls, s.prefix_breaks, [(b.text, b.open, list(b.trace.tokens)) for b in s.branches])
            for sid, s in store.sessions.items()}


@pytest.mark.vllm
def test_random_requests_never_get_a_5xx_nor_corrupt_a_session(vllm_server, tokenizer):
    store, base_url = vllm_server.store, vllm_server.server.base_url
    statuses: Counter[int | str] = Counter()
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
            if r.headers["content-type"].startswith("text/event-stream"):  # stream=true
                events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
                assert events[-1] == "[DONE]", r.text
                chunks = [json.loads(e) for e in events[:-1]]
                assert chunks and all("error" not in c for c in chunks), r.text
                statuses["streamed"] += 1
                if (body.get("stream_options") or {}).get("include_usage") is True:
                    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
            elif r.status_code >= 400:
                error = r.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error", r.text
                assert _snapshot(store) == before, "a rejected request changed a session"
            elif path == "/chat/completions":
                for choice in r.json()["choices"]:
                    tokens = choice["token_ids"]
                    assert len(choice["logprobs"]["content"]) == len(tokens) <= (body["max_tokens"] or 512)
                    assert all(t["logprob"] <= 0 for t in choice["logprobs"]["content"])

        one()
        counts = dict(sorted(statuses.items(), key=str))
        print(f"random requests: {sum(statuses.values()) - statuses['streamed']} bodies, statuses {counts}")
        assert statuses[200] >= 20 and statuses[400] >= 100  # both valid and invalid bodies were tried
        assert statuses["streamed"] >= 20  # and streamed replies
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


# ---- request fields through real vLLM, with the openai package ------------------------------
STRICT_SCHEMAS = {
    "required string and enum": {
        "type": "object", "additionalProperties": False, "required": ["expression", "mode"],
        "properties": {"expression": {"type": "string", "maxLength": 12},
                       "mode": {"enum": ["fast", "exact"]}}},
    "nested object": {
        "type": "object", "additionalProperties": False, "required": ["point"],
        "properties": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                 "properties": {"x": {"type": "string", "maxLength": 4},
                                                "y": {"type": "boolean"}}}}},
    "array of enums, optional flag": {
        "type": "object", "additionalProperties": False, "required": ["ops"],
        "properties": {"ops": {"type": "array", "items": {"enum": ["+", "-", "*"]}, "minItems": 1,
                               "maxItems": 3},
                       "verbose": {"type": "boolean"}}},
}


def _client(vllm_server):
    import openai

    return openai.OpenAI(base_url=vllm_server.server.base_url, api_key="unused", max_retries=0)


def _session(vllm_server):
    return vllm_server.store.open()


@pytest.mark.vllm
def test_strict_forced_tool_calls_are_valid_under_their_schemas(vllm_server):
    import jsonschema

    client, valid, total = _client(vllm_server), 0, 0
    for i, (name, schema) in enumerate(STRICT_SCHEMAS.items()):
        tool = {"type": "function", "function": {"name": f"tool_{i}", "strict": True, "parameters": schema}}
        other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
        r = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "12+34="}], tools=[other, tool], n=4,
            tool_choice={"type": "function", "function": {"name": f"tool_{i}"}}, max_tokens=200, seed=i,
            extra_body={"session_id": _session(vllm_server)})
        for choice in r.choices:
            total += 1
            assert choice.finish_reason == "tool_calls", (name, choice)
            (call,) = choice.message.tool_calls
            assert call.function.name == f"tool_{i}"
            jsonschema.validate(json.loads(call.function.arguments), schema)
            valid += 1
    print(f"strict forced tool calls: {valid} of {total} argument objects valid under their schema")
    assert valid == total == 4 * len(STRICT_SCHEMAS)


@pytest.mark.vllm
def test_response_format_constrains_the_content_and_is_recorded(vllm_server):
    import jsonschema

    client, store = _client(vllm_server), vllm_server.store
    schema = STRICT_SCHEMAS["nested object"]
    sid = _session(vllm_server)
    r = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "a point?"}], max_tokens=200, seed=0, n=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "point", "schema": schema, "strict": True}},
        extra_body={"session_id": sid})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    # any JSON object: this random model writes numbers and keys of any length, so a reply may
    # end at max_tokens; one that stopped is an object, and every one starts as one
    r = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "json?"}], max_tokens=200, seed=1,
        response_format={"type": "json_object"}, extra_body={"session_id": sid})
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    samples = store.close(sid).to_samples(Sample(group_id=0, prompt=[], answer=""))
    kinds = sorted(s.turns[-1]["sampling"]["constraint"]["kind"] for s in samples)
    assert kinds == ["json_object"] + ["json_schema"] * 3  # the training data shows the constraint


@pytest.mark.vllm
def test_top_logprobs_logit_bias_and_penalties_are_honoured(vllm_server, tokenizer):
    client = _client(vllm_server)

    def chat(**kw):
        return client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=24, temperature=0,
            extra_body={"session_id": _session(vllm_server)}, **kw).choices[0]

    # top_logprobs: k distinct alternatives per token, likeliest first; greedy picks the first
    c = chat(logprobs=True, top_logprobs=5)
    for tok in c.logprobs.content:
        alts = [a.logprob for a in tok.top_logprobs]
        assert len(alts) == 5 and alts == sorted(alts, reverse=True)
        assert len({a.token for a in tok.top_logprobs}) == 5
        assert tok.logprob == pytest.approx(alts[0], abs=1e-5)
    # logit_bias: +100 makes a token certain, -100 makes the greedy one impossible
    forced = chat(logit_bias={"50": 100}).model_extra["token_ids"]
    assert forced == [50] * 24
    plain = chat().model_extra["token_ids"]
    banned = chat(logit_bias={str(plain[0]): -100}).model_extra["token_ids"]
    assert plain[0] not in banned
    # penalties: greedy without them repeats tokens; with them it repeats fewer
    def most_repeated(ids):
        return max(Counter(ids).values())
    assert most_repeated(plain) > 1
    penalised = chat(frequency_penalty=2.0, presence_penalty=2.0).model_extra["token_ids"]
    assert most_repeated(penalised) < most_repeated(plain)


@pytest.mark.vllm
def test_completions_n_and_logprobs(vllm_server):
    r = _client(vllm_server).completions.create(model="policy", prompt="12+34=", max_tokens=6, n=3, seed=0,
                                                logprobs=2, logit_bias={"2": -100})  # 2: end of turn
    assert len(r.choices) == 3 and len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"])
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs) and 2 not in c.model_extra["token_ids"]



@pytest.mark.vllm
def test_a_streamed_completion_is_the_plain_completion(vllm_server):
    """/v1/completions, streamed and not, the same seeded request: the text chunks join to the
    plain reply's text, their token ids to its token ids, and the usage chunk counts them."""
    client = _client(vllm_server)
    body = dict(model="policy", prompt="12+34=", max_tokens=16, seed=5, temperature=1.0,
                logit_bias={"2": -100})  # 2, end of turn: never, 16 tokens
    plain = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == plain.text
    ids = [t for p in parts for t in (p.model_extra or {}).get("token_ids", [])]
    assert ids == plain.model_extra["token_ids"] and len(ids) == 16
    assert sum(1 for p in parts if (p.model_extra or {}).get("token_ids")) > 1  # as generated, not at the end
    assert parts[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 16

def _stop_inside(text):
    """A stop string of two characters whose first occurrence in `text` is past its start."""
    return next(text[i:i + 2] for i in range(1, len(text) - 1) if text.index(text[i:i + 2]) == i)


def _trained_turns(sample):
    """(tokens, logprobs) of each span of a sample the policy wrote."""
    return [(sample.tokens[a:b], sample.logprobs[a:b]) for t in sample.turns if t["mask"]
            for a, b in [t["span"]]]


@pytest.mark.vllm
def test_parallel_tool_calls_false_under_auto_returns_one_call_and_the_next_turn_extends_it(
        vllm_server, tokenizer):
    """vLLM writes two calls (pinned by its structured outputs through `RecordingEngine.force`:
    the tiny model writes none on its own); with parallel_tool_calls=false under "auto" the
    reply is the first, its tokens cut right after its `</tool_call>`. The `openai` package
    sends back the call and its result: the next turn extends the kept tokens (no prefix
    break), and the sample trains exactly the tokens returned, with vLLM's logprobs."""
    import jsonschema

    from rlexp.chat.schema import Tool
    from rlexp.chat.structured import call_regex
    from rlexp.sample import Constraint

    store, recorder, client = vllm_server.store, vllm_server.recorder, _client(vllm_server)
    schema = {"type": "object", "additionalProperties": False, "required": ["expression"],
              "properties": {"expression": {"type": "string", "maxLength": 6}}}
    tool = {"type": "function", "function": {"name": "calculator", "parameters": schema}}
    one = call_regex([Tool.model_validate(tool)], ["calculator"])
    sid = _session(vllm_server)
    recorder.calls.clear()
    recorder.force = Constraint("regex", f"({one})({one})")
    messages = [{"role": "user", "content": "12+34="}]
    try:
        r1 = client.chat.completions.create(
            model="policy", messages=messages, tools=[tool], tool_choice="auto", parallel_tool_calls=False,
            max_tokens=300, seed=0, extra_body={"session_id": sid})
    finally:
        recorder.force = None  # used, or not (a refused request): never by another request
    c1 = r1.choices[0]
    (prompt1, gen1), = recorder.calls
    assert tokenizer.decode(gen1, skip_special_tokens=True).count("</tool_call>") == 2  # vLLM wrote two
    assert c1.finish_reason == "tool_calls" and len(c1.message.tool_calls) == 1
    assert c1.message.tool_calls[0].function.name == "calculator"
    jsonschema.validate(json.loads(c1.message.tool_calls[0].function.arguments), schema)
    kept = c1.model_extra["token_ids"]
    assert gen1[:len(kept)] == kept and len(kept) < len(gen1)
    text = tokenizer.decode(kept)
    assert text.endswith("</tool_call>") and text.count("</tool_call>") == 1
    assert r1.usage.completion_tokens == len(kept) == len(c1.logprobs.content)

    call = c1.message.tool_calls[0]
    messages += [c1.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                 {"role": "tool", "tool_call_id": call.id, "content": "46"}]
    r2 = client.chat.completions.create(  # tools, no tool_choice: "auto"
        model="policy", messages=messages, tools=[tool], parallel_tool_calls=False, max_tokens=24, seed=1,
        extra_body={"session_id": sid})
    c2 = r2.choices[0]
    assert len(c2.message.tool_calls or []) <= 1
    session = store.close(sid)
    assert session.prefix_breaks == 0
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    assert sample.metadata["prefix_breaks"] == 0
    prompt2, _ = recorder.calls[1]
    assert prompt2[:len(prompt1) + len(kept)] == prompt1 + kept  # turn 2 extends the kept tokens
    assert sample.tokens == prompt2 + c2.model_extra["token_ids"]
    assert _trained_turns(sample) == [(kept, [t.logprob for t in c1.logprobs.content]),
                                      (c2.model_extra["token_ids"], [t.logprob for t in c2.logprobs.content])]
    assert "<|im_start|>tool\n46<|im_end|>" in tokenizer.decode(sample.tokens)


@pytest.mark.vllm
def test_stop_strings_are_left_out_of_the_reply_and_the_next_turn_extends_the_generated_tokens(
        vllm_server, tokenizer):
    """Greedy replies, without and with a stop string taken from inside the first: the reply
    is the text before it, streamed or not, chat or completions; the session keeps the tokens
    vLLM generated up to the one that completed it, and the next turn, which sends back the
    shortened content, extends them without a prefix break."""
    store, recorder, client = vllm_server.store, vllm_server.recorder, _client(vllm_server)
    body = dict(model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=16,
                temperature=0.0, logit_bias={"2": -100})  # 2, end of turn: never, 16 tokens
    plain = client.chat.completions.create(**body, extra_body={"session_id": _session(vllm_server)})
    plain = plain.choices[0]
    ids, text = plain.model_extra["token_ids"], plain.message.content
    stop = _stop_inside(text)
    k = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i], skip_special_tokens=True))

    sid = _session(vllm_server)
    recorder.calls.clear()
    r1 = client.chat.completions.create(**body, stop=[stop], extra_body={"session_id": sid}).choices[0]
    assert r1.message.content == text[:text.index(stop)] != "" and r1.finish_reason == "stop"
    assert r1.model_extra["token_ids"] == ids[:k] == recorder.calls[0][1][:k]  # whole tokens, as generated
    messages = body["messages"] + [{"role": "assistant", "content": r1.message.content},
                                   {"role": "user", "content": "Sure?"}]
    r2 = client.chat.completions.create(**(body | {"messages": messages}), stop=[stop],
                                        extra_body={"session_id": sid}).choices[0]
    session = store.close(sid)
    assert session.prefix_breaks == 0
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    assert sample.metadata["prefix_breaks"] == 0
    (prompt1, gen1), (prompt2, _) = recorder.calls
    assert prompt2[:len(prompt1) + k] == prompt1 + gen1[:k]
    assert _trained_turns(sample) == [(gen1[:k], [t.logprob for t in r1.logprobs.content]),
                                      (r2.model_extra["token_ids"], [t.logprob for t in r2.logprobs.content])]

    streamed = client.chat.completions.create(**body, stop=[stop], stream=True,
                                              extra_body={"session_id": _session(vllm_server)})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r1.message.content
    # /v1/completions: the same, streamed and not
    completion = dict(model="policy", prompt="12+34=", max_tokens=16, temperature=0.0, logit_bias={"2": -100})
    whole = client.completions.create(**completion).choices[0].text
    cut = client.completions.create(**completion, stop=_stop_inside(whole)).choices[0]
    assert cut.text == whole[:whole.index(_stop_inside(whole))] != "" and cut.finish_reason == "stop"
    chunks = client.completions.create(**completion, stop=_stop_inside(whole), stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.text

# ---- streaming ------------------------------------------------------------------------------
@pytest.mark.vllm
def test_streamed_and_plain_replies_of_a_seeded_request_give_the_same_session(vllm_server):
    store, url = vllm_server.store, vllm_server.server.base_url
    seen = Counter()

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**31), n=st.integers(1, 3), max_tokens=st.integers(1, 24),
           temperature=st.sampled_from([0.0, 0.7, 1.0]), content=st.sampled_from(["12+34=", "hi", "7*8="]))
    def same(seed, n, max_tokens, temperature, content):
        body = dict(messages=[{"role": "user", "content": content}], seed=seed, n=n, max_tokens=max_tokens,
                    temperature=temperature, logit_bias={"2": -100})  # 2, end of turn: never, long replies
        chunks, reply, (streamed, plain) = vllm_server.run(_streamed_and_not(url, store, body))
        assert streamed == plain  # every branch: the same tokens, logprobs and text
        for i, choice in enumerate(reply.choices):
            assert _joined(chunks, i)[0] == choice.message.content
            streamed_ids = [t for c in chunks if c.choices and c.choices[0].index == i
                            for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
            assert streamed_ids == choice.model_extra["token_ids"]
            seen["token chunks"] += sum(1 for c in chunks if c.choices and c.choices[0].index == i
                                        and (c.choices[0].model_extra or {}).get("token_ids"))
            seen["tokens"] += len(streamed_ids)
            seen["replies"] += 1
        assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    same()
    print(f"streaming: {dict(seen)}")
    # replies came in several chunks as they were generated, not each in one at its end (an
    # engine step's tokens come together; when the reader lags, several steps' do)
    assert seen["token chunks"] > seen["replies"]


@pytest.mark.vllm
def test_a_client_that_disconnects_mid_stream_leaves_its_session_unrecorded(vllm_server):
    store, url = vllm_server.store, vllm_server.server.base_url
    sid = store.open()
    body = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 400,
            "stream": True, "logit_bias": {"2": -100}, "session_id": sid}  # 2: end of turn, never

    async def read_two_chunks_and_leave():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with http.stream("POST", "/chat/completions", json=body) as r:
                assert r.status_code == 200
                got = 0
                async for line in r.aiter_lines():
                    got += line.startswith("data: ")
                    if got == 2:
                        break
        for _ in range(200):  # the server notices the closed connection and cancels the reply
            await asyncio.sleep(0.05)
            if not busy.active:
                break

    busy = vllm_server.recorder.engine.busy
    tokens_before = busy.tokens
    vllm_server.run(read_two_chunks_and_leave())
    assert busy.active == 0 and busy.tokens - tokens_before < 400  # the generation was cut short
    session = store.get(sid)
    assert session.branches == [] and session.calls == 0  # nothing of the cut reply was recorded
    r = _client(vllm_server).chat.completions.create(  # and the session goes on as new
        model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=4,
        extra_body={"session_id": sid})
    assert r.choices[0].model_extra["token_ids"] and len(store.get(sid).branches) == 1


@pytest.mark.vllm
def test_a_streamed_request_the_engine_rejects_is_a_400_before_any_chunk(vllm_server):
    """A constrained reply streams as one chunk when it is whole, so a schema vLLM's grammar
    cannot take (found by the fuzz) is answered like the same request not streamed: a 400."""
    store, url = vllm_server.store, vllm_server.server.base_url
    sid = store.open()
    body = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4,
            "session_id": sid, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": {"type": None}}}}
    with httpx.Client(base_url=url, timeout=120) as http:
        for stream in (False, True):
            r = http.post("/chat/completions", json=body | {"stream": stream})
            assert r.status_code == 400 and "grammar" in r.json()["error"]["message"], r.text
    assert store.close(sid).branches == []  # nothing recorded
