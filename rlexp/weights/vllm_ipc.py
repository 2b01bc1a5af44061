"""GPU: vLLM's native weight transfer over CUDA IPC (`weight_transfer=vllm_ipc`).

The trainer's tensors stay where they are: vLLM's trainer-side IPC engine hands the engine's
workers CUDA IPC handles of them, and each worker copies them into its own weights (one
device-to-device copy, vLLM's checkpoint-format loading). A handle opens only on the GPU it
was made on, so every engine must share the trainer's GPU (placement=colocate; a replica on
another GPU fails with vLLM's "IPC handle not found for GPU UUID"). What it shares with the
NCCL transport (threads, a pool's replicas, restarts): vllm_native.py."""

from __future__ import annotations

from typing import Any

from rlexp.weights.protocols import ClusterShape
from rlexp.weights.vllm_native import EngineClient, NativeTransport


class VllmIpcTransport(NativeTransport):
    """Needs CUDA and engines started with `weight_transfer_backend: ipc` (the
    `weight_transfer=vllm_ipc` config sets both). `packed`: send through one bounded
    staging buffer instead of a handle per tensor (less memory, one more copy)."""

    engine_backend = "ipc"

    def __init__(self, packed: bool = False, cluster: ClusterShape | None = None):
        super().__init__(cluster)
        self.packed = packed

    def _connect(self, client: EngineClient, source: Any) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=self.packed), client=client, source=source)
