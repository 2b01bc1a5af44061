"""Chat messages with image parts, and a sample's metadata, as the engine, the chat templates
and a trace line take them."""

from __future__ import annotations

from typing import Any


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(`messages` with each image part bare, `{"type": "image"}` as a chat template takes it;
    their images, in order)."""
    bare, images = [], []
    for m in messages:
        if isinstance(m.get("content"), list):
            images += [p["image"] for p in m["content"] if p.get("type") == "image"]
            m = {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
        bare.append(m)
    return bare, images


def as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each string content as one text part (for a chat template that reads content as parts)."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
            else m for m in messages]


def jsonable_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each image part as `{"type": "image", "index": k}` (its place among the
    sample's images) in place of the image itself."""
    out, k = [], 0
    for m in messages:
        if isinstance(m.get("content"), list):
            parts = []
            for part in m["content"]:
                if part.get("type") == "image":
                    part, k = {"type": "image", "index": k}, k + 1
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out


# Metadata a trace line does not repeat: the judge's exchange and the error have keys of their
# own, and `messages` is the conversation that the line's turns hold token by token.
NOT_TRACED = ("judge", "error", "messages")


def trace_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a trace line keeps of a sample's metadata: what names its task (a data source's
    fields: `task_index`, `task_split`, reasoning-gym's `entry`, ...) and what the agent and the
    judge recorded (`verifiers`, `metrics`, `predicted`, ...), as JSON types."""
    return {str(k): jsonable(v) for k, v in metadata.items() if k not in NOT_TRACED}


def jsonable(value: Any) -> Any:
    """`value` as JSON types: mappings and sequences walked, a numpy scalar as its number, any
    other value not JSON as its repr."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # a numpy scalar
        return jsonable(value.item())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)
