"""cluster=ray on a real Ray cluster of three nodes on this host (tests/ray_nodes.py: a head
with no CPUs, where this process connects, and two worker nodes) with a vLLM replica of the
tiny model on each worker node: weights reach every replica, through Ray's object store
across nodes too, and a LoRA run's adapter alone (its files through the object store too);
an update mid-generation on both replicas (keep: nothing prefilled again, the tokens after it
tagged with the new version; abort: the tokens each replica prefilled again, summed by the
pool); a SIGKILLed replica is restarted on its node with the current weights while its
requests finish elsewhere; a node that cannot read the model is named before anything
starts; the ways of naming the cluster (cluster.address, RAY_ADDRESS, auto) join it. The
RolloutPool's routing and fault handling over fake replicas: tests/test_pool.py."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from rlexp.cluster.pool import RolloutPool
from rlexp.errors import ConfigError
from rlexp.sample import SamplingConfig
from tests.engine_helpers import TEMPERATURE, _max_logprob_diff, _prompts, _publish, _trainer
from tests.test_engines_interrupted import _mid_generation, _new_weights

RESTART_FAILSAFE_S = 600  # turns a restart that never comes into a failure
# tokens of a long generation (the prompts leave 256 - 25 positions): a replica's second request
# can reach vLLM some 50 tokens after its first on a loaded machine, and both must be running
LONG = 200


# ---- a real Ray cluster of three nodes: a vLLM replica of the tiny model on each worker node ----
@pytest.fixture(scope="module")
def ray_pool(nodes, tiny_model_path):
    from omegaconf import OmegaConf

    from rlexp.cluster.ray_cluster import RayCluster
    from rlexp.weights.ram_file import RamFileTransport

    cluster = RayCluster(address=nodes.address, replicas=2, max_restarts=2, strategy="SPREAD")
    rollout = OmegaConf.create({"_target_": "rlexp.rollout.vllm_engine.VLLMEngine", "seed": 0,
                                "max_model_len": 256, "kv_cache_gb": 0.25, "max_num_seqs": 32,
                                "weight_transfer_backend": None, "replicas": 2, "gpus_per_replica": 1,
                                "max_lora_rank": 8})  # LoRA adapters too (weight_transfer=lora_adapter)
    try:
        cluster.rollout_engine(rollout, tiny_model_path, RamFileTransport)
        yield cluster
    finally:
        cluster.shutdown()


def _fresh(cluster) -> RolloutPool:
    """A pool over the cluster's replicas for this test's event loop."""
    old = cluster.pool
    return RolloutPool(old.actors, old.sampling, old.max_model_len)


async def _per_replica(pool, prompts, sampling):
    return [await asyncio.gather(*(a.generate.remote(p, sampling) for p in prompts)) for a in pool.actors]


def _replica_check(pool, trainer, tokenizer, transport, version):
    """Move the trainer's weights, publish them through `transport`, and return, per replica,
    its generations and their largest logprob difference from the trainer's."""
    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=12, seed=5)

    async def main():
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        stale = await _per_replica(pool, prompts, sampling)
        assert min(_max_logprob_diff(trainer, prompts, g) for g in stale) > 1e-3  # tells weights apart
        try:
            await transport.transfer(trainer.weights(), pool, version)
        finally:
            transport.close()
        gens = await _per_replica(pool, prompts, sampling)
        return gens, [_max_logprob_diff(trainer, prompts, g) for g in gens]

    return asyncio.run(main())


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.parametrize("path", ["ram_file", "object_store"])
def test_after_a_weight_update_every_replica_returns_the_trainers_logprobs(ray_pool, tiny_model_path,
                                                                          tokenizer, path):
    from rlexp.weights.object_store import ObjectStoreTransport
    from rlexp.weights.ram_file import RamFileTransport

    transport = RamFileTransport() if path == "ram_file" else ObjectStoreTransport()
    pool = _fresh(ray_pool)
    version = 3 if path == "ram_file" else 4
    trainer = _trainer(tiny_model_path)
    gens, diffs = _replica_check(pool, trainer, tokenizer, transport, version)
    print(f"{path}: max |logprob(replica) - logprob(trainer)| per replica: {diffs}")
    assert max(diffs) < 1e-5, diffs
    assert [g.token_ids for g in gens[0]] == [g.token_ids for g in gens[1]]  # per-request seeds
    assert all(g.versions == [version] * len(g.token_ids) for r in gens for g in r)
    assert pool.version == version
    # one replica per worker node, none on the driver's: the object crossed into both nodes' stores
    replica_nodes = {node for node, _, _ in asyncio.run(_ready(pool))}
    assert replica_nodes == set(ray_pool.replica_nodes) and len(replica_nodes) == 2
    assert ray_pool.driver_node not in replica_nodes and ray_pool.multi_node
    pulled = pool.pop_replica_metrics()
    if path == "object_store":
        from rlexp.weights.object_store import to_arrays

        arrays = {id(a): a for _, a in to_arrays(trainer.weights()).values()}  # tied weights once
        weight_bytes = sum(a.nbytes for a in arrays.values())
        assert pulled["weights/object_store_nodes_pulled"] == 2
        # Ray's size of the pickled arrays: the weights and a little framing per tensor
        assert 2 * weight_bytes <= pulled["weights/object_store_bytes_pulled"] <= 2 * weight_bytes * 1.01
        print(f"object_store: {pulled['weights/object_store_bytes_pulled']:.0f} bytes pulled by 2 nodes")
    else:
        assert "weights/object_store_bytes_pulled" not in pulled


