"""`weight_transfer=object_store` (cluster=ray, replicas on other nodes, no shared file system):
one `ray.put` of the weights per sync; each replica's node pulls the object once and loads it
through a RAM file of its own. Both halves: `ObjectStoreTransport` in the driver,
`ObjectStoreReceiver` in each replica's actor."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from rlexp.errors import ConfigError
from rlexp.weights.protocols import ClusterShape, LoadsWeightFiles, LoadsWeightObjects, NamedTensors
from rlexp.weights.ram_file import RamFileTransport


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
    """The sending half: the weights into Ray's object store, the engine (a RolloutPool)
    told where they are."""

    engine_backend = None
    sends_from_driver = False  # a trainer group's weights too (they reach this process on the CPU)
    sends_adapter = False  # the policy's full tensors

    def __init__(self, cluster: ClusterShape | None = None):
        if cluster is not None and cluster.name != "ray":
            raise ConfigError(f"weight_transfer=object_store goes through Ray's object store: it needs "
                              f"cluster=ray (this run has cluster={cluster.name})")
        self._ref: Any = None

    async def transfer(self, weights: NamedTensors, engine: LoadsWeightObjects, version: int) -> None:
        import ray

        self._ref = ray.put(to_arrays(weights))  # kept: a restarted replica reloads from it
        await engine.load_weights_object(self._ref, version)

    def close(self) -> None:
        self._ref = None


class ObjectStoreReceiver:
    """The receiving half, in a replica's actor: `arrays` (the object, resolved on this node)
    written into this replica's own RAM file, then loaded like a local sync."""

    def __init__(self) -> None:
        self._file: RamFileTransport | None = None

    async def load(self, arrays: dict[str, tuple[str, Any]], engine: LoadsWeightFiles, version: int) -> None:
        if self._file is None:
            self._file = RamFileTransport()
        await self._file.transfer(from_arrays(arrays), engine, version)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
