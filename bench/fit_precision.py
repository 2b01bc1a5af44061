"""The trainer's fit time per precision setting, against float32, side by side in one process:

    .venv/bin/python bench/fit_precision.py [--models tiny smollm2 moe] [--rows 8] [--tokens 256] [--reps 3]

Settings: `float32` (trainer.dtype=float32), `autocast` (trainer.mixed_precision=bfloat16:
bf16 compute under torch.autocast, fp32 master weights and AdamW state) and `bfloat16`
(trainer.dtype=bfloat16: weights, gradients and AdamW state in bf16). Models, built locally:
`tiny` (the default experiment's, rlexp/models/tiny.py), `smollm2` (SmolLM2-135M's layout,
random weights, bench/fit_memory.py) and `moe` (the tiny model as a Qwen3-MoE, 4 experts, top 2).
A batch is `--rows` rows of `--tokens` tokens (half of them rewarded); each rep fits it once per
setting, in turn (a warm-up fit each first); the median per setting. The trainer/engine
logprob mismatch of each setting is `python -m rlexp.check` (docs/memory-and-precision.md).
The headline is autocast over float32 on smollm2."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from fit_memory import build  # bench/ is on the path when run as a script

from rlexp.sample import Sample, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from rlexp.trainer.sync_check import SyncCheck

SETTINGS = {"float32": dict(dtype="float32"), "autocast": dict(mixed_precision="bfloat16"),
            "bfloat16": dict(dtype="bfloat16")}


def model_path(name: str, tmp: Path) -> str:
    from common import default_config, default_model

    if name == "smollm2":
        return build("smollm2", tmp, "float32")
    return default_model(default_config(["model.num_experts=4"] if name == "moe" else []))


def batch(rows: int, tokens: int, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        ids = torch.randint(vocab, (tokens,), generator=g).tolist()
        half = tokens // 2
        trace = TokenTrace(ids, [0] * half + [1] * (tokens - half), [0.0] * half + [-2.0] * (tokens - half),
                           [0] * tokens)
        out.append(Sample(group_id=0, prompt=[], answer="", trace=trace, reward=float(i % 2),
                          status=Status.COMPLETED))
    return out


def trainer(path: str, **setting) -> TrainController:
    torch.manual_seed(0)
    return TrainController(path, temperature=1.0, total_steps=100, ref_kl_every_n_steps=0,
                           optimizer=partial(torch.optim.AdamW, lr=1e-5),
                           sync_check=partial(SyncCheck, bound="off"), **setting)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2", "moe"])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    headline = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            path = model_path(name, Path(tmp))
            trainers = {s: trainer(path, **kw) for s, kw in SETTINGS.items()}
            rows = batch(a.rows, a.tokens, trainers["float32"].model.config.vocab_size)
            times: dict[str, list[float]] = {s: [] for s in SETTINGS}
            for t in trainers.values():
                t.fit(rows, 0)  # warm-up: AdamW's state, oneDNN's kernels
            for rep in range(a.reps):
                for s, t in trainers.items():
                    start = time.perf_counter()
                    t.fit(rows, rep + 1)
                    times[s].append(time.perf_counter() - start)
            med = {s: statistics.median(v) for s, v in times.items()}
            cells = [f"{s} {med[s]:.3f} s ({med[s] / med['float32']:.3f}x)" for s in SETTINGS]
            print(f"{name:8s} " + "  ".join(cells), flush=True)
            if name == "smollm2":
                headline = med["autocast"] / med["float32"]
            del trainers
    if headline is not None:
        print(f"ratio: {headline:.3f}  (smollm2 fit, autocast bf16 / float32)")


if __name__ == "__main__":
    main()