async def _ready(pool):
    return await asyncio.gather(*(a.ready.remote() for a in pool.actors))


def _watch(replica, tokens: int) -> None:
    """In a replica's process (Ray's `__ray_call__`): once both of its requests have streamed
    `tokens` tokens from vLLM and are not finished, its engine's `mid_flight()` (reached by
    `call_engine`) freezes them there with vLLM's keep pause, until the update's own pause and
    resume. The engine process is stopped (SIGSTOP) while that pause is sent, so it takes it
    within a step or so of going on: the other replica, however far behind on a loaded
    machine, gets there too before the update, and no request finishes first."""
    mid = _mid_generation(replica.engine, 2, tokens)

    async def held() -> None:
        await mid.wait()
        cores = [p for p in psutil.Process().children() if "EngineCore" in " ".join(p.cmdline())]
        for p in cores:
            p.suspend()
        try:
            llm = replica.engine.llm
            freeze = asyncio.ensure_future(llm.pause_generation(mode="keep", clear_cache=False))
            await asyncio.sleep(0.05)  # the pause on its way to the stopped process
        finally:
            for p in cores:
                p.resume()
        await freeze

    replica.engine.mid_flight = held


def _go(replica) -> None:
    """vLLM's own generate again, no more watching."""
    replica.engine.__dict__.pop("mid_flight", None)
    replica.engine.llm.__dict__.pop("generate", None)


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_an_update_mid_generation_on_both_replicas_and_the_tokens_they_prefilled_again(ray_pool,
                                                                                     tiny_model_path,
                                                                                     tokenizer, mode):
    """Long generations on both replicas, a weight update while each has both of its running:
    every generation goes on to its full length, its tokens after the update tagged with the
    new version. keep: no replica prefilled anything again (the pool's sum: 0), the tokens after
    the update mixed; abort: each replica re-sent its cut-short requests, and the pool's
    `busy.prefilled_again` (rlexp/step.py's rollout/prefilled_again_tokens) is their sum."""
    pool = _fresh(ray_pool)
    trainer = _trainer(tiny_model_path)
    prompts = _prompts(tokenizer)[:2] * 2  # 2 per replica (least loaded), different prompts on each
    long = [SamplingConfig(TEMPERATURE, 1.0, LONG, seed=i, ignore_eos=True) for i in range(len(prompts))]

    def go():
        return asyncio.gather(*(a.__ray_call__.remote(_go) for a in pool.actors))

    async def main():
        await _publish(trainer, pool, version=0)
        await asyncio.gather(*(a.__ray_call__.remote(_watch, 8) for a in pool.actors))
        try:
            held = asyncio.gather(*(a.call_engine.remote("mid_flight") for a in pool.actors))
            reqs = [asyncio.create_task(pool.generate(p, s)) for p, s in zip(prompts, long)]
            # (a request that fails instead stops the wait: the test fails below)
            await asyncio.wait([held, asyncio.gather(*reqs)], return_when=asyncio.FIRST_COMPLETED)
            await _new_weights(trainer, pool, mode)  # both replicas frozen mid-generation
            return await asyncio.gather(*reqs)
        finally:
            await go()

    gens = asyncio.run(main())
    m, again = pool.pop_replica_metrics(), [r.prefilled_again for r in pool.replica_busy]
    print(f"{mode}: tokens prefilled again per replica {again}, the pool's sum {pool.busy.prefilled_again}; "
          f"tokens before the update {[g.versions.count(0) for g in gens]}")
    assert m["replica/0/requests"] == m["replica/1/requests"] == 2
    assert all(len(g.token_ids) == len(g.versions) == LONG and g.finish_reason == "length" for g in gens)
    assert all(g.versions[0] == 0 and g.versions[-1] == 1 and g.versions == sorted(g.versions)
               for g in gens), [g.versions.count(0) for g in gens]
    mixed = [(g.mixed_from, g.context_version) for g in gens]
    assert mixed == ([(g.versions.index(1), 0) for g in gens] if mode == "keep" else [(None, None)] * 4)
    assert pool.busy.prefilled_again == sum(again)
    assert all(a > 0 for a in again) if mode == "abort" else again == [0, 0]


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.slow
def test_a_sigkilled_replica_is_restarted_with_the_current_weights(ray_pool, tiny_model_path, tokenizer):
    from rlexp.weights.ram_file import RamFileTransport

    pool = _fresh(ray_pool)
    trainer = _trainer(tiny_model_path)
    transport = RamFileTransport()
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=64, seed=1)
    prompts = _prompts(tokenizer) * 20

    async def main():
        await transport.transfer(trainer.weights(), pool, 7)
        node, pid, version = await pool.actors[0].ready.remote()
        assert version == 7
        tasks = [asyncio.create_task(pool.generate(p, sampling)) for p in prompts]
        while not pool.in_flight[0]:
            await asyncio.sleep(0)
        os.kill(pid, signal.SIGKILL)  # the replica's actor process, mid-generation
        gens = await asyncio.gather(*tasks)  # every request finishes, on the other replica
        # the pool saw the replica die: it is still restarting, or (a slow machine: the other
        # replica took longer over the requests than Ray over the restart) already back once
        assert not pool._healthy[0] or pool.restarts[0] == 1
        assert all(g.versions == [7] * len(g.token_ids) for g in gens)
        # the pool's recovery: Ray restarts the actor, the pool loads the current weights into it
        await asyncio.wait_for(asyncio.gather(*pool._recovering.values()), RESTART_FAILSAFE_S)
        assert pool._healthy[0], "the replica was not restarted"
        new_node, new_pid, version = await pool.actors[0].ready.remote()
        assert new_pid != pid and version == 7 and pool.restarts == [1, 0]
        assert new_node == node  # restarted in its placement group's bundle, on the same node
        # the restarted replica serves the trainer's weights, not the model path's
        gens = await _per_replica(pool, _prompts(tokenizer), SamplingConfig(TEMPERATURE, 1.0, 12, 5))
        return [_max_logprob_diff(trainer, _prompts(tokenizer), g) for g in gens]

    try:
        diffs = asyncio.run(main())
    finally:
        transport.close()
    print("after the restart, max |logprob diff| per replica:", diffs)
    assert max(diffs) < 1e-5, diffs


