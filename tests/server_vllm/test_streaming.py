"""Streaming from real vLLM behind the HTTP server: a streamed completion or chat reply is the
plain one (the same session, the same tokens, as generated), a client that disconnects mid-stream
leaves its session unrecorded, and a request the engine rejects is a 400 before any chunk."""

import asyncio
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_helpers import _joined, _streamed_and_not
from tests.server_vllm.helpers import _client


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
