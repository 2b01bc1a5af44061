"""The RolloutEngine seam, and helpers every engine shares."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextvars import ContextVar
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

    async def pause(self, interrupt: bool) -> None:
        """Stop starting new work before a weight update. interrupt=False: wait until every
        in-flight request finished; True: cut them short now; each resumes under the new
        weights after `resume`, every token keeping the version that produced it."""

    async def resume(self) -> None: ...

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


# Tokens generated on behalf of the current asyncio task tree (a scheduler sets a fresh list
# per prompt group; engines add to it), so tokens that were generated but never trained
# are counted exactly, whatever agent produced them.
generated_tokens: ContextVar[list[int] | None] = ContextVar("generated_tokens", default=None)


def count_generated(n: int) -> None:
    meter = generated_tokens.get()
    if meter is not None:
        meter[0] += n


class BusyMeter:
    """Seconds during which at least one request was being generated (engine busy time),
    and the tokens generated (the engine adds them)."""

    def __init__(self):
        self.tokens = 0
        self.active = 0
        self._busy = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._busy += time.perf_counter() - self._since

    @property
    def busy_s(self) -> float:
        return self._busy + (time.perf_counter() - self._since if self.active else 0.0)
