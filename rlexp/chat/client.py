"""An in-process, OpenAI-shaped chat client whose every call is recorded token by token.

    store = SessionStore(engine, tokenizer, max_context=512)
    async with store.record() as rec:   # one session for one task attempt
        r = await rec.client.chat.completions.create(messages=[...])  # as on openai.AsyncOpenAI()
        r.choices[0].message.content, r.prompt_token_ids, r.choices[0].token_ids,
        r.choices[0].logprobs.content[0].logprob
    samples = rec.samples(template)     # the session's leaves as training samples

The HTTP server (rlexp/chat/server.py) serves the same SessionStore."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion

from rlexp.chat import structured
from rlexp.chat.images import ImagePrompts
from rlexp.chat.render import encode
from rlexp.chat.reply_end import TOOL_CALL, cut
from rlexp.chat.request_sampling import choice_sampling, request_sampling
from rlexp.chat.schema import ChatRequest, CompletionRequest, parse
from rlexp.chat.session import ChatSession, PrefixBreak
from rlexp.chat.streaming import ChunkStream, Emit
from rlexp.chat.tool_prompt import ToolPrompt, resolve
from rlexp.errors import SessionError
from rlexp.protocols import RolloutEngine
from rlexp.rollout.accounting import conversation
from rlexp.sample import Generation, Sample, SamplingConfig


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    A block that is not valid JSON still becomes a call (name "invalid"), so the agent can
    answer it with an error instead of losing the turn."""
    calls = []
    for i, m in enumerate(TOOL_CALL.finditer(text)):
        try:
            body = json.loads(m.group(1))
            name, args = str(body["name"]), body.get("arguments", {})
            arguments = args if isinstance(args, str) else json.dumps(args)
        except (json.JSONDecodeError, KeyError, TypeError):
            name, arguments = "invalid", json.dumps({"raw": m.group(1)})
        calls.append({"id": f"call_{i}_{uuid.uuid4().hex[:8]}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    content = TOOL_CALL.sub("", text).strip() if calls else text
    return content, calls


def _message_key(message: dict[str, Any]) -> str:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return json.dumps([message.get("content") or "", calls])


class SessionStore:
    """Open sessions by id; turns chat requests into engine calls and OpenAI responses."""

    def __init__(self, engine: RolloutEngine, tokenizer, max_context: int,
                 on_prefix_break: PrefixBreak = "split", model_name: str = "policy",
                 tool_prompt: ToolPrompt = "auto"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.on_prefix_break = on_prefix_break
        self.model_name = model_name
        self.tool_prompt = resolve(tokenizer, tool_prompt)  # where tool specs go: rlexp/chat/tool_prompt.py
        self.image_prompts = ImagePrompts(tokenizer)  # one processor for every session's images
        self.sessions: dict[str, ChatSession] = {}
        self._raw: dict[str, dict[str, str]] = {}  # session -> message key -> generated text
        self._sampling: dict[str, SamplingConfig] = {}
        self._ids = itertools.count()

    def open(self, session_id: str | None = None, sampling: SamplingConfig | None = None) -> str:
        """A new session; `sampling` fills what its requests leave out (default: the engine's)."""
        sid = session_id or f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.sessions[sid] = ChatSession(self.tokenizer, self.max_context, self.on_prefix_break,
                                         self.tool_prompt, self.image_prompts)
        self._raw[sid] = {}
        self._sampling[sid] = sampling or self.engine.sampling
        return sid

    def get(self, session_id: str) -> ChatSession:
        if session_id not in self.sessions:
            raise SessionError(f"unknown session_id {session_id!r}", param="session_id", status=404)
        return self.sessions[session_id]

    def close(self, session_id: str) -> ChatSession:
        session = self.get(session_id)
        del self.sessions[session_id], self._raw[session_id], self._sampling[session_id]
        return session

    def client(self, session_id: str, sampling: SamplingConfig | None = None) -> TrackedClient:
        return TrackedClient(self, session_id, sampling or self.engine.sampling)

    def record(self, sampling: SamplingConfig | None = None) -> Recording:
        """A new session for one task attempt, closed when the `async with` block ends."""
        return Recording(self, sampling or self.engine.sampling)

    async def chat(self, session_id: str, request: dict[str, Any] | ChatRequest,
                   default: SamplingConfig | None = None, emit: Emit | None = None) -> dict[str, Any]:
        """An OpenAI chat.completion dict for `request` (the JSON body's fields); with `emit`,
        also its chunks as they are made (`stream=true`, rlexp/chat/streaming.py). The session
        records the reply once every choice is whole: a request cancelled before (a streaming
        client that disconnected) leaves the session as it was."""
        if not isinstance(request, ChatRequest):
            request = parse(ChatRequest, request, self.model_name)
        session = self.get(session_id)
        conversation.set(session)  # a pool of replicas keeps the session on one (its prefix cache)
        raw = self._raw[session_id]
        messages = [m.for_template() for m in request.messages]
        # Our own earlier replies go back into the template exactly as they were generated
        # (tool-call markup included), so that the rendering stays a prefix of the tokens.
        rendered = [{"role": "assistant", "content": raw[_message_key(m)]}
                    if m["role"] == "assistant" and _message_key(m) in raw else m
                    for m in messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        prompt = session.prepare(rendered, tools)
        sampling = request_sampling(request, default or self._sampling[session_id], len(prompt.trace),
                                    self.max_context, self.tokenizer)
        sampling = dataclasses.replace(sampling, constraint=structured.constraint(request),
                                       top_logprobs=request.top_logprobs or 0)
        calls_allowed = bool(tools) and request.tool_choice != "none"
        # parallel_tool_calls=false: at most one call. A forced call is one already (its
        # constraint); under "auto" the reply is cut after its first call (`rlexp/chat/reply_end.py`).
        one_call = calls_allowed and request.parallel_tool_calls is False and not request.forced_tools
        stream = ChunkStream(emit, self.tokenizer, self.model_name, chat=True) if emit else None
        token_by_token = not calls_allowed and not request.stops
        gens = [await self._generate_choice(prompt.trace.tokens, choice_sampling(sampling, i), i, stream,
                                            token_by_token, prompt.images or None)
                for i in range(request.n or 1)]
        choices: list[dict[str, Any]] = []
        for i, gen in enumerate(gens):  # no await from here on: all choices are recorded, or none
            gen, text, was_cut = cut(gen, self.tokenizer, request.stops, one_call, len(prompt.trace.tokens))
            session.record(prompt, gen, sampling.requested())
            content, calls = parse_tool_calls(text) if calls_allowed else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            # keyed by the reply as returned (a cut reply's text is shorter than its tokens'),
            # since that is what the client sends back
            raw[_message_key(message)] = self._template_text(gen, was_cut)
            finish = "tool_calls" if calls else ("length" if gen.finish_reason == "length" else "stop")
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "token_ids": gen.token_ids, "logprobs": {"content": self._token_logprobs(gen)}})
            if stream:
                stream.end(i, choices[-1])
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": len(prompt.trace.tokens), "completion_tokens": completion_tokens,
                 "total_tokens": len(prompt.trace.tokens) + completion_tokens}
        if stream and request.stream_options and request.stream_options.include_usage:
            stream.usage(usage)
        return {
            "id": stream.id if stream else f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name, "choices": choices,
            "prompt_token_ids": prompt.trace.tokens, "session_id": session_id, "usage": usage,
        }

    def _template_text(self, gen: Generation, was_cut: bool) -> str:
        """What the template must write back for this reply to reproduce the generated tokens:
        every token, special ones included, except the closing stop token."""
        ids = gen.token_ids
        ends_on_special = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
        if not was_cut and gen.finish_reason == "stop" and ends_on_special:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def _generate_choice(self, token_ids: list[int], sampling: SamplingConfig, index: int,
                               stream: ChunkStream | None, token_by_token: bool,
                               images: list[Any] | None = None) -> Generation:
        """One choice; streamed token by token as the engine reports them when the reply's
        text is final as it comes (`token_by_token`, a sampling that never restarts, no
        alternatives to report), else its chunks come when it is whole. A choice's stream
        starts at its first tokens, so that a request the engine rejects is a plain 4xx
        answer. `images`: one per image in `token_ids` (a vision-language model's)."""
        if stream is None or not (token_by_token and not sampling.depends_on_the_reply
                                  and not sampling.top_logprobs):
            gen = await self._generate(token_ids, sampling, images=images)
        else:
            def on_tokens(ids: list[int], logprobs: list[float]) -> None:
                stream.tokens(index, ids, self._token_logprobs(Generation(ids, logprobs, "", [])))

            gen = await self._generate(token_ids, sampling, lambda: self.engine.generate_streaming(
                token_ids, sampling, on_tokens, images=images))
        if stream:
            stream.start(index)
        return gen

    async def complete(self, request: dict[str, Any] | CompletionRequest, emit: Emit | None = None
                       ) -> dict[str, Any]:
        """/v1/completions: a text prompt (or token ids) in, text out; not session-tracked.
        With `emit`, also its chunks as they are made (`stream=true`)."""
        request = request if isinstance(request, CompletionRequest) else \
            parse(CompletionRequest, request, self.model_name)
        if isinstance(request.prompt, str):
            ids = encode(self.tokenizer, request.prompt)
        elif max(request.prompt) >= len(self.tokenizer):
            raise SessionError(f"prompt: token id {max(request.prompt)} is not in the vocabulary "
                               f"(size {len(self.tokenizer)})", param="prompt")
        else:
            ids = request.prompt
        if len(ids) >= self.max_context:
            raise SessionError(f"prompt has {len(ids)} tokens; the context is {self.max_context}",
                               param="prompt")
        sampling = request_sampling(request, self.engine.sampling, len(ids), self.max_context, self.tokenizer)
        sampling = dataclasses.replace(sampling, top_logprobs=request.logprobs or 0)
        stream = ChunkStream(emit, self.tokenizer, self.model_name, chat=False) if emit else None
        choices: list[dict[str, Any]] = []
        for i in range(request.n or 1):
            gen = await self._generate_choice(ids, choice_sampling(sampling, i), i, stream,
                                              not request.stops and request.logprobs is None)
            gen, text, _ = cut(gen, self.tokenizer, request.stops, False, len(ids))
            choices.append({"index": i, "text": text, "token_ids": gen.token_ids,
                            "finish_reason": "length" if gen.finish_reason == "length" else "stop",
                            "logprobs": None if request.logprobs is None else self._completion_logprobs(gen)})
            if stream:
                stream.end(i, choices[-1])
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(ids) + completion_tokens}
        if stream and request.stream_options and request.stream_options.include_usage:
            stream.usage(usage)
        return {"id": stream.id if stream else f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "prompt_token_ids": ids,
                "choices": choices, "usage": usage}

    def _completion_logprobs(self, gen: Generation) -> dict[str, Any]:
        """The completions API's `logprobs`: tokens, their logprobs, alternatives, text offsets."""
        tokens = [self.tokenizer.decode([t]) for t in gen.token_ids]
        offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        top = [{self.tokenizer.decode([a]): lp for a, lp in alts.items()} for alts in gen.top_logprobs or []]
        return {"tokens": tokens, "token_logprobs": gen.logprobs, "top_logprobs": top or None,
                "text_offset": offsets}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(token_id) or f"<id:{token_id}>"  # past the vocabulary

    def _token_logprobs(self, gen: Generation) -> list[dict[str, Any]]:
        """Chat's `logprobs.content`: each token's logprob and, when asked, its alternatives."""
        top = gen.top_logprobs or [{}] * len(gen.token_ids)
        return [{"token": self._token(t), "logprob": lp, "bytes": None,
                 "top_logprobs": [{"token": self._token(a), "logprob": alp, "bytes": None}
                                  for a, alp in sorted(alts.items(), key=lambda kv: -kv[1])]}
                for t, lp, alts in zip(gen.token_ids, gen.logprobs, top)]

    async def _generate(self, token_ids: list[int], sampling: SamplingConfig,
                        call: Callable[[], Awaitable[Generation]] | None = None,
                        images: list[Any] | None = None) -> Generation:
        """The engine's generation (or `call`'s), its own input errors as a 400."""
        try:
            return await (call() if call else self.engine.generate(token_ids, sampling, images))
        except ValueError as e:  # the engine's own input checks (vLLM's VLLMValidationError)
            raise SessionError(f"the engine rejected the request: {e}") from e


