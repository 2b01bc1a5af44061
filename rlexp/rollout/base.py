"""The RolloutEngine seam, and helpers every engine shares."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from rlexp.sample import Generation, SamplingConfig


class RolloutEngine(Protocol):
    version: int  # policy version of the weights currently loaded
    sampling: SamplingConfig  # the run's default (training) sampling settings

    async def generate(self, token_ids: list[int], sampling: SamplingConfig) -> Generation: ...

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...


def save_state_dict(state_dict: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write a full state dict as one safetensors file, atomically.

    Tied tensors (e.g. lm_head / embed_tokens) are cloned: safetensors refuses shared
    storage, and leaving one name out makes some loaders keep a stale copy."""
    directory.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu", copy=False).contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    tmp = directory / f".model.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    final = directory / "model.safetensors"
    tmp.replace(final)
    return final
