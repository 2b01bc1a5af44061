"""Structured outputs: what a chat request's `tool_choice`, `tools` and `response_format`
constrain a reply to, as one `Constraint` for the engine's guided decoding.

- a forced call (`tool_choice` "required" or a named tool): exactly one Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` whose arguments match that tool's
  `parameters` schema (any JSON object when it has none, or, for a non-strict tool, when the
  schema cannot be compiled; a strict tool's schema that cannot be compiled is a 400);
- `response_format` json_object / json_schema: the reply's content is that JSON (vLLM's own
  JSON constraint); beside tools under `tool_choice` "auto", either one call or that JSON;
- `tool_choice` "none": no constraint, and the reply is never parsed as a call.

Argument schemas become regular expressions with outlines-core (vLLM's structured-output
dependency), so a call's markup and its arguments are one pattern."""

from __future__ import annotations

import json
import re
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

from rlexp.chat.schema import ChatRequest, ResponseFormat, Tool
from rlexp.errors import SessionError
from rlexp.sample import Constraint

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON-schema keywords a pattern cannot enforce (outlines-core drops them): a strict tool
# using one would get arguments its schema rejects, so it is refused instead.
UNENFORCED = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
              "minProperties", "maxProperties", "patternProperties", "propertyNames", "dependentRequired",
              "dependentSchemas", "if", "then", "else", "not", "contains", "unevaluatedProperties"}


def unenforced(schema: Any, where: str) -> str | None:
    """The first place in `schema` that uses a keyword of UNENFORCED (None: there is none)."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNENFORCED:
            return f"{where}.{key}"
    subs = [(f"{where}.properties.{k}", v) for k, v in _entries(schema.get("properties"))]
    subs += [(f"{where}.$defs.{k}", v) for k, v in _entries(schema.get("$defs"))]
    subs += [(f"{where}.{k}", schema[k]) for k in ("items", "additionalProperties") if k in schema]
    subs += [(f"{where}.{k}.[{i}]", v) for k in ("anyOf", "oneOf", "allOf", "prefixItems")
             for i, v in enumerate(_elements(schema.get(k)))]
    return next((found for w, sub in subs if (found := unenforced(sub, w))), None)


def _entries(value: Any) -> list[tuple[str, Any]]:
    """A schema keyword's subschemas by name; none where it is not an object (a malformed
    schema, which building its pattern then refuses)."""
    return list(value.items()) if isinstance(value, dict) else []


def _elements(value: Any) -> list[Any]:
    """A schema keyword's list of subschemas; none where it is not a list (as for _entries)."""
    return value if isinstance(value, list) else []


def schema_regex(schema: dict[str, Any]) -> str:
    """A regular expression for the JSON texts `schema` accepts (ValueError if it cannot)."""
    return build_regex_from_schema(json.dumps(schema))


def _arguments_regex(tool: Tool, index: int) -> str:
    schema = tool.function.parameters or ANY_OBJECT
    where = f"tools.[{index}].function.parameters"
    if tool.function.strict and (found := unenforced(schema, where)):
        raise SessionError(f"{found}: a strict tool's schema may not use {found.rsplit('.', 1)[1]!r}: "
                           "structured outputs cannot enforce it", param=where)
    try:
        return schema_regex(schema)
    except (ValueError, TypeError) as e:
        if tool.function.strict:
            raise SessionError(f"{where}: a strict tool's schema must be one structured outputs can "
                               f"enforce: {e}", param=where) from None
        return schema_regex(ANY_OBJECT)


def call_regex(tools: list[Tool], names: list[str]) -> str:
    """One call of one of `names`, its arguments valid under that tool's schema."""
    alternatives = []
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            name = re.escape(json.dumps(tool.function.name))
            alternatives.append(r'<tool_call>\{"name": ' + name + r', "arguments": '
                                + _arguments_regex(tool, i) + r'\}</tool_call>')
    return "|".join(f"({a})" for a in alternatives)


def _content_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    assert fmt.json_schema is not None  # the schema validates the pair
    return fmt.json_schema.schema_ or ANY_OBJECT


def constraint(request: ChatRequest) -> Constraint | None:
    """The constraint a chat request puts on its reply (None: free text)."""
    tools, forced = request.tools or [], request.forced_tools
    if forced:
        return Constraint("regex", call_regex(tools, forced))
    content = _content_schema(request.response_format)
    if content is None:
        return None
    if tools and request.tool_choice != "none":  # either a call or the JSON content
        try:
            content_regex = schema_regex(content)
        except (ValueError, TypeError) as e:
            raise SessionError(f"response_format: its schema cannot be enforced beside tools: {e}",
                               param="response_format") from None
        names = [t.function.name for t in tools]
        return Constraint("regex", f"({call_regex(tools, names)})|({content_regex})")
    if request.response_format is not None and request.response_format.type == "json_object":
        return Constraint("json_object")
    return Constraint("json_schema", json.dumps(content))