class Recording:
    """One recorded session: the agent talks through `client` inside `async with`; then
    `samples(template)` stitches the session's leaves into training samples."""

    def __init__(self, store: SessionStore, sampling: SamplingConfig):
        self.store = store
        self.session_id = store.open(sampling=sampling)
        self.client = store.client(self.session_id, sampling)
        self.session: ChatSession | None = None

    async def __aenter__(self) -> Recording:
        return self

    async def __aexit__(self, *exc) -> None:
        self.session = self.store.close(self.session_id)

    def newest(self, template: Sample) -> Sample:
        """Inside `async with`: the conversation up to its newest reply as a Sample (a copy of
        `template`), for the agent's judge to score."""
        return self.store.get(self.session_id).newest(template)

    def samples(self, template: Sample) -> list[Sample]:
        assert self.session is not None, "samples() is for after the `async with` block"
        return self.session.to_samples(template)


class TrackedClient:
    """`client.chat.completions.create(...)`, as on `openai.AsyncOpenAI`, in process."""

    def __init__(self, store: SessionStore, session_id: str, sampling: SamplingConfig):
        self.store, self.session_id, self.sampling = store, session_id, sampling
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create_chat))
        self.completions = SimpleNamespace(create=self._create_completion)

    async def _create_chat(self, *, messages, model: str | None = None, extra_body=None, **kw):
        """A ChatCompletion; with stream=True, its chunks (ChatCompletionChunk) to iterate over
        with `async for`, as openai's AsyncStream (here they come once the reply is whole)."""
        request = {"messages": messages, **kw, **(extra_body or {})}
        if model is not None:
            request["model"] = model
        chunks: list[dict[str, Any]] = []
        body = await self.store.chat(self.session_id, request, self.sampling,
                                     emit=chunks.append if request.get("stream") else None)
        if request.get("stream"):
            return _iterate([ChatCompletionChunk.model_validate(c) for c in chunks])
        return ChatCompletion.model_validate(body)

    async def _create_completion(self, *, prompt, model: str | None = None, **kw):
        request = {"prompt": prompt, **kw} | ({"model": model} if model is not None else {})
        chunks: list[dict[str, Any]] = []
        body = await self.store.complete(request, emit=chunks.append if request.get("stream") else None)
        if request.get("stream"):
            return _iterate([Completion.model_validate(c) for c in chunks])
        return Completion.model_validate(body)


async def _iterate(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
