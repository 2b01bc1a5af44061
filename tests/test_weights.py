"""The RAM-file weight transport's file: standard safetensors, rewritten in place, tied
tensors stored once; the object store's arrays as a replica receives them; which cluster each
transport refuses."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from rlexp.errors import ConfigError
from rlexp.weights.adapter_file import AdapterFileTransport
from rlexp.weights.files import WEIGHTS_FILE, read_shared
from rlexp.weights.object_store import ObjectStoreReceiver, ObjectStoreTransport, to_arrays
from rlexp.weights.ram_file import RamFileTransport


class Recorder:
    """An engine that only records what it was told to load."""

    version = 0

    async def load_weights(self, directory, version):
        self.loaded = dict(read_shared(directory / WEIGHTS_FILE))
        self.version = version


def _tied_weights():
    emb = torch.randn(16, 4)
    return {"embed.weight": emb, "layer.weight": torch.randn(4, 4), "layer.bias": torch.zeros(4),
            "lm_head.weight": emb}  # tied: the same tensor under two names


def test_tied_tensors_are_written_once_and_read_back_under_both_names():
    weights, engine, transport = _tied_weights(), Recorder(), RamFileTransport()
    try:
        asyncio.run(transport.transfer(iter(weights.items()), engine, 1))
        path = transport.directory / WEIGHTS_FILE
        with safe_open(str(path), "pt") as f:  # a standard safetensors file
            assert set(f.keys()) == {"embed.weight", "layer.weight", "layer.bias"}
        assert path.stat().st_size < 8 + 2048 + 4 * (16 * 4 + 16 + 4)  # the tied tensor once
        assert engine.loaded.keys() == weights.keys() and engine.version == 1
        assert all(torch.equal(engine.loaded[k], v) for k, v in weights.items())
    finally:
        transport.close()
    assert not transport.directory.exists()


def test_each_sync_overwrites_the_same_file_in_place():
    weights, engine, transport = _tied_weights(), Recorder(), RamFileTransport()
    try:
        asyncio.run(transport.transfer(iter(weights.items()), engine, 1))
        path = transport.directory / WEIGHTS_FILE
        inode, first_view = path.stat().st_ino, engine.loaded["layer.weight"]
        weights["layer.weight"].mul_(2)
        asyncio.run(transport.transfer(iter(weights.items()), engine, 2))
        assert path.stat().st_ino == inode  # same file, same layout: no new file, no parse
        assert torch.equal(engine.loaded["layer.weight"], weights["layer.weight"])
        assert torch.equal(first_view, weights["layer.weight"])  # views map the live file
        weights["layer.weight"] = torch.randn(5, 4)  # a new layout: a new file
        asyncio.run(transport.transfer(iter(weights.items()), engine, 3))
        assert torch.equal(engine.loaded["layer.weight"], weights["layer.weight"])
    finally:
        transport.close()


def test_the_object_store_path_round_trips_dtypes_and_tied_names_into_the_replicas_file():
    """Both halves without Ray: the arrays `ray.put` would store, and what a replica's
    ObjectStoreReceiver loads from them (through a RAM file of its own)."""
    weights = _tied_weights() | {"half": torch.randn(3, 2).to(torch.bfloat16)}
    arrays = to_arrays(iter(weights.items()))
    assert arrays["lm_head.weight"][1] is arrays["embed.weight"][1]  # stored once
    engine, receiver = Recorder(), ObjectStoreReceiver()
    try:
        asyncio.run(receiver.load(arrays, engine, 5))
        assert engine.version == 5 and engine.loaded.keys() == weights.keys()
        assert engine.loaded["half"].dtype == torch.bfloat16
        assert all(torch.equal(engine.loaded[k], v) for k, v in weights.items())
    finally:
        receiver.close()


def test_a_transport_refuses_a_cluster_it_cannot_reach():
    one_node = SimpleNamespace(name="local", multi_node=False, placement="split", trainer_workers=1)
    other_nodes = SimpleNamespace(name="ray", multi_node=True, placement="split", trainer_workers=1)
    with pytest.raises(ConfigError, match="object_store"):
        RamFileTransport(cluster=other_nodes)
    with pytest.raises(ConfigError, match="cluster=ray"):
        ObjectStoreTransport(cluster=one_node)
    ObjectStoreTransport(cluster=other_nodes).close()
    transport = RamFileTransport(cluster=one_node)
    transport.close()
    assert not transport.directory.exists()
    # a LoRA adapter's files in this node's RAM: a pool on this node reads them, others cannot
    with pytest.raises(ConfigError, match="weight_transfer=auto"):
        AdapterFileTransport(8, 16, ["q_proj"], cluster=other_nodes)
    ray_here = SimpleNamespace(name="ray", multi_node=False, placement="split", trainer_workers=1)
    for cluster in (one_node, ray_here):
        AdapterFileTransport(8, 16, ["q_proj"], cluster=cluster).close()
