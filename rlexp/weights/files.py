"""Safetensors files of named tensors: written standalone (checkpoints), read as views of one
shared mapping (an engine loading a sync), and `SharedFile`, a file mapped once and rewritten
in place at every sync (ram_file.py)."""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlexp.weights.protocols import NamedTensors

WEIGHTS_FILE = "model.safetensors"
ALIASES = "rlexp.aliases"  # metadata key: {name: name it shares storage with} (tied weights)
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_TORCH = {v: k for k, v in _DTYPES.items()}


def save_safetensors(weights: NamedTensors, directory: Path, filename: str = WEIGHTS_FILE) -> Path:
    """Write named tensors as one standalone safetensors file, atomically (checkpoints).

    Tied tensors (e.g. lm_head / embed_tokens) are cloned: safetensors refuses shared
    storage, and leaving one name out makes some loaders keep a stale copy."""
    directory.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in weights:
        t = t.detach().to("cpu", copy=False).contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    tmp = directory / f".{filename}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    final = directory / filename
    tmp.replace(final)
    return final


def read_shared(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file as views of one shared mapping of it (no copy),
    tied names included (metadata `rlexp.aliases`). Valid while the file is not rewritten."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    buf = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
    views = {}
    for name, h in header.items():
        start, end = h["data_offsets"]
        views[name] = buf[8 + n + start: 8 + n + end].view(_TORCH[h["dtype"]]).view(h["shape"])
        yield name, views[name]
    for alias, target in json.loads(meta.get(ALIASES, "{}")).items():
        yield alias, views[target]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, as one memcpy on one thread where it can be (both contiguous, on the
    CPU, same dtype and shape). torch's `copy_` splits a tensor of more than a few KB across its
    thread pool and waits for every thread; with the machine's other cores busy (vLLM's
    processes, a second job) each of a sync's few hundred copies waited for a thread to be
    scheduled: SmolLM2-135M's 651 MB took 1.5 s on 2 cores instead of 0.13 s (bench/weight_sync.py).
    A copy is bound by memory bandwidth, which one thread nearly saturates."""
    if (src.device.type == "cpu" and src.is_contiguous() and src.dtype == dst.dtype
            and src.shape == dst.shape and dst.is_contiguous()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


class SharedFile:
    """A safetensors file whose layout is fixed at the first write and whose data region is
    mapped into this process, so a sync is one `copy_` per tensor (no serialisation, no
    page faults after the first). Tensors sharing storage are written once, as aliases."""

    def __init__(self, path: Path):
        self.path = path
        self.layout: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None
        self.slots: dict[str, torch.Tensor] = {}

    def write(self, weights: NamedTensors) -> None:
        tensors: list[tuple[str, torch.Tensor]] = []
        aliases: dict[str, str] = {}
        owner: dict[tuple, str] = {}
        for name, t in weights:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape)
            if key in owner:
                aliases[name] = owner[key]
                continue
            owner[key] = name
            tensors.append((name, t.detach()))
        layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
        if layout != self.layout:
            self._create(layout, aliases)
        with torch.no_grad():
            for name, t in tensors:
                _copy(self.slots[name], t)

    def _create(self, layout, aliases) -> None:
        header: dict = {"__metadata__": {"format": "pt", ALIASES: json.dumps(aliases)}}
        offset = 0
        for name, dtype, shape in layout:
            size = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        tmp.replace(self.path)
        buf = torch.from_file(str(self.path), shared=True, size=8 + len(raw) + offset, dtype=torch.uint8)
        data = buf[8 + len(raw):]
        self.slots = {}
        for name, dtype, shape in layout:
            start, end = header[name]["data_offsets"]
            self.slots[name] = data[start:end].view(dtype).view(shape)
        self.layout = layout
