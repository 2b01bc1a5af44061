"""vLLM's native weight transfer (rlexp/weights/vllm_ipc.py, vllm_nccl.py): the engine's side
of it, called by name by the trainer's side (through EngineReplica.call_engine under
cluster=ray)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rlexp.weights.protocols import EngineProcess, in_process


class NativeTransfer:
    """VLLMEngine's weight-transfer calls: its `llm` (an AsyncLLM) and `_call` (a call into
    the engine process, EngineDead if that dies meanwhile)."""

    llm: Any
    _call: Callable[[Awaitable[Any]], Awaitable[Any]]

    async def load_weights_native(self, send: Callable[[EngineProcess], Awaitable[None]],
                                  version: int) -> None:
        """This engine's process is the one to send to (its methods called in this process)."""
        await send(in_process(self))

    def workers(self) -> int:
        """vLLM's worker processes (tensor x pipeline parallel): each joins an NCCL transfer group."""
        return self.llm.vllm_config.parallel_config.world_size

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._call(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    async def start_weight_update(self) -> None:
        await self._call(self.llm.start_weight_update())

    async def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._call(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    async def finish_weight_update(self) -> None:
        await self._call(self.llm.finish_weight_update())
