"""The in-run sync check (rlexp/trainer/sync_check.py) against planted weight-sync faults: how
far each moves |logprob(trainer) - logprob(engine)| at the next step, and whether the check's
automatic bound stops the run there.

    .venv/bin/python bench/sync_faults.py [--dtype float32,bfloat16]

Per dtype (the engine's and the trainer's alike), per fault of tests/sync_faults.py: a fresh
trainer, its weights pushed (version 0), a batch from the engine and one real update (AdamW,
lr 1e-3, GRPO); then the faulty push (version 1), a batch of the same prompts, and the fit's
check on it, as a run would make them. Rows:
  tiny model (default experiment's, tied embeddings): a correct push; the lm_head left out of
    the push; the old weights' KV reused after the reload (the prefix cache neither reset nor
    salted by version; each prompt ~150 tokens, one KV block cached); a transport that sent
    nothing; in float32, weights cast to bfloat16 on the way; with LoRA (rank 8): a correct
    push, the base weights without the adapters.
    8 questions x 2 samples, 8 tokens at most.
  tiny MoE (Qwen3-MoE layout, random weights, routing replay on): a correct push; the push
    through vLLM's own reload, which skips the CPU experts' repack. 4 prompts x 2 samples.
The figures are the sync check's over the tokens generated at version 1 (`sync/*`); `caught`:
the fit raised SyncMismatch at the automatic bound (AUTO_BOUNDS, by dtype). Last line
`ratio: X`: the smallest faulty p99 over the largest healthy p99 in float32 (else the one dtype
run), the separation its bound sits in."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.sync_faults
from common import CONF, default_config, default_model  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlexp.chat.render import render_prompt  # noqa: E402
from rlexp.models.arch import build_arch_model  # noqa: E402
from rlexp.trainer.controller import TrainController  # noqa: E402
from rlexp.trainer.sync_check import SyncCheck, resolve_bound  # noqa: E402
from tests import sync_faults as sf  # noqa: E402

QUESTIONS = ["4+13=", "21+5=", "3+3=", "10+17=", "8+2=", "15+15=", "0+9=", "27+1="]
MOE_QUESTIONS = ["What is 12+3?", "Name a prime number.", "Say hello in French.", "Count to three."]
LORA = {"lora": {"rank": 8}}
# (row name, the push, extra trainer settings, dtypes it applies to)
TINY_CASES = [("healthy", sf.correct, {}, None),
              ("lm_head left out (tied)", sf.lm_head_left_out, {}, None),
              ("prefix cache neither reset nor salted", sf.kv_reused, {}, None),
              ("transport sent nothing", sf.nothing_sent, {}, None),
              ("cast to bfloat16 on the way", sf.rounded_to_bfloat16, {}, ("float32",)),
              ("healthy, LoRA", sf.correct, LORA, None),
              ("LoRA not merged", sf.lora_not_merged, LORA, None)]
MOE_CASES = [("healthy, MoE", sf.correct, {"routing_replay": "rollout"}, None),
             ("MoE experts not repacked", sf.experts_not_repacked, {"routing_replay": "rollout"}, None)]


def engine_on_a_loop(path: str, dtype: str, **kwargs):
    """A VLLMEngine made on (and belonging to) a new event loop; (engine, run, loop)."""
    from rlexp.rollout.vllm_engine import VLLMEngine

    loop = asyncio.new_event_loop()

    async def make():
        return VLLMEngine(path, seed=0, dtype=dtype, max_num_seqs=32, kv_cache_gb=0.25, **kwargs)

    return loop.run_until_complete(make()), loop.run_until_complete, loop


def measure(path: str, dtype: str, cases, prompts, **engine_kwargs) -> list[dict]:
    """One engine; per case a fresh trainer and `sf.plant`: the row's figures."""
    engine, run, loop = engine_on_a_loop(path, dtype, **engine_kwargs)
    rows = []
    try:
        for name, fault, extra, dtypes in cases:
            if dtypes and dtype not in dtypes:
                continue
            trainer = TrainController(path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                                      dtype=dtype, optimizer=partial(torch.optim.AdamW, lr=1e-3),
                                      sync_check=partial(SyncCheck, engine_dtype=dtype), **extra)
            out = sf.plant(fault, trainer, engine, run, prompts, temperature=1.0)
            assert out.versions == {1} and out.healthy["sync/tokens"] > 0, (name, out.versions)
            m = out.went_on
            rows.append({"fault": name, "dtype": dtype, "healthy": fault is sf.correct,
                         "p99": m["sync/logprob_diff_p99"], "max": m["sync/logprob_diff_max"],
                         "tokens": m["sync/tokens"], "caught": out.error is not None,
                         "bound": resolve_bound("auto", [dtype, dtype])})
            print(table(rows[-1:]).splitlines()[-1], flush=True)  # as measured: a hang shows where
    finally:
        engine.shutdown()
        close(loop)
    return rows


def close(loop: asyncio.AbstractEventLoop) -> None:
    """Close the engine's loop with its tasks ended: a task left pending (vLLM's output
    handler) keeps the engine's zmq sockets open, and the garbage collector then blocks for ever
    in `zmq.Context.term` at the next engine's shutdown."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def table(rows: list[dict]) -> str:
    lines = ["| fault | dtype | p99 \\|diff\\| | max \\|diff\\| | tokens | caught (auto bound) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fault']} | {r['dtype']} | {r['p99']:.2e} | {r['max']:.2e} | {r['tokens']:.0f} | "
                     f"{'yes' if r['caught'] else 'no'} ({r['bound']:g}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32,bfloat16", help="one or both, comma-separated")
    args = parser.parse_args()
    t0 = time.perf_counter()
    tiny = default_model(default_config())
    moe = build_arch_model("qwen3_moe", str(CONF.parent / ".cache" / "models"), seed=0)
    tiny_tok, moe_tok = AutoTokenizer.from_pretrained(tiny), AutoTokenizer.from_pretrained(moe)
    tiny_prompts = [p for p in sf.history_prompts(tiny_tok, QUESTIONS) for _ in "ab"]  # groups of 2
    moe_prompts = [render_prompt(moe_tok, [{"role": "user", "content": q}]) for q in MOE_QUESTIONS
                   for _ in "ab"]
    rows = []
    for dtype in args.dtype.split(","):
        rows += measure(tiny, dtype, TINY_CASES, tiny_prompts, max_model_len=256)
        rows += measure(moe, dtype, MOE_CASES, moe_prompts, max_model_len=512, routing_capture=True)
    print(table(rows))
    headline = "float32" if any(r["dtype"] == "float32" for r in rows) else rows[0]["dtype"]
    mine = [r for r in rows if r["dtype"] == headline]
    faulty, healthy = [r["p99"] for r in mine if not r["healthy"]], [r["p99"] for r in mine if r["healthy"]]
    print(f"\n{time.perf_counter() - t0:.0f} s. {headline}: smallest faulty p99 {min(faulty):.2e}, "
          f"largest healthy p99 {max(healthy):.2e}")
    print(f"ratio: {min(faulty) / max(healthy):.1f}")

if __name__ == "__main__":
    main()
