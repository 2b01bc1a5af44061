"""vLLM's native weight transfer (rlexp/weights/vllm_ipc.py, vllm_nccl.py) into a local engine
and into a RolloutPool of Ray actors (cluster=ray): placement=colocate over CUDA IPC,
placement=split over NCCL. The GPU tests skip without CUDA (NCCL's without two GPUs); the
unmarked ones check, on CPU, which transport `weight_transfer=auto` picks and how a transport
drives a pool's replicas (vLLM's trainer side replaced by a recorder)."""

import asyncio
import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from rlexp.cluster.pool import RolloutPool
from rlexp.sample import Generation, SamplingConfig
from rlexp.weights import vllm_native
from rlexp.weights.auto import auto_transport
from rlexp.weights.object_store import ObjectStoreTransport
from rlexp.weights.protocols import in_process
from rlexp.weights.ram_file import RamFileTransport
from tests.engine_helpers import TEMPERATURE, _check_engine, _max_logprob_diff, _prompts, _trainer

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="NCCL needs the trainer and the engine on different GPUs")


# ---- CPU: which transport, and how it drives a pool --------------------------------------
@pytest.mark.parametrize("placement, chosen", [("colocate", "VllmIpcTransport"),
                                               ("split", "VllmNcclTransport")])
def test_auto_picks_vllms_native_transfer_on_gpu(monkeypatch, placement, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cluster = SimpleNamespace(name="ray", placement=placement, multi_node=False, trainer_workers=1)
    transport = auto_transport(cluster)
    assert type(transport).__name__ == chosen
    assert transport.engine_backend == {"colocate": "ipc", "split": "nccl"}[placement]


def test_auto_without_gpu_and_native_transports_refuse_cpu(monkeypatch):
    from rlexp.weights.vllm_ipc import VllmIpcTransport
    from rlexp.weights.vllm_nccl import VllmNcclTransport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for multi_node, chosen in ((False, RamFileTransport), (True, ObjectStoreTransport)):
        cluster = SimpleNamespace(name="ray", placement="split", multi_node=multi_node, trainer_workers=1)
        assert isinstance(auto_transport(cluster), chosen)
    for transport in (VllmIpcTransport, VllmNcclTransport):
        with pytest.raises(RuntimeError, match="needs CUDA"):
            transport()


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeReplica:
    """An EngineReplica actor as the pool and the transports call it; `dies` makes its next
    request fail the way a dead actor's does, and Ray restart it (a new process, back at the
    model's weights)."""

    def __init__(self, pid: int):
        self.pid, self.version, self.calls, self.dies = pid, 0, [], False
        self.ready, self.call_engine = _Remote(self._ready), _Remote(self._call)
        self.generate_counted = _Remote(self._gen)

    async def _ready(self):
        return "node", self.pid, self.version

    async def _call(self, method, *args):
        self.calls.append(method)
        if method == "workers":
            return 1
        if method == "weights_loaded":
            self.version = args[0]

    async def _gen(self, token_ids, sampling, images=None):
        from ray.exceptions import RayActorError

        await asyncio.sleep(0.01)
        if self.dies:
            self.dies, self.pid, self.version = False, self.pid + 1, 0
            raise RayActorError()
        return Generation([1], [-0.5], "stop", [self.version]), 0  # nothing prefilled again


class FakeSender:
    """vLLM's trainer-side engine, as far as the transports see it."""

    made: list["FakeSender"] = []

    def __init__(self, info, client, source):
        self.info, self.client, self.source, self.closed = info, client, source, False
        client.init_weight_transfer_engine({"world_size": getattr(info, "world_size", None)})
        FakeSender.made.append(self)

    def send_weights(self):
        self.client.start_weight_update()
        self.client.update_weights({"names": [n for n, _ in self.source]})
        self.client.finish_weight_update()

    def shutdown(self):
        self.closed = True


ONE_UPDATE = ["start_weight_update", "update_weights", "finish_weight_update", "weights_loaded"]


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_pool_sync_connects_each_replica_once_and_a_restarted_one_at_the_next_sync(monkeypatch, caplog,
                                                                                   backend):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlexp.weights.vllm_ipc import VllmIpcTransport
    from rlexp.weights.vllm_nccl import VllmNcclTransport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init",
                        lambda info, *, client, source: FakeSender(info, client, source))
    monkeypatch.setattr(vllm_native, "_on_weights_gpu", lambda source: contextlib.nullcontext())
    FakeSender.made = []
    connect = (["init_weight_transfer_engine"] if backend == "ipc"
               else ["workers", "init_weight_transfer_engine"])
    transport = VllmIpcTransport() if backend == "ipc" else VllmNcclTransport()
    a, b = FakeReplica(100), FakeReplica(200)
    pool = RolloutPool([a, b], SamplingConfig(1.0, 1.0, 4, None), 64)
    weights = [("w", torch.zeros(2))]

    async def main():
        await transport.transfer(iter(weights), pool, 1)
        assert a.calls == b.calls == connect + ONE_UPDATE
        assert pool.version == a.version == b.version == 1 and len(FakeSender.made) == 2
        if backend == "nccl":
            assert all(s.info.world_size == 2 for s in FakeSender.made)  # trainer + one worker
        await transport.transfer(iter(weights), pool, 2)  # connected already
        assert a.calls == b.calls == connect + ONE_UPDATE * 2 and len(FakeSender.made) == 2

        b.dies = True  # two requests at once: one per replica (least loaded)
        gens = await asyncio.gather(*(pool.generate([0], pool.sampling) for _ in range(2)))
        assert all(g.versions == [2] for g in gens)  # b's request retried on a
        await asyncio.gather(*pool._recovering.values())  # the pool's recovery of b, in the background
        assert pool.restarts == [0, 1]
        # The pool replayed the last sync for the restarted replica: nothing to send it, and
        # it says so; it serves the model's weights as version 0 until the next sync.
        assert b.calls == connect + ONE_UPDATE * 2 and b.version == 0
        assert "keeps the model's initial weights (version 0)" in caplog.text

        await transport.transfer(iter(weights), pool, 3)
        assert b.calls == connect + ONE_UPDATE * 2 + connect + ONE_UPDATE  # a new process: connected again
        assert a.calls == connect + ONE_UPDATE * 3
        assert a.version == b.version == pool.version == 3
        assert len(FakeSender.made) == 3 and not FakeSender.made[2].closed
        assert [s.closed for s in FakeSender.made].count(True) == 1  # b's old sender, torn down

    caplog.set_level(logging.WARNING)
    asyncio.run(main())
    transport.close()
    assert all(s.closed for s in FakeSender.made)


