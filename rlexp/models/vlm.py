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
content as a list of parts."""

from __future__ import annotations

from pathlib import Path

from rlexp.models.arch import FORMAT_VERSION, TEMPLATE_DIR, build_arch_model, cached_build

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
EOS = "<end_of_utterance>"


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
) -> str:
    """The built directory's path, building it on first use. Each image becomes
    (image_size / patch_size)^2 / scale_factor^2 tokens (64, 16, 2: 4 tokens)."""
    if image_size % patch_size or (image_size // patch_size) % scale_factor:
        raise ValueError(
            f"model: image_size={image_size} must be a multiple of patch_size={patch_size} x "
            f"scale_factor={scale_factor}"
        )
    args = {k: v for k, v in locals().items() if k != "cache_dir"}
    return cached_build(
        "smolvlm", args, FORMAT_VERSION, cache_dir, lambda out: _build(out, cache_dir, **args)
    )


def image_tokens(image_size: int, patch_size: int, scale_factor: int) -> int:
    return (image_size // patch_size) ** 2 // scale_factor**2


def _build(
    out: Path,
    cache_dir: str,
    seed: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    vision_hidden_size: int,
    vision_layers: int,
    image_size: int,
    patch_size: int,
    scale_factor: int,
) -> None:
    import torch
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    text_path = build_arch_model(
        "llama",
        cache_dir,
        seed,
        chat_template="smollm2",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        tie_word_embeddings=True,
    )
    tok = transformers.AutoTokenizer.from_pretrained(text_path)
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tok.eos_token = EOS
    text = transformers.AutoConfig.from_pretrained(text_path)
    if len(tok) > text.vocab_size:
        raise ValueError(
            f"model: the tokenizer's {len(tok)} tokens do not fit the text model's {text.vocab_size}"
        )
    text.eos_token_id = tok.convert_tokens_to_ids(EOS)
    vision = transformers.Idefics3VisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=max(1, vision_hidden_size // 32),
        image_size=image_size,
        patch_size=patch_size,
    )
    config = transformers.Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=scale_factor,
        image_token_id=tok.get_vocab()["<image>"],
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=[text.eos_token_id], pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    template = (TEMPLATE_DIR / "smolvlm.jinja").read_text()
    tok.chat_template = template
    square = {"longest_edge": image_size}
    processor = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False, size=square, max_image_size=square
        ),
        tokenizer=tok,
        image_seq_len=image_tokens(image_size, patch_size, scale_factor),
        chat_template=template,
    )
    processor.save_pretrained(out)
    tok.save_pretrained(out)
