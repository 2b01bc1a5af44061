"""Weight sync through a Ray rollout pool (cluster=ray) over its memcpy floor: the ram_file
and object_store transports, for the tiny model and a ~135M-parameter model.

    .venv/bin/python -u bench/ray_weight_transfer.py [--reps 7] [--models tiny,llama-135m] [--replicas 1]
    .venv/bin/python -u bench/ray_weight_transfer.py --models tiny --reps 1 --rollout hf   # smoke (~1 min)

Per model: a RayCluster (a local Ray, one placement-group bundle per replica) whose RolloutPool
holds `--replicas` vLLM engines in Ray actors, and the model's weights as the trainer holds them
(its state dict, in this process). Timed, side by side, alternating the order every repetition:
  floor         every weight tensor copied once into a preallocated buffer, the faster of
                torch's `copy_` and one memcpy per tensor (as bench/weight_sync.py defines it)
  ram_file      RamFileTransport.transfer(weights, pool, v): the tensors written into the mapped
                RAM file in /dev/shm (`write`), then the pool's fan-out: each replica's actor has
                its engine reload in place from that file (`replicas`); `weight_transfer=auto`
                picks it on one node
  object_store  ObjectStoreTransport.transfer(weights, pool, v): one `ray.put` of the tensors
                as numpy arrays (`put`), then the fan-out (`replicas`): each actor gets the
                object (mapped from Ray's shared memory on this node), writes it into a RAM file
                of its own and has its engine reload from it; what `auto` picks when replicas
                sit on other nodes (there the pull also crosses the network, not measured here)
Before every timed sync the weights are scaled by 1.0001, so each moves new numbers. Before
timing, each path is checked once on every replica: the logprobs of a fixed seeded prompt
change after it carries perturbed weights and come back exactly after it carries the
originals (and both paths give the same logprobs), so neither path can be a no-op.

Headline (the last line, `ratio: X`): object_store / floor for the last model. ram_file is
what a one-node run uses; object_store is the only path across nodes, and on one node its cost
over ram_file is the price of that generality (one more copy: put, then the replica's file).
On this 2-core machine the driver, Ray's own processes and each replica's vLLM engine share two
cores, so a fan-out to 2 replicas runs their reloads on the same cores (no parallel speed-up);
the floor (one copy of the bytes) is the least any sync can cost. `--rollout hf` puts transformers
engines in the replicas instead of vLLM (quick start; the smoke test's mode).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_config, default_model, median  # noqa: E402
from weight_sync import llama_135m  # noqa: E402

from rlexp.sample import SamplingConfig  # noqa: E402
from rlexp.weights.object_store import ObjectStoreTransport  # noqa: E402
from rlexp.weights.ram_file import RamFileTransport  # noqa: E402

PROBE = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=8, seed=1234)


class _TimedPool:
    """The pool as a transport sees it, timing the pool's part of a transfer (the fan-out)."""

    def __init__(self, pool):
        self.pool, self.seconds = pool, 0.0

    async def load_weights(self, directory, version):
        t0 = time.perf_counter()
        await self.pool.load_weights(directory, version)
        self.seconds = time.perf_counter() - t0

    async def load_weights_object(self, ref, version):
        t0 = time.perf_counter()
        await self.pool.load_weights_object(ref, version)
        self.seconds = time.perf_counter() - t0


async def probe(pool, prompt: list[int]) -> list[list[float]]:
    """Each replica's sampling logprobs for the fixed prompt (same seed: same tokens if the
    weights are the same)."""
    gens = await asyncio.gather(*(a.generate.remote(prompt, PROBE) for a in pool.actors))
    return [g.logprobs for g in gens]


def differ(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max((abs(x - y) for x, y in zip(p, q)), default=0.0) + abs(len(p) - len(q))
               for p, q in zip(a, b))


