"""`cluster=ray`: the rollout engines, and the trainer's ranks when `trainer.workers` > 1,
as Ray actors placed by placement groups.

    cluster.address=null          RAY_ADDRESS when set, else a local Ray stopped with the run
    cluster.address=auto          join the Ray cluster this node belongs to (`ray start`)
    cluster.address=host:6379     join the cluster whose head listens there
    cluster.address=ray://h:10001 join a remote cluster through Ray Client
(rlexp/cluster/ray_connect.py). Before any replica or rank starts, every node that holds one
of the run's bundles must read the model (and the checkpoint on resume): `check_readable`.

Placement (`placement=split|colocate`, one bundle per rollout replica):
    split     each replica's actor takes its whole bundle (`cluster.cpus_per_replica` CPUs,
              `rollout.gpus_per_replica` GPUs): the trainer trains on other devices, and the
              async scheduler overlaps the two.
    colocate  each replica's actor takes half of its bundle; the other half is the trainer's
              share of the same devices. On GPU vLLM sleeps while the trainer trains.

The trainer: with `trainer.workers: 1` it trains in this process (on GPU with split: the
last GPU). With more, a TrainerGroup (rlexp/cluster/trainer_group.py): one bundle per rank
(`cluster.cpus_per_trainer_worker` CPUs, one GPU on GPU clusters) in a second placement
group. Both groups use `cluster.strategy`: PACK (as few nodes as fit), SPREAD (over as many
nodes as possible), or Ray's STRICT_ variants.
"""

from __future__ import annotations

import logging
import math
import os
from functools import partial
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlexp import orphans
from rlexp.cluster import engine_spec, ray_connect
from rlexp.cluster.description import ClusterDescription
from rlexp.cluster.node_check import check_nodes_read
from rlexp.cluster.pool import RolloutPool
from rlexp.cluster.replica import EngineReplica, no_room
from rlexp.constraints import AtLeast0, AtLeast1, Placement, PlacementStrategy, Positive
from rlexp.errors import ConfigError, EngineDead, TrainerDead
from rlexp.rollout import reaper
from rlexp.sample import SamplingConfig
from rlexp.weights.auto import auto_pick
from rlexp.weights.protocols import WeightTransport
from rlexp.weights.ram_file import RamFileTransport

log = logging.getLogger(__name__)


