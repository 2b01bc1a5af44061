"""Zoom tool, for a vision-language model: one quarter of a picture of the conversation,
enlarged to the picture's size, returned as an image (the tool message's content parts)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rlexp.data.images import QUARTERS, zoom, zoom_caption


class Zoom:
    name = "zoom"
    reads_images = True  # called with the conversation's images
    spec = {"type": "function", "function": {
        "name": "zoom", "description": "Zoom into one quarter of a picture: returns it enlarged.",
        "parameters": {"type": "object", "properties": {
            "quarter": {"type": "string", "enum": list(QUARTERS)},
            "image": {"type": "integer", "description": "which picture, 0 = the first (default 0)"}},
            "required": ["quarter"]}}}

    def __init__(self, timeout_s: float = 2.0):
        """`timeout_s` is taken as every tool takes it; a crop is bounded by the picture's size."""

    async def __call__(self, arguments: str, images: Sequence[Any] = ()) -> str | list[dict[str, Any]]:
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"error: arguments are not JSON: {e}"
        if not isinstance(args, dict) or args.get("quarter") not in QUARTERS:
            return f"error: 'quarter' must be one of {', '.join(QUARTERS)}"
        k = args.get("image", 0)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(images):
            return f"error: 'image' must be a picture's index, 0 .. {len(images) - 1}"
        return [{"type": "image", "image": zoom(images[k], args["quarter"])},
                {"type": "text", "text": zoom_caption(args["quarter"], k)}]
