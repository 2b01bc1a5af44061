"""What the HTTP server tests share (tests/test_server*.py on a scripted engine,
tests/server_vllm/ on real vLLM): requests and tool calls, a three-turn chat through the
`openai` package, the checks that a session stitches its turns, the same request streamed and
not, and a tokenizer whose tokens can straddle the place where a reply is cut."""

import httpx
import openai

from rlexp.chat.client import SessionStore
from rlexp.sample import Sample

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'
CALL2 = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


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


def _assistant_turns(sample):
    """The trained spans of a sample: (tokens, logprobs) of each turn the policy wrote."""
    return [(sample.tokens[a:b], sample.logprobs[a:b]) for t in sample.turns if t["mask"]
            for a, b in [t["span"]]]
