"""The HTTP server path's overhead against the in-process client, for multi-turn sessions.

    .venv/bin/python bench/http_overhead.py [--sessions 64 --turns 3 --reps 5]

One vLLM engine; the same agent code (`three_turns` below: plain OpenAI-client calls) runs
each session through `OpenAIAgent` with `transport=inprocess` (rlexp's in-process client)
and with `transport=http` (the real `openai` package against rlexp's FastAPI server on
loopback). Same prompts and per-request seeds, so both generate the same tokens.
Repetitions alternate the order; the ratio is HTTP tokens/s over in-process tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AutoTokenizer

import rlexp.config  # noqa: F401  (registers the config resolvers)
from rlexp.agents.openai_agent import OpenAIAgent
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.judges.math_exact import MathExactJudge
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.schedulers.sync import SyncScheduler

CONF = Path(__file__).resolve().parents[1] / "conf"
TURNS = 3
MAX_TOKENS = 8  # per reply; set by --max-tokens


async def three_turns(client, task) -> float:
    """A fixed-length conversation: answer, hear "again", answer, ... (TURNS replies)."""
    messages = list(task["messages"])
    seed = task["metadata"]["seed"]
    for turn in range(TURNS):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS,
                                                 seed=seed + turn)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""}]
        if turn < TURNS - 1:
            messages += [{"role": "user", "content": "Again."}]
    return 0.0


async def one_rep(agent, args, rep: int) -> tuple[int, float]:
    src = ArithmeticSource(max_operand=99, ops="+", eval_size=200, seed=0)
    data = DataManager(src, prompts_per_step=args.sessions, samples_per_prompt=1, seed=rep)
    t0 = time.perf_counter()
    batch = await SyncScheduler().produce_batch(data, agent, version=0)
    return sum(s.response_length for s in batch), time.perf_counter() - t0


async def main(args) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"model.warm_start_steps={args.warm_start_steps}"])
    model = instantiate(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = VLLMEngine(model, seed=0, max_model_len=512)
    agents = {t: OpenAIAgent(engine, tokenizer, MathExactJudge(), entrypoint="__main__:three_turns",
                             transport=t) for t in ("inprocess", "http")}
    rows = []
    try:
        for agent in agents.values():
            await one_rep(agent, args, -1)  # warm-up (and server start)
        gc.collect()
        gc.freeze()
        for rep in range(args.reps):
            order = ("inprocess", "http") if rep % 2 == 0 else ("http", "inprocess")
            result = {t: await one_rep(agents[t], args, rep) for t in order}
            rows.append(result)
    finally:
        for agent in agents.values():
            await agent.aclose()
        engine.shutdown()
    print(f"\nsessions per repetition: {args.sessions}, {TURNS} policy calls each")
    print(f"{'rep':>3} {'in-process tok/s':>17} {'http tok/s':>11} {'ratio':>6} {'tokens':>7}")
    ratios = []
    for i, r in enumerate(rows):
        (ti, si), (th, sh) = r["inprocess"], r["http"]
        ratios.append((th / sh) / (ti / si))
        print(f"{i:>3} {ti / si:>17.0f} {th / sh:>11.0f} {ratios[-1]:>6.3f} {ti:>4}/{th}")
    print(f"http / in-process throughput, median of {args.reps}: {statistics.median(ratios):.3f}")
    print(f"ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--warm-start-steps", type=int, default=1500,
                   help="0 gives an untrained model whose replies run to --max-tokens")
    args = p.parse_args()
    MAX_TOKENS = args.max_tokens
    asyncio.run(main(args))
