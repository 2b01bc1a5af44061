"""How new weights reach every replica of a RolloutPool, one method per transport
(rlexp/weights/protocols.py: what each asks of an engine). Each fans out to the replicas and
is kept, so a replica Ray restarts later catches up with the others by running it again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlexp.cluster.replica_calls import answer
from rlexp.weights.adapter_file import read_adapter
from rlexp.weights.protocols import EngineProcess


class PoolWeights:
    """RolloutPool's weight loading: its replicas' `_fan_out`, the lock one update (or a
    replica's catch-up) holds, the last update's `_reload`, and the object-store bytes pulled
    since the last report."""

    version: int
    call_timeout_s: float
    _update: asyncio.Lock
    _reload: Callable[[Any], Awaitable[None]] | None
    _fan_out: Callable[[Callable[[Any], Any]], Awaitable[None]]
    _pulled_bytes: int
    _pulled_nodes: int

    async def _update_weights(self, load: Callable[[Any], Awaitable[None]], version: int) -> None:
        """Every replica runs `load(actor)` (it serves `version` after); a replica restarted
        later runs the same `load`, so it catches up with the others."""
        async with self._update:
            await self._fan_out(load)
            self._reload = load
            self.version = version

    async def load_weights(self, directory: Path, version: int) -> None:
        """From a file every replica's node can read (RamFileTransport, one node)."""
        await self._update_weights(lambda a: a.load_weights.remote(str(directory), version), version)

    async def load_adapter(self, name: str, directory: Path, version: int | None = None) -> None:
        """A LoRA adapter from peft's files in this process's node (AdapterFileTransport): one
        `ray.put` of them, each replica's node pulls it; each replica serves it on its base,
        and a restarted replica loads it again."""
        import ray

        ref = ray.put(read_adapter(directory))
        await self._update_weights(lambda a: a.load_adapter_files.remote(name, ref, version),
                                   self.version if version is None else version)
        self._count_pulled(ref)

    async def load_weights_object(self, ref: Any, version: int) -> None:
        """From Ray's object store (ObjectStoreTransport): each replica's node pulls `ref`."""
        await self._update_weights(lambda a: a.load_weights_object.remote(ref, version), version)
        self._count_pulled(ref)

    def _count_pulled(self, ref: Any) -> None:
        """The bytes of `ref` that crossed into other nodes' object stores, as Ray's own
        object directory lists its copies."""
        import ray
        from ray.experimental import get_object_locations

        where = get_object_locations([ref])[ref]
        others = set(where["node_ids"]) - {ray.get_runtime_context().get_node_id()}
        self._pulled_bytes += where["object_size"] * len(others)
        self._pulled_nodes = len(others)

    async def load_weights_native(self, send: Callable[[EngineProcess], Awaitable[None]],
                                  version: int) -> None:
        """vLLM's native transfer: each replica's engine process, reached through
        `EngineReplica.call_engine`; a replica Ray restarted is a new process."""
        async def load(actor: Any) -> None:
            node, pid, _ = await answer(actor.ready.remote(), self.call_timeout_s, "rollout replica")
            await send(EngineProcess(actor, (node, pid),
                                     lambda method, *args: actor.call_engine.remote(method, *args)))

        await self._update_weights(load, version)
