"""GPU: what vLLM's native weight transfers (vllm_ipc.py over CUDA IPC, vllm_nccl.py over NCCL)
share: the sending threads, one sender per engine process, the replay for a restarted replica.

The engine (a local VLLMEngine or a RolloutPool under cluster=ray) hands each of its engine
processes to `send` (`LoadsNativeWeights.load_weights_native`). vLLM's trainer side is
synchronous (it drives a `VLLMWeightSyncClient`), so each send runs in a thread and each call
it makes is put back on the event loop, to that process's `call` (the VLLMEngine's methods, or
a replica's through `EngineReplica.call_engine`). Each engine process gets its own trainer-side
vLLM engine (a "sender"), connected at its first sync and again when the process changes (Ray
restarted the replica); a pool fans one full update out to every replica, one at a time.

A replica that Ray restarts starts from the model path, i.e. policy version 0. The pool
replays the last sync for it, but these transports hold no copy of the weights they sent: the
trainer's tensors have moved on since (it may be training right now). So the replay sends
nothing; the replica serves version 0 (its tokens say so, and the scheduler counts their
staleness) until the next sync, which reconnects and updates it like the others."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlexp.weights.protocols import ClusterShape, EngineProcess, LoadsNativeWeights, NamedTensors

log = logging.getLogger(__name__)


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


def _on_weights_gpu(source: _NamedTensors) -> contextlib.AbstractContextManager:
    """vLLM's trainer side works on the current CUDA device, which is per thread (a fresh
    thread's is cuda:0): make it the device the weights are on."""
    device = source.tensors[0][1].device if source.tensors else torch.device("cpu")
    if device.type != "cuda":
        raise RuntimeError(f"vLLM's native weight transfer sends from the trainer's GPU; its weights are "
                           f"on {device}")
    return torch.cuda.device(device)


async def _awaited(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


class EngineClient:
    """vLLM's `VLLMWeightSyncClient`, called from the sending thread, over one engine:
    `call(method, *args)` (run on the event loop) calls that method of the engine."""

    def __init__(self, loop: asyncio.AbstractEventLoop, call: Callable[..., Any]):
        self.loop, self._call = loop, call
        self.abort: Callable[[], None] | None = None  # tears the sender down if the engine fails
        self.failed: BaseException | None = None

    def call(self, method: str, *args: Any) -> Any:
        async def run():
            return await _awaited(self._call(method, *args))

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        try:
            self.call("update_weights", update_info)
        except BaseException as e:
            # NCCL: the trainer's side of the broadcast would wait forever for a peer that
            # failed (or died); aborting the communicator releases it.
            self.failed = e
            if self.abort is not None:
                self.abort()
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update")


class NativeTransport:
    """The part the IPC and NCCL transports share (see the module docstring); a subclass
    names its `engine_backend` and connects a sender to one engine (`_connect`)."""

    engine_backend: str  # the engine side of the transfer (rollout.weight_transfer_backend)
    sends_from_driver = True  # from a trainer in this process: not from a trainer group's ranks
    sends_adapter = False  # the policy's full tensors

    def __init__(self, cluster: ClusterShape | None = None) -> None:
        """`cluster`: not read (any cluster with CUDA; config.py refuses a trainer group)."""
        if not torch.cuda.is_available():
            raise RuntimeError(f"weight_transfer=vllm_{self.engine_backend} needs CUDA; on CPU use "
                               "weight_transfer=ram_file")
        self._senders: dict[Any, tuple[Any, Any]] = {}  # engine -> (its process, sender)
        self._lock = threading.Lock()  # one send at a time: bounded staging memory on the GPU

    def _connect(self, client: EngineClient, source: Any) -> Any:
        """vLLM's trainer-side sender for one engine: each subclass (IPC, NCCL) returns its own."""
        raise NotImplementedError(f"{type(self).__name__} must define _connect")

    def _send(self, key: Any, process: Any, client: EngineClient, source: Any) -> None:
        """In a thread: one full update of one engine (`key`), connecting to it first if it is
        new or its `process` changed."""
        with self._lock, _on_weights_gpu(source):
            held = self._senders.pop(key, None)
            if held is not None and held[0] != process:
                held[1].shutdown()
                held = None
            sender = held[1] if held is not None else self._connect(client, source)
            sender.client, sender.source = client, source
            client.abort = sender.shutdown
            try:
                sender.send_weights()
            except BaseException as e:
                sender.shutdown()  # not kept: the next sync connects again
                if client.failed is not None and client.failed is not e:
                    raise client.failed from e  # the engine's error, not the aborted send's
                raise
            self._senders[key] = (process, sender)

    async def transfer(self, weights: NamedTensors, engine: LoadsNativeWeights, version: int) -> None:
        source = _source(weights)
        loop = asyncio.get_running_loop()
        current = True

        async def send(process: EngineProcess) -> None:
            if not current:  # a pool replaying this sync for a restarted replica
                log.warning("a restarted rollout replica keeps the model's initial weights (version 0) "
                            "until the next weight sync: vLLM's %s transfer cannot resend version %d",
                            self.engine_backend, version)
                return
            client = EngineClient(loop, process.call)
            await asyncio.to_thread(self._send, process.key, process.process, client, source)
            await _awaited(process.call("weights_loaded", version))

        try:
            await engine.load_weights_native(send, version)
        finally:
            current = False

    def close(self) -> None:
        for _, sender in self._senders.values():
            sender.shutdown()
        self._senders.clear()