def test_a_failed_update_drops_the_sender_and_raises_the_engines_error(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlexp.weights.vllm_nccl import VllmNcclTransport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init",
                        lambda info, *, client, source: FakeSender(info, client, source))
    monkeypatch.setattr(vllm_native, "_on_weights_gpu", lambda source: contextlib.nullcontext())
    FakeSender.made = []

    class Engine:  # a local engine whose worker fails while receiving
        version = 0

        async def load_weights_native(self, send, version):
            await send(in_process(self))

        async def workers(self):
            return 1

        async def init_weight_transfer_engine(self, info): ...
        async def start_weight_update(self): ...
        async def finish_weight_update(self): ...

        async def update_weights(self, info):
            raise ValueError("worker failed")

    transport = VllmNcclTransport()
    with pytest.raises(ValueError, match="worker failed"):
        asyncio.run(transport.transfer(iter([("w", torch.zeros(2))]), Engine(), 1))
    assert FakeSender.made[0].closed and not transport._senders  # the next sync connects again


# ---- GPU ----------------------------------------------------------------------------------
def _rollout(**kw):
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(
        _target_="rlexp.rollout.vllm_engine.VLLMEngine", seed=0, temperature=1.0, top_p=1.0,
        max_response_tokens=12, max_model_len=256, gpu_memory_utilization=0.2, enable_sleep_mode=False,
        weight_transfer_backend=None, replicas=1, gpus_per_replica=1) | kw)


@pytest.fixture
def trainer_gpu():
    """The trainer on the last GPU; a local Ray is given the GPUs before it, so that rollout
    replicas never land on the trainer's GPU (placement=split)."""
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)
    yield last
    torch.cuda.set_device(0)


