"""EngineReplica: one rollout engine inside a Ray actor, built from the rollout group's config,
with the weight loading the pool (rlexp/cluster/pool.py) asks of it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from rlexp.constraints import UpdateMode
from rlexp.sample import Generation, SamplingConfig
from rlexp.weights.adapter_file import AdapterReceiver
from rlexp.weights.object_store import ObjectStoreReceiver


class EngineReplica:
    """Runs inside a Ray actor: one rollout engine built from its config (`spec`, the rollout
    group with `_target_`) and the weight loading the pool asks of it."""

    def __init__(self, spec: dict[str, Any], model_path: str):
        from hydra.utils import instantiate

        self.engine = instantiate(dict(spec, replicas=1), model_path=model_path)
        self._received = ObjectStoreReceiver()
        self._adapters = AdapterReceiver()
        self._again_told = 0  # the engine's prefilled-again tokens told to the pool so far

    def ready(self) -> tuple[str, int, int]:
        """(node id, pid, version): answers once the engine is up."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid(), self.engine.version

    async def generate(self, token_ids: list[int], sampling: SamplingConfig,
                       images: list | None = None) -> Generation:
        return await self.engine.generate(token_ids, sampling, images)

    async def generate_counted(self, token_ids: list[int], sampling: SamplingConfig,
                               images: list | None = None) -> tuple[Generation, int]:
        """`generate` (what the pool calls), and the tokens the engine prefilled again since
        the last such reply (prompts and tokens re-sent after an abort pause; this
        generation's own re-sends among them): the engine counts them in its process, the
        pool adds them up over its replicas (RolloutPool.busy.prefilled_again)."""
        gen = await self.engine.generate(token_ids, sampling, images)
        total = self.engine.busy.prefilled_again
        again, self._again_told = total - self._again_told, total
        return gen, again

    async def pause(self, mode: UpdateMode) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def load_weights(self, directory: str, version: int) -> None:
        """From a safetensors file this node can read (RamFileTransport on one node)."""
        await self.engine.load_weights(Path(directory), version)

    async def load_adapter_files(self, name: str, files: dict[str, bytes],
                                 version: int | None = None) -> None:
        """A LoRA adapter from peft's files, arrived through Ray's object store (resolved on
        this node): written into this replica's own RAM directory and loaded from there."""
        await self._adapters.load(name, files, self.engine, version)

    async def load_weights_object(self, arrays: dict[str, Any], version: int) -> None:
        """From Ray's object store (`arrays` arrives resolved on this node)."""
        await self._received.load(arrays, self.engine, version)

    async def call_engine(self, method: str, *args: Any) -> Any:
        """A method of the engine by name (vLLM's native weight transfer on GPU)."""
        result = getattr(self.engine, method)(*args)
        return await result if asyncio.iscoroutine(result) else result

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._received.close()
        self._adapters.close()


def no_room(bundle: dict[str, float], node: str) -> str | None:
    """Why a replica lost with its node `node` (its id's first 8 hex digits) cannot come back
    now, as Ray's available resources per live node show them (`room_report`); None where
    they cannot be read (Ray Client)."""
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - the loss line goes out without it
        return None
    return room_report(bundle, node, free)


def room_report(bundle: dict[str, float], node: str, free: dict[str, dict[str, float]]) -> str | None:
    """None when node `node` is alive (Ray restarts the replica in its own bundle there) or a
    live node has `bundle` free (Ray places the bundle again there); else what the bundle needs
    and what each live node (`free`: node id -> available resources) has of it."""
    if any(n.startswith(node) for n in free):
        return None
    if any(all(r.get(k, 0.0) >= v for k, v in bundle.items()) for r in free.values()):
        return None
    need = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    has = "; ".join(f"node {n[:8]}: " + ", ".join(f"{r.get(k, 0.0):g} {k}" for k in bundle)
                    for n, r in sorted(free.items()))
    has = has or "no live node"
    return f"its node is gone and no live node has room for its bundle ({need}; free: {has})"
