"""rlexp's whole step over a naive single-file GRPO loop's, logging included, on the default experiment.

    .venv/bin/python bench/step_vs_naive.py [--steps 12 --blocks 2]

Both generate with vLLM on the same model, task and sizes (32 prompts x 8 samples, the
default sampling and max_response_tokens, lr, grad clip). The naive loop is what one writes
in an afternoon: vLLM's offline `LLM.generate(n=8)`, reward by the same judge, group-
normalised advantages, one padded forward/backward of -A * log pi (PPO's gradient at ratio
1), AdamW, `safetensors.save_model` into /dev/shm and vLLM's `reload_weights`, then one
`mlflow.log_metrics` of its scalars into a SQLite store. rlexp runs its own loop (`RLLoop`)
with its logging as a user gets it (MLflow metrics and the per-step traces).

Both sides are timed over whole steps, logging included: the naive loop from the top of its
body to after its `log_metrics`; rlexp from one step's log line to the next (its
`timing/step_s`, produce + fit + sync without the logging, is printed beside it).

Each side runs in its own process (one vLLM engine per process, nothing shared); blocks
alternate naive/rlexp so both meet the same machine. The first 2 steps of each block are
warm-up. The ratio is median rlexp whole step / median naive whole step over all timed steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 2


def naive_setup(cfg):
    """What the naive loop holds: the tokenizer, the task's train problems, vLLM's offline
    `LLM`, the policy in float32 with its AdamW, and the sampling of a group."""
    import torch
    from common import default_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from rlexp.data.sources import ArithmeticSource

    path = default_model(cfg)
    tok = AutoTokenizer.from_pretrained(path)
    src = cfg.data.source
    problems = ArithmeticSource(src.max_operand, src.ops, src.eval_size, src.seed).problems("train")
    r = cfg.rollout
    llm = LLM(path, seed=0, dtype="float32", max_model_len=r.max_model_len, enforce_eager=True,
              kv_cache_memory_bytes=int(r.kv_cache_gb * (1 << 30)), enable_chunked_prefill=False)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.trainer.optimizer.lr, weight_decay=0.0)
    params = SamplingParams(n=cfg.data.samples_per_prompt, temperature=r.temperature,
                            max_tokens=r.max_response_tokens)
    return tok, problems, llm, policy, opt, params


def naive_rollouts(llm, tok, params, batch) -> tuple[list[tuple[list[int], list[int]]], list[float]]:
    """A group of samples per problem from `LLM.generate`, each scored by the judge's answer
    match: the (prompt, completion) token rows and their rewards, group by group."""
    from rlexp.judges.math_exact import extract_answer, normalize

    prompts = [tok.encode(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for p in batch]
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows, rewards = [], []
    for prob, prompt, res in zip(batch, prompts, results):
        for c in res.outputs:
            answer = extract_answer(tok.decode(c.token_ids, skip_special_tokens=True))
            rewards.append(float(answer is not None and normalize(answer) == normalize(prob.answer)))
            rows.append((prompt, list(c.token_ids)))
    return rows, rewards


def naive_fit(policy, opt, rows, rewards, groups: int, pad_id: int, max_grad_norm: float):
    """Group-normalised advantages, one padded forward/backward of -A * log pi over the
    completions' tokens, grad clipping and an AdamW step: the loss and the rewards by group."""
    import torch

    g = torch.tensor(rewards).view(groups, -1)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).flatten()
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width - 1)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1:len(p) + len(c) - 1] = 1.0
    logp = torch.log_softmax(policy(ids).logits[:, :-1].float(), -1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    opt.step()
    return loss, g


def naive_sync(policy, llm, shm: Path) -> None:
    """The new weights into vLLM: saved as safetensors into /dev/shm, then `reload_weights`."""
    from safetensors.torch import save_model

    save_model(policy, str(shm / "model.safetensors"))
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(shm)})
    llm.reset_prefix_cache()


def naive_steps(steps: int, mark: Callable[[int, str], None] = lambda step, phase: None,
                ) -> list[dict[str, float]]:
    """`steps` steps of the naive loop: each step's whole time and its phases'. `mark(step,
    phase)` is called as each phase begins (produce, fit, sync, log)."""
    import random

    import mlflow
    from common import default_config

    cfg = default_config()
    tok, problems, llm, policy, opt, params = naive_setup(cfg)
    shm = Path(tempfile.mkdtemp(prefix="naive-", dir="/dev/shm"))
    store = Path(tempfile.mkdtemp(prefix="naive-mlflow-"))  # on disk, as rlexp's store
    mlflow.set_tracking_uri(f"sqlite:///{store}/mlflow.db")
    mlflow.start_run()
    rng = random.Random(0)
    out = []
    for step in range(1, steps + 1):
        mark(step, "produce")
        t0 = time.perf_counter()
        batch = rng.sample(problems, cfg.data.prompts_per_step)
        rows, rewards = naive_rollouts(llm, tok, params, batch)
        t1 = time.perf_counter()
        mark(step, "fit")

        loss, g = naive_fit(policy, opt, rows, rewards, len(batch), tok.pad_token_id or 0,
                            cfg.trainer.max_grad_norm)
        t2 = time.perf_counter()
        mark(step, "sync")

        naive_sync(policy, llm, shm)
        t3 = time.perf_counter()
        mark(step, "log")
        tokens = sum(len(c) for _, c in rows) / len(rows)
        mlflow.log_metrics({"loss": loss.item(), "reward_mean": g.mean().item(), "tokens": tokens,
                            "produce_s": t1 - t0, "fit_s": t2 - t1, "sync_s": t3 - t2}, step=step)
        t4 = time.perf_counter()
        out.append(dict(whole=t4 - t0, produce=t1 - t0, fit=t2 - t1, sync=t3 - t2, log=t4 - t3,
                        tokens=tokens))
    mlflow.end_run()
    shutil.rmtree(shm)
    shutil.rmtree(store)
    return out


def rlexp_steps(steps: int, overrides: list[str]) -> list[dict[str, float]]:
    from common import rlexp_step_times

    with tempfile.TemporaryDirectory() as tmp:
        return rlexp_step_times(overrides, steps, Path(tmp))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="steps per block (the first 2 untimed)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per side, alternating")
    p.add_argument("--side", choices=["naive", "rlexp"], help=argparse.SUPPRESS)
    p.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:  # one block, in a child process: its per-step times as JSON into --out
        steps = naive_steps(args.steps) if args.side == "naive" else rlexp_steps(args.steps, args.overrides)
        Path(args.out).write_text(json.dumps(steps))
        return
    from common import alternate_blocks

    me = [sys.executable, __file__, "--steps", str(args.steps), "--side"]
    sides = {"naive": [*me, "naive"], "rlexp": [*me, "rlexp"]}
    steps = alternate_blocks(sides, args.blocks, WARMUP)
    times = {side: [s["whole"] for s in records] for side, records in steps.items()}
    naive, ours = statistics.median(times["naive"]), statistics.median(times["rlexp"])
    inner = statistics.median(s["step"] for s in steps["rlexp"])
    print(f"median whole step (logging included) over {len(times['naive'])} timed steps each: "
          f"rlexp {ours:.3f} s, naive {naive:.3f} s; rlexp's timing/step_s (no logging) {inner:.3f} s")
    print(f"ratio: {ours / naive:.3f}")


if __name__ == "__main__":
    main()
