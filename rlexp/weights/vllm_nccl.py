"""GPU: vLLM's native weight transfer over NCCL (`weight_transfer=vllm_nccl`), for engines on
other GPUs than the trainer's (placement=split), on this node or another.

vLLM's trainer-side NCCL engine opens a group with the trainer as rank 0 and one engine's
workers after it, then broadcasts the trainer's tensors to them (packed into bounded staging
buffers by default), each worker loading them as they arrive (vLLM's checkpoint-format loading).
NCCL refuses two ranks on one GPU: trainer and engine must be on different GPUs (sharing one:
weight_transfer=vllm_ipc).

One group per engine: with a RolloutPool (cluster=ray) every replica has its own group with the
trainer, and a sync broadcasts to the replicas one after another (vllm_native.py has
the part shared with the IPC transport: the pool fan-out, threads, restarts). A single group
holding every replica would broadcast once, but vLLM ranks an engine's workers from its own
(data-parallel) index, the same in every replica; and an NCCL group's members are fixed, so one
dead replica would hang every broadcast and a restarted one could never join again. Per group,
a replica that fails during a transfer aborts only its own communicator, and one restarted by Ray
is connected afresh at the next sync (until then it serves the model's initial weights, version
0: nothing here keeps a copy of a past version to resend)."""

from __future__ import annotations

import logging
from typing import Any

from rlexp.weights.protocols import ClusterShape
from rlexp.weights.vllm_native import EngineClient, NativeTransport

log = logging.getLogger(__name__)


class VllmNcclTransport(NativeTransport):
    """Needs CUDA and engines started with `weight_transfer_backend: nccl` (the
    `weight_transfer=vllm_nccl` config sets both). `packed`: broadcast through bounded staging
    buffers (vLLM's default) instead of one broadcast per tensor. `address`: the trainer's
    address as the engines reach it (null: vLLM's guess, `VLLM_HOST_IP` or this node's IP)."""

    engine_backend = "nccl"

    def __init__(self, packed: bool = True, address: str | None = None, cluster: ClusterShape | None = None):
        super().__init__(cluster)
        self.packed, self.address = packed, address

    def _connect(self, client: EngineClient, source: Any) -> Any:
        """The rendezvous: vLLM's trainer engine runs the engine's side of it in a thread while
        it opens rank 0 (both block until every rank has joined)."""
        import torch
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_ip, get_open_port

        info = NCCLTrainerInitInfo(rank=0, master_address=self.address or get_ip(),
                                   master_port=get_open_port(), world_size=1 + client.call("workers"),
                                   packed=self.packed)
        try:
            return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        except Exception:  # raised as it is: the pool tells a lost replica by its error's type
            log.error("weight_transfer=vllm_nccl: the trainer (cuda:%d) could not form an NCCL group with "
                      "the rollout engine at %s:%d. NCCL needs them on different GPUs (sharing one: "
                      "weight_transfer=vllm_ipc)", torch.cuda.current_device(), info.master_address,
                      info.master_port)
            raise
