"""The policy the trainer updates: a causal LM, with LoRA adapters when asked, and the frozen
reference copy when the algorithm needs one, both sharded when distributed."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rlexp.models.local import resolve_dtype
from rlexp.trainer import distributed
from rlexp.trainer.lora import add_adapters, check_spec

log = logging.getLogger(__name__)


def build_policy(model_path: str, dtype: str, gradient_checkpointing: bool, mixed_precision: str,
                 lora: dict | None, device: torch.device, keep_ref: bool):
    """(model, its frozen reference or None, LoRA's scaling or None for full fine-tuning).
    With LoRA the reference is the model with its adapters off: no copy is kept."""
    vision = hasattr(AutoConfig.from_pretrained(model_path), "vision_config")  # a vision-language model
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model: Any = auto.from_pretrained(model_path, dtype=getattr(torch, resolve_dtype(dtype)))
    if gradient_checkpointing:  # recompute each layer's activations in backward: memory for time
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    spec: dict[str, Any] = {"rank": 0, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    spec |= dict(lora or {})
    check_spec(spec["rank"], spec["alpha"], spec["target_modules"])
    scaling = spec["alpha"] / spec["rank"] if spec["rank"] else None
    if scaling:
        model = add_adapters(model, spec["rank"], spec["alpha"], spec["target_modules"])
    model.to(device).train()
    ref = copy.deepcopy(model).eval().requires_grad_(False) if keep_ref and not scaling else None
    if distributed.sharded():
        for m in (model, ref):
            if m is not None:
                distributed.shard(m, None if mixed_precision == "none" else mixed_precision)
    rank, world = distributed.rank_world()
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("trainer: rank %d of %d, %s, %d of %d parameters trained%s", rank, world, device, n_trained,
             sum(p.numel() for p in model.parameters()), f" (LoRA rank {spec['rank']})" if scaling else "")
    return model, ref, scaling
