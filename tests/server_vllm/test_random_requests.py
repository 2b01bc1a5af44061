"""The HTTP server on real vLLM, driven by the real `openai` package and by random requests
(hypothesis, tests/fuzz_requests.py): never a 5xx, never a corrupted session, and a
conversation through the `openai` package stitched exactly, before and after the fuzz."""

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from rlexp.sample import Sample
from tests.fuzz_requests import requests
from tests.server_helpers import _check_stitching, three_turns_with_a_tool_call
from tests.server_vllm.helpers import _snapshot


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
