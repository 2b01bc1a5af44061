"""Weight transports that need a cluster, and `weight_transfer=auto`, which picks one:

    one node, no GPU            ram_file      (rlexp/rollout/weights.py; every replica maps it)
    replicas on other nodes     object_store  (Ray's object store: put once, each node pulls)
    GPU, vLLM, placement=colocate   vllm_ipc  (CUDA IPC handles; rlexp/rollout/vllm_ipc.py)
    GPU, vLLM, placement=split      vllm_nccl (NCCL broadcast; rlexp/rollout/vllm_nccl.py)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from rlexp.protocols import NamedTensors, WeightTransport

log = logging.getLogger(__name__)


def to_arrays(weights: NamedTensors) -> dict[str, tuple[str, Any]]:
    """Named tensors as numpy arrays (Ray stores those without a copy on put and maps them on
    get), each with its torch dtype; bfloat16 travels as its bits. Names that share a tensor
    share the array (pickle keeps one)."""
    out: dict[str, tuple[str, Any]] = {}
    seen: dict[tuple, Any] = {}
    for name, t in weights:
        t = t.detach().to("cpu")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            raw = t.contiguous()
            seen[key] = (raw.view(torch.int16) if raw.dtype == torch.bfloat16 else raw).numpy()
        out[name] = (str(t.dtype).removeprefix("torch."), seen[key])
    return out


def from_arrays(arrays: dict[str, tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    with warnings.catch_warnings():  # the object store's arrays are read-only; they are only read
        warnings.simplefilter("ignore", UserWarning)
        for name, (dtype, array) in arrays.items():
            t = torch.from_numpy(array)
            yield name, t.view(torch.bfloat16) if dtype == "bfloat16" else t


class ObjectStoreTransport:
    """Across nodes without a shared file system: one `ray.put` of the weights per sync; each
    replica's node pulls the object once and loads it through a RAM file of its own."""

    def __init__(self):
        self._ref: Any = None

    async def transfer(self, weights: NamedTensors, engine: Any, version: int) -> None:
        import ray

        self._ref = ray.put(to_arrays(weights))  # kept: a restarted replica reloads from it
        await engine.load_weights_object(self._ref, version)

    def close(self) -> None:
        self._ref = None


def auto_transport(cluster: Any) -> WeightTransport:
    """The transport that fits `cluster` (see the module's table)."""
    from rlexp.rollout.weights import RamFileTransport

    # A trainer group's weights reach this process bucket by bucket, as CPU tensors.
    group = getattr(cluster, "trainer_workers", 1) > 1
    if cluster.name == "ray" and torch.cuda.is_available() and not group:
        if cluster.placement == "colocate":
            from rlexp.rollout.vllm_ipc import VllmIpcTransport

            chosen: WeightTransport = VllmIpcTransport()
        else:
            from rlexp.rollout.vllm_nccl import VllmNcclTransport

            chosen = VllmNcclTransport()
    elif cluster.multi_node:
        chosen = ObjectStoreTransport()
    else:
        chosen = RamFileTransport()
    log.info("weight_transfer=auto: %s", type(chosen).__name__)
    return chosen
