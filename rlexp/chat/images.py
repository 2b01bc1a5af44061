"""Prompts with images, for a vision-language model: the chat template's text with each image's
placeholder, the processor's tokens with each image's tokens expanded (what the trace and the
trainer hold), and the two things a Sample carries for its images: `mm_infer_info` (the images,
for the engine) and `mm_train_info` (the processor's pixel inputs, for the trainer's forward).

A message's content may be a list of parts, OpenAI-style: `{"type": "text", "text": ...}` and
`{"type": "image", "image": <PIL image>}`."""

from __future__ import annotations

from typing import Any

from rlexp.sample import split_images

PIXEL_KEYS = ("pixel_values", "pixel_attention_mask")


def images_of(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of `messages`, in order."""
    return split_images(messages)[1]


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

            self._processor = AutoProcessor.from_pretrained(self.tokenizer.name_or_path)
        return self._processor

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[str, list[int], dict, dict]:
        """(text, token ids, mm_infer_info, mm_train_info) of the prompt `messages`."""
        bare, images = split_images(messages)
        text = self.processor.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
        enc = self.processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
        train = {k: enc[k][0] for k in PIXEL_KEYS if k in enc}
        return text, enc["input_ids"][0].tolist(), {"images": images}, train
