"""OpenAI tool specs for rlexp's tools."""

from __future__ import annotations


def expression_tool_spec(name: str, description: str) -> dict:
    """The OpenAI tool spec of a tool whose one argument is an `expression` string."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}
