"""What rlexp's requests ask of vLLM beyond a naive loop's: per-request seeds and logprobs.

    .venv/bin/python bench/sampling_cost.py [--reps 16]

One vLLM engine, the default experiment's model and batch (32 prompt groups, each one
request with n = 8, up to 8 new tokens), raw `AsyncLLM.generate`, four ways alternating:
seeded or not (rlexp seeds every group so that rollouts reproduce whatever the finish
order; vLLM then samples with a generator per request) and with the sampled tokens'
logprobs or without (rlexp needs them for the sync check and the engine's old logprobs).
Medians of tokens/s. Headline: tokens/s without either over tokens/s with both (rlexp's),
the part of a naive loop's speed that is these two requirements, not rlexp's code.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WAYS = [(True, True), (True, False), (False, True), (False, False)]  # (seeded, logprobs)


async def tokens_per_s(engine, prompts: list[list[int]], seeds: list[int], seeded: bool, logprobs: bool,
                       tag: str) -> float:
    from vllm import SamplingParams

    async def one(i: int) -> int:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8, n=8, detokenize=False,
                                seed=seeds[i] if seeded else None, logprobs=0 if logprobs else None)
        lengths: dict[int, int] = {}
        request = {"prompt_token_ids": prompts[i]}
        async for out in engine.llm.generate(request, params, request_id=f"{tag}-{i}"):
            lengths |= {c.index: len(c.token_ids) for c in out.outputs}
        return sum(lengths.values())

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    return tokens / (time.perf_counter() - t0)


async def main(reps: int) -> None:
    from common import default_config, default_model
    from rollout_overhead import ArithmeticSource, DataManager, render_prompt
    from transformers import AutoTokenizer

    from rlexp.rollout.vllm_engine import VLLMEngine

    model = default_model(default_config())
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = VLLMEngine(model, seed=0, max_response_tokens=8, max_model_len=256)
    source = ArithmeticSource(max_operand=99, ops="+", eval_size=200, seed=0)
    speeds: dict[tuple[bool, bool], list[float]] = {w: [] for w in WAYS}
    try:
        for rep in range(-1, reps):  # -1: warm-up
            data = DataManager(source, prompts_per_step=32, samples_per_prompt=8, seed=rep)
            groups = data.sample_groups(32)
            prompts = [render_prompt(tokenizer, g[0].prompt) for g in groups]
            seeds = [1000 * (rep + 2) + 8 * i for i in range(len(prompts))]
            for way in (WAYS if rep % 2 else WAYS[::-1]):
                speed = await tokens_per_s(engine, prompts, seeds, *way, tag=f"{rep}-{way}")
                if rep >= 0:
                    speeds[way].append(speed)
    finally:
        engine.shutdown()
    med = {w: statistics.median(v) for w, v in speeds.items()}
    for (seeded, logprobs), v in med.items():
        print(f"seeded {seeded!s:>5}, logprobs {logprobs!s:>5}: {v:.0f} tok/s (median of {reps})")
    print(f"ratio: {med[False, False] / med[True, True]:.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=16)
    asyncio.run(main(p.parse_args().reps))
