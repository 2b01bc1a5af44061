"""A vision-language model (rlexp/models/vlm.py: SmolVLM's layout, no torchvision anywhere):
vLLM serves image prompts through rlexp's engine with the logprobs transformers computes, and
after a weight push (vision tower included) it serves the new weights, for a seen image too
(the engine resets vLLM's encoder and prefix caches).

    .venv/bin/pytest tests/test_vlm.py -s     # prints the figures ([vlm] lines)
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image, ImageDraw

from rlexp.sample import SamplingConfig

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    from rlexp.models.vlm import build_vlm_model

    return build_vlm_model(str(tmp_path_factory.mktemp("vlm")), seed=0)


def _image(circles: int, color: str) -> Image.Image:
    img = Image.new("RGB", (96, 72), "white")
    draw = ImageDraw.Draw(img)
    for i in range(circles):
        draw.ellipse((6 + 22 * i, 20, 24 + 22 * i, 38), fill=color)
    return img


def _prompts(path: str):
    """(token ids with each image's tokens expanded, images, pixel inputs for transformers)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    out = []
    for images, question in (
        ([_image(2, "red")], "How many circles?"),
        ([_image(3, "blue"), _image(1, "green")], "Which picture has more?"),
    ):
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        enc = processor(text=text, images=images, return_tensors="pt")
        out.append(
            (enc["input_ids"][0].tolist(), images, {k: v for k, v in enc.items() if k.startswith("pixel")})
        )
    return out


def test_the_processor_needs_no_torchvision_and_expands_each_image():
    import importlib.util

    from rlexp.models.vlm import image_tokens

    assert importlib.util.find_spec("torchvision") is None  # the point of the family
    assert image_tokens(64, 16, 2) == 4


def _logprobs(model, ids: list[int], pixels: dict) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_vllm_serves_image_prompts_with_the_trainers_logprobs_before_and_after_a_weight_push(
    vlm_path, tmp_path
):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlexp.rollout.vllm_engine import VLLMEngine
    from rlexp.weights.files import save_safetensors

    prompts = _prompts(vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32).eval()
    image_id = AutoProcessor.from_pretrained(vlm_path).tokenizer.convert_tokens_to_ids("<image>")
    assert [ids.count(image_id) for ids, _, _ in prompts] == [4, 8]

    async def sample(engine):
        return await asyncio.gather(
            *(
                engine.generate(ids, SamplingConfig(1.0, 1.0, 10, seed=i), images)
                for i, (ids, images, _) in enumerate(prompts)
            )
        )

    def worst(gens) -> float:
        return max(
            (_logprobs(model, ids + g.token_ids, px)[len(ids) - 1 :] - torch.tensor(g.logprobs))
            .abs()
            .max()
            .item()
            for (ids, _, px), g in zip(prompts, gens)
        )

    async def go():
        engine = VLLMEngine(
            vlm_path, seed=0, max_model_len=256, kv_cache_gb=0.25, max_num_seqs=8, dtype="float32"
        )
        try:
            before = await sample(engine)
            parity_before = worst(before)
            with torch.no_grad():  # a "trained" model: every tensor moved, the vision tower's too
                g = torch.Generator().manual_seed(1)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().clamp(min=1e-2))
            save_safetensors(model.state_dict().items(), tmp_path)  # lm_head too: vLLM keeps its own
            await engine.load_weights(tmp_path, version=1)
            after = await sample(engine)  # the same images: cached encodings would be stale
            return before, parity_before, after, worst(after)
        finally:
            engine.shutdown()

    before, parity_before, after, parity_after = asyncio.run(go())
    stale = max(
        (_logprobs(model, ids + g.token_ids, px)[len(ids) - 1 :] - torch.tensor(g.logprobs))
        .abs()
        .max()
        .item()
        for (ids, _, px), g in zip(prompts, before)
    )
    print(
        f"\n[vlm] fp32, 2 image prompts (1 and 2 images): max |logprob - transformers'| {parity_before:.2e} "
        f"before a weight push, {parity_after:.2e} after it; the old weights' logprobs under the new "
        f"model {stale:.2e}"
    )
    assert parity_before < 1e-4 and parity_after < 1e-4
    assert stale > 100 * max(parity_after, 1e-5)  # the push changed what the engine serves
