"""Chat rendering: messages to the chat template's text, text to token ids. Shared by the
agents, the chat sessions, the OpenAI-shaped client and server, and preflight's length check,
so every one of them sends the engine the same tokens for the same messages."""

from __future__ import annotations

from typing import Any

from rlexp.chat.tool_prompt import ToolPath, with_tools_in_system
from rlexp.errors import SessionError
from rlexp.messages import as_parts


def encode(tokenizer, text: str) -> list[int]:
    """Text to token ids, adding no special tokens (a chat template writes them as text, so
    none is added twice). A fast tokenizer encodes one text directly: its batch path
    (`tokenizer.encode`) wakes a thread pool per call, which cost ~0.9 ms a prompt while
    vLLM held the other core (~0.05 ms alone)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


_PROBE = "rlexp-content-probe"
_TAKES_PARTS: dict[str, bool] = {}  # by template text: what decides it


def takes_parts(tokenizer) -> bool:
    """Whether the chat template reads a message's content as a list of parts
    (`[{"type": "text", "text": ...}]`, SmolVLM's, Idefics3's) and not as a string: a string
    given to such a template renders as nothing. Found by rendering a probe message once per
    template (vLLM's chat utils detect the same "content format", by the template's source)."""
    template = str(getattr(tokenizer, "chat_template", None))
    if template not in _TAKES_PARTS:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
        except Exception:  # a template that fails on a string (e.g. indexes content[0]['type'])
            text = ""
        _TAKES_PARTS[template] = _PROBE not in text
    return _TAKES_PARTS[template]


def _for_template(tokenizer, messages):
    return as_parts(messages) if takes_parts(tokenizer) else messages


def render_prompt_text(tokenizer, messages) -> str:
    """The chat template's text for the prompt `messages`, ending with the assistant's cue."""
    return tokenizer.apply_chat_template(_for_template(tokenizer, messages), add_generation_prompt=True,
                                         tokenize=False)


def render_prompt(tokenizer, messages) -> list[int]:
    """Chat-template the prompt messages into token ids."""
    return encode(tokenizer, render_prompt_text(tokenizer, messages))


def render_chat(tokenizer, messages: list[dict[str, Any]], tools: list | None = None,
                add_generation_prompt: bool = True, tool_prompt: ToolPath = "template") -> str:
    """The chat template's text for `messages`, with `tools` rendered by the template or in
    the system prompt (rlexp/chat/tool_prompt.py). The template is fixed and the messages are
    the caller's, so whatever it raises (jinja2's errors, TypeError on a missing key, its own
    raise_exception) is a bad request."""
    kwargs = {}
    if tools and tool_prompt == "system_prompt":
        messages = with_tools_in_system(messages, tools)
    elif tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(_for_template(tokenizer, messages),
                                             add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)
    except Exception as e:
        raise SessionError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages") from e
