"""Reading the Tinker API's JSON bodies: each field checked for its type, a missing or
mistyped one refused with a 400 naming it (`BadRequest`), before any work starts."""

from __future__ import annotations

import json
import math
from typing import Any

from rlexp.tinker.errors import BadRequest

MISSING = object()
KINDS: dict[type, str] = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
                          dict: "an object", list: "a list"}


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("the request body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None)
    return body


def get(body: dict[str, Any], key: str, kind: type, default: Any = MISSING, at: str = "") -> Any:
    """body[key] of type `kind` (int accepted for float; None counts as absent)."""
    where = f"{at}{key}"
    value = body.get(key)
    if value is None:
        if default is MISSING:
            raise BadRequest(f"{where} is missing", where)
        return default
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise BadRequest(f"{where} must be {KINDS[kind]}, not {json.dumps(value)[:80]}", where)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{where} must be finite", where)
    return value


def nonneg(body: dict[str, Any], key: str, kind: type, default: Any, at: str = "") -> Any:
    value = get(body, key, kind, default, at)
    if value is not None and value < 0:
        raise BadRequest(f"{at}{key} must be >= 0, got {value}", f"{at}{key}")
    return value


def tokens(value: Any, where: str) -> list[int]:
    """A ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}) as token ids."""
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise BadRequest(f"{where} must be an object with a list of chunks", where)
    out: list[int] = []
    for j, chunk in enumerate(value["chunks"]):
        at = f"{where}.chunks[{j}]"
        if not isinstance(chunk, dict):
            raise BadRequest(f"{at} must be an object", at)
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise BadRequest(f"{at}: chunk type {kind!r} is not served (text models: encoded_text)",
                             f"{at}.type")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise BadRequest(f"{at}.tokens must be a list of integer token ids", f"{at}.tokens")
        out += ids
    return out


def tinker_path(path: Any, where: str = "path") -> tuple[str, str, str]:
    """(model id, "weights" | "sampler_weights", name) of `tinker://<model>/<kind>/<name>`."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise BadRequest(f"{where} must be a tinker:// path, not {json.dumps(path)[:80]}", where)
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not all(parts):
        raise BadRequest(f"{where} {path!r} is not tinker://<model id>/(weights|sampler_weights)/<name>",
                         where)
    return parts[0], parts[1], parts[2]


def check_name(name: str, where: str) -> str:
    if not name or "/" in name or name in (".", "..") or len(name) > 200:
        raise BadRequest(f"{where} {name!r} is not a checkpoint name (no '/', 1..200 characters)", where)
    return name
