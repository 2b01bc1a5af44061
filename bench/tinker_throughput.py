"""Tokens/s of the Tinker API's forward_backward + optim_step, driven by the official `tinker`
SDK (.venv-tinker) against `python -m rlexp.tinker`, against rlexp's own `fit` of the same rows
(the same LoRA model, loss and Adam step) in this process, one after the other on one machine.

    .venv/bin/python bench/tinker_throughput.py [--rows 256] [--reps 5] [--rank 8] [key=value ...]

The rows: `--rows` sequences of 48..160 tokens (a prompt, a response with GRPO advantages).
The SDK's side of each repetition: forward_backward(ppo) and optim_step sent back to back,
timed until both results are back (HTTP, protobuf, the server's queue included); rlexp's side:
`TrainController.fit` on the same samples. Medians of `--reps` after one warm-up each. key=value
overrides go to both (conf/tinker.yaml), e.g. model=smollm2. The headline, last:
ratio = SDK tokens/s / fit tokens/s."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

import rlexp.config  # noqa: F401 - the ${rlexp.*} resolvers
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.tinker.models import LORA_PARTS
from rlexp.trainer import update
from rlexp.trainer.batch import TrainBatch, trained

ROOT = Path(__file__).resolve().parents[1]
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CLIENT = """
import json, sys, time
import tinker
from tinker import types
url, data_file, rank, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
service = tinker.ServiceClient(base_url=url)
tc = service.create_lora_training_client(base_model="rlexp/tiny-chat", rank=rank, seed=0)
datums = [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                      loss_fn_inputs={"target_tokens": d["targets"], "logprobs": d["logprobs"],
                                      "advantages": d["advantages"]}) for d in json.load(open(data_file))]
adam = types.AdamParams(learning_rate=5e-4, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
seconds = []
for _ in range(reps + 1):
    t0 = time.perf_counter()
    fb, step = tc.forward_backward(datums, "ppo"), tc.optim_step(adam)
    fb.result(), step.result()
    seconds.append(time.perf_counter() - t0)
print(json.dumps(seconds[1:]))
"""


def samples(n: int, seed: int = 0) -> list[Sample]:
    g = random.Random(seed)
    out = []
    for i in range(n):
        prompt, response = g.randint(16, 64), g.randint(32, 96)
        tokens = [g.randint(3, 98) for _ in range(prompt + response)]
        logprobs = [0.0] * prompt + [-g.random() * 3 for _ in range(response)]
        s = Sample(group_id=i // 8, prompt=[], answer="",
                   trace=TokenTrace(tokens, [0] * prompt + [1] * response, logprobs, [0] * len(tokens)))
        s.reward, s.status = float(g.random() > 0.5), Status.COMPLETED
        out.append(s)
    return out


def datums(trainer, batch_samples: list[Sample]) -> list[dict]:
    """The rows as the fit sees them: advantages 0 off the trained tokens and / the tokens."""
    batch = TrainBatch.build(trained(batch_samples), 0, trainer.learner.layout)
    signals = update.advantages(trainer.learner, batch, batch.rollout_logprobs, None, None)
    adv = signals.advantages.cpu() * batch.loss_mask / batch.minibatches[0].totals.tokens
    return [{"tokens": s.tokens[:-1], "targets": s.tokens[1:], "logprobs": s.logprobs[1:],
             "advantages": adv[i, :len(s.tokens) - 1].tolist()} for i, s in enumerate(trained(batch_samples))]


def start_server(root: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rlexp.tinker", "tinker.port=0", f"tinker.state_dir={root}/state",
           f"logger.tracking_uri=sqlite:///{root}/mlflow.db", f"logger.artifact_location={root}/art",
           f"hydra.run.dir={root}/hydra", "trainer.sync_check.bound=off", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(root / "server.log", "w"), text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("rlexp tinker: serving"):
            return proc, line.split(" on ")[1].split()[0]
    raise SystemExit(f"the server did not start: {(root / 'server.log').read_text()[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rank", type=int, default=8)
    args, overrides = p.parse_known_args()
    with initialize_config_module(config_module="rlexp.conf", version_base="1.3"):
        cfg = compose("tinker", overrides=["trainer.sync_check.bound=off", *overrides])
    root = Path(tempfile.mkdtemp(prefix="rlexp-tinker-bench-"))
    proc, url = start_server(root, overrides)
    try:
        torch.manual_seed(0)
        targets = sum(LORA_PARTS.values(), [])
        lora = {"rank": args.rank, "alpha": cfg.trainer.lora.alpha, "target_modules": targets}
        trainer = instantiate(cfg.trainer, model_path=str(root / "state" / "base"), lora=lora)
        batch = samples(args.rows)
        tokens = sum(len(s.tokens) - 1 for s in batch)
        (root / "rows.json").write_text(json.dumps(datums(trainer, batch)))
        (root / "client.py").write_text(CLIENT)
        env = os.environ | {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0"}
        cmd = [str(SDK_PYTHON), str(root / "client.py"), url, str(root / "rows.json"), str(args.rank),
               str(args.reps)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        sdk_s = statistics.median(json.loads(out.stdout.strip().splitlines()[-1]))
        fit_times = []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            trainer.fit(batch, 0)
            fit_times.append(time.perf_counter() - t0)
        fit_s = statistics.median(fit_times[1:])
    finally:
        proc.terminate()
        proc.wait()
    print(f"rows {args.rows}, tokens {tokens} (forward positions), LoRA rank {args.rank}, {args.reps} reps, "
          f"overrides {overrides or 'none'}")
    print(f"tinker SDK forward_backward + optim_step: {sdk_s:.3f} s, {tokens / sdk_s:,.0f} tokens/s")
    print(f"rlexp fit:                                {fit_s:.3f} s, {tokens / fit_s:,.0f} tokens/s")
    print(f"ratio: {fit_s / sdk_s:.3f}")


if __name__ == "__main__":
    main()
