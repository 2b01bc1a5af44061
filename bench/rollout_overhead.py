"""rlexp's rollout throughput over raw vLLM's, side by side in one process.

    .venv/bin/python bench/rollout_overhead.py [--prompts 32 --samples 8 --max-tokens 8 --reps 5]

Both paths use one vLLM AsyncLLM, the same prompts, the same per-request seeds and the
same SamplingParams, so they generate the same tokens. The raw path calls
`AsyncLLM.generate` directly; the rlexp path goes through DataManager -> SyncScheduler
-> SingleTurnAgent -> VLLMEngine -> Judge, plus trace capture (each sample serialised to
a JSONL line and written to disk by a background thread, as the loop's tracker does).
Repetitions alternate raw/rlexp; the ratio is the median over repetitions of rlexp
tokens/s divided by raw tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.schedulers.sync import SyncScheduler

CONF = Path(__file__).resolve().parents[1] / "conf"


def data_manager(args, rep: int) -> DataManager:
    src = ArithmeticSource(max_operand=99, ops="+", eval_size=200, seed=0)
    return DataManager(src, prompts_per_step=args.prompts, samples_per_prompt=args.samples, seed=rep)


async def raw_vllm(engine: VLLMEngine, tokenizer, args, rep: int) -> tuple[int, float]:
    from vllm import SamplingParams

    groups = data_manager(args, rep).sample_groups(args.prompts)
    samples = [s for g in groups for s in g]
    prompts = [render_prompt(tokenizer, s.prompt) for s in samples]

    async def one(i, prompt, seed):
        params = SamplingParams(temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens,
                                seed=seed, logprobs=0, detokenize=False)
        final = None
        request = {"prompt_token_ids": prompt}
        async for out in engine.llm.generate(request, params, request_id=f"raw{rep}-{i}"):
            final = out
        return len(final.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, request_seed(args.seed, s))
                                    for i, (p, s) in enumerate(zip(prompts, samples))))
    return sum(counts), time.perf_counter() - t0


async def rlexp_path(engine, tokenizer, args, rep: int, trace_dir: Path) -> tuple[int, float]:
    data = data_manager(args, rep)
    agent = SingleTurnAgent(engine, tokenizer, MathExactJudge())
    t0 = time.perf_counter()
    batch = await SyncScheduler().produce_batch(data, agent, version=0)
    # As the loop's tracker does: the trace file is written by a background thread (in the
    # loop it overlaps the fit); the clock stops at the hand-over, the write is awaited after.
    write = asyncio.get_running_loop().run_in_executor(WRITER, write_trace, batch, tokenizer.decode,
                                                      trace_dir / f"step_{rep:05d}.jsonl")
    elapsed = time.perf_counter() - t0
    await write
    return sum(s.response_length for s in batch), elapsed


WRITER = ThreadPoolExecutor(1)


def write_trace(batch, decode, path: Path) -> None:
    path.write_text("\n".join(json.dumps(s.to_trace(decode)) for s in batch) + "\n")


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
            await raw_vllm(engine, tokenizer, args, -1)  # warm-up
            await rlexp_path(engine, tokenizer, args, -1, Path(tmp))
            gc.collect()
            gc.freeze()  # as rlexp.run does after start-up: cheap full collections
            for rep in range(args.reps):
                # Alternate which path goes first, so neither always meets a warmer engine.
                if rep % 2 == 0:
                    raw_tok, raw_s = await raw_vllm(engine, tokenizer, args, rep)
                    our_tok, our_s = await rlexp_path(engine, tokenizer, args, rep, Path(tmp))
                else:
                    our_tok, our_s = await rlexp_path(engine, tokenizer, args, rep, Path(tmp))
                    raw_tok, raw_s = await raw_vllm(engine, tokenizer, args, rep)
                rows.append((raw_tok / raw_s, our_tok / our_s, raw_tok, our_tok))
    finally:
        engine.shutdown()
    print(f"\nrequests per repetition: {args.prompts * args.samples}  max_tokens: {args.max_tokens}")
    print(f"{'rep':>3} {'raw tok/s':>10} {'rlexp tok/s':>12} {'ratio':>6} {'raw tok':>8} {'rlexp tok':>9}")
    for i, (raw, ours, rt, ot) in enumerate(rows):
        print(f"{i:>3} {raw:>10.0f} {ours:>12.0f} {ours / raw:>6.3f} {rt:>8} {ot:>9}")
    ratio = statistics.median(o / r for r, o, *_ in rows)
    pooled = sum(r[3] for r in rows) / sum(r[3] / r[1] for r in rows)
    pooled_raw = sum(r[2] for r in rows) / sum(r[2] / r[0] for r in rows)
    print(f"rollout throughput ratio (rlexp / raw vLLM), median of {args.reps}: {ratio:.3f}")
    print(f"pooled over all repetitions: rlexp {pooled:.0f} tok/s, raw {pooled_raw:.0f} tok/s, "
          f"ratio {pooled / pooled_raw:.3f}")
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
    p.add_argument("--seed", type=int, default=0)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(p.parse_args()))
