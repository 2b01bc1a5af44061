"""A vision-language model (rlexp/models/vlm.py: SmolVLM's layout, no torchvision anywhere),
one vLLM engine for the module: it serves image prompts through rlexp's engine with the
logprobs transformers computes, and after a weight push (vision tower included) the new
weights, for a seen image too (the engine resets vLLM's encoder and prefix caches); the
single-turn agent keeps each sample's images and pixel inputs, and the trainer's forward
takes them.

    .venv/bin/pytest tests/test_vlm.py -s     # prints the figures ([vlm] lines)
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from PIL import Image, ImageDraw

from rlexp.sample import SamplingConfig
from tests.conftest import vllm_on_thread

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm(vlm_path, tmp_path_factory):
    """The engine, and `reset()`: push the built weights back (a test that pushed others)."""
    from rlexp.weights.files import save_safetensors

    with vllm_on_thread(vlm_path, 600, seed=0, max_model_len=256, kv_cache_gb=0.25, max_num_seqs=8,
                        dtype="float32", max_response_tokens=10) as (engine, run):
        built = tmp_path_factory.mktemp("built")
        save_safetensors(_model(vlm_path).state_dict().items(), built)

        def reset():
            run(engine.load_weights(built, version=engine.version + 1))

        yield SimpleNamespace(engine=engine, run=run, reset=reset)


def _model(path: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


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
    for images, question in (([_image(2, "red")], "How many circles?"),
                             ([_image(3, "blue"), _image(1, "green")], "Which picture has more?")):
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        enc = processor(text=text, images=images, return_tensors="pt")
        pixels = {k: v for k, v in enc.items() if k.startswith("pixel")}
        out.append((enc["input_ids"][0].tolist(), images, pixels))
    return out


def test_the_processor_needs_no_torchvision_and_expands_each_image():
    import importlib.util

    from rlexp.models.vlm import image_tokens

    assert importlib.util.find_spec("torchvision") is None  # the point of the family
    assert image_tokens(64, 16, 2) == 4


def _logprobs(model, ids: list[int], pixels: dict) -> torch.Tensor:
    """transformers' logprobs of `ids`, the image placeholders masked (the engine never samples one)."""
    from rlexp.models.vlm import placeholder_ids

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, :-1].float()
    logits[:, placeholder_ids(model.config)] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_vllm_serves_image_prompts_with_the_trainers_logprobs_before_and_after_a_weight_push(
        vllm, vlm_path, tmp_path):
    from transformers import AutoProcessor

    from rlexp.weights.files import save_safetensors

    vllm.reset()
    prompts = _prompts(vlm_path)
    model = _model(vlm_path)
    image_id = AutoProcessor.from_pretrained(vlm_path).tokenizer.convert_tokens_to_ids("<image>")
    assert [ids.count(image_id) for ids, _, _ in prompts] == [4, 8]

    async def sample():
        return await asyncio.gather(*(vllm.engine.generate(ids, SamplingConfig(1.0, 1.0, 10, seed=i), images)
                                      for i, (ids, images, _) in enumerate(prompts)))

    def worst(gens) -> float:
        return max((_logprobs(model, ids + g.token_ids, px)[len(ids) - 1:] - torch.tensor(g.logprobs))
                   .abs().max().item() for (ids, _, px), g in zip(prompts, gens))

    before = vllm.run(sample())
    parity_before = worst(before)
    with torch.no_grad():  # a "trained" model: every tensor moved, the vision tower's too
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().clamp(min=1e-2))
    save_safetensors(model.state_dict().items(), tmp_path)  # lm_head too: vLLM keeps its own
    vllm.run(vllm.engine.load_weights(tmp_path, version=vllm.engine.version + 1))
    after = vllm.run(sample())  # the same images: cached encodings would be stale (or missed)
    parity_after, stale = worst(after), worst(before)
    print(f"\n[vlm] fp32, 2 image prompts (1 and 2 images): max |logprob - transformers'| "
          f"{parity_before:.2e} before a weight push, {parity_after:.2e} after it; the old weights' "
          f"logprobs under the new model {stale:.2e}")
    assert parity_before < 1e-4 and parity_after < 1e-4
    assert stale > 100 * max(parity_after, 1e-5)  # the push changed what the engine serves


