"""A LoRA run's weight sync: the adapter into vLLM's LoRA serving (weight_transfer=lora_adapter)
against the merged model (weight_transfer=ram_file, what auto picks on one CPU node), side by
side on one engine, per model.

    .venv/bin/python bench/lora_sync.py [--models tiny smollm2 --syncs 10 --rank 8]

For each model: one trainer with LoRA of rank `--rank` on the default targets (q, k, v, o,
gate, up, down) and two vLLM engines, one per way (a merged push replaces the base weights an
adapter applies to, so the two cannot share an engine). Each round moves the adapters, then
syncs them both ways, alternating which goes first: merged (the policy's W + s B A for every
adapted matrix, every other tensor as it is, written into the RAM file and reloaded in place,
into an engine without LoRA) and adapter (peft's files of the A and B matrices, loaded in
place of the policy's adapter, into an engine serving adapters up to `--rank`).
Timed: the transport's `transfer`, from the trainer's tensors to the engine serving them. After
the last round of each, the engine's logprobs of a few sampled replies are compared with the
trainer's (both must serve the trainer's policy). Bytes: the tensors each writes per sync.

Printed last: `ratio:` merged seconds / adapter seconds per sync (medians) on the last model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoTokenizer

import rlexp.config
from rlexp.chat.render import render_prompt
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.sample import SamplingConfig
from rlexp.trainer.controller import TrainController
from rlexp.trainer.models import LORA_TARGETS
from rlexp.weights.adapter_file import AdapterFileTransport
from rlexp.weights.ram_file import RamFileTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.engine_helpers
from tests.engine_helpers import _as_samples  # noqa: E402  (the engine's replies as samples)

PROMPTS = ["12+3=", "7+25=", "40+2=", "9+9="]


def model_path(name: str) -> str:
    conf = Path(rlexp.config.__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[] if name == "tiny" else [f"model={name}"])
    return instantiate(cfg.model)


def logprob_gap(trainer: TrainController, engine: VLLMEngine, tokenizer) -> float:
    """max |logprob| difference, trainer vs engine, over a few sampled replies."""
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in PROMPTS]

    async def sample():
        return await asyncio.gather(*(engine.generate(p, SamplingConfig(1.0, 1.0, 12, seed=i))
                                      for i, p in enumerate(prompts)))
    gens = asyncio.get_event_loop().run_until_complete(sample())
    ours = trainer.sample_logprobs(_as_samples(prompts, gens))
    return max((lp[len(p):] - torch.tensor(g.logprobs)).abs().max().item()
               for p, g, lp in zip(prompts, gens, ours))


def bench_model(name: str, args, loop) -> dict:
    path = model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)

    async def start(rank):
        return VLLMEngine(path, seed=0, max_model_len=256, kv_cache_gb=0.25, max_num_seqs=32,
                          max_lora_rank=rank)
    ranks = {"merged": 0, "adapter": args.rank}
    engines = {side: loop.run_until_complete(start(rank)) for side, rank in ranks.items()}
    trainer = TrainController(path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), lora={"rank": args.rank})
    merged, adapter = RamFileTransport(), AdapterFileTransport(args.rank, 16, LORA_TARGETS)
    times: dict[str, list[float]] = {"merged": [], "adapter": []}
    gaps: dict[str, float] = {}

    def sync(side: str, version: int) -> None:
        t0 = time.perf_counter()
        if side == "merged":
            loop.run_until_complete(merged.transfer(trainer.weights(), engines[side], version))
        else:
            loop.run_until_complete(adapter.transfer(trainer.adapter_weights(), engines[side], version))
        times[side].append(time.perf_counter() - t0)

    try:
        version = 0
        for round_ in range(args.syncs):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 0.05)
            order = ("merged", "adapter") if round_ % 2 == 0 else ("adapter", "merged")
            for side in order:
                version += 1
                sync(side, version)
                if round_ == args.syncs - 1:
                    gaps[side] = logprob_gap(trainer, engines[side], tokenizer)
        merged_bytes = merged.file.path.stat().st_size  # the safetensors file, header included
    finally:
        merged.close()
        adapter.close()
        for engine in engines.values():
            engine.shutdown()
    return {"model": name, "params": sum(p.numel() for p in trainer.model.parameters()),
            "merged_s": statistics.median(times["merged"][1:]),
            "adapter_s": statistics.median(times["adapter"][1:]),
            "merged_bytes": merged_bytes, "adapter_bytes": adapter.bytes_sent, "gaps": gaps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--syncs", type=int, default=10, help="rounds (each: one merged and one adapter sync)")
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    rows = [bench_model(name, args, loop) for name in args.models]
    print(f"\nLoRA rank {args.rank}, {args.syncs} syncs each way per model "
          "(medians, the first of each left out)")
    print(f"{'model':>8} {'params':>11} {'merged s':>9} {'adapter s':>10} {'merged MB':>10} "
          f"{'adapter MB':>11} {'gap merged':>11} {'gap adapter':>12}")
    for r in rows:
        print(f"{r['model']:>8} {r['params']:>11,} {r['merged_s']:>9.4f} {r['adapter_s']:>10.4f} "
              f"{r['merged_bytes'] / 1e6:>10.2f} {r['adapter_bytes'] / 1e6:>11.3f} "
              f"{r['gaps']['merged']:>11.1e} {r['gaps']['adapter']:>12.1e}")
    last = rows[-1]
    size = last["merged_bytes"] / last["adapter_bytes"]
    print(f"{last['model']}: bytes per sync merged / adapter {size:.1f}")
    print(f"ratio: {last['merged_s'] / last['adapter_s']:.2f}")


if __name__ == "__main__":
    main()
