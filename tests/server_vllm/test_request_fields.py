"""Request fields through real vLLM behind the HTTP server, with the `openai` package: strict
forced tool calls valid under their schemas, response_format, top_logprobs, logit_bias and
penalties, completions' n and logprobs, parallel_tool_calls=false under "auto", and stop
strings, each cut token-aligned and extended by the next turn."""

import json
from collections import Counter

import pytest

from rlexp.sample import Sample
from tests.server_vllm.helpers import STRICT_SCHEMAS, _client, _session, _stop_inside, _trained_turns


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