@pytest.mark.ray
@pytest.mark.vllm
def test_a_lora_runs_adapter_reaches_every_replica_as_the_trainers_policy(ray_pool, tiny_model_path,
                                                                         tokenizer):
    from rlexp.trainer.models import LORA_TARGETS
    from rlexp.weights.adapter_file import POLICY, AdapterFileTransport
    from tests.test_lora_engine import RANK, _lora_trainer, _move
    from tests.test_lora_engine import TEMPERATURE as LORA_TEMPERATURE

    pool = _fresh(ray_pool)
    trainer = _lora_trainer(tiny_model_path)
    assert ray_pool.multi_node  # the replicas run on the worker nodes, not the driver's
    transport = AdapterFileTransport(RANK, 16, LORA_TARGETS, cluster=ray_pool)
    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(temperature=LORA_TEMPERATURE, max_tokens=12, seed=5)

    async def main():
        _move(trainer)  # lora_B starts at 0: moved, the policy is not the base model
        base = await _per_replica(pool, prompts, sampling)
        pool.pop_replica_metrics()
        await transport.transfer(trainer.adapter_weights(), pool, 6)
        return base, await _per_replica(pool, prompts, sampling), pool.pop_replica_metrics()

    async def restore():  # the module's replicas as found: the base model alone
        await asyncio.gather(*(a.call_engine.remote("remove_adapter", POLICY) for a in pool.actors))

    try:
        base, gens, metrics = asyncio.run(main())
    finally:
        transport.close()
        asyncio.run(restore())
    diffs = [_max_logprob_diff(trainer, prompts, g) for g in gens]
    print(f"adapter: max |logprob(replica) - logprob(trainer)| per replica {diffs}; "
          f"{transport.bytes_sent} bytes sent; {metrics}")
    assert min(_max_logprob_diff(trainer, prompts, g) for g in base) > 1e-2  # tells the adapter apart
    assert max(diffs) < 1e-4, diffs  # float32, as test_lora_engine's one engine
    assert transport.bytes_sent == sum(p.numel() * 4 for p in trainer.model.parameters() if p.requires_grad)
    # through Ray's object store: both worker nodes pulled the files, a little over the tensors
    assert metrics["weights/object_store_nodes_pulled"] == 2
    pulled = metrics["weights/object_store_bytes_pulled"]
    assert 2 * transport.bytes_sent < pulled < 2.1 * transport.bytes_sent, pulled
    assert [g.token_ids for g in gens[0]] == [g.token_ids for g in gens[1]]  # per-request seeds
    assert all(g.versions == [6] * len(g.token_ids) for r in gens for g in r)
    assert pool.version == 6


