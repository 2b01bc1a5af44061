"""A small random-weight vision-language model of a real architecture: SmolVLM's layout
(transformers' Idefics3: a SigLIP-style vision tower, a pixel-shuffle connector, a Llama text
model with SmolLM2's tokenizer layout), built locally and cached like rlexp/models/arch.py.

Why this family: its image processing needs no torchvision in vLLM or in transformers.
vLLM 0.32's Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA (through Pixtral's processor), LLaVA-
OneVision, Gemma 3 and InternVL modules import torchvision, and the only torchvision for
torch 2.13 on the registry is a CUDA build that does not import beside the CPU torch;
vLLM's `idefics3` module imports without it, and transformers 5 has a PIL backend of the
Idefics3 image processor (`Idefics3ImageProcessorPil`), which `AutoProcessor` falls back to.

The directory holds what both need: `config.json` (Idefics3Config), the weights, the
tokenizer (SmolLM2's layout plus SmolVLM's image tokens `<fake_token_around_image>`,
`<image>`, `<global-img>` and its turn end `<end_of_utterance>`, which is the eos), the
processor (no image splitting: one `image_size` square per image, `image_tokens` tokens) and
SmolVLM-Instruct's chat template (rlexp/models/templates/smolvlm.jinja), which renders
content as a list of parts, with one change: the published template writes an assistant
turn as `Assistant: text` but cues a reply with `Assistant:`, so no reply the model writes
after the cue is a prefix of the next turn's rendering (every multi-turn request is a prefix
break); here an assistant turn is written `Assistant:text`, exactly as it was generated."""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path
from typing import Any

from rlexp.data.images import zoom, zoom_caption
from rlexp.data.sources import Problem
from rlexp.messages import as_parts, split_images
from rlexp.models.arch import FORMAT_VERSION, TEMPLATE_DIR, build_arch_model, cached_build

log = logging.getLogger(__name__)
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
EOS = "<end_of_utterance>"
IMAGE = "<image>"
ZOOM_CALL = '<tool_call>{"name": "zoom", "arguments": {"quarter": "top-left"}}</tool_call>'


