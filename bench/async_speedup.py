"""Sync vs async scheduling on the same workload and the same number of steps, in one run.

    .venv/bin/python bench/async_speedup.py [--workload tail|multiturn] [--steps 30]
                                            [--thresholds 1 2] [--reps 1]

Each configuration is a real `python -m rlexp.run` (vLLM, GRPO trainer, MLflow) with the
same seed and workload; only `scheduler=...` differs. Workloads:
  tail       long-tailed response lengths: the tiny model warm-started for only 10 steps,
             so most answers are short but some ramble (p50 ~5, p90 ~17 tokens, up to 64);
             it barely knows arithmetic, so accuracy says little here: this one measures time
  multiturn  the default tiny model with agent=multiturn: 1 to 3 replies per trajectory,
             and it learns (accuracy rises within a few dozen steps)
Reported per configuration, read back
from each run's MLflow store: training-loop wall time (sum of `timing/step_s`: produce +
fit + sync, no engine start-up, no evaluation), whole-process wall time, eval accuracy
before and after, mean rollout-engine and trainer idle fractions, staleness, expired
samples, tokens generated but never trained, response-length percentiles. Ratios are
sync / async wall time (> 1: async is faster). With --reps > 1 the configurations run in
rotating order and the median per configuration is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # before mlflow is imported

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "tail": ["model.warm_start_steps=10", "model.warm_start_target_accuracy=1.0",
             "rollout.max_response_tokens=64", "rollout.max_model_len=128",
             "data.prompts_per_step=16", "data.samples_per_prompt=8", "evaluator.prompts=100"],
    "multiturn": ["agent=multiturn", "judge=multiturn", "evaluator.prompts=100"],
}


def run_one(name: str, overrides: list[str], steps: int, workdir: Path) -> dict:
    uri = f"sqlite:///{workdir}/{name}.db"
    cmd = [sys.executable, "-m", "rlexp.run", *overrides, f"trainer.total_steps={steps}",
           f"evaluator.every_n_steps={steps}", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={workdir}/{name}-artifacts", f"hydra.run.dir={workdir}/{name}-out",
           f"logger.run_name={name}"]
    t0 = time.time()
    env = dict(os.environ, HF_HUB_OFFLINE="1", MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if res.returncode != 0:
        sys.exit(f"{name} failed:\n{res.stderr[-3000:]}")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def hist(key):
        history = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    lengths = []
    for step in range(1, steps + 1):
        path = client.download_artifacts(run.info.run_id, f"traces/step_{step:05d}.jsonl")
        lengths += [sum(json.loads(x)["loss_mask"]) for x in Path(path).read_text().splitlines()]
    lengths.sort()
    evals = hist("eval/accuracy")
    return {
        "loop_s": sum(hist("timing/step_s")), "wall_s": wall, "eval_start": evals[0], "eval_end": evals[-1],
        "engine_idle": statistics.mean(hist("rollout/engine_idle_frac")),
        "trainer_idle": statistics.mean(hist("train/idle_frac")),
        "staleness_mean": statistics.mean(hist("rollout/staleness_mean")),
        "staleness_max": max(hist("rollout/staleness_max")),
        "expired": sum(hist("samples/expired")), "untrained_tokens": sum(hist("rollout/untrained_tokens")),
        "len_p50": lengths[len(lengths) // 2], "len_p90": lengths[int(len(lengths) * 0.9)],
        "len_max": lengths[-1], "len_mean": statistics.mean(lengths),
        # The policies drift apart, so equal steps need not mean equal tokens: also per token.
        "ktok_per_s": sum(lengths) / 1000 / sum(hist("timing/step_s")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="tail")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--thresholds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--partial", choices=["true", "false"], default="true")
    args = ap.parse_args()
    configs = {"sync": ["scheduler=sync"]} | {
        f"async_{k}": ["scheduler=async", f"scheduler.staleness_threshold={k}",
                       f"scheduler.enable_partial_rollout={args.partial}"] for k in args.thresholds}
    names = list(configs)
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="rlexp-async-bench-") as tmp:
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                overrides = WORKLOADS[args.workload] + configs[name]
                r = run_one(f"{name}-{rep}", overrides, args.steps, Path(tmp))
                results[name].append(r)
                print(f"rep {rep} {name:8s} loop {r['loop_s']:6.1f}s  wall {r['wall_s']:6.1f}s", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    print(f"\nworkload {args.workload}, {args.steps} steps, {args.reps} rep(s), "
          f"partial rollout {args.partial}; medians")
    cols = ["loop_s", "wall_s", "eval_start", "eval_end", "engine_idle", "trainer_idle", "staleness_mean",
            "staleness_max", "expired", "untrained_tokens", "len_mean", "len_p50", "len_p90", "len_max",
            "ktok_per_s"]
    print("config    " + " ".join(f"{c:>14s}" for c in cols))
    for n in names:
        print(f"{n:9s} " + " ".join(f"{med[n][c]:14.3f}" for c in cols))
    for n in names[1:]:
        print(f"sync/{n}: training loop {med['sync']['loop_s'] / med[n]['loop_s']:.2f}x, "
              f"whole run {med['sync']['wall_s'] / med[n]['wall_s']:.2f}x, "
              f"trained tokens/s {med[n]['ktok_per_s'] / med['sync']['ktok_per_s']:.2f}x")
    if len(names) > 1:  # headline: sync / first async configuration, training loop time
        print(f"ratio: {med['sync']['loop_s'] / med[names[1]]['loop_s']:.3f}")


if __name__ == "__main__":
    main()
