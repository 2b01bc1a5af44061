"""`weight_transfer=auto`: the transport that fits the cluster (the table in __init__.py)."""

from __future__ import annotations

import logging

import torch

from rlexp.weights.object_store import ObjectStoreTransport
from rlexp.weights.protocols import ClusterShape, WeightTransport
from rlexp.weights.ram_file import RamFileTransport

log = logging.getLogger(__name__)


def auto_transport(cluster: ClusterShape) -> WeightTransport:
    """The transport that fits `cluster`, built for it (the table in rlexp/weights/__init__.py)."""
    # A trainer group's weights reach this process bucket by bucket, as CPU tensors.
    group = cluster.trainer_workers > 1
    if cluster.name == "ray" and torch.cuda.is_available() and not group:
        if cluster.placement == "colocate":
            from rlexp.weights.vllm_ipc import VllmIpcTransport

            chosen: WeightTransport = VllmIpcTransport(cluster=cluster)
        else:
            from rlexp.weights.vllm_nccl import VllmNcclTransport

            chosen = VllmNcclTransport(cluster=cluster)
    elif cluster.multi_node:
        chosen = ObjectStoreTransport(cluster=cluster)
    else:
        chosen = RamFileTransport(cluster=cluster)
    log.info("weight_transfer=auto: %s", type(chosen).__name__)
    return chosen
