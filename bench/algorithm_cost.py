"""Each algorithm piece's fit time over the default composition's, same batch, one process.

    .venv/bin/python bench/algorithm_cost.py [--reps 9] [trainer.key=value ...]

The batch is one step of the default experiment (32 prompts x 8 samples, generated with the
transformers engine). Every composition below gets its own TrainController built from the
composed config (the default one with that group changed), from the same initial weights;
each repetition times one `fit` of every composition, in an order rotated per repetition
(the first repetition warms up, untimed). Medians. Pieces that need no extra forward should
cost about the default's; the ones that do (a recomputed proximal policy, or the reference
model every step) are listed apart with what the forward costs.

Headline: the largest fit-time ratio among the pieces that need no extra forward."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_config, default_model, median, one_step_batch  # noqa: E402

NO_EXTRA_FORWARD = {
    "dr_grpo": ["advantage=dr_grpo"], "grpo_sample_std": ["trainer.advantage.std=sample"],
    "rloo": ["advantage=rloo"], "reinforce_pp": ["advantage=reinforce_pp"],
    "reinforce_pp_baseline": ["advantage=reinforce_pp_baseline"],
    "dual_clip": ["trainer.policy_loss.dual_clip=3"], "gspo": ["policy_loss=gspo"],
    "cispo": ["policy_loss=cispo"], "tis": ["policy_loss=tis"],
    "seq_mean_token_sum": ["aggregation=seq_mean_token_sum"],
    "seq_mean_token_mean": ["aggregation=seq_mean_token_mean"],
    "seq_mean_token_sum_norm": ["aggregation=seq_mean_token_sum_norm"],
}
EXTRA_FORWARD = {  # name: (overrides, the forward it adds)
    "decoupled": (["policy_loss=decoupled"], "policy, recomputed"),
    "token_tis": (["mismatch=token_tis"], "policy, recomputed"),
    "seq_tis": (["mismatch=seq_tis"], "policy, recomputed"),
    "icepop": (["mismatch=icepop"], "policy, recomputed"),
    "seq_mask": (["mismatch=seq_mask"], "policy, recomputed"),
    "kl_k3_loss": (["trainer.kl.coef=0.01"], "reference, every step"),
    "kl_low_var_reward": (["kl=low_var_kl", "trainer.kl.coef=0.01", "trainer.kl.where=reward"],
                          "reference, every step"),
    "ppo": (["recipe=ppo"], "critic: values, then its forward/backward per minibatch"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("overrides", nargs="*", help="config overrides for every composition")
    args = p.parse_args()
    # ref_kl_every_n_steps=0: no step of any composition runs the reference only to log train/kl
    base = ["trainer.ref_kl_every_n_steps=0", *args.overrides]
    cfg = default_config(base)
    model_path = default_model(cfg)
    batch = one_step_batch(cfg, model_path)
    variants = {"default": []} | NO_EXTRA_FORWARD | {k: o for k, (o, _) in EXTRA_FORWARD.items()}
    trainers = {}
    for name, overrides in variants.items():
        torch.manual_seed(0)
        trainers[name] = instantiate(default_config(base + overrides).trainer, model_path=model_path)
    print(f"batch: {len(batch)} samples, {sum(s.response_length for s in batch)} trained tokens; "
          f"{len(variants)} compositions, torch threads {torch.get_num_threads()}", flush=True)
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps + 1):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            trainers[name].fit(batch, rep)
            if rep:
                times[name].append(time.perf_counter() - t0)
    base_s = median(times["default"])
    print(f"\nmedian fit over {args.reps} reps: default {base_s:.3f} s")
    print("no extra forward:")
    for name in NO_EXTRA_FORWARD:
        print(f"  {name:24s} {median(times[name]):.3f} s  {median(times[name]) / base_s:.3f}x")
    print("one extra forward:")
    for name, (_, forward) in EXTRA_FORWARD.items():
        print(f"  {name:24s} {median(times[name]):.3f} s  {median(times[name]) / base_s:.3f}x  ({forward})")
    print(f"ratio: {max(median(times[n]) for n in NO_EXTRA_FORWARD) / base_s:.3f}")


if __name__ == "__main__":
    main()
