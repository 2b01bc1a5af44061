"""GPU: vLLM's native weight transfer over CUDA IPC (`weight_transfer=vllm_ipc`).

The trainer's tensors stay where they are: vLLM's trainer-side IPC engine hands the
engine's workers CUDA IPC handles of them, and each worker copies them into its own
weights (one device-to-device copy, vLLM's checkpoint-format loading). vLLM's protocol is
synchronous (a `VLLMWeightSyncClient`), so the send runs in a thread and each call to the
in-process `AsyncLLM` is put back on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import torch

from rlexp.protocols import NamedTensors


class _NamedTensors:
    """One sync's named tensors as the `WeightSource` vLLM's trainer engine reads."""

    def __init__(self, weights: NamedTensors):
        from vllm.distributed.weight_transfer.base import ParamMeta

        self.tensors = [(name, t.detach()) for name, t in weights]
        self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors]

    def metadata(self):
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


def _source(weights: NamedTensors):
    from vllm.distributed.weight_transfer.base import WeightSource

    class Source(_NamedTensors, WeightSource):
        """The trainer's tensors as vLLM's WeightSource (vLLM is imported only on this path)."""

    return Source(weights)


class _LoopClient:
    """`VLLMWeightSyncClient` over an in-process AsyncLLM, called from a worker thread."""

    def __init__(self, llm, loop: asyncio.AbstractEventLoop):
        self.llm, self.loop = llm, loop

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._call(self.llm.start_weight_update())

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._call(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.llm.finish_weight_update(weight_version))


class VllmIpcTransport:
    """Needs CUDA and an engine started with `weight_transfer_backend: ipc` (the
    `weight_transfer=vllm_ipc` config sets both). `packed`: send through one bounded
    staging buffer instead of a handle per tensor (less memory, one more copy)."""

    engine_backend = "ipc"  # the engine side of the transfer (rollout.weight_transfer_backend)

    def __init__(self, packed: bool = False):
        if not torch.cuda.is_available():
            raise RuntimeError("weight_transfer=vllm_ipc needs CUDA; on CPU use weight_transfer=ram_file")
        self.packed = packed
        self._sender: Any = None

    async def transfer(self, weights: NamedTensors, engine, version: int) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        source = _source(weights)
        client = _LoopClient(engine.llm, asyncio.get_running_loop())

        def send() -> None:
            if self._sender is None:
                self._sender = WeightTransferTrainerFactory.trainer_init(
                    IPCTrainerInitInfo(rank=0, packed=self.packed), client=client, source=source)
            self._sender.client, self._sender.source = client, source
            self._sender.send_weights()

        await asyncio.to_thread(send)
        await engine.weights_loaded(version)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
