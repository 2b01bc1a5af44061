"""The places where rlexp reaches past vLLM's public API (rlexp/weights/vllm_private.py) are where
it expects them in the installed vLLM: a vLLM upgrade that moves one fails here, not silently in
a run (an idle spin left at vLLM's 1 s, a "Failed to load weights" per layer per sync). No engine
is started."""

import importlib
import inspect

import pytest
import vllm
import zmq

from rlexp.weights import vllm_private


def test_the_installed_vllm_is_the_one_the_places_were_checked_against():
    assert vllm.__version__ == vllm_private.CHECKED_WITH, (
        "vLLM changed: check each place in rlexp/weights/vllm_private.py, then update CHECKED_WITH")


@pytest.mark.parametrize("module, name, why", vllm_private.PLACES, ids=lambda x: str(x)[:40])
def test_each_place_exists(module, name, why):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name}: {why}"


def test_the_reload_skip_lists_are_sets_and_take_the_rotary_tables():
    from vllm.model_executor.model_loader.reload import meta

    assert isinstance(meta.SKIP_LOAD_TENSORS, set) and isinstance(meta.SKIP_TENSORS, set)
    assert vllm_private.skip_derived_buffers()
    assert set(vllm_private.DERIVED_BUFFERS) <= meta.SKIP_LOAD_TENSORS & meta.SKIP_TENSORS


def test_the_rotary_embedding_registers_the_tables_by_those_names():
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rotary = RotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)
    assert "cos_sin_cache" in dict(rotary.named_buffers())
    source = "".join(inspect.getsource(c) for c in RotaryEmbedding.__mro__ if c.__module__.startswith("vllm"))
    assert all(f'"{name}"' in source for name in vllm_private.DERIVED_BUFFERS)  # bf16: ROCm only


def test_set_idle_spin_finds_a_live_queue_reader_and_sets_its_busy_poll():
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    context = zmq.Context()
    conditions = []
    try:
        # the writer binds the address the reader subscribes to, as in vLLM (a reader connected
        # to an address nobody binds can make libzmq abort when the context is destroyed)
        writer = SpinCondition(is_reader=False, context=context, notify_address="inproc://rlexp-spin-test")
        conditions.append(writer)
        reader = SpinCondition(is_reader=True, context=context, notify_address="inproc://rlexp-spin-test")
        conditions.append(reader)
        assert reader.busy_loop_s == 1  # vLLM's default, which rlexp shortens
        assert vllm_private.set_idle_spin(0.05) >= 1
        assert reader.busy_loop_s == 0.05 and writer.busy_loop_s == 0  # readers only
    finally:
        for c in conditions:  # each socket closed here, in the thread that made it
            for sock in vars(c).values():
                if isinstance(sock, zmq.Socket):
                    sock.close(linger=0)
        context.term()
