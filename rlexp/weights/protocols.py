"""What a weight transport is, and what it asks of the engine it carries weights to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


class WeightTransport(Protocol):
    """Carries one version of the trainer's weights into a rollout engine. `weights` yields
    full tensors by name, one at a time (a sharded trainer gathers each as it is asked for).
    The engine serves `version` once `transfer` returns.

    Every transport is built with the run's cluster (`cluster=`, a `ClusterShape`), so that
    one that cannot work on it says so before any engine starts."""

    # sends from a trainer in this process (the driver): not from a trainer group's ranks,
    # so the config check refuses it with trainer.workers > 1
    sends_from_driver: bool = False
    # carries a LoRA run's adapter (trainer.adapter_weights) to an engine that serves adapters,
    # not the policy's full tensors (rlexp.step.outgoing)
    sends_adapter: bool = False

    @property
    def engine_backend(self) -> str | None:
        """vLLM's native weight-transfer backend the engine must start with (the engine's
        `weight_transfer_backend`); None: the transport uses the engine's own load methods."""
        ...

    async def transfer(self, weights: NamedTensors, engine: Any, version: int) -> None: ...

    def close(self) -> None: ...


class ClusterShape(Protocol):
    """What a transport reads of the cluster it runs on (rlexp/cluster: LocalCluster, RayCluster)."""

    @property
    def name(self) -> str:
        """"local" or "ray"."""
        ...

    @property
    def multi_node(self) -> bool:
        """Some rollout replica runs on another node than this process."""
        ...

    @property
    def placement(self) -> str:
        """"split" or "colocate": the rollout engines' devices against the trainer's."""
        ...

    @property
    def trainer_workers(self) -> int:
        """The trainer's ranks (more than 1: its weights reach this process on the CPU)."""
        ...


class LoadsWeightFiles(Protocol):
    """An engine that can reload its weights from a directory holding `model.safetensors`
    (ram_file; VLLMEngine, HFEngine, RolloutPool)."""

    async def load_weights(self, directory: Path, version: int) -> None: ...


class LoadsWeightObjects(Protocol):
    """An engine whose replicas pull the weights from Ray's object store (object_store;
    RolloutPool): `ref` holds `object_store.to_arrays(weights)`."""

    async def load_weights_object(self, ref: Any, version: int) -> None: ...


@dataclass
class EngineProcess:
    """One vLLM engine process as vLLM's native weight transfer reaches it."""

    key: Any  # the engine (or replica) it serves: one sender is kept per key
    process: Any  # the process serving it now: a new one (Ray restarted it) is connected afresh
    call: Callable[..., Any]  # call(method, *args): that method of the engine (may return an awaitable)


def in_process(engine: Any) -> EngineProcess:
    """An engine in this process, its methods called directly."""
    return EngineProcess(engine, None, lambda method, *args: getattr(engine, method)(*args))


class LoadsNativeWeights(Protocol):
    """An engine vLLM's native weight transfer reaches process by process (vllm_ipc,
    vllm_nccl; VLLMEngine, RolloutPool)."""

    async def load_weights_native(self, send: Callable[[EngineProcess], Awaitable[None]],
                                  version: int) -> None:
        """`send(process)` for each of its engine processes; `send` leaves that process serving
        `version`. A pool runs `send` again for a replica Ray restarts later."""
        ...