def _image_samples(n: int):
    from rlexp.sample import Sample

    return [Sample(group_id=0, uid=i, answer=str(1 + i % 3), reward=float(i % 2),
                   prompt=[{"role": "user", "content": [{"type": "image", "image": _image(1 + i % 3, "red")},
                                                        {"type": "text", "text": "How many circles?"}]}])
            for i in range(n)]


@pytest.mark.parametrize("freeze_vision", [False, True], ids=["vision trains", "vision frozen"])
def test_the_trainer_takes_the_samples_pixels_and_its_weights_reach_the_engine(vllm, vlm_path, tmp_path,
                                                                               freeze_vision):
    """agent=single_turn renders image prompts through the processor (the sample keeps the
    images and their pixel inputs); the trainer's forward takes the pixels (logprobs equal the
    engine's), trains, and its weights pushed to the engine are what the engine then serves.
    With the vision encoder frozen, the push leaves it out and the engine keeps its own."""
    from functools import partial

    from transformers import AutoTokenizer

    from rlexp.agents.single_turn import SingleTurnAgent
    from rlexp.judges.math_exact import MathExactJudge
    from rlexp.sample import Status
    from rlexp.trainer.controller import TrainController
    from rlexp.weights.files import save_safetensors

    vllm.reset()
    trainer = TrainController(vlm_path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                              optimizer=partial(torch.optim.SGD, lr=0.5), freeze_vision=freeze_vision)
    agent = SingleTurnAgent(vllm.engine, AutoTokenizer.from_pretrained(vlm_path), MathExactJudge())

    def worst(samples) -> float:
        ours = trainer.sample_logprobs(samples)
        return max((lp - torch.tensor(s.logprobs))[torch.tensor(s.loss_mask).bool()].abs().max().item()
                   for s, lp in zip(samples, ours))

    async def rollouts():
        return await asyncio.gather(*(agent.rollout(s) for s in _image_samples(4)))

    before = vllm.run(rollouts())
    assert all(s.status == Status.COMPLETED and s.mm_train_info["pixel_values"].shape[0] == 1 for s in before)
    parity_before = worst(before)
    for s in before:
        s.reward = float(s.uid % 2)  # a signal to train on, whatever the judge said
    metrics = trainer.fit(before, version=vllm.engine.version)  # the version that made them: checked
    pushed = dict(trainer.weights())
    assert any("vision_model" in name for name in pushed) != freeze_vision
    save_safetensors(pushed.items(), tmp_path)
    vllm.run(vllm.engine.load_weights(tmp_path, version=vllm.engine.version + 1))
    parity_after, moved = worst(vllm.run(rollouts())), worst(before)
    print(f"\n[vlm] trainer vs engine, single-turn image samples, freeze_vision={freeze_vision}: "
          f"max |logprob diff| {parity_before:.2e} "
          f"before a step, {parity_after:.2e} after it and a weight push (the old samples now {moved:.2e} "
          f"off)")
    assert metrics["train/skipped_step"] == 0.0 and metrics["sync/tokens"] > 0  # the sync was checked
    assert parity_before < 1e-4 and parity_after < 1e-4 and moved > 100 * max(parity_after, 1e-5)