class RayCluster:
    name = "ray"
    distributed = True  # rollout replicas and trainer ranks as Ray actors

    def __init__(self, replicas: AtLeast1 = 1, gpus_per_replica: AtLeast1 = 1, placement: Placement = "split",
                 address: str | None = None, num_cpus: AtLeast1 | None = None,
                 cpus_per_replica: Positive = 1.0, max_restarts: AtLeast0 = 3,
                 ready_timeout_s: Positive = 600.0, call_timeout_s: Positive = 600.0,
                 restart_timeout_s: Positive = 300.0, trainer_workers: AtLeast1 = 1,
                 cpus_per_trainer_worker: Positive = 1.0, strategy: PlacementStrategy = "PACK"):
        import ray

        self.replicas, self.placement = replicas, placement
        self.gpus_per_replica, self.cpus_per_replica = gpus_per_replica, cpus_per_replica
        self.max_restarts, self.ready_timeout_s = max_restarts, ready_timeout_s
        self.call_timeout_s, self.restart_timeout_s = call_timeout_s, restart_timeout_s
        self.trainer_workers, self.strategy = trainer_workers, strategy
        where = ray_connect.RayAddress.resolve(address)
        self._owns_ray = not ray.is_initialized()
        self._reaper: Any = None  # the process that takes down what ray.init started
        num_gpus = None
        driver_trains = trainer_workers == 1
        if where.address is None and placement == "split" and torch.cuda.device_count() > 0 and driver_trains:
            # A local Ray gets every GPU but the last, which the trainer (this process) trains on.
            if torch.cuda.device_count() < 2:
                raise ConfigError("placement=split puts rollout and trainer on separate GPUs: this "
                                  "machine has 1; use placement=colocate")
            num_gpus = torch.cuda.device_count() - 1
            torch.cuda.set_device(num_gpus)
        if self._owns_ray:
            if where.address is None and num_cpus is None:  # logical CPUs, for placement: may oversubscribe
                num_cpus = max(os.cpu_count() or 1, math.ceil(
                    replicas * cpus_per_replica + (trainer_workers * cpus_per_trainer_worker
                                                   if trainer_workers > 1 else 0)))
            self._start_ray(where, num_cpus, num_gpus)
        resources = ray.cluster_resources()
        self.gpu = resources.get("GPU", 0) > 0
        self.bundle = {"CPU": cpus_per_replica} | ({"GPU": gpus_per_replica} if self.gpu else {})
        self.trainer_bundle = {"CPU": cpus_per_trainer_worker} | ({"GPU": 1} if self.gpu else {})
        trainer_bundles = trainer_workers if trainer_workers > 1 else 0
        self._check_fits(resources, trainer_bundles)
        self._place(trainer_bundles)
        self.replica_nodes = _bundle_nodes(self.pg)
        self.trainer_nodes = _bundle_nodes(self.trainer_pg) if self.trainer_pg is not None else []
        self.nodes = sorted(set(self.replica_nodes))
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.multi_node = self.nodes != [self.driver_node]
        self.pool: RolloutPool | None = None
        self.group: Any = None
        log.info("ray: %s", ray_connect.describe(where))
        log.info("ray: %s", self.shape().describe())

    def _start_ray(self, where: ray_connect.RayAddress, num_cpus: int | None, num_gpus: int | None) -> None:
        # A local Ray's GCS and raylet die with this process, but its dashboard and
        # runtime-env agents were measured outliving a SIGKILLed driver: the reaper takes
        # down every process ray.init started (the actors go with their raylet).
        self._reaper = reaper.start()
        with reaper.watching(self._reaper):
            ray_connect.init(where, num_cpus, num_gpus)

    def _check_fits(self, resources: dict, trainer_bundles: int) -> None:
        """The bundles fit in the cluster, and the placement is one this cluster supports."""
        replicas, trainer_workers = self.replicas, self.trainer_workers
        for kind in self.bundle:
            needed = replicas * self.bundle[kind] + trainer_bundles * self.trainer_bundle[kind]
            if needed > resources.get(kind, 0):
                self.shutdown()
                raise ConfigError(
                    f"rollout.replicas={replicas} x {self.bundle[kind]:g} {kind} per replica"
                    + (f" + trainer.workers={trainer_workers} x {self.trainer_bundle[kind]:g}"
                       if trainer_bundles else "")
                    + f" do not fit in the Ray cluster's {resources.get(kind, 0):g} {kind}s "
                    "(cluster.cpus_per_replica, rollout.gpus_per_replica, cluster.cpus_per_trainer_worker, "
                    "cluster.num_cpus)")
        if self.gpu and trainer_bundles and self.placement == "colocate":
            self.shutdown()
            raise ConfigError("placement=colocate with trainer.workers > 1 on GPU is not supported yet: "
                              "use placement=split")
        if self.placement == "colocate" and self.gpu and (self.gpus_per_replica > 1 or replicas > 1):
            self.shutdown()  # CUDA IPC handles open on the trainer's GPU only
            raise ConfigError("placement=colocate shares the trainer's GPU with the rollout replica: it "
                              "needs rollout.replicas=1 and rollout.gpus_per_replica=1 (until the trainer "
                              "runs as Ray actors beside each replica)")

    def _place(self, trainer_bundles: int) -> None:
        """Placement groups for the replicas (and the trainer's ranks), ready or a ConfigError."""
        import ray
        from ray.util.placement_group import placement_group

        self.pg = placement_group([dict(self.bundle) for _ in range(self.replicas)], strategy=self.strategy)
        self.trainer_pg = None
        if trainer_bundles:
            self.trainer_pg = placement_group([dict(self.trainer_bundle) for _ in range(trainer_bundles)],
                                              strategy=self.strategy)
        try:
            for pg in (self.pg, self.trainer_pg):
                if pg is not None:
                    ray.get(pg.ready(), timeout=self.ready_timeout_s)
        except Exception as e:
            self.shutdown()
            raise ConfigError(f"the Ray cluster could not place {self.replicas} bundles of {self.bundle}"
                              + (f" and {trainer_bundles} of {self.trainer_bundle}" * bool(trainer_bundles))
                              + f" with strategy={self.strategy} within {self.ready_timeout_s:g}s: {e}"
                              ) from e

    def check_readable(self, paths: dict[str, str]) -> None:
        """Every node holding one of the run's bundles can read `paths` (node_check.py)."""
        try:
            nodes = sorted(set(self.replica_nodes + self.trainer_nodes))
            check_nodes_read(paths, nodes, self.ready_timeout_s)
        except ConfigError:
            self.shutdown()
            raise

    def _actor_share(self) -> dict[str, float]:
        """What one replica's actor takes of its bundle."""
        share = 0.5 if self.placement == "colocate" else 1.0
        return {"num_cpus": self.cpus_per_replica * share,
                "num_gpus": self.gpus_per_replica * share if self.gpu else 0}

    def rollout_engine(self, rollout: DictConfig, model_path: str, transport: WeightTransport) -> RolloutPool:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = engine_spec(rollout, transport)
        sleeps = self.gpu and self.placement == "colocate" and "enable_sleep_mode" in spec
        if sleeps:
            spec["enable_sleep_mode"] = True
        actor: Any = ray.remote(EngineReplica)
        actors: list[Any] = [actor.options(
            **self._actor_share(), max_restarts=self.max_restarts, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(spec, model_path) for i in range(self.replicas)]
        try:
            infos = ray.get([a.ready.remote() for a in actors], timeout=self.ready_timeout_s)
        except Exception as e:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise EngineDead(f"a rollout replica failed to start: {e}") from e
        log.info("ray: %d rollout replica(s) up: %s", len(actors),
                 ", ".join(f"pid {pid} on node {node[:8]}" for node, pid, _ in infos))
        keys = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_response_tokens",
                "seed": "seed"}  # SamplingConfig's defaults fill what the rollout config leaves out
        sampling = SamplingConfig(**{field: spec[key] for field, key in keys.items() if key in spec})
        self.pool = RolloutPool(actors, sampling, spec["max_model_len"], sleeps=sleeps,
                                nodes=_short([node for node, _, _ in infos]),
                                call_timeout_s=self.call_timeout_s, restart_timeout_s=self.restart_timeout_s,
                                room=partial(no_room, dict(self.bundle)))
        return self.pool

    def trainer(self, trainer: DictConfig, model_path: str) -> Any:
        """In this process with one worker; a TrainerGroup of Ray actors with more."""
        if self.trainer_pg is None:
            return instantiate(trainer, model_path=model_path)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlexp.cluster.trainer_group import TrainerGroup, TrainerWorker

        spec, pg = OmegaConf.to_container(trainer, resolve=True), self.trainer_pg
        worker: Any = ray.remote(TrainerWorker)
        actors = [worker.options(
            num_cpus=self.trainer_bundle["CPU"], num_gpus=self.trainer_bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
        ).remote(r, self.trainer_workers) for r in range(self.trainer_workers)]
        try:
            endpoints = ray.get([a.endpoint.remote() for a in actors], timeout=self.ready_timeout_s)
        except Exception as e:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise TrainerDead(f"a trainer rank did not start within {self.ready_timeout_s:g}s "
                              f"(cluster.ready_timeout_s): {e}") from e
        address, port, _ = endpoints[0]
        self.group = TrainerGroup(actors, [pid for _, _, pid in endpoints], _short(self.trainer_nodes),
                                  self.call_timeout_s)
        self.group._all("setup", address, port, spec, model_path)
        log.info("ray: trainer group of %d rank(s) up: %s", len(actors), ", ".join(
            f"pid {pid} on node {node[:8]}" for pid, node in zip(self.group.pids, self.trainer_nodes)))
        return self.group

    def shape(self) -> ClusterDescription:
        """What the run sees of the cluster now: its nodes, and where the run's parts are."""
        return ClusterDescription.of_ray(self.driver_node, self.replica_nodes, self.trainer_nodes,
                                         auto_pick(self))

    def params(self) -> dict[str, Any]:
        params = self.shape().params() | {
            "cluster.rollout_bundle": str(self.bundle),
            "cluster.rollout_gpus": self.replicas * int(self.bundle.get("GPU", 0))}
        if self.trainer_pg is not None:
            params["cluster.trainer_bundle"] = str(self.trainer_bundle)
        return params

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.__dict__.get("pool") is not None:
            self.pool.shutdown()  # type: ignore[union-attr]
            self.pool = None
        if self.__dict__.get("group") is not None:
            self.group.shutdown()  # type: ignore[union-attr]
            self.group = None
        for name in ("pg", "trainer_pg"):
            if self.__dict__.get(name) is not None and ray.is_initialized():
                remove_placement_group(self.__dict__[name])
                setattr(self, name, None)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        reaper.stop(self.__dict__.pop("_reaper", None))
        # A replica on this host that died with its node (or was killed) left its weight file
        orphans.reap(RamFileTransport.PREFIX, orphans.ram_root())


def _bundle_nodes(pg: Any) -> list[str]:
    """The node id of each of `pg`'s bundles, in bundle order (the pg is ready)."""
    from ray.util.placement_group import placement_group_table

    placed = placement_group_table(pg)["bundles_to_node_id"]
    return [placed[i] for i in range(len(placed))]


def _short(node_ids: list[str]) -> list[str]:
    """Node ids as Ray's CLI shows them in one line: their first 8 hex digits."""
    return [n[:8] for n in node_ids]
