"""Rollout tokens/s through cluster=ray with rollout.replicas=1 and 2, and cluster=local's one
engine as the reference, on the tiny model.

    .venv/bin/python -u bench/ray_rollout.py [--reps 11] [--max-tokens 8]

Three rollout engines built as a run builds them (`cluster.rollout_engine(cfg.rollout, ...)`,
the default experiment's config), all up at once: `local` (one VLLMEngine in this process),
`ray1` (a RolloutPool of one replica) and `ray2` (a RolloutPool of two replicas; the pool
routes each request to the replica with the fewest in flight). Each repetition sends every side
the same fixed batch: one training step's requests of the default task (32 prompts x 8
samples = 256 requests), the default sampling (temperature 1, max_response_tokens), each
request with its own seed (as SingleTurnAgent derives it), all at once through the engine
Protocol (`engine.generate`). The sides alternate order every repetition, after one untimed
warm-up round. Reported: generated tokens / wall seconds per side.

On this 2-core machine this mostly measures overhead, not scaling: the two replicas of `ray2`
share the same two cores with each other, with the driver (this process: routing, asyncio,
Ray's client) and with Ray's own processes, so a second replica adds no compute; what differs
between the sides is the per-request cost of the Ray actor hop and of two engines competing
for the cores. On a machine with a core (or GPU) per replica, ray2 / ray1 is the scaling.

The last line is `ratio: X`: ray2 / ray1 tokens/s (median over repetitions of the per-repetition
ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_config, default_model, median  # noqa: E402

NOTE = ("note: 2 CPU cores here: ray2's two engines share them with each other, the driver and Ray, "
        "so this measures overhead, not scaling")


async def batch(engine, prompts: list[list[int]], seeds: list[int], sampling) -> tuple[int, float]:
    """Every request at once; (tokens generated, wall seconds)."""
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(ids, replace(sampling, seed=s))
                                  for ids, s in zip(prompts, seeds)))
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0


async def measure(engines: dict, prompts, seeds, sampling, reps: int) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in engines}
    names = list(engines)
    for rep in range(reps + 1):  # round 0 warms up, untimed
        for name in names if rep % 2 else names[::-1]:
            tokens, seconds = await batch(engines[name], prompts, seeds, sampling)
            if rep:
                out[name].append((tokens, seconds))
        if rep:
            print(f"rep {rep:2}  " + "  ".join(f"{n} {out[n][-1][0] / out[n][-1][1]:7.0f} tok/s "
                                               f"({out[n][-1][0]} tok)" for n in names), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--max-tokens", type=int, default=None, help="default: the config's max_response_tokens")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the replicas' (Ray forwards their output)
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from rlexp.agents.single_turn import request_seed
    from rlexp.chat.render import render_prompt
    from rlexp.cluster import LocalCluster
    from rlexp.weights.ram_file import RamFileTransport

    extra = [f"rollout.max_response_tokens={args.max_tokens}"] if args.max_tokens else []
    # Both Ray clusters share one local Ray: 3 replica bundles of 1 logical CPU (placement only)
    cfgs = {"local": default_config(extra),
            "ray1": default_config(["cluster=ray", "rollout.replicas=1", "cluster.num_cpus=3", *extra]),
            "ray2": default_config(["cluster=ray", "rollout.replicas=2", *extra])}
    cfg = cfgs["local"]
    model_path = default_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    groups = instantiate(cfg.data).sample_groups(cfg.data.prompts_per_step)
    samples = [s for g in groups for s in g]
    prompts = [render_prompt(tokenizer, s.prompt) for s in samples]
    seeds = [request_seed(cfg.seed, s) for s in samples]
    transport = RamFileTransport()  # what weight_transfer=auto picks on one node (unused here)
    clusters, engines = [], {}
    try:
        for name, c in cfgs.items():
            cluster = LocalCluster() if name == "local" else instantiate(c.cluster)
            clusters.append(cluster)
            engines[name] = cluster.rollout_engine(c.rollout, model_path, transport)
        sampling = engines["local"].sampling
        print(f"\n{len(prompts)} requests per repetition, max_tokens {sampling.max_tokens}, "
              f"temperature {sampling.temperature}; {NOTE}", flush=True)
        results = asyncio.run(measure(engines, prompts, seeds, sampling, args.reps))
    finally:
        for cluster in reversed(clusters):  # the Ray owner (ray1) last
            cluster.shutdown()
        if "local" in engines:
            engines["local"].shutdown()
        transport.close()
    rate = {n: [t / s for t, s in r] for n, r in results.items()}
    print(f"\n{'side':6} {'median tok/s':>12} {'/ local':>8}   tokens per repetition")
    for n, r in rate.items():
        print(f"{n:6} {median(r):12.0f} {median(r) / median(rate['local']):8.3f}   "
              f"{' '.join(str(t) for t, _ in results[n])}")
    ratio = median([b / a for a, b in zip(rate["ray1"], rate["ray2"])])
    print(f"ray2 / ray1 tokens/s: {ratio:.3f} (median of per-repetition ratios; ratio of medians "
          f"{median(rate['ray2']) / median(rate['ray1']):.3f}); ray1 / local "
          f"{median([b / a for a, b in zip(rate['local'], rate['ray1'])]):.3f}")
    print(NOTE)
    print(f"ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
