"""The RAM-file weight transport's file: standard safetensors, rewritten in place, tied
tensors stored once."""

import asyncio

import torch
from safetensors import safe_open

from rlexp.rollout.weights import WEIGHTS_FILE, RamFileTransport, read_shared


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
