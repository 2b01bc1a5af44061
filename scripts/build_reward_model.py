"""A sequence-classification reward model (one label) built locally from a model directory:
the same backbone and tokenizer, a new scalar head (seeded), for `judge=reward_model`.

    .venv/bin/python scripts/build_reward_model.py <model dir> <out dir> [--seed 0]
    python -m rlexp.run judge=reward_model judge.judges.rm.model_path=<out dir>

Its head is random: it shows the judge's plumbing (a local forward per sample, its score a
reward component beside the rule), not a reward worth learning from. A trained reward model
from your own directory goes in the same place."""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer


def build(model_dir: str, out_dir: str, seed: int = 0) -> None:
    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.model_dir, args.out_dir, args.seed)
    print(f"reward model: {args.out_dir}")
