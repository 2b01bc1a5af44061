"""Prompts with images, for a vision-language model: the chat template's text with each image's
placeholder, the processor's tokens with each image's tokens expanded (what the trace and the
trainer hold), and the two things a Sample carries for its images: `mm_infer_info` (the images,
for the engine) and `mm_train_info` (the processor's pixel inputs, for the trainer's forward).

A message's content may be a list of parts, OpenAI-style: `{"type": "text", "text": ...}` and
`{"type": "image", "image": <PIL image>}`."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path
from typing import Any

from rlexp.chat.render import render_prompt_text
from rlexp.data.images import load_images
from rlexp.errors import SessionError
from rlexp.messages import split_images

PIXEL_KEYS = ("pixel_values", "pixel_attention_mask")


def images_of(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of `messages`, in order."""
    return split_images(messages)[1]


def load_image_url(url: str):
    """The PIL image (RGB, fully read) of an OpenAI `image_url`: a data URL
    (`data:image/png;base64,...`), a `file://` URL or a local path, read as a data row's image
    is (rlexp/data/images.py). Nothing is fetched over the network. A ValueError says what is
    wrong."""
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("a data URL's image must be base64 (data:image/png;base64,...)")
        try:
            raw = base64.b64decode(data, validate=True)
        except binascii.Error as e:
            raise ValueError(f"the data URL is not valid base64: {e}") from None
        return load_images(raw, Path("/"), "the data URL")[0]
    return load_images(url.removeprefix("file://"), Path("/"), "the image_url")[0]


def data_url(image) -> str:
    """A PNG data URL of a PIL image (lossless: it decodes to the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` in OpenAI's format (a copy): each image part an `image_url` part with a data
    URL, as a client sends it over HTTP."""
    return [{**m, "content": [{"type": "image_url", "image_url": {"url": data_url(p["image"])}}
                              if p.get("type") == "image" else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else dict(m) for m in messages]


def image_key(image) -> str:
    """An image's identity by content (size, mode, pixels): two requests that send the same
    picture (decoded anew each time) continue the same conversation."""
    digest = hashlib.blake2b(image.tobytes(), digest_size=16)
    digest.update(f"{image.mode}{image.size}".encode())
    return digest.hexdigest()


class ImagePrompts:
    """Renders prompts with images through the model's processor (loaded from the tokenizer's
    directory at the first image prompt)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._processor = None

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(self.tokenizer.name_or_path)
            if getattr(processor, "image_processor", None) is None:
                raise SessionError(f"the model {self.tokenizer.name_or_path} takes no images (its "
                                   "directory has no image processor)", param="messages")
            self._processor = processor
        return self._processor

    def check(self) -> None:
        """A SessionError unless the model takes images."""
        self.processor  # noqa: B018 (loading it is the check)

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[str, list[int], dict, dict]:
        """(text, token ids, mm_infer_info, mm_train_info) of the prompt `messages`."""
        bare, images = split_images(messages)
        text = render_prompt_text(self.tokenizer, bare)  # a string content (a system prompt) as a text part
        enc = self.processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
        train = {k: enc[k][0] for k in PIXEL_KEYS if k in enc}
        ids = enc["input_ids"][0].tolist()
        return text, ids, self.infer_info(images, ids), train

    def infer_info(self, images: list[Any], ids: list[int]) -> dict[str, Any]:
        """`mm_infer_info` of a sample with `images` and tokens `ids`: the images, and where
        their tokens sit (`spans`: [start, end) of each run of image-slot tokens, for traces)."""
        slot = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        starts = [i for i, t in enumerate(ids) if t == slot and (i == 0 or ids[i - 1] != slot)]
        ends = [i + 1 for i, t in enumerate(ids) if t == slot and (i + 1 == len(ids) or ids[i + 1] != slot)]
        return {"images": images, "spans": [list(se) for se in zip(starts, ends)]}

    def encode(self, text: str, images: list[Any]) -> list[int]:
        """Token ids of `text`, which holds one placeholder per image of `images`, each
        expanded into its image's tokens (a piece of a conversation: no special tokens added)."""
        try:
            enc = self.processor(text=text, images=images, add_special_tokens=False)
        except ValueError as e:  # placeholders and images do not pair up
            raise SessionError(f"the images do not fit the messages: {e}", param="messages") from e
        return list(enc["input_ids"][0])

    def train_info(self, images: list[Any]) -> dict[str, Any]:
        """`mm_train_info` of a sample with `images`: the pixel inputs the processor makes for
        them (the same tensors as for the whole prompt at once)."""
        enc = self.processor.image_processor([images], return_tensors="pt")
        return {k: enc[k][0] for k in PIXEL_KEYS if k in enc}
