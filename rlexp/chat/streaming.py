"""`stream=true`: a reply as OpenAI's server-sent chunks, built beside the reply itself.

The session records a streamed reply exactly as a non-streamed one: the chunks are only a
view of the same generation, and the reply is recorded once it is whole. Text streams token
by token where each token's text is final when it is generated: a plain reply. A reply the
server must see whole before it can say what it is (one that may hold tool calls, one cut at
`stop` strings) comes as one chunk when it ends; a reply from an engine that cannot stream
comes whole as its one batch of tokens (`RolloutEngine.generate_streaming`'s default)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

Emit = Callable[[dict[str, Any]], None]


class ChunkStream:
    """The chunks of one request's reply (every choice), handed to `emit` as they are made.
    `chat`: chat.completion.chunk objects, else text_completion ones."""

    def __init__(self, emit: Emit, tokenizer, model: str, chat: bool):
        self.emit, self.tokenizer, self.model, self.chat = emit, tokenizer, model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        self.created = int(time.time())
        self._ids: dict[int, list[int]] = {}
        self._sent: dict[int, str] = {}

    def _chunk(self, choice: dict[str, Any]) -> None:
        self.emit({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": [choice]})

    def _choice(self, index: int, text: str, **fields: Any) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text else {}
            return {"index": index, "delta": delta, "finish_reason": None} | fields
        return {"index": index, "text": text, "finish_reason": None, "logprobs": None} | fields

    def start(self, index: int) -> None:
        """Choice `index` begins (chat: its role chunk), at its first tokens or once it is
        whole, whichever comes first; once."""
        if index in self._ids:
            return
        self._ids[index], self._sent[index] = [], ""
        if self.chat:
            self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None})

    def tokens(self, index: int, ids: list[int], logprobs: list[dict[str, Any]]) -> None:
        """New tokens of choice `index`: their text (held back while it ends in an incomplete
        character), token ids and logprobs."""
        self.start(index)
        self._ids[index] += ids
        text = self.tokenizer.decode(self._ids[index], skip_special_tokens=True)
        new = text[len(self._sent[index]):] if not text.endswith("\ufffd") else ""
        self._sent[index] += new
        extra: dict[str, Any] = {"token_ids": ids}
        if self.chat:
            extra["logprobs"] = {"content": logprobs}
        self._chunk(self._choice(index, new, **extra))

    def end(self, index: int, choice: dict[str, Any]) -> None:
        """Choice `index` is whole (`choice`: its non-streamed form): what was not sent yet
        (all of it when nothing streamed), then its finish reason."""
        sent = self._sent[index]
        if self.chat:
            message = choice["message"]
            content = message.get("content") or ""
            delta: dict[str, Any] = {"content": content[len(sent):]} if content[len(sent):] else {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [c | {"index": k} for k, c in enumerate(message["tool_calls"])]
            rest: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": choice["finish_reason"]}
            if not sent and not self._ids[index]:  # nothing streamed: the tokens come now
                rest |= {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]}
            self._chunk(rest)
        else:
            fields = {"finish_reason": choice["finish_reason"]}
            if not self._ids[index]:
                fields |= {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]}
            self._chunk(self._choice(index, choice["text"][len(sent):], **fields))

    def usage(self, usage: dict[str, int]) -> None:
        """`stream_options.include_usage`: a last chunk with no choices."""
        self.emit({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": [], "usage": usage})
