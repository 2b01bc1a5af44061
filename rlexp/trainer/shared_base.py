"""Frozen base weights shared between the LoRA trainers of one process (the Tinker server's
tenants, rlexp/tinker): a LoRA trainer trains its adapters only, so the base tensors of two
trainers built from the same model files, in the same dtype and on the same device, are equal
and never written. A new trainer's frozen parameters point at a live trainer's storage instead
of holding a copy: one base in memory, however many LoRA tenants train on it.

Nothing is kept alive here: a base is found through the trainers that hold it (weak
references), and goes when the last of them does."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

# (model files, dtype, device) -> parameter name -> the live trainers' frozen parameters of that name
_LIVE: dict[tuple, dict[str, weakref.WeakSet]] = {}


def model_key(model_path: str, dtype: torch.dtype, device: torch.device) -> tuple:
    """What decides a model's base tensors: its files (path, sizes and times) and where and how
    they were loaded."""
    root = Path(model_path).resolve()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.glob("*.safetensors"))
    return str(root), tuple(files), str(dtype), str(device)


def share_frozen(model: torch.nn.Module, key: tuple) -> int:
    """Point each frozen parameter of `model` at the storage of a live model's of the same name,
    shape and dtype under `key`, and offer `model`'s own to the next; the bytes no longer held
    twice."""
    live = _LIVE.setdefault(key, {})
    shared = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        others = live.setdefault(name, weakref.WeakSet())
        other = next((o for o in others if o.shape == param.shape and o.dtype == param.dtype), None)
        if other is not None and other.data_ptr() != param.data_ptr():
            shared += param.numel() * param.element_size()
            param.data = other.data
        others.add(param)
    return shared
