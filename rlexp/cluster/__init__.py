"""Where rlexp's parts run: `cluster=local` (one process; Ray is never imported) or
`cluster=ray` (rlexp/cluster/ray_cluster.py: rollout replicas, and with trainer.workers > 1
the trainer's ranks, as Ray actors).

A cluster builds the rollout engine (one engine, or a RolloutPool of replicas behind the
same Protocol) and the trainer (in this process, or a TrainerGroup behind the same Protocol),
and shows a weight transport what it needs of it (`Cluster`'s attributes, which
`weight_transfer=auto` picks by)."""

from __future__ import annotations

from typing import Any, Protocol

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlexp.constraints import AtLeast1, Placement
from rlexp.errors import config_error_unwrapped
from rlexp.protocols import RolloutEngine, Trainer
from rlexp.weights.protocols import ClusterShape, WeightTransport


class Cluster(ClusterShape, Protocol):
    """Where the rollout engines and the trainer run; its attributes (`ClusterShape`) are what
    a weight transport reads of it."""

    distributed: bool = False  # rollout replicas and trainer ranks run as actors of their own

    def rollout_engine(self, rollout: DictConfig, model_path: str,
                       transport: WeightTransport) -> RolloutEngine:
        """The `rollout` group's engine, or a pool of them, started as `transport` needs."""
        ...

    def trainer(self, trainer: DictConfig, model_path: str) -> Trainer: ...

    def check_readable(self, paths: dict[str, str]) -> None:
        """A ConfigError unless every machine that will load them can read `paths` (name ->
        path: the model, the checkpoint on resume)."""
        ...

    def params(self) -> dict[str, Any]:
        """What the run logs about the cluster (`cluster.*` params)."""
        ...

    def shutdown(self) -> None: ...


def engine_spec(rollout: DictConfig, transport: WeightTransport) -> dict[str, Any]:
    """The rollout group as a plain dict for one engine, with the weight-transfer backend the
    transport needs (vLLM's native transfer) where the group leaves it unset."""
    spec: dict[str, Any] = OmegaConf.to_container(rollout, resolve=True)  # type: ignore[assignment]
    backend = transport.engine_backend
    if backend and "weight_transfer_backend" in spec and spec["weight_transfer_backend"] is None:
        spec["weight_transfer_backend"] = backend
    return spec


def build_cluster(cfg: DictConfig) -> Cluster:
    """The `cluster` group, given what other groups own: the rollout replicas and their GPUs
    (rollout), the trainer's ranks (trainer) and `placement`; every cluster takes them.
    Passed here rather than interpolated in the YAML, so that `resume=... trainer.workers=1`
    reaches the cluster too (a resumed run's saved config holds resolved values)."""
    owned = {"replicas": cfg.rollout.get("replicas", 1),
             "gpus_per_replica": cfg.rollout.get("gpus_per_replica", 1),
             "placement": cfg.get("placement", "split"), "trainer_workers": cfg.trainer.get("workers", 1)}
    node = cfg.get("cluster")
    if node is None:
        return LocalCluster(**owned)
    with config_error_unwrapped():  # a cluster that cannot be joined or placed: its one line
        return instantiate(node, **owned)


class LocalCluster:
    """Everything in this process: one rollout engine, the trainer beside it."""

    name = "local"
    multi_node = False
    distributed = False  # one engine, one trainer, both in this process

    def __init__(self, replicas: AtLeast1 = 1, gpus_per_replica: AtLeast1 = 1, placement: Placement = "split",
                 trainer_workers: AtLeast1 = 1):
        """The arguments every cluster is given (`build_cluster`); one process holds one engine and
        one trainer (config.py refuses more replicas or workers without cluster=ray)."""
        self.replicas, self.gpus_per_replica = replicas, gpus_per_replica
        self.placement, self.trainer_workers = placement, trainer_workers

    def rollout_engine(self, rollout: DictConfig, model_path: str,
                       transport: WeightTransport) -> RolloutEngine:
        return instantiate(engine_spec(rollout, transport), model_path=model_path)

    def trainer(self, trainer: DictConfig, model_path: str) -> Trainer:
        return instantiate(trainer, model_path=model_path)

    def check_readable(self, paths: dict[str, str]) -> None:
        """This process already read them (preflight)."""

    def params(self) -> dict[str, Any]:
        import torch

        from rlexp.weights.auto import auto_pick

        return {"cluster.nodes": 1, "cluster.multi_node": False, "cluster.gpus": torch.cuda.device_count(),
                "cluster.auto_transport": auto_pick(self)}

    def shutdown(self) -> None:
        """Nothing to stop: the engine and transport are shut down by the loop."""
