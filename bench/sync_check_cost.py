"""The in-run sync check's cost: one fit with the check over the same fit without it.

    .venv/bin/python bench/sync_check_cost.py [--model tiny|smollm2] [--dtype float32|bfloat16]
                                              [--rows 64] [--prompt 32] [--response 96] [--reps 7]

The check adds no forward: it reads the fit's first forward (the first minibatch's training
forward with `old_logprobs=rollout`, the recomputed old logprobs with `recompute`), gathers
the |logprob differences| of the tokens generated at the current version, takes their max,
p99 and mean and reads them on the host once, before the optimizer step. Measured here: the
same trainer alternating fits with the check (`SyncCheck`, bound off so that the drifting
weights never stop it: the same work) and without it (a check that does nothing), on a
synthetic batch whose engine logprobs are the trainer's own. Medians per mode; the headline
is the default mode's (`old_logprobs=rollout`). Runs on a GPU when there is one (no vLLM,
Ray, MLflow needed): `smollm2` is a randomly initialised model of SmolLM2-135M's shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlexp.sample import Sample, Status, TokenTrace  # noqa: E402
from rlexp.trainer.controller import TrainController  # noqa: E402
from rlexp.trainer.sync_check import SyncCheck  # noqa: E402


class NoCheck(SyncCheck):
    """The fit without the check: nothing kept, nothing gathered, nothing read."""

    def add(self, logp, engine_logp, staleness, mask) -> None:
        pass

    def finish(self, version: int) -> dict[str, float]:
        return {}


def model_path(kind: str, directory: Path) -> str:
    if kind == "tiny":  # the default experiment's model (composed with Hydra)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import default_config, default_model

        return default_model(default_config())
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory / "smollm2_shape")
    return str(directory / "smollm2_shape")


def batch(vocab: int, rows: int, prompt: int, response: int, version: int) -> list[Sample]:
    """New tokens per `version`, the same lengths: after the warm-up round no new shapes reach
    the kernels (cuDNN's attention builds a plan per new shape, ~0.3 s of CPU on the GPU
    machine, which would land on whichever side met the shape first)."""
    lengths, g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(version)
    out = []
    for i in range(rows):
        n_resp = int(torch.randint(response // 2, response + 1, (1,), generator=lengths))
        tokens = torch.randint(0, vocab, (prompt + n_resp,), generator=g).tolist()
        n = len(tokens)
        trace = TokenTrace(tokens, [0] * prompt + [1] * n_resp, [0.0] * n, [version] * n)
        out.append(Sample(group_id=i // 8, prompt=[], answer="", trace=trace, reward=float(i % 3 == 0),
                          status=Status.COMPLETED))
    return out


def timed_fits(trainer: TrainController, vocab: int, a: argparse.Namespace) -> dict[str, list[float]]:
    """Fits alternating with and without the check; the engine logprobs are the trainer's own."""
    checks = {"with": SyncCheck(bound="off"), "without": NoCheck()}
    times: dict[str, list[float]] = {k: [] for k in checks}
    calls: dict[str, dict[str, list[float]]] = {k: {} for k in checks}  # timing/fit/<call>_s
    for rep in range(a.reps + 1):  # the first round warms up
        for name, check in (checks.items() if rep % 2 else reversed(checks.items())):
            samples = batch(vocab, a.rows, a.prompt, a.response, version=rep)
            for s, lp in zip(samples, trainer.sample_logprobs(samples)):
                s.trace.logprobs = lp.tolist()
            trainer.sync_check = trainer.update.sync_check = check
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = trainer.fit(samples, rep)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                times[name].append(time.perf_counter() - t0)
                for k, v in metrics.items():
                    if k.startswith("timing/fit/"):
                        calls[name].setdefault(k.removeprefix("timing/fit/"), []).append(v)
            assert ("sync/tokens" in metrics) == (name == "with")
    for name, per_call in calls.items():
        print(f"  {name}: " + ", ".join(f"{k} {statistics.median(v):.4f}" for k, v in per_call.items()))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=96)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    ratios = {}
    with tempfile.TemporaryDirectory() as d:
        path = model_path(a.model, Path(d))
        for mode in ("recompute", "rollout"):  # the headline (the default mode) last
            torch.manual_seed(0)
            trainer = TrainController(path, temperature=1.0, total_steps=100, ref_kl_every_n_steps=0,
                                      optimizer=partial(torch.optim.AdamW, lr=1e-6), dtype=a.dtype,
                                      old_logprobs=mode, micro_batch_tokens=8192)
            vocab = trainer.model.config.vocab_size
            times = timed_fits(trainer, vocab, a)
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios[mode] = med["with"] / med["without"]
            print(f"{a.model} {a.dtype} on {trainer.device.type}, old_logprobs={mode}, {a.rows} rows x "
                  f"<= {a.prompt + a.response} tokens: fit with the check {med['with']:.4f} s, without "
                  f"{med['without']:.4f} s (medians of {a.reps}); with / without {ratios[mode]:.4f}")
            del trainer
    print(f"ratio: {ratios['rollout']:.4f}")


if __name__ == "__main__":
    main()
