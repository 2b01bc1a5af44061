"""Weight transfer: how one version of the trainer's weights reaches the rollout engine.

A transport takes the trainer's full tensors by name (`Trainer.weights()`, one at a time)
and makes the engine serve them as policy `version` (the loop's number). The scheduler
decides *when* (between batches, or with the engine paused); the transport decides *how*:

    RamFileTransport   same node, no GPU: one safetensors file in RAM (/dev/shm), which the
                       engine reloads in place (vLLM: `reload_weights` in its workers)

Later transports (Ray's object store across nodes; vLLM's native NCCL / CUDA-IPC weight
transfer on GPU) implement the same `transfer(weights, engine, version)`."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlexp.protocols import LoadsWeightFiles, NamedTensors

WEIGHTS_FILE = "model.safetensors"


def save_safetensors(weights: NamedTensors, directory: Path) -> Path:
    """Write named tensors as one safetensors file, atomically.

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
    tmp = directory / f".model.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    final = directory / WEIGHTS_FILE
    tmp.replace(final)
    return final


class RamFileTransport:
    """The weights as a safetensors file in a RAM-backed directory; the engine reloads it."""

    def __init__(self, directory: str | None = None):
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="rlexp-weights-", dir=shm))

    async def transfer(self, weights: NamedTensors, engine: LoadsWeightFiles, version: int) -> None:
        save_safetensors(weights, self.directory)
        await engine.load_weights(self.directory, version)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
