"""How new weights reach a running vLLM engine: the pause around an update (keep, abort or
wait for the running requests), a whole model reloaded in place, and LoRA adapters loaded by
name on the one base model (rlexp/rollout/vllm_adapters.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlexp.constraints import UpdateMode
from rlexp.rollout.vllm_adapters import Adapters


class WeightUpdates:
    """VLLMEngine's weight updates: its `llm` (an AsyncLLM), `_call` (a call into the engine
    process, EngineDead if that dies meanwhile), the pause state its requests wait on, and
    its adapters."""

    llm: Any
    _call: Callable[[Awaitable[Any]], Awaitable[Any]]
    _running: asyncio.Event
    _interrupts: int
    _keeping: bool
    _labelled: bool
    adapters: Adapters
    policy_adapter: str | None
    version: int

    async def pause(self, mode: UpdateMode) -> None:
        """keep: requests stay in the scheduler with their KV cache (vLLM's keep mode without
        its cache clearing, which would preempt and prefill every request again); abort: cut
        them short, to continue from their tokens after `resume`; wait: let them finish."""
        self._running.clear()
        self._interrupts += mode == "abort"
        self._keeping = mode == "keep"
        await self._call(self.llm.pause_generation(mode=mode, clear_cache=mode != "keep"))

    async def resume(self) -> None:
        await self._call(self.llm.resume_generation())
        self._keeping = False
        self._running.set()

    async def load_weights(self, directory: Path, version: int) -> None:
        """Reload `directory/model.safetensors` in place; from now on tokens carry `version`."""
        await self._call(self.llm.collective_rpc("load_shared_weights", args=(str(directory),)))
        await self.weights_loaded(version)

    async def weights_loaded(self, version: int) -> None:
        """New weights are in place (by whatever transport): from now on tokens carry `version`.
        Cached KV was computed by the old weights: the reset drops it where no request holds it
        (after abort or wait); KV that requests kept (keep) stays out of later requests' reach
        by its cache salt, the version their request was sent at. Under keep there is no reset:
        vLLM resets all or nothing, so with requests holding blocks it would only warn."""
        if not self._keeping:
            await self._call(self.llm.reset_prefix_cache())
        await self._call(self.llm.update_weight_version(str(version)))
        self._labelled = True
        if self.llm.model_config.is_multimodal_model:  # so were the cached image encodings (and
            await self._call(self.llm.reset_encoder_cache())  # a seen image would miss: the engine dies)
        self.version = version

    async def load_adapter(self, name: str, directory: Path, version: int | None = None) -> None:
        """Serve the LoRA adapter in `directory` (peft's files) as `name`, in place of its
        weights so far; requests that name it use it from their next engine step. `version`:
        the policy version it makes (the run's policy adapter), as `weights_loaded`; None for
        an adapter that is not the engine's policy (a Tinker tenant's)."""
        await self._call(self.llm.add_lora(self.adapters.load(name, directory)))
        if version is not None:
            self.policy_adapter = name
            await self.weights_loaded(version)

    async def remove_adapter(self, name: str) -> None:
        await self._call(self.llm.remove_lora(self.adapters.remove(name)))
        if self.policy_adapter == name:
            self.policy_adapter = None

