"""Evaluation under the async scheduler, with and without `scheduler.pause_for_eval`, beside
the sync scheduler, on the same run length, seed and evaluation schedule.

    .venv/bin/python bench/eval_priority.py [--steps 12] [--every 2]

Each configuration is a real `python -m rlexp.run` (vLLM, GRPO trainer, MLflow). Read back
from each run's MLflow store: the mean `timing/eval_s` of the evaluations after step 0 (step
0 runs before any training rollout exists, so it is the same for all), and the eval accuracy
curve. Under async without the pause, the weight sync before an evaluation wakes the
background producer, which launches a batch of training rollouts that compete with
evaluation for the engine. The headline is async without / with the pause (> 1: the pause
makes evaluation faster)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"sync": ["scheduler=sync"],
         "async, pause_for_eval=true": ["scheduler=async", "scheduler.pause_for_eval=true"],
         "async, pause_for_eval=false": ["scheduler=async", "scheduler.pause_for_eval=false"]}


def run(name: str, overrides: list[str], steps: int, every: int, workdir: Path) -> dict[str, float]:
    uri = f"sqlite:///{workdir}/{len(list(workdir.iterdir()))}.db"
    cmd = [sys.executable, "-m", "rlexp.run", *overrides, f"trainer.total_steps={steps}",
           f"evaluator.every_n_steps={every}", "data.prompts_per_step=16", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={workdir}/artifacts", "logger.log_traces=false",
           f"hydra.run.dir={workdir}/out_{len(list(workdir.iterdir()))}", "checkpoint.every_n_steps=0"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = MlflowClient(tracking_uri=uri)
    (r,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    evals = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "timing/eval_s")}
    accuracy = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "eval/accuracy")}
    after = [v for step, v in evals.items() if step > 0]
    return {"eval_s": statistics.mean(after), "evals": len(after), "first": accuracy[0],
            "last": accuracy[max(accuracy)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SIDES.items():
            results[name] = run(name, overrides, args.steps, args.every, Path(tmp))
            r = results[name]
            print(f"{name:30s} timing/eval_s mean {r['eval_s']:.3f} over {r['evals']} evals "
                  f"(eval/accuracy {r['first']:.3f} -> {r['last']:.3f})", flush=True)
    paused, unpaused = (results[k]["eval_s"] for k in list(SIDES)[1:])
    print(f"sync / async-paused eval_s: {results['sync']['eval_s'] / paused:.3f}")
    print(f"ratio: {unpaused / paused:.3f}")


if __name__ == "__main__":
    main()
