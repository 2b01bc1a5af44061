"""Image prompts for vLLM given as tokens.

rlexp's traces hold each image's tokens expanded, as the model's processor writes them and the
trainer's forward needs them (SmolVLM: `<fake_token_around_image><global-img>` + `<image>` x n
+ `<fake_token_around_image>`). vLLM 0.32 expands every image placeholder of a token prompt
itself, expanded already or not, so the engine hands it each image's span collapsed back to
the one placeholder the chat template wrote, and checks that vLLM's expansion gives back the
trace's tokens exactly. This takes a family whose expansion of an image does not depend on the
image (a fixed size, no splitting into tiles), as rlexp/models/vlm.py builds."""

from __future__ import annotations


class ImagePlaceholders:
    def __init__(self, model_path: str):
        from PIL import Image
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_path)
        self.placeholder_text: str = processor.image_token
        self.placeholder = processor.tokenizer.convert_tokens_to_ids(self.placeholder_text)
        self.expansion: list[int] = processor(
            text=self.placeholder_text, images=[Image.new("RGB", (32, 32))], add_special_tokens=False
        )["input_ids"][0]
        if not isinstance(self.expansion, list):
            self.expansion = self.expansion.tolist()

    def collapse(self, token_ids: list[int], images: int) -> list[int]:
        """`token_ids` with each image's expanded span replaced by the placeholder; a prompt
        whose spans are not `images` whole expansions is a ValueError naming the counts."""
        out: list[int] = []
        found, i, n = 0, 0, len(self.expansion)
        while i < len(token_ids):
            if token_ids[i : i + n] == self.expansion:
                out.append(self.placeholder)
                found, i = found + 1, i + n
            else:
                out.append(token_ids[i])
                i += 1
        if found != images:
            raise ValueError(
                f"image prompt: {images} image(s) given, but the tokens hold {found} whole image "
                f"span(s) of {n} tokens ({self.placeholder_text!r} expanded by the processor)"
            )
        return out
