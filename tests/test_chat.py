"""Token-tracked sessions and the in-process OpenAI-shaped client."""

import asyncio

import pytest

from rlexp.chat.client import SessionStore, parse_tool_calls
from rlexp.errors import SessionError
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine


def _run(coro):
    return asyncio.run(coro)


def _converse(store, turns):
    async def go():
        sid = store.open()
        client = store.client(sid)
        messages = [{"role": "user", "content": "12+34="}]
        replies = []
        for follow_up in turns:
            r = await client.chat.completions.create(messages=messages)
            replies.append(r)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return store.close(sid), replies
    return _run(go())


def test_multi_turn_session_is_token_in_token_out(tokenizer):
    engine = ScriptedEngine(tokenizer, ["45", "46"])
    store = SessionStore(engine, tokenizer, max_context=256)
    session, replies = _converse(store, ["Incorrect, try again.", None])
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    (p1, g1), (p2, g2) = engine.calls
    # turn 2's prompt extends turn 1's prompt + generation token for token
    assert p2[: len(p1) + len(g1)] == p1 + g1
    assert sample.tokens == p2 + g2  # the sample is exactly what the engine saw and made
    n_new = len(p2) - len(p1) - len(g1)
    assert sample.loss_mask == [0] * len(p1) + [1] * len(g1) + [0] * n_new + [1] * len(g2)
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [-0.5] * (len(g1) + len(g2))
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    assert session.prefix_breaks == 0
    # the OpenAI-shaped response carries the token-level fields
    r = replies[1]
    assert r.prompt_token_ids == p2 and r.choices[0].token_ids == g2
    assert [c.logprob for c in r.choices[0].logprobs.content] == [-0.5] * len(g2)
    assert r.choices[0].message.content == "46"
    # the text appended for turn 2 is exactly the template's rendering of the new message
    new = tokenizer.decode(p2[len(p1) + len(g1):])
    assert new == "\n<|im_start|>user\nIncorrect, try again.<|im_end|>\n<|im_start|>assistant\n"


def test_n_greater_than_one_branches_share_the_prefix(tokenizer):
    engine = ScriptedEngine(tokenizer, ["1", "2", "3"])
    store = SessionStore(engine, tokenizer, max_context=256)

    async def go():
        sid = store.open()
        client = store.client(sid)
        msgs = [{"role": "user", "content": "q"}]
        r = await client.chat.completions.create(messages=msgs, n=2)
        # continue only the second branch
        msgs2 = msgs + [{"role": "assistant", "content": r.choices[1].message.content},
                        {"role": "user", "content": "more"}]
        await client.chat.completions.create(messages=msgs2)
        return store.close(sid)

    session = _run(go())
    samples = session.to_samples(Sample(group_id=3, prompt=[], answer=""))
    assert len(samples) == 2 and {s.group_id for s in samples} == {3}
    short, long = sorted(samples, key=lambda s: len(s.tokens))
    prompt_len = len(engine.calls[0][0])
    assert short.tokens[:prompt_len] == long.tokens[:prompt_len]
    assert tokenizer.decode(short.tokens[prompt_len:]) == "1<|im_end|>"
    assert tokenizer.decode(long.tokens[prompt_len:prompt_len + 2]) == "2<|im_end|>"
    assert sum(long.loss_mask) == 4 and session.prefix_breaks == 0


BROKEN_TEMPLATE = (  # drops earlier assistant turns: not prefix-preserving
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("strategy, n_samples", [("split", 2), ("restart", 1)])
def test_prefix_break_is_detected_counted_and_handled(tiny_model_path, strategy, n_samples):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = BROKEN_TEMPLATE
    engine = ScriptedEngine(tok, ["45", "46"])
    store = SessionStore(engine, tok, max_context=256, on_prefix_break=strategy)
    session, _ = _converse(store, ["again", None])
    assert session.prefix_breaks == 1
    samples = session.to_samples(Sample(group_id=0, prompt=[], answer="46"))
    assert len(samples) == n_samples
    last = max(samples, key=lambda s: s.metadata["segment"])
    # the newest segment is the re-rendered prompt (mask 0) plus the second reply (mask 1)
    assert last.tokens == engine.calls[1][0] + engine.calls[1][1]
    assert sum(last.loss_mask) == len(engine.calls[1][1])


def test_invalid_requests_raise_session_errors(tokenizer):
    store = SessionStore(ScriptedEngine(tokenizer, []), tokenizer, max_context=30)
    with pytest.raises(SessionError, match="unknown session"):
        _run(store.chat("nope", {"messages": [{"role": "user", "content": "x"}]}))
    sid = store.open()
    with pytest.raises(SessionError, match="messages: List should have at least 1 item"):
        _run(store.chat(sid, {"messages": []}))
    with pytest.raises(SessionError, match="the context is 30"):
        _run(store.chat(sid, {"messages": [{"role": "user", "content": "x" * 40}]}))


def test_parse_tool_calls():
    content, calls = parse_tool_calls(
        'let me <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert content == "let me" and calls[0]["function"]["name"] == "calculator"
    assert calls[0]["function"]["arguments"] == '{"expression": "2+3"}'
    _, bad = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert bad[0]["function"]["name"] == "invalid"
    assert parse_tool_calls("plain 5") == ("plain 5", [])


def test_special_tokens_inside_a_reply_do_not_break_the_prefix(tokenizer):
    # The policy may emit a special token mid-reply; the message content cannot show it,
    # but the session writes the reply back exactly as generated.
    engine = ScriptedEngine(tokenizer, ["4<|im_start|>5", "46"])
    store = SessionStore(engine, tokenizer, max_context=256)
    session, replies = _converse(store, ["again", None])
    assert replies[0].choices[0].message.content == "45"
    assert session.prefix_breaks == 0
    (p1, g1), (p2, _) = engine.calls
    assert p2[: len(p1) + len(g1)] == p1 + g1


def test_a_template_that_reads_content_as_parts_gets_string_content_as_a_text_part(tokenizer):
    """SmolVLM's published template indexes content[0]['type']: a string would render as
    nothing (the question silently gone); rlexp finds the template's content format and wraps
    strings as one text part, and leaves a string template's messages as they are."""
    import copy

    from rlexp.chat.render import render_prompt_text, takes_parts
    from rlexp.models.arch import TEMPLATE_DIR

    parts = copy.deepcopy(tokenizer)
    parts.chat_template = (TEMPLATE_DIR / "smolvlm.jinja").read_text()
    message = [{"role": "user", "content": "What is 12+3?"}]
    assert "12+3" not in parts.apply_chat_template(message, tokenize=False)  # the trap
    assert takes_parts(parts) and not takes_parts(tokenizer)
    expected = "<|im_start|>User: What is 12+3?<end_of_utterance>\nAssistant:"
    assert render_prompt_text(parts, message) == expected
    assert render_prompt_text(tokenizer, message) == tokenizer.apply_chat_template(
        message, add_generation_prompt=True, tokenize=False)
