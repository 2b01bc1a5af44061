"""ClusterDescription: what a run sees of its Ray cluster (the nodes alive, their CPUs and GPUs)
and where its parts landed (the driver, each rollout replica, each trainer rank), logged once
at the start and as the `cluster.*` MLflow params."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Node:
    id: str  # its first 8 hex digits, as Ray's CLI shows it
    ip: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ClusterDescription:
    nodes: list[Node]  # alive
    driver: str  # node ids (short) of the run's parts
    replicas: list[str]
    ranks: list[str]  # the trainer group's; empty when the driver trains
    auto_transport: str  # what weight_transfer=auto picks on this cluster

    @classmethod
    def of_ray(cls, driver: str, replicas: list[str], ranks: list[str],
               auto_transport: str) -> ClusterDescription:
        """The connected Ray cluster's alive nodes (`ray.nodes()`), with full node ids given."""
        import ray

        nodes = [Node(n["NodeID"][:8], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0),
                      n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n["Alive"]]
        return cls(sorted(nodes, key=lambda n: n.ip), driver[:8], [r[:8] for r in replicas],
                   [r[:8] for r in ranks], auto_transport)

    @property
    def used(self) -> list[str]:
        """The nodes the run's parts run on."""
        return sorted({self.driver, *self.replicas, *self.ranks})

    @property
    def multi_node(self) -> bool:
        return len(self.used) > 1

    def describe(self) -> str:
        """One log line."""
        nodes = "; ".join(f"{n.id} {n.ip} {n.cpus:g} CPU {n.gpus:g} GPU" for n in self.nodes)
        where = [f"driver on {self.driver}", *(f"replica {i} on {n}" for i, n in enumerate(self.replicas)),
                 *(f"rank {r} on {n}" for r, n in enumerate(self.ranks))]
        return (f"cluster of {len(self.nodes)} node(s) ({nodes}): {', '.join(where)}; "
                f"multi-node: {'yes' if self.multi_node else 'no'} ({len(self.used)} node(s) used); "
                f"weight_transfer=auto picks {self.auto_transport}")

    def params(self) -> dict[str, Any]:
        nodes = self.nodes
        params = {"cluster.nodes": len(nodes), "cluster.nodes_used": len(self.used),
                  "cluster.multi_node": self.multi_node,
                  "cluster.cpus": sum(n.cpus for n in nodes), "cluster.gpus": int(sum(n.gpus for n in nodes)),
                  "cluster.node_list": ",".join(f"{n.id}:{n.ip}:{n.cpus:g}cpu:{n.gpus:g}gpu" for n in nodes),
                  "cluster.driver_node": self.driver, "cluster.replica_nodes": ",".join(self.replicas),
                  "cluster.auto_transport": self.auto_transport}
        if self.ranks:
            params["cluster.trainer_nodes"] = ",".join(self.ranks)
        return params
