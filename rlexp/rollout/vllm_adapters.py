"""The LoRA adapters a vLLM engine serves on its one base model, by name.

vLLM identifies an adapter by an int id (its slot in the engine's adapter caches) and a
directory it loads the adapter from (peft's `adapter_config.json` + `adapter_model.safetensors`).
Each name here keeps one id for its life, and the directory of its current weights. Loading a
name again replaces its weights in place (`load_inplace`). vLLM's prefix cache keys a block by
the adapter's name and directory, not by its weights, so new weights must come in a directory
of their own (rlexp/weights/adapter_file.py writes one per version); the engine's cache salt
(the version a request was sent at) keeps them apart as well.

vLLM keeps up to `max_cpu_loras` adapters in memory and evicts the least recently used; a
request for an evicted one loads it again from its directory, so a name's directory must stay
until the name is loaded again or removed.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The adapter ranks vLLM's engine accepts for `max_lora_rank` (vllm/config/lora.py); an adapter
# of any rank up to the engine's is served (padded).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_rank(max_lora_rank: int) -> int:
    """The smallest rank vLLM accepts that holds `max_lora_rank` adapters."""
    for rank in VLLM_RANKS:
        if rank >= max_lora_rank:
            return rank
    raise ValueError(f"rollout.max_lora_rank={max_lora_rank}: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}")


def lora_args(max_lora_rank: int, max_loras: int, max_cpu_loras: int) -> dict[str, Any]:
    """vLLM's engine arguments for serving adapters of rank <= `max_lora_rank` (0: none);
    `max_loras` adapters in one engine step, `max_cpu_loras` kept loaded."""
    if max_lora_rank == 0:
        return {}
    return {"enable_lora": True, "max_lora_rank": engine_rank(max_lora_rank), "max_loras": max_loras,
            "max_cpu_loras": max(max_cpu_loras, max_loras)}


def adapts_unembedding(model_config: Any) -> bool:
    """vLLM serves adapters of this model's unembedding (`lm_head`): its model class names it
    among its LoRA embedding modules. Llama's classes do; Qwen2's do not, and vLLM refuses such
    an adapter ("expected target modules in {...}")."""
    from vllm.model_executor.models import ModelRegistry

    model_class, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    return "lm_head" in getattr(model_class, "embedding_modules", {})


class UnknownAdapter(KeyError):
    """A request named an adapter this engine was never given (or has removed)."""


@dataclass(frozen=True)
class AdapterSpec:
    """What vLLM reads from `adapter_config.json`: rank, alpha (scaling alpha / rank) and the
    modules adapted, by their names in the model."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]

    @classmethod
    def read(cls, directory: Path) -> AdapterSpec:
        config = json.loads((directory / "adapter_config.json").read_text())
        return cls(config["r"], config["lora_alpha"], tuple(config["target_modules"]))


class Adapters:
    """Name -> vLLM `LoRARequest` (a stable id, the directory of the current weights)."""

    def __init__(self, max_rank: int):
        self.max_rank = max_rank  # 0: the engine serves no adapter
        self._ids = itertools.count(1)  # vLLM's ids start at 1
        self._requests: dict[str, Any] = {}

    def load(self, name: str, directory: Path) -> Any:
        """The `LoRARequest` that loads `directory` as `name` (in place of its weights so far);
        requests name it from then on."""
        from vllm.lora.request import LoRARequest

        if self.max_rank == 0:
            raise ValueError(f"adapter {name!r}: this engine serves no LoRA adapter "
                             "(rollout.max_lora_rank=0)")
        spec = AdapterSpec.read(directory)
        if spec.rank > self.max_rank:
            raise ValueError(f"adapter {name!r}: rank {spec.rank} is above this engine's "
                             f"rollout.max_lora_rank={self.max_rank}")
        old = self._requests.get(name)
        lora_id = old.lora_int_id if old is not None else next(self._ids)
        self._requests[name] = LoRARequest(name, lora_id, str(directory))
        return LoRARequest(name, lora_id, str(directory), load_inplace=True)

    def request(self, name: str | None) -> Any:
        """The `LoRARequest` a request for `name` carries (None: the base model, no adapter)."""
        if name is None:
            return None
        try:
            return self._requests[name]
        except KeyError:
            raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded "
                                 f"(loaded: {sorted(self._requests) or 'none'})") from None

    def remove(self, name: str) -> int:
        """Forget `name`; its vLLM id, for the engine to drop it."""
        request = self.request(name)
        del self._requests[name]
        return request.lora_int_id

    def names(self) -> list[str]:
        return sorted(self._requests)