def test_a_micro_batch_stacks_each_rows_pixels_and_pads_with_zero_images():
    from rlexp.sample import Sample, TokenTrace
    from rlexp.trainer.batch import Layout, TrainBatch

    def sample(images: int) -> Sample:
        trace = TokenTrace([1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4, [0] * 4)
        s = Sample(group_id=0, prompt=[], answer="", trace=trace)
        if images:
            s.mm_train_info = {"pixel_values": torch.full((images, 3, 8, 8), float(images)),
                               "pixel_attention_mask": torch.ones(images, 8, 8, dtype=torch.bool)}
        return s

    tb = TrainBatch.build([sample(2), sample(0), sample(1)], 0, Layout())
    assert tb.images is not None
    inputs = tb.images.inputs(torch.tensor([0, 1, 2]), torch.device("cpu"))
    assert inputs["pixel_values"].shape == (3, 2, 3, 8, 8)
    assert (inputs["pixel_values"][0] == 2).all() and (inputs["pixel_values"][1] == 0).all()
    assert (inputs["pixel_values"][2, 0] == 1).all() and (inputs["pixel_values"][2, 1] == 0).all()
    mask = inputs["pixel_attention_mask"]
    assert mask[2].sum() == 64 and mask.dtype == torch.bool
    assert tb.images.inputs(torch.tensor([1]), torch.device("cpu")) == {}


def test_the_engine_gets_each_images_span_collapsed_to_the_placeholder(vlm_path):
    from rlexp.rollout.vllm_images import ImagePlaceholders

    places = ImagePlaceholders(vlm_path)
    (ids, _, _), (two, _, _) = _prompts(vlm_path)
    assert len(places.expansion) == 7  # <fake_token_around_image> <global-img> <image> x 4 <fake_...>
    collapsed = places.collapse(two, images=2)
    assert len(collapsed) == len(two) - 2 * 6 and collapsed.count(places.placeholder) == 2
    with pytest.raises(ValueError, match="3 image\\(s\\) given, but the tokens hold 2 whole image span"):
        places.collapse(two, images=3)
    with pytest.raises(ValueError, match="hold 0 whole"):
        places.collapse(ids[:6] + ids[8:], images=1)  # a span cut short


def test_multi_turn_image_conversations_keep_the_trainers_logprobs_before_and_after_a_push(
        vllm, vlm_path, tmp_path):
    """Three requests through the token-tracked client: a picture and a question, then a tool
    message with the zoomed picture (rlexp/tools/zoom.py), then a plain follow-up. The stitched
    sample (two pictures, no prefix break) scores in the trainer as the engine sampled it,
    before and after a step whose weights are pushed."""
    from functools import partial

    from transformers import AutoTokenizer

    from rlexp.chat.client import SessionStore
    from rlexp.data.images import zoom
    from rlexp.sample import Sample
    from rlexp.trainer.controller import TrainController
    from rlexp.weights.files import save_safetensors

    vllm.reset()
    tokenizer = AutoTokenizer.from_pretrained(vlm_path)
    store = SessionStore(vllm.engine, tokenizer, max_context=256)
    trainer = TrainController(vlm_path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                              optimizer=partial(torch.optim.SGD, lr=0.5))

    async def conversation(i: int):
        picture = _image(1 + i % 3, "red")
        messages = [{"role": "user", "content": [{"type": "image", "image": picture},
                                                 {"type": "text", "text": "How many circles?"}]}]
        async with store.record(SamplingConfig(1.0, 1.0, 10, seed=i)) as rec:
            for follow_up in ([{"type": "image", "image": zoom(picture, "top-left")},
                               {"type": "text", "text": "The top-left quarter."}], "Are you sure?", None):
                r = await rec.client.chat.completions.create(messages=messages, seed=i)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
                if follow_up:
                    messages.append({"role": "tool" if isinstance(follow_up, list) else "user",
                                     "content": follow_up})
        return rec.samples(Sample(group_id=0, uid=i, prompt=[], answer="1", reward=float(i % 2)))

    def rollouts():
        async def all_of():
            return [s for ss in await asyncio.gather(*(conversation(i) for i in range(4))) for s in ss]
        return vllm.run(all_of())

    def worst(samples) -> float:
        ours = trainer.sample_logprobs(samples)
        return max((lp - torch.tensor(s.logprobs))[torch.tensor(s.loss_mask).bool()].abs().max().item()
                   for s, lp in zip(samples, ours))

    before = rollouts()
    assert len(before) == 4 and all(s.metadata["prefix_breaks"] == 0 for s in before)
    assert all(len(s.mm_infer_info["images"]) == 2 and s.mm_train_info["pixel_values"].shape[0] == 2
               for s in before)
    assert all(sum(t["mask"] for t in s.trace.turns) == 3 for s in before)
    parity_before = worst(before)
    assert trainer.fit(before, vllm.engine.version)["sync/tokens"] == sum(sum(s.loss_mask) for s in before)
    save_safetensors(trainer.weights(), tmp_path)
    vllm.run(vllm.engine.load_weights(tmp_path, version=vllm.engine.version + 1))
    parity_after, moved = worst(rollouts()), worst(before)
    print(f"\n[vlm] trainer vs engine, 3-turn conversations with a zoomed picture from a tool: max "
          f"|logprob diff| {parity_before:.2e} before a step, {parity_after:.2e} after it and a weight push "
          f"(the old samples now {moved:.2e} off); prefix breaks 0 of 8 continued requests")
    assert parity_before < 1e-4 and parity_after < 1e-4 and moved > 100 * max(parity_after, 1e-5)


def test_the_policy_never_samples_an_image_placeholder_and_the_trainer_scores_it_alike(vllm, vlm_path,
                                                                                        tmp_path):
    """A policy that would write `<image>` in its reply breaks its own training forward (the
    token asks for an image slot that has no image). Weights that make `<image>` the likeliest
    next token (p > 0.9 unmasked): the engine never samples it, and the trainer's logprobs,
    which mask it as the engine does, still equal the engine's."""
    from functools import partial

    from rlexp.models.vlm import placeholder_ids
    from rlexp.trainer.controller import TrainController
    from rlexp.weights.files import save_safetensors

    model = _model(vlm_path)
    (image_id,) = placeholder_ids(model.config)
    ids, images, pixels = _prompts(vlm_path)[0]
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids]), output_hidden_states=True, **pixels).hidden_states[-1][0, -1]
        model.lm_head.weight[image_id] = 30 * h / h.dot(h)  # a logit of 30 after this prompt
        p_image = torch.softmax(model(input_ids=torch.tensor([ids]), **pixels).logits[0, -1], -1)[image_id]
    assert p_image > 0.9
    save_safetensors(model.state_dict().items(), tmp_path)
    vllm.run(vllm.engine.load_weights(tmp_path, version=vllm.engine.version + 1))
    async def sample():
        return await asyncio.gather(*(vllm.engine.generate(ids, SamplingConfig(1.0, 1.0, 10, seed=i), images)
                                      for i in range(8)))

    try:
        gens = vllm.run(sample())
        trainer = TrainController(vlm_path, temperature=1.0, total_steps=1, ref_kl_every_n_steps=0,
                                  optimizer=partial(torch.optim.SGD, lr=0.0))
        trainer.model.load_state_dict(model.state_dict())
    finally:
        vllm.reset()
    assert not any(image_id in g.token_ids for g in gens)
    from rlexp.sample import Sample, TokenTrace

    samples = []
    for g in gens:
        trace = TokenTrace()
        trace.append(ids, role="prompt")
        trace.append(g.token_ids, role="assistant", generation=g)
        samples.append(Sample(group_id=0, prompt=[], answer="", trace=trace,
                              mm_train_info={k: v[0] for k, v in pixels.items()}))
    ours = trainer.sample_logprobs(samples)
    worst = max((lp - torch.tensor(s.logprobs))[torch.tensor(s.loss_mask).bool()].abs().max().item()
                for s, lp in zip(samples, ours))
    print(f"\n[vlm] <image> at p={p_image:.3f} unmasked: sampled 0 times in 8 x 10 tokens; "
          f"trainer vs engine max |logprob diff| {worst:.2e}")
    assert worst < 1e-4
