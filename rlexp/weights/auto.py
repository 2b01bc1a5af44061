"""`weight_transfer=auto`: the transport that fits the cluster (the table in __init__.py)."""

from __future__ import annotations

import importlib
import logging

import torch

from rlexp.weights.protocols import ClusterShape, WeightTransport

log = logging.getLogger(__name__)


# The transports auto picks from, by class name: the module each lives in (imported only when
# picked: vLLM's native ones import vLLM)
MODULES = {"VllmIpcTransport": "rlexp.weights.vllm_ipc", "VllmNcclTransport": "rlexp.weights.vllm_nccl",
           "ObjectStoreTransport": "rlexp.weights.object_store", "RamFileTransport": "rlexp.weights.ram_file"}


def auto_pick(cluster: ClusterShape) -> str:
    """The class name of the transport that fits `cluster` (the table in rlexp/weights/__init__.py)."""
    # A trainer group's weights reach this process bucket by bucket, as CPU tensors.
    group = cluster.trainer_workers > 1
    if cluster.name == "ray" and torch.cuda.is_available() and not group:
        return "VllmIpcTransport" if cluster.placement == "colocate" else "VllmNcclTransport"
    return "ObjectStoreTransport" if cluster.multi_node else "RamFileTransport"


def auto_transport(cluster: ClusterShape) -> WeightTransport:
    """The transport that fits `cluster`, built for it."""
    name = auto_pick(cluster)
    chosen: WeightTransport = getattr(importlib.import_module(MODULES[name]), name)(cluster=cluster)
    log.info("weight_transfer=auto: %s", name)
    return chosen
