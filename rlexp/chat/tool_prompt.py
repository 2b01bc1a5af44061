"""Tool specs for any instruct model, whether or not its chat template renders `tools`.

Two paths (`tool_prompt` in agent=tool and agent=openai):
- "template": the chat template renders the specs itself (Qwen2.5, Llama 3.1, Hermes, ...);
  rlexp passes `tools=` to it and the messages as they are.
- "system_prompt": the template never reads `tools` (SmolLM2, many fine-tunes), so a model
  would not see them. rlexp writes the specs into the system message in the format below,
  the one Qwen2.5's and Hermes' templates use, and the messages are rewritten into roles
  every template knows: a tool result becomes a user message `<tool_response>..</tool_response>`
  (consecutive results in one message), an assistant's `tool_calls` become `<tool_call>`
  blocks in its content. Calls come back as `<tool_call>{"name": .., "arguments": {..}}</tool_call>`
  and `rlexp.chat.client.parse_tool_calls` reads them on both paths.
"auto" picks "template" when the template refers to the `tools` variable, else "system_prompt".
"""

from __future__ import annotations

import contextlib
import json
from functools import lru_cache
from typing import Any, Literal

ToolPrompt = Literal["auto", "template", "system_prompt"]
ToolPath = Literal["template", "system_prompt"]

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@lru_cache(maxsize=16)
def template_reads_tools(template: str) -> bool:
    """Whether a chat template's source uses the `tools` variable at all."""
    import jinja2
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))


def resolve(tokenizer, tool_prompt: ToolPrompt) -> ToolPath:
    """The path `tool_prompt` means for this tokenizer's chat template."""
    if tool_prompt != "auto":
        return tool_prompt
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default") or next(iter(template.values()))
    return "template" if template and template_reads_tools(template) else "system_prompt"


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The specs as the system prompt's tools section."""
    return "\n".join([TOOLS_HEADER, *(json.dumps(t, ensure_ascii=False) for t in tools), TOOLS_FOOTER])


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that ignores `tools`: the specs appended to the system
    message (or a new one first), tool traffic in plain user/assistant messages."""
    section = tools_system_text(tools)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            response = [_part("<tool_response>\n"), *_parts(m.get("content")), _part("\n</tool_response>")]
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += [_part("\n"), *response]
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [f"<tool_call>\n{json.dumps(_call(c), ensure_ascii=False)}\n</tool_call>"
                     for c in m["tool_calls"]]
            content = _text(m.get("content"))
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        else:
            out.append(dict(m))
    for m in out:
        if m.pop("_tool_results", None) and all(p["type"] == "text" for p in m["content"]):
            m["content"] = _text(m["content"])  # text only: one string, as every template reads it
    if out and out[0].get("role") == "system":
        system = _text(out[0].get("content"))
        out[0]["content"] = f"{system}\n\n{section}" if system else section
    else:
        out.insert(0, {"role": "system", "content": section})
    return out


def _text(content: Any) -> str:
    """Message content as text (OpenAI content parts are joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _parts(content: Any) -> list[dict[str, Any]]:
    """Message content as parts (an image part kept as it is)."""
    return list(content) if isinstance(content, list) else [_part(_text(content))]


def _call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: written as the string it is
            args = json.loads(args)
    return {"name": fn.get("name"), "arguments": args}