async def verify(name: str, transfer, model, pool, prompt: list[int]) -> list[list[float]]:
    """`transfer(version)` carries the weights: perturbed ones must change every replica's
    logprobs, the originals must bring them back."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    await transfer(pool.version + 1)
    before = await probe(pool, prompt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    await transfer(pool.version + 1)
    changed = differ(before, await probe(pool, prompt))
    model.load_state_dict(saved)
    await transfer(pool.version + 1)
    back = differ(before, await probe(pool, prompt))
    ok = changed > 1e-3 and back < 1e-5
    print(f"  check {name:12} perturbed weights move logprobs by {changed:.4f}, originals restore "
          f"them to within {back:.1e}: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        sys.exit(f"{name}: the transfer did not reach every replica")
    return before


async def check_transports(model, sd, ram, obj, pool, prompt: list[int]) -> None:
    """Both transports reach every replica (verify), and give the same logprobs for the same
    weights (`sd`: the model's state dict, as the transports send it)."""
    a = await verify("ram_file", lambda v: ram.transfer(sd.items(), pool, v), model, pool, prompt)
    b = await verify("object_store", lambda v: obj.transfer(sd.items(), pool, v), model, pool, prompt)
    if differ(a, b) > 1e-5:
        sys.exit("ram_file and object_store gave different logprobs for the same weights")


async def timed_rounds(model, sd, ram, obj, pool, reps: int) -> dict[str, list[float]]:
    """`reps` timed rounds (after one untimed warm-up) of the floors (a copy_ and a memcpy into
    preallocated tensors) and both transports, the weights nudged before each, the order
    reversed every other round; the transports' times split into their own part and the pool's."""
    timed = _TimedPool(pool)
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    times: dict[str, list[float]] = {k: [] for k in (
        "floor copy_", "floor memcpy", "ram_file", "  write", "  replicas", "object_store", "  put",
        "  replicas ")}
    order = ["floor copy_", "floor memcpy", "ram_file", "object_store"]
    for rep in range(reps + 1):  # the first round warms up (first mapping, page faults), untimed
        for what in order if rep % 2 else order[::-1]:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0001)
            t0 = time.perf_counter()
            if what == "floor copy_":
                with torch.no_grad():
                    for k, v in sd.items():
                        dst[k].copy_(v)
            elif what == "floor memcpy":
                for k, v in sd.items():
                    ctypes.memmove(dst[k].data_ptr(), v.data_ptr(), v.numel() * v.element_size())
            elif what == "ram_file":
                await ram.transfer(sd.items(), timed, pool.version + 1)
            else:
                await obj.transfer(sd.items(), timed, pool.version + 1)
            t = time.perf_counter() - t0
            if rep:
                times[what].append(t)
                if what == "ram_file":
                    times["  write"].append(t - timed.seconds)
                    times["  replicas"].append(timed.seconds)
                elif what == "object_store":
                    times["  put"].append(t - timed.seconds)
                    times["  replicas "].append(timed.seconds)
    return times


def print_times(times: dict[str, list[float]], n_bytes: int) -> float:
    """A row per measurement (median, over the floor, every repetition), then the ratios; the
    floor: the faster of the two copies."""
    floor = min(median(times["floor copy_"]), median(times["floor memcpy"]))
    print(f"  {'':14} {'median s':>9} {'/ floor':>8}   repetitions (s)")
    for what, ts in times.items():
        print(f"  {what:14} {median(ts):9.4f} {median(ts) / floor:8.2f}   {' '.join(f'{t:.4f}' for t in ts)}")
    print(f"  floor {floor:.4f} s ({n_bytes / floor / 1e9:.1f} GB/s)   ram_file / floor "
          f"{median(times['ram_file']) / floor:.2f}   object_store / floor "
          f"{median(times['object_store']) / floor:.2f}   object_store / ram_file "
          f"{median(times['object_store']) / median(times['ram_file']):.2f}", flush=True)
    return floor


async def bench_model(name: str, path: str, replicas: int, reps: int, rollout: str) -> dict[str, list[float]]:
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlexp.chat.render import render_prompt

    model = AutoModelForCausalLM.from_pretrained(path)  # the trainer's weights
    sd = model.state_dict()
    n_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"\n{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, state dict "
          f"{n_bytes / 1e6:.0f} MB (tied counted twice); {replicas} {rollout} replica(s)", flush=True)
    prompt = render_prompt(AutoTokenizer.from_pretrained(path), [{"role": "user", "content": "12+34="}])
    engine = ["rollout.kv_cache_gb=0.25"] if rollout == "vllm" else ["rollout=hf"]
    cfg = default_config(["cluster=ray", f"rollout.replicas={replicas}", *engine])
    cluster = instantiate(cfg.cluster)
    ram, obj = RamFileTransport(), ObjectStoreTransport()
    try:
        pool = cluster.rollout_engine(cfg.rollout, path, ram)
        await check_transports(model, sd, ram, obj, pool, prompt)
        times = await timed_rounds(model, sd, ram, obj, pool, reps)
    finally:
        ram.close()
        obj.close()
        cluster.shutdown()
    times["floor"] = [print_times(times, n_bytes)]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--models", default="tiny,llama-135m", help="of tiny, llama-135m")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--rollout", default="vllm", choices=["vllm", "hf"],
                   help="the replicas' engine; hf (transformers) starts faster: the smoke test's quick mode")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the replicas' (Ray forwards their output)
    paths = {"tiny": lambda: default_model(default_config()), "llama-135m": llama_135m}
    results = {name: asyncio.run(bench_model(name, paths[name](), args.replicas, args.reps, args.rollout))
               for name in args.models.split(",")}
    last = results[args.models.split(",")[-1]]
    print(f"ratio: {median(last['object_store']) / last['floor'][0]:.3f}")


if __name__ == "__main__":
    main()
