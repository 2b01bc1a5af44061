"""The policy the trainer updates: a causal LM or a vision-language model, with LoRA adapters
when asked, and the frozen reference copy when the algorithm needs one, both sharded when
distributed; and the tensors it publishes.

A vision-language model (a config with a `vision_config`, loaded as transformers'
`AutoModelForImageTextToText`):

- `freeze_vision` freezes its vision encoder, the module transformers' `get_encoder("image")`
  finds (`vision_tower`, `visual`, `vision_model`, `vision_encoder` or `image_tower`;
  Idefics3/SmolVLM: `model.vision_model`): requires_grad False, so the optimizer never sees
  it, and its tensors are left out of the weights pushed to the engine, which keeps the ones
  it loaded (they never change). The connector that projects the image features into the
  language model (Idefics3's `model.connector`) still trains, as with LLaMA-Factory's
  `freeze_vision_tower` (its projector has a switch of its own, `freeze_multi_modal_projector`);
  where transformers' vision module holds the projector itself (Qwen2-VL's `visual` holds its
  `merger`), that is frozen with it, as with verl's `freeze_vision_tower`.
- Sharded over ranks (FSDP2), every trained row of a batch needs an image, or none does
  (`check_sharded_images`).
- LoRA puts adapters only on the language model's (`get_decoder()`: Idefics3's
  `model.text_model`) modules named in `target_modules`: a SigLIP-style vision tower has
  q_proj/k_proj/v_proj too, which stay plain (and frozen, as every base weight under LoRA)."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rlexp.models.local import resolve_dtype
from rlexp.trainer import distributed
from rlexp.trainer.lora import PREFIX, add_adapters, check_spec, is_adapter, merged_weights
from rlexp.trainer.shared_base import model_key, share_frozen

log = logging.getLogger(__name__)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION_NAMES = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_tower")  # transformers'


def build_policy(model_path: str, dtype: str, gradient_checkpointing: bool, mixed_precision: str,
                 lora: dict | None, device: torch.device, keep_ref: bool, freeze_vision: bool = False):
    """(model, its frozen reference or None, LoRA's scaling or None for full fine-tuning, the
    name prefixes of the tensors never published: the frozen vision encoder's, or none).
    With LoRA the reference is the model with its adapters off: no copy is kept."""
    vision = hasattr(AutoConfig.from_pretrained(model_path), "vision_config")  # a vision-language model
    if freeze_vision and not vision:
        raise ValueError(f"trainer.freeze_vision=true needs a vision-language model (a config with a "
                         f"vision_config); {model_path} is a text model")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model: Any = auto.from_pretrained(model_path, dtype=getattr(torch, resolve_dtype(dtype)))
    if gradient_checkpointing:  # recompute each layer's activations in backward: memory for time
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    spec: dict[str, Any] = {"rank": 0, "alpha": 16, "target_modules": LORA_TARGETS}  # as the YAML
    spec |= dict(lora or {})
    check_spec(spec["rank"], spec["alpha"], spec["target_modules"])
    unsynced: tuple[str, ...] = ()
    if freeze_vision:
        encoder = vision_encoder(model)
        model.get_submodule(encoder).requires_grad_(False)
        unsynced = (f"{encoder}.",)
    scaling = spec["alpha"] / spec["rank"] if spec["rank"] else None
    if scaling:
        targets = language_targets(model, spec["target_modules"]) if vision else spec["target_modules"]
        model = add_adapters(model, spec["rank"], spec["alpha"], targets)
    model.to(device).train()
    if scaling and not distributed.sharded():  # the frozen base: one copy per process
        shared = share_frozen(model, model_key(model_path, model.dtype, torch.device(device)))
        if shared:
            log.info("trainer: the frozen base (%.0f MB) is shared with a live LoRA trainer of the same "
                     "model", shared / 2**20)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if keep_ref and not scaling else None
    if distributed.sharded():
        for m in (model, ref):
            if m is not None:
                distributed.shard(m, None if mixed_precision == "none" else mixed_precision)
    rank, world = distributed.rank_world()
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("trainer: rank %d of %d, %s, %d of %d parameters trained%s%s", rank, world, device, n_trained,
             sum(p.numel() for p in model.parameters()), f" (LoRA rank {spec['rank']})" if scaling else "",
             f", {unsynced[0][:-1]} frozen" if unsynced else "")
    return model, ref, scaling, unsynced


def policy_weights(model: torch.nn.Module, scaling: float | None,
                   skip: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full tensors one at a time by the base model's names (when sharded, each
    is gathered as it is reached: every rank must iterate); with LoRA, the adapted weights
    merged. Names starting with one of `skip` are left out (not gathered either)."""
    named = ((name, distributed.full_tensor(t)) for name, t in model.state_dict().items()
             if not name.removeprefix(PREFIX).startswith(skip))
    yield from merged_weights(named, scaling) if scaling else named


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """LoRA's trained tensors, full (gathered when sharded: every rank must iterate)."""
    return ((n, distributed.full_tensor(t)) for n, t in model.state_dict().items() if is_adapter(n))


def _name_of(model: torch.nn.Module, module: Any) -> str:
    """`module`'s qualified name in `model` ("" for the model itself or a stranger)."""
    return next((name for name, m in model.named_modules() if m is module), "")


def vision_encoder(model: Any) -> str:
    """The qualified name of a vision-language model's vision encoder (transformers'
    `get_encoder(modality="image")`, which looks on the model and on its base model)."""
    name = _name_of(model, model.get_encoder(modality="image")) if hasattr(model, "get_encoder") else ""
    if not name:
        raise ValueError(f"trainer.freeze_vision: {type(model).__name__} has no vision encoder under a "
                         f"name transformers knows ({', '.join(VISION_NAMES)})")
    return name


def language_targets(model: Any, names: list[str]) -> str:
    """peft's `target_modules` for a vision-language model: the modules called one of `names`
    inside its language model only (transformers' `get_decoder()`), as a regex peft fullmatches
    against each module's qualified name."""
    decoder = _name_of(model, model.get_decoder()) if hasattr(model, "get_decoder") else ""
    if not decoder:
        raise ValueError(f"trainer.lora: found no language model in {type(model).__name__} "
                         "(transformers' get_decoder()) to put the adapters on")
    return rf"{re.escape(decoder)}\.(.*\.)?({'|'.join(map(re.escape, names))})"
