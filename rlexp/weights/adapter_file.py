"""`weight_transfer=lora_adapter`: a LoRA run's adapter, not the merged model, into vLLM.

At every sync the trainer's adapter tensors (rank x width per adapted matrix: a few per cent
of the model at rank 8) are written as peft's files (`adapter_config.json`,
`adapter_model.safetensors`) into a fresh directory in RAM, which the engine loads in place
of the policy's adapter (`VLLMEngine.load_adapter`, vLLM's LoRA serving); the base weights
stay as the engine loaded them. A directory per version: vLLM's prefix cache keys a block
by the adapter's directory, and an adapter vLLM evicted is loaded again from it, so the one
the engine serves stays until the next one is loaded.

A Ray pool (rlexp/cluster/pool.py) ships the files to its replicas through Ray's object store,
so replicas on other nodes get them too; each writes them into a directory of its own
(`AdapterReceiver`) and loads them from there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Protocol

from safetensors.torch import save_file

from rlexp import orphans
from rlexp.errors import ConfigError
from rlexp.weights.protocols import ClusterShape, NamedTensors

POLICY = "policy"  # the adapter's name in the engine
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoadsAdapters(Protocol):
    """An engine that serves LoRA adapters on its base model (VLLMEngine with max_lora_rank > 0)."""

    async def load_adapter(self, name: str, directory: Path, version: int | None = None) -> None: ...


def peft_name(name: str) -> str:
    """A trainer's adapter tensor name as peft saves it: `base_model.model.<module>.lora_A.weight`
    (the trainer's state dict names the adapter, `.lora_A.default.weight`)."""
    return PEFT_PREFIX + name.removeprefix(PEFT_PREFIX).replace(".default.", ".")


def write_adapter(directory: Path, weights: NamedTensors, rank: int, alpha: int,
                  target_modules: list[str]) -> int:
    """peft's two files in `directory`; the bytes of the tensors written."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {peft_name(n): t.detach().to("cpu").contiguous() for n, t in weights}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(target_modules),
              "bias": "none", "lora_dropout": 0.0, "modules_to_save": None, "use_dora": False}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterFileTransport:
    """The policy's LoRA adapter as peft's files in RAM, one directory per version."""

    PREFIX = "rlexp-adapter-"
    engine_backend = None
    sends_from_driver = True  # the adapter of a trainer in this process (trainer.adapter_weights)
    sends_adapter = True  # the trainer's adapter tensors, not its merged weights (rlexp.step.outgoing)

    def __init__(self, rank: int, alpha: int, target_modules: list[str], cluster: ClusterShape | None = None):
        if rank <= 0:
            raise ConfigError("weight_transfer=lora_adapter sends a LoRA adapter: set trainer.lora.rank > 0 "
                              "(or use weight_transfer=auto for full fine-tuning)")
        self.rank, self.alpha, self.target_modules = rank, alpha, list(target_modules)
        self._lock: int | None
        self.root, self._lock = orphans.owned_ram_dir(self.PREFIX)  # and adapters of killed runs go
        self.bytes_sent = 0  # the last sync's tensor bytes
        self._serving: Path | None = None

    async def transfer(self, weights: NamedTensors, engine: LoadsAdapters, version: int) -> None:
        directory = self.root / f"v{version}"
        if directory.exists():  # the same version again (a resumed run's first sync)
            shutil.rmtree(directory)
        self.bytes_sent = write_adapter(directory, weights, self.rank, self.alpha, self.target_modules)
        await engine.load_adapter(POLICY, directory, version)
        if self._serving is not None and self._serving != directory:
            shutil.rmtree(self._serving, ignore_errors=True)
        self._serving = directory

    def close(self) -> None:
        orphans.remove(self.root, self._lock)
        self._lock = None


def read_adapter(directory: Path) -> dict[str, bytes]:
    """peft's two files in `directory`, by name: what crosses to a replica's node."""
    return {name: (directory / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}


class AdapterReceiver:
    """The receiving half in a replica's actor: an adapter's files (`read_adapter`, resolved on
    this node) written into a new directory in this node's RAM, then loaded; the directory an
    adapter was served from goes once the next one of its name is loaded."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self._lock: int | None = None
        self._serving: dict[str, Path] = {}
        self._loads = 0

    async def load(self, name: str, files: dict[str, bytes], engine: LoadsAdapters,
                   version: int | None) -> None:
        if self.root is None:
            self.root, self._lock = orphans.owned_ram_dir(AdapterFileTransport.PREFIX)
        self._loads += 1  # a new directory each time: vLLM's prefix cache keys blocks by it
        directory = self.root / f"{name}-{self._loads}"
        directory.mkdir()
        for file, data in files.items():
            (directory / Path(file).name).write_bytes(data)
        await engine.load_adapter(name, directory, version)
        old = self._serving.get(name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._serving[name] = directory

    def close(self) -> None:
        if self.root is not None:
            orphans.remove(self.root, self._lock)
            self.root, self._lock = None, None