def build_vlm_model(
    cache_dir: str,
    seed: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    vision_hidden_size: int = 64,
    vision_layers: int = 2,
    image_size: int = 64,
    patch_size: int = 16,
    scale_factor: int = 2,
    warm_start_steps: int = 400,
    warm_start_batch_size: int = 32,
    warm_start_lr: float = 0.003,
    warm_start_target_accuracy: float = 0.35,
    warm_start_format: str = "answer",
    task_max_shapes: int = 4,
    task_train_size: int = 2000,
    task_eval_size: int = 200,
    task_seed: int = 0,
) -> str:
    """The built directory's path, building it on first use. Each image becomes
    (image_size / patch_size)^2 / scale_factor^2 tokens (64, 16, 2: 4 tokens).

    `warm_start_steps` > 0: supervised training on the shape-counting task's training split
    (rlexp/data/shapes.py with the `task_*` arguments; never its held-out problems) until
    greedy decoding answers `warm_start_target_accuracy` of a probe of its problems, so that
    RL starts from a policy that is sometimes right (as the tiny text model does)."""
    if warm_start_format not in ("answer", "zoom"):
        raise ValueError(f"model.warm_start_format must be 'answer' or 'zoom', got {warm_start_format!r}")
    if image_size % patch_size or (image_size // patch_size) % scale_factor:
        raise ValueError(
            f"model: image_size={image_size} must be a multiple of patch_size={patch_size} x "
            f"scale_factor={scale_factor}"
        )
    args = {k: v for k, v in locals().items() if k not in ("cache_dir", "warm_start_format")}
    if warm_start_format != "answer":  # the answer format's models keep their cache key
        args["warm_start_format"] = warm_start_format
    template = hashlib.sha1((TEMPLATE_DIR / "smolvlm.jinja").read_bytes()).hexdigest()[:12]
    return cached_build(
        "smolvlm", args | {"template": template}, FORMAT_VERSION, cache_dir,
        lambda out: _build(out, cache_dir, **args)
    )


def placeholder_ids(config) -> list[int]:
    """A vision-language model's image placeholder token ids, from its (transformers) config;
    none for a text model. A policy must never sample one: its forward would take the token
    for an image slot and find no image for it (transformers raises; EasyR1 #110, verl #3469).
    So the engine masks them when sampling (rlexp/rollout/vllm_engine.py) and the trainer when
    scoring (rlexp/trainer/controller.py): both see the same distribution."""
    ids = {getattr(config, key, None) for key in ("image_token_id", "image_token_index", "video_token_id")}
    return sorted(i for i in ids if isinstance(i, int))


def image_tokens(image_size: int, patch_size: int, scale_factor: int) -> int:
    return (image_size // patch_size) ** 2 // scale_factor**2


def _build(out: Path, cache_dir: str, **args: Any) -> None:
    model, processor = _random_model(cache_dir, **{k: v for k, v in args.items()
                                                   if not k.startswith(("warm_start_", "task_"))})
    if args["warm_start_steps"] > 0:
        from rlexp.data.shapes import ShapesSource

        task = ShapesSource(args["task_max_shapes"], args["image_size"], args["task_train_size"],
                            args["task_eval_size"], args["task_seed"])
        accuracy = warm_start(model, processor, task.problems("train"), args["warm_start_steps"],
                              args["warm_start_batch_size"], args["warm_start_lr"],
                              args["warm_start_target_accuracy"], args["seed"],
                              args.get("warm_start_format", "answer"))
        log.info("vlm: warm-started to probe accuracy %.3f", accuracy)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)


def _random_model(cache_dir: str, seed: int, hidden_size: int, num_layers: int, num_heads: int,
                  vision_hidden_size: int, vision_layers: int, image_size: int, patch_size: int,
                  scale_factor: int):
    """(Idefics3ForConditionalGeneration with random weights, its processor)."""
    import torch
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    text_path = build_arch_model("llama", cache_dir, seed, chat_template="smollm2", hidden_size=hidden_size,
                                 num_layers=num_layers, num_heads=num_heads, tie_word_embeddings=True)
    tok = transformers.AutoTokenizer.from_pretrained(text_path)
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tok.eos_token = EOS
    text = transformers.AutoConfig.from_pretrained(text_path)
    if len(tok) > text.vocab_size:
        raise ValueError(f"model: the tokenizer's {len(tok)} tokens do not fit the text model's "
                         f"{text.vocab_size}")
    text.eos_token_id = tok.convert_tokens_to_ids(EOS)
    vision = transformers.Idefics3VisionConfig(
        hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=vision_layers, num_attention_heads=max(1, vision_hidden_size // 32),
        image_size=image_size, patch_size=patch_size)
    config = transformers.Idefics3Config(
        vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=scale_factor,
        image_token_id=tok.get_vocab()["<image>"], tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=[text.eos_token_id], pad_token_id=tok.pad_token_id)
    template = (TEMPLATE_DIR / "smolvlm.jinja").read_text()
    tok.chat_template = template
    square = {"longest_edge": image_size}
    processor = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(do_image_splitting=False, size=square,
                                                  max_image_size=square),
        tokenizer=tok, image_seq_len=image_tokens(image_size, patch_size, scale_factor),
        chat_template=template)
    return model, processor


# ---- the warm-start ------------------------------------------------------------------------


def _prompt(processor, messages: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """The chat template's text for the prompt `messages` and their images, in order."""
    bare, images = split_images(messages)
    return processor.apply_chat_template(as_parts(bare), add_generation_prompt=True), images


def _example(processor, problem) -> tuple[list[int], list[int], dict[str, Any]]:
    """(token ids, labels: the answer and its end of turn only, pixel inputs)."""
    prompt, images = _prompt(processor, problem.messages)
    n = len(processor(text=prompt, images=images, add_special_tokens=False)["input_ids"][0])
    enc = processor(text=prompt + problem.answer + EOS, images=images, add_special_tokens=False,
                    return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    return ids, [-100] * n + ids[n:], {k: v[0] for k, v in enc.items() if k.startswith("pixel")}


def zoom_first(problem) -> Problem:
    """`problem` as the zoom format's warm-start sees it: the policy has called the zoom tool
    on the top-left quarter and the tool message holds the zoomed picture (rlexp/tools/zoom.py,
    with agent.tool_prompt=template); the answer comes next."""
    picture = split_images(problem.messages)[1][0]
    call = {"role": "assistant", "content": [{"type": "text", "text": ZOOM_CALL}]}
    tool = {"role": "tool", "content": [{"type": "image", "image": zoom(picture, "top-left")},
                                        {"type": "text", "text": zoom_caption("top-left", 0)}]}
    return Problem([*problem.messages, call, tool], problem.answer, problem.where)


def _conversation_example(processor, problem) -> tuple[list[int], list[int], dict[str, Any]]:
    """(token ids, labels on every assistant reply and its end of turn, pixel inputs) of the
    conversation `problem.messages` + its answer, built turn by turn as a chat session builds
    it: each prompt's new text, with its pictures expanded, then the reply's tokens."""
    reply = {"role": "assistant", "content": [{"type": "text", "text": problem.answer}]}
    bare, images = split_images([*problem.messages, reply])
    bare = as_parts(bare)
    ids: list[int] = []
    labels: list[int] = []
    text, used = "", 0
    for k, m in enumerate(bare):
        if m["role"] != "assistant":
            continue
        prompt = processor.apply_chat_template(bare[:k], add_generation_prompt=True, tokenize=False)
        new_text, n = prompt[len(text):], prompt[len(text):].count(IMAGE)
        new = processor(text=new_text, images=images[used:used + n] or None, add_special_tokens=False)
        answer = processor.tokenizer.encode(m["content"][0]["text"] + EOS, add_special_tokens=False)
        ids += list(new["input_ids"][0]) + answer
        labels += [-100] * len(new["input_ids"][0]) + answer
        text, used = prompt + m["content"][0]["text"] + EOS, used + n
    pixels = processor.image_processor([images], return_tensors="pt")
    return ids, labels, {k: v[0] for k, v in pixels.items() if k.startswith("pixel")}


def greedy_accuracy(model, processor, problems) -> float:
    """Share of `problems` whose greedy reply (up to 4 tokens) is exactly the answer."""
    import torch

    model.eval()
    right = 0
    with torch.no_grad():
        for problem in problems:
            prompt, images = _prompt(processor, problem.messages)
            enc = processor(text=prompt, images=images, add_special_tokens=False, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=4, do_sample=False,
                                 eos_token_id=processor.tokenizer.convert_tokens_to_ids(EOS),
                                 pad_token_id=processor.tokenizer.pad_token_id)
            reply = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            right += reply.strip() == problem.answer
    return right / len(problems)


def warm_start(model, processor, problems, steps: int, batch_size: int, lr: float, target_accuracy: float,
               seed: int, fmt: str = "answer") -> float:
    """Supervised training on (picture, question) -> answer of `problems` (a training split),
    loss on the answer and its end of turn, for at most `steps` steps, stopping once greedy
    decoding answers `target_accuracy` of a fixed probe of 128 of them (checked every 25
    steps). Returns the last probe accuracy. `fmt="zoom"`: the conversation first calls the
    zoom tool (`zoom_first`), loss on the call and the answer; the probe answers after it."""
    import torch

    rng = random.Random(seed)
    example = _example
    if fmt == "zoom":
        problems, example = [zoom_first(p) for p in problems], _conversation_example
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    accuracy = 0.0
    for step in range(1, steps + 1):
        model.train()
        batch = [example(processor, p) for p in rng.choices(problems, k=batch_size)]
        width = max(len(ids) for ids, _, _ in batch)
        pad = processor.tokenizer.pad_token_id
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab, _ in batch])
        pixels = {k: torch.stack([px[k] for _, _, px in batch]) for k in batch[0][2]}
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels, **pixels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            accuracy = greedy_accuracy(model, processor, problems[:128])
            log.info("vlm: warm-start step %d, loss %.3f, probe accuracy %.3f", step, loss.item(), accuracy)
            if accuracy >= target_accuracy:
                break
    model.eval()
    return accuracy
