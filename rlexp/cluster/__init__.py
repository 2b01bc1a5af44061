"""Where rlexp's parts run: `cluster=local` (one process; Ray is never imported) or
`cluster=ray` (rlexp/cluster/ray_cluster.py: rollout replicas, and with trainer.workers > 1
the trainer's ranks, as Ray actors).

A cluster builds the rollout engine (one engine, or a RolloutPool of replicas behind the
same Protocol) and the trainer (in this process, or a TrainerGroup behind the same Protocol),
and says which weight transport fits it (`weight_transfer=auto`)."""

from __future__ import annotations

import inspect
from typing import Any

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from rlexp.protocols import RolloutEngine, Trainer, WeightTransport


def engine_spec(rollout: DictConfig, transport: WeightTransport) -> dict[str, Any]:
    """The rollout group as a plain dict for one engine; a transport that needs the engine's
    side configured (vLLM's native weight transfer) names its backend."""
    spec: dict[str, Any] = OmegaConf.to_container(rollout, resolve=True)  # type: ignore[assignment]
    backend = getattr(transport, "engine_backend", None)
    if backend and "weight_transfer_backend" in spec and spec["weight_transfer_backend"] is None:
        spec["weight_transfer_backend"] = backend
    return spec


def build_cluster(cfg: DictConfig) -> Any:
    """The `cluster` group, given what other groups own: the rollout replicas and their GPUs
    (rollout), the trainer's ranks (trainer) and `placement`. Passed here rather than
    interpolated in the YAML, so that `resume=... trainer.workers=1` reaches the cluster too
    (a resumed run's saved config holds resolved values)."""
    node = cfg.get("cluster")
    if node is None:
        return LocalCluster()
    owned = {"replicas": cfg.rollout.get("replicas", 1),
             "gpus_per_replica": cfg.rollout.get("gpus_per_replica", 1),
             "placement": cfg.get("placement", "split"), "trainer_workers": cfg.trainer.get("workers", 1)}
    takes = inspect.signature(get_object(node._target_)).parameters
    return instantiate(node, **{k: v for k, v in owned.items() if k in takes})


class LocalCluster:
    """Everything in this process: one rollout engine, the trainer beside it."""

    name = "local"
    multi_node = False

    def rollout_engine(self, rollout: DictConfig, model_path: str,
                       transport: WeightTransport) -> RolloutEngine:
        return instantiate(engine_spec(rollout, transport), model_path=model_path)

    def trainer(self, trainer: DictConfig, model_path: str) -> Trainer:
        return instantiate(trainer, model_path=model_path)

    def params(self) -> dict[str, Any]:
        import torch

        return {"cluster.nodes": 1, "cluster.gpus": torch.cuda.device_count()}

    def shutdown(self) -> None:
        """Nothing to stop: the engine and transport are shut down by the loop."""
