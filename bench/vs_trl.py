"""rlexp's step time over TRL's GRPOTrainer's, same model, prompts and sizes.

    bash scripts/install_trl.sh        # once: TRL in its own venv, .venv-trl (bench only)
    .venv/bin/python bench/vs_trl.py [--tokens 8 64 --steps 8 --blocks 2]

Both train the default experiment's model on its arithmetic prompts (chat-templated),
32 prompts x 8 completions a step, temperature 1, lr 5e-4, no KL (TRL beta=0; rlexp
kl_coef=0), grad clip 1, one update per batch, float32 without gradient checkpointing (TRL's
defaults are bf16 and checkpointing; both are turned off), on the CPU. TRL generates with transformers
(its vLLM modes need a GPU); rlexp with vLLM. At 8 new tokens the model is the default
warm-started one (answers stop after ~3-4 tokens); for longer settings it is the untrained
model, whose completions run to the limit, so both sides really generate that many tokens
(the mean completion length of each side is printed). Each side runs in its own process;
blocks alternate. The last line is the ratio at the longest setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE.parent / ".venv-trl" / "bin" / "python"
WARMUP = 2


def trl_steps(spec: dict, steps: int) -> list[dict[str, float]]:
    sys.path.insert(0, str(HERE.parent))  # for rlexp's judge only (pure Python)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlexp.judges.math_exact import extract_answer, normalize

    def correct(completions, answer, **_):
        return [float(extract_answer(c[0]["content"]) == normalize(a)) for c, a in zip(completions, answer)]

    records: list[dict[str, float]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            records.append({"step": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs and records:
                records[-1]["tokens"] = logs["completions/mean_length"]

    n = spec["samples_per_prompt"]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, report_to="none", save_strategy="no", use_cpu=True, seed=0, max_steps=steps,
            logging_steps=1, per_device_train_batch_size=spec["prompts_per_step"] * n, num_generations=n,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            max_completion_length=spec["max_tokens"], temperature=1.0, top_p=1.0, beta=0.0,
            learning_rate=spec["lr"], weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
            warmup_steps=0, epsilon=0.2, dataloader_num_workers=0,
            # TRL's defaults are bf16 autocast and gradient checkpointing; rlexp trains in float32
            # without checkpointing, so both sides do the same arithmetic.
            bf16=False, gradient_checkpointing=False)
        data = Dataset.from_list([{"prompt": p["messages"], "answer": p["answer"]} for p in spec["problems"]])
        trainer = GRPOTrainer(model=spec["model"], reward_funcs=correct, args=args, train_dataset=data,
                              callbacks=[StepTimer()])
        trainer.train()
    return records


def rlexp_steps(spec: dict, steps: int, overrides: list[str]) -> list[dict[str, float]]:
    from common import rlexp_step_times

    with tempfile.TemporaryDirectory() as tmp:
        return rlexp_step_times(spec["overrides"] + overrides, steps, Path(tmp))


def spec_for(tokens: int, workdir: Path) -> Path:
    """What both sides need, as a JSON file the TRL venv can read (it has no Hydra)."""
    from common import default_config, default_model

    untrained = [] if tokens <= 8 else ["model.warm_start_steps=0"]
    overrides = [f"rollout.max_response_tokens={tokens}", *untrained]
    cfg = default_config(overrides)
    src = cfg.data.source
    from rlexp.data.sources import ArithmeticSource

    problems = ArithmeticSource(src.max_operand, src.ops, src.eval_size, src.seed).problems("train")
    spec = dict(model=default_model(cfg), overrides=overrides, max_tokens=tokens, lr=cfg.trainer.optimizer.lr,
                prompts_per_step=cfg.data.prompts_per_step, samples_per_prompt=cfg.data.samples_per_prompt,
                problems=[{"messages": p.messages, "answer": p.answer} for p in problems])
    path = workdir / f"spec_{tokens}.json"
    path.write_text(json.dumps(spec))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 64], help="max new tokens settings")
    p.add_argument("--steps", type=int, default=8, help="steps per block (the first 2 untimed)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per side, alternating")
    p.add_argument("--side", choices=["trl", "rlexp"], help=argparse.SUPPRESS)
    p.add_argument("--hf", action="store_true",
                   help="also run rlexp with rollout=hf (transformers generate, as TRL on CPU)")
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:  # one block, in a child process
        spec = json.loads(Path(args.spec).read_text())
        if args.side == "trl":
            steps = trl_steps(spec, args.steps)
        else:
            steps = rlexp_steps(spec, args.steps, args.overrides)
        Path(args.out).write_text(json.dumps(steps))
        return
    if not TRL_PYTHON.exists():
        print(f"skipped: TRL is not installed beside the project ({TRL_PYTHON} missing); "
              "run `bash scripts/install_trl.sh` first")
        return
    from common import alternate_blocks

    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            spec = spec_for(tokens, Path(tmp))
            print(f"\nmax new tokens {tokens}:", flush=True)
            common_args = [__file__, "--steps", str(args.steps), "--spec", str(spec), "--side"]
            sides = {"trl": [str(TRL_PYTHON), *common_args, "trl"],
                     "rlexp": [sys.executable, *common_args, "rlexp"]}
            if args.hf:
                sides["rlexp_hf"] = [*sides["rlexp"], "--overrides", "rollout=hf"]
            res = alternate_blocks(sides, args.blocks, WARMUP)
            med = {side: statistics.median(s["step"] for s in recs) for side, recs in res.items()}
            length = {side: statistics.mean(s.get("tokens", float("nan")) for s in recs)
                      for side, recs in res.items()}
            ratios[tokens] = med["rlexp"] / med["trl"]
            print(f"  median step: rlexp {med['rlexp']:.3f} s, TRL {med['trl']:.3f} s; "
                  f"mean completion tokens: rlexp {length['rlexp']:.1f}, TRL {length['trl']:.1f}; "
                  f"rlexp / TRL {ratios[tokens]:.3f}")
            if args.hf:
                hf = statistics.median(s["step"] for s in res["rlexp_hf"])
                print(f"  rlexp with rollout=hf: {hf:.3f} s, / TRL {hf / med['trl']:.3f}")
    print("\n" + "  ".join(f"{t} tokens: {r:.3f}" for t, r in ratios.items()))
    print(f"ratio: {ratios[max(ratios)]:.3f}")


if __name__ == "__main__":
    main()
