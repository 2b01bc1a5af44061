"""LoRA through peft: only the adapters train. The rollout engine gets either merged weights
(any transport: W + scaling * B @ A per adapted matrix, so the engine runs the same dense
model as without LoRA, any architecture vLLM serves, at the cost of the full model at every
sync) or, with weight_transfer=lora_adapter, the adapter alone (rlexp/weights/adapter_file.py:
vLLM's LoRA serving on the base weights it loaded once)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlexp.weights.protocols import NamedTensors

PREFIX = "base_model.model."  # where peft puts the wrapped model's names
ADAPTER_FILE = "adapter.safetensors"


def check_spec(rank: int, alpha: int, target_modules: list[str]) -> None:
    if rank < 0 or alpha <= 0 or not target_modules:
        raise ValueError(f"trainer.lora: rank must be >= 0 (0 = no LoRA), alpha > 0 and target_modules "
                         f"non-empty; got rank={rank}, alpha={alpha}, target_modules={target_modules}")


def add_adapters(model: torch.nn.Module, rank: int, alpha: int,
                 target_modules: list[str] | str) -> torch.nn.Module:
    """The model with rank-`rank` adapters on `target_modules` (module names, or one regex
    that peft fullmatches against each module's qualified name); everything else frozen."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(model, config)  # type: ignore[arg-type]


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model's outputs (the reference policy): every adapter's scaling set to 0.
    Not peft's `disable_adapter()`, which skips the adapters: FSDP2 with bf16 mixed precision
    then fails the next backward (torch 2.13, "assign a gradient with dtype BFloat16 to a
    tensor with grad_dtype Float"); x + 0 * BAx is x exactly."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    saved = [dict(m.scaling) for m in layers]
    for m in layers:
        m.scaling = {k: 0.0 for k in m.scaling}
    try:
        yield
    finally:
        for m, scaling in zip(layers, saved):
            m.scaling = scaling


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_weights(named: NamedTensors, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The peft model's tensors (in state-dict order) as the base model's names and shapes,
    each adapted weight W + scaling * B @ A. A module's base weight comes before its A and B,
    so at most one module's tensors wait here at a time."""
    waiting: dict[str, torch.Tensor] = {}  # module name -> its base weight, until A and B arrive
    adapters: dict[str, torch.Tensor] = {}
    for name, t in named:
        name = name.removeprefix(PREFIX)
        if ".base_layer." in name:
            module, _, leaf = name.partition(".base_layer.")
            if leaf == "weight":
                waiting[module] = t
                continue
            yield f"{module}.{leaf}", t
        elif is_adapter(name):
            module = name.split(".lora_")[0]
            adapters[name.split(".lora_")[1][0]] = t  # "A" or "B"
            if len(adapters) == 2:
                base = waiting.pop(module)
                delta = (adapters.pop("B").float() @ adapters.pop("A").float()) * scaling
                yield f"{module}.weight", (base.float() + delta).to(base.dtype)
        else:
            yield name, t
    assert not waiting and not adapters, f"LoRA tensors without their pair: {list(waiting) + list(adapters)}"
