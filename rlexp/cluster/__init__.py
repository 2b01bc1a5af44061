"""Where rlexp's parts run: `cluster=local` (one process; Ray is never imported) or
`cluster=ray` (rlexp/cluster/ray_cluster.py: rollout replicas as Ray actors).

A cluster builds the rollout engine (one engine, or a RolloutPool of replicas behind the
same Protocol) and says which weight transport fits it (`weight_transfer=auto`)."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlexp.protocols import RolloutEngine, WeightTransport


def engine_spec(rollout: DictConfig, transport: WeightTransport) -> dict[str, Any]:
    """The rollout group as a plain dict for one engine; a transport that needs the engine's
    side configured (vLLM's native weight transfer) names its backend."""
    spec: dict[str, Any] = OmegaConf.to_container(rollout, resolve=True)  # type: ignore[assignment]
    backend = getattr(transport, "engine_backend", None)
    if backend and "weight_transfer_backend" in spec and spec["weight_transfer_backend"] is None:
        spec["weight_transfer_backend"] = backend
    return spec


class LocalCluster:
    """Everything in this process: one rollout engine, the trainer beside it."""

    name = "local"
    multi_node = False

    def rollout_engine(self, rollout: DictConfig, model_path: str,
                       transport: WeightTransport) -> RolloutEngine:
        return instantiate(engine_spec(rollout, transport), model_path=model_path)

    def params(self) -> dict[str, Any]:
        import torch

        return {"cluster.nodes": 1, "cluster.gpus": torch.cuda.device_count()}

    def shutdown(self) -> None:
        """Nothing to stop: the engine and transport are shut down by the loop."""
