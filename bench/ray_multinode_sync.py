"""One weight sync through Ray's object store when the replica sits on another node, over the
same sync when it sits on the driver's node.

    .venv/bin/python -u bench/ray_multinode_sync.py [--reps 7] [--model llama-135m|tiny]

Two setups, one after the other in this process, each with one vLLM replica of the model:
  one node   a local Ray (cluster.address=null): the driver's `ray.put` lands in the shared
             memory of the node the replica is on; the replica maps it
  two nodes  a Ray cluster of two nodes on this host (tests/ray_nodes.py: a head with no CPUs,
             where this driver connects, and a worker node with its own raylet and object
             store, where the replica must go): the replica's node pulls the object from the
             head's store over Ray's object manager (TCP on loopback here, the network on a
             real cluster), then maps it
Each timed sync is ObjectStoreTransport.transfer: the weights scaled by 1.0001 (new numbers
every time), one `ray.put`, the pool's fan-out (the replica writes the arrays into its own RAM
file and vLLM reloads from it). Before timing, each setup is checked as in
bench/ray_weight_transfer.py: perturbed weights move the replica's logprobs, the originals
restore them; and the pool reports, from Ray's object directory, how many bytes other nodes
pulled per sync (0 on one node).

Headline (the last line, `ratio: X`): the two-node sync's median time over the one-node's.
Both nodes share this host's two cores and memory, so the crossing costs a copy through
loopback TCP, not a network transfer; on separate hosts add bytes / bandwidth.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")  # read once, when Ray is imported (tests/ray_nodes.py)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from common import default_config, default_model, median  # noqa: E402
from ray_weight_transfer import verify  # noqa: E402
from weight_sync import llama_135m  # noqa: E402

from rlexp.weights.object_store import ObjectStoreTransport  # noqa: E402
from tests.ray_nodes import RayNodes  # noqa: E402


async def syncs(cluster, path: str, reps: int) -> tuple[list[float], float]:
    """The replica's pool on `cluster`: checked, then `reps` timed syncs (after one untimed);
    their times and the bytes other nodes pulled per sync."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlexp.chat.render import render_prompt

    model = AutoModelForCausalLM.from_pretrained(path)
    sd = model.state_dict()
    prompt = render_prompt(AutoTokenizer.from_pretrained(path), [{"role": "user", "content": "12+34="}])
    cfg = default_config(["cluster=ray", "rollout.kv_cache_gb=0.25"])
    obj = ObjectStoreTransport()
    try:
        pool = cluster.rollout_engine(cfg.rollout, path, obj)
        await verify("object_store", lambda v: obj.transfer(sd.items(), pool, v), model, pool, prompt)
        pool.pop_replica_metrics()
        times = []
        for rep in range(reps + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0001)
            t0 = time.perf_counter()
            await obj.transfer(sd.items(), pool, pool.version + 1)
            if rep:
                times.append(time.perf_counter() - t0)
        pulled = pool.pop_replica_metrics().get("weights/object_store_bytes_pulled", 0.0) / (reps + 1)
    finally:
        obj.close()
        cluster.shutdown()
    return times, pulled


def report(name: str, times: list[float], pulled: float, nodes: list[str], driver: str) -> None:
    print(f"  {name:9} replica on node {nodes[0][:8]}, driver on {driver[:8]}; pulled by other nodes "
          f"per sync {pulled / 1e6:.1f} MB; median {median(times):.3f} s   "
          + " ".join(f"{t:.3f}" for t in times), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--model", default="llama-135m", choices=["llama-135m", "tiny"])
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    path = llama_135m() if args.model == "llama-135m" else default_model(default_config())
    from rlexp.cluster.ray_cluster import RayCluster

    local = RayCluster(replicas=1)
    where = (local.replica_nodes, local.driver_node)
    one, one_pulled = asyncio.run(syncs(local, path, args.reps))
    report("one node", one, one_pulled, *where)
    nodes = RayNodes(Path(tempfile.mkdtemp(prefix="ray_nodes_")), object_store_mb=2048).start()
    try:
        nodes.add_node(cpus=2)
        remote = RayCluster(address=nodes.address, replicas=1)
        where = (remote.replica_nodes, remote.driver_node)
        two, two_pulled = asyncio.run(syncs(remote, path, args.reps))
    finally:
        nodes.stop()
    report("two nodes", two, two_pulled, *where)
    if not (one_pulled == 0 and two_pulled > 0 and where[0][0] != where[1]):
        sys.exit("the two-node sync did not cross nodes (or the one-node one did)")
    print(f"ratio: {median(two) / median(one):.3f}")


if __name__ == "__main__":
    main()
