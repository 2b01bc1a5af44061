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
    # a LoRA adapter's files in this node's RAM: a pool ships them to its replicas' nodes
    ray_here = SimpleNamespace(name="ray", multi_node=False, placement="split", trainer_workers=1)
    for cluster in (one_node, ray_here, other_nodes):
        AdapterFileTransport(8, 16, ["q_proj"], cluster=cluster).close()


def test_a_replica_writes_each_adapter_it_receives_into_a_new_directory_and_drops_the_last():
    """What a replica gets through the object store (`read_adapter` of the driver's files) is
    loaded from a directory of its own, byte for byte, a new one per load (vLLM's prefix cache
    keys blocks by the directory); the one served before goes once the next is loaded."""
    from rlexp.weights.adapter_file import ADAPTER_WEIGHTS, AdapterReceiver, read_adapter, write_adapter

    class Engine:
        def __init__(self):
            self.loaded = []

        async def load_adapter(self, name, directory, version=None):
            self.loaded.append((name, directory, version, read_adapter(directory)))

    sent = AdapterFileTransport(8, 16, ["q_proj"])
    receiver, engine = AdapterReceiver(), Engine()
    try:
        for version in (3, 4):
            tensors = [("m.q_proj.lora_A.default.weight", torch.full((8, 4), float(version)))]
            write_adapter(sent.root / f"v{version}", tensors, 8, 16, ["q_proj"])
            files = read_adapter(sent.root / f"v{version}")
            asyncio.run(receiver.load("policy", files, engine, version))
            assert engine.loaded[-1][3] == files and engine.loaded[-1][2] == version
        (_, first, _, _), (_, second, _, _) = engine.loaded
        assert first != second and not first.exists() and (second / ADAPTER_WEIGHTS).is_file()
    finally:
        sent.close()
        receiver.close()
    assert not second.exists()