@pytest.mark.ray
@pytest.mark.vllm
def test_a_node_that_cannot_read_the_model_is_named_before_anything_starts(nodes, ray_pool, tiny_model_path):
    from rlexp.cluster.ray_cluster import RayCluster
    from tests.ray_nodes import can_hide_directories

    if not can_hide_directories():
        pytest.skip("hiding the model from a node needs a mount namespace (unshare -m): not allowed here")
    blind = nodes.add_node(cpus=1, hide=(Path(tiny_model_path),))
    # one bundle per node with a free CPU: the two worker nodes (one CPU each is the pool's) and `blind`
    cluster = RayCluster(address=nodes.address, replicas=3, strategy="STRICT_SPREAD")
    with pytest.raises(ConfigError) as err:
        cluster.check_readable({"model_path": tiny_model_path})
    print(err.value)
    lines = str(err.value).splitlines()[1:]
    # the node sees an empty directory there: every file of the model is missing
    assert len(lines) == 1 and f"({blind}): model_path={tiny_model_path}: missing " in lines[0], lines
    assert "config.json" in lines[0]
    assert ray_pool.pool is not None  # the run's other placement groups were left alone


JOIN = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from rlexp.cluster.ray_cluster import RayCluster
cluster = RayCluster(address=sys.argv[1] or None, replicas=1)
print(cluster.params()["cluster.replica_nodes"], cluster.params()["cluster.driver_node"])
cluster.shutdown()
"""


@pytest.mark.ray
@pytest.mark.parametrize("how", ["RAY_ADDRESS", "auto"])
def test_a_driver_on_a_cluster_node_joins_that_cluster(nodes, how):
    """`cluster.address=null` with RAY_ADDRESS set (as `ray job submit` sets it), and
    `cluster.address=auto` on a node of the cluster: the run joins it, and says so."""
    env = os.environ | ({"RAY_ADDRESS": nodes.address} if how == "RAY_ADDRESS" else {})
    res = subprocess.run([sys.executable, "-c", JOIN, "" if how == "RAY_ADDRESS" else "auto"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    source = f"RAY_ADDRESS={nodes.address}" if how == "RAY_ADDRESS" else "cluster.address=auto"
    assert f"ray: joined the cluster at {nodes.address} ({source}" in res.stderr, res.stderr[-3000:]
    assert f"{len(nodes)} node(s), {nodes.cpus} CPUs, 0 GPUs" in res.stderr, res.stderr[-3000:]
    replica_node, driver_node = res.stdout.split()
    assert replica_node != driver_node  # the head, where this driver connected, has no CPUs