@contextlib.contextmanager
def _ray_pool(placement: str, model_path: str, rollout_gpus: int):
    import ray

    from rlexp.cluster.ray_cluster import RayCluster

    ray.init(num_gpus=rollout_gpus, num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    cluster = transport = None
    try:
        cluster = RayCluster(replicas=1, placement=placement)
        transport = auto_transport(cluster)
        yield cluster.rollout_engine(_rollout(), model_path, transport), transport
    finally:
        if transport is not None:
            transport.close()
        if cluster is not None:
            cluster.shutdown()
        ray.shutdown()


def _perturb(trainer) -> None:
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


async def _sync_restart_sync(pool, transport, trainer, initial, tokenizer):
    """Generate, sync twice, kill the replica (Ray restarts it), generate, sync: after each sync
    the engine's logprobs are the trainer's, and the restarted replica says it serves version 0."""
    import ray

    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(TEMPERATURE, 1.0, 12, seed=5)

    async def generate():
        return await asyncio.gather(*(pool.generate(p, sampling) for p in prompts))

    async def sync(version):
        await pool.sleep()  # the loop's order: the trainer trains while vLLM sleeps (colocate)
        _perturb(trainer)
        await pool.wake_up()
        await pool.pause("wait")
        await transport.transfer(trainer.weights(), pool, version)
        await pool.resume()
        gens = await generate()
        assert all(g.versions == [version] * len(g.token_ids) for g in gens)
        assert _max_logprob_diff(trainer, prompts, gens) < 1e-4

    assert _max_logprob_diff(trainer, prompts, await generate()) < 1e-4
    await sync(1)
    await sync(2)  # over the same connection
    ray.kill(pool.actors[0], no_restart=False)
    gens = await generate()  # retried on the replica Ray restarted
    assert pool.restarts == [1] and all(g.versions == [0] * len(g.token_ids) for g in gens)
    assert _max_logprob_diff(initial, prompts, gens) < 1e-4  # version 0 is what it says
    await sync(3)  # connects to the new process


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.ray
def test_colocate_pool_syncs_over_cuda_ipc(tiny_model_path, tokenizer):
    """The trainer on cuda:0, the one replica too (Ray is given one GPU)."""
    from rlexp.weights.vllm_ipc import VllmIpcTransport

    trainer, initial = _trainer(tiny_model_path), _trainer(tiny_model_path)
    with _ray_pool("colocate", tiny_model_path, rollout_gpus=1) as (pool, transport):
        assert isinstance(transport, VllmIpcTransport) and pool.sleeps
        asyncio.run(_sync_restart_sync(pool, transport, trainer, initial, tokenizer))


@two_gpus
@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.ray
def test_split_pool_syncs_over_nccl(tiny_model_path, tokenizer, trainer_gpu):
    from rlexp.weights.vllm_nccl import VllmNcclTransport

    trainer, initial = _trainer(tiny_model_path), _trainer(tiny_model_path)
    with _ray_pool("split", tiny_model_path, rollout_gpus=trainer_gpu) as (pool, transport):
        assert isinstance(transport, VllmNcclTransport) and not pool.sleeps
        asyncio.run(_sync_restart_sync(pool, transport, trainer, initial, tokenizer))


@two_gpus
@pytest.mark.gpu
@pytest.mark.vllm
def test_nccl_transport_into_a_local_engine(tiny_model_path, tokenizer, trainer_gpu):
    """cluster=local: vLLM's engine on cuda:0, the trainer on the last GPU."""
    from rlexp.rollout.vllm_engine import VLLMEngine
    from rlexp.weights.vllm_nccl import VllmNcclTransport

    trainer = _trainer(tiny_model_path)

    async def main():
        engine = VLLMEngine(tiny_model_path, seed=0, weight_transfer_backend="nccl",
                            gpu_memory_utilization=0.2)
        try:
            return await _check_engine(engine, trainer, tokenizer, VllmNcclTransport())
        finally:
            engine.shutdown()

    before, after = asyncio.run(main())
    assert before < 1e-4 and after < 1e-4
