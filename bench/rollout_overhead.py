"""rlexp's rollout throughput over raw vLLM's, side by side in one process.

    .venv/bin/python bench/rollout_overhead.py [--reps 20 --batches 4 --streaming]

Both paths use one vLLM AsyncLLM, the same prompts, the same seeds and the same
SamplingParams (logprobs as flat lists, no text), so they generate the same tokens. The raw
path calls `AsyncLLM.generate` directly, one request with n = samples per prompt for each
prompt group (what rlexp's engine sends); the rlexp path goes through DataManager ->
SyncScheduler -> SingleTurnAgent (a prompt group in one coroutine: `rollout_group`) ->
VLLMEngine -> Judge, plus trace capture as the loop's tracker does it (each sample's trace
line handed to the run's MLflow writer process, which stores the step's trace file:
`MlflowTracker.log_samples`, into an MLflow store in a temporary directory).

A repetition is `--batches` batches (the default experiment's 32 prompts x 8 samples each),
timed back to back: one batch takes about 0.3 s here, too short to time alone (single
batches scattered from 0.71x to 1.09x). Repetitions alternate raw/rlexp; the ratio is the
median over repetitions of rlexp tokens/s divided by raw tokens/s. `--streaming` adds a
third side, rlexp with every reply streamed token by token to a callback, and prints its
tokens/s over rlexp's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoTokenizer

import rlexp.config  # noqa: F401  (registers the config resolvers)
from rlexp.agents.single_turn import SingleTurnAgent, request_seed
from rlexp.chat.render import render_prompt
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.judges.math_exact import MathExactJudge
from rlexp.rollout.each import generate_each
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.schedulers.sync import SyncScheduler
from rlexp.tracking.mlflow_tracker import MlflowTracker

CONF = Path(rlexp.config.__file__).resolve().parents[1] / "conf"  # the imported rlexp's checkout


def data_manager(args, rep: int) -> DataManager:
    src = ArithmeticSource(max_operand=99, ops="+", eval_size=200, seed=0)
    return DataManager(src, prompts_per_step=args.prompts, samples_per_prompt=args.samples, seed=rep)


async def raw_vllm(engine: VLLMEngine, tokenizer, args, rep: int) -> tuple[int, float]:
    """Each prompt group as one request with n = samples per prompt, seeded with the group's
    first sample's seed: the requests rlexp's engine sends (rlexp/rollout/vllm_groups.py)."""
    from vllm import SamplingParams

    data = data_manager(args, rep)
    batches = [data.sample_groups(args.prompts) for _ in range(args.batches)]
    prompts = [[render_prompt(tokenizer, g[0].prompt) for g in groups] for groups in batches]

    async def one(i, prompt, seed, n):
        params = SamplingParams(temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens,
                                seed=seed, logprobs=0, flat_logprobs=True, detokenize=False, n=n)
        final: dict[int, int] = {}
        request = {"prompt_token_ids": prompt}
        async for out in engine.llm.generate(request, params, request_id=f"raw{rep}-{i}"):
            final |= {c.index: len(c.token_ids) for c in out.outputs}
        return sum(final.values())

    tokens, elapsed = 0, 0.0
    for b, groups in enumerate(batches):
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(f"{b}-{i}", p, request_seed(args.seed, g[0]), len(g))
                                        for i, (p, g) in enumerate(zip(prompts[b], groups))))
        elapsed += time.perf_counter() - t0
        tokens += sum(counts)
    return tokens, elapsed


class Streamed:
    """The engine, each reply streamed to a callback that drops it (as the server's streaming
    does, less the HTTP): a request with a callback goes out on its own, not with its group."""

    def __init__(self, engine: VLLMEngine):
        self.engine, self.sampling = engine, engine.sampling

    async def generate(self, token_ids, sampling, images=None):
        return await self.engine.generate_streaming(token_ids, sampling, lambda ids, lps: None, images)

    async def generate_group(self, token_ids, samplings):
        return await generate_each(self, token_ids, samplings)


async def rlexp_path(engine, tokenizer, args, rep: int, tracker: MlflowTracker) -> tuple[int, float]:
    data = data_manager(args, rep)
    agent = SingleTurnAgent(engine, tokenizer, MathExactJudge())
    tokens, elapsed = 0, 0.0
    for b in range(args.batches):
        t0 = time.perf_counter()
        batch = await SyncScheduler().produce_batch(data, agent, version=0)
        # As the loop does: the clock stops once the trace lines are handed to the writer process.
        tracker.log_samples(batch, (rep + 1) * args.batches + b + 1, tokenizer.decode)
        elapsed += time.perf_counter() - t0
        tokens += sum(s.response_length for s in batch)
    tracker.flush()  # the writer's work is done before the next repetition
    return tokens, elapsed


async def main(args) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"model.warm_start_steps={args.warm_start_steps}"])
    model = instantiate(cfg.model)  # the default experiment's model (built once, cached)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = VLLMEngine(model, seed=args.seed, temperature=args.temperature,
                        max_response_tokens=args.max_tokens, max_model_len=256)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tracker = MlflowTracker(f"sqlite:///{tmp}/mlflow.db", "rollout_overhead",
                                    trace_sample_rate=cfg.logger.trace_sample_rate)
            tracker.start(cfg)
            await raw_vllm(engine, tokenizer, args, -1)  # warm-up
            await rlexp_path(engine, tokenizer, args, -1, tracker)
            gc.collect()
            gc.freeze()  # as rlexp.run does after start-up: cheap full collections
            for rep in range(args.reps):
                # Alternate which path goes first, so neither always meets a warmer engine.
                sides = [partial(raw_vllm, engine, tokenizer, args, rep),
                         partial(rlexp_path, engine, tokenizer, args, rep, tracker)]
                if args.streaming:
                    sides.append(partial(rlexp_path, Streamed(engine), tokenizer, args, rep, tracker))
                order = range(len(sides)) if rep % 2 == 0 else reversed(range(len(sides)))
                done = {i: await sides[i]() for i in order}
                rows.append([done[i][0] / done[i][1] for i in range(len(sides))] + [done[0][0], done[1][0]])
            tracker.end()
    finally:
        engine.shutdown()
    print(f"\nrequests per repetition: {args.batches} x {args.prompts * args.samples}  "
          f"max_tokens: {args.max_tokens}")
    print(f"{'rep':>3} {'raw tok/s':>10} {'rlexp tok/s':>12} {'ratio':>6} {'raw tok':>8} {'rlexp tok':>9}")
    for i, (raw, ours, *rest) in enumerate(rows):
        print(f"{i:>3} {raw:>10.0f} {ours:>12.0f} {ours / raw:>6.3f} {rest[-2]:>8} {rest[-1]:>9}")
    ratio = statistics.median(r[1] / r[0] for r in rows)
    pooled, pooled_raw = (sum(r[-1] for r in rows) / sum(r[-1] / r[i] for r in rows) for i in (1, 0))
    print(f"rollout throughput ratio (rlexp / raw vLLM), median of {args.reps}: {ratio:.3f}")
    print(f"pooled over all repetitions: rlexp {pooled:.0f} tok/s, raw {pooled_raw:.0f} tok/s, "
          f"ratio {pooled / pooled_raw:.3f}")
    if args.streaming:
        streamed = statistics.median(r[2] / r[1] for r in rows)
        print(f"rlexp streamed / rlexp, median of {args.reps}: {streamed:.3f}")
    print(f"ratio: {ratio:.3f}")

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warm-start-steps", type=int, default=1500,
                   help="0 gives an untrained model whose responses run to --max-tokens")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batches", type=int, default=4,
                   help="batches (steps' rollouts) per repetition, timed back to back: one takes ~0.3 s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streaming", action="store_true",
                   help="also time rlexp with every reply streamed to a callback (its cost)")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(p.parse_args()))
