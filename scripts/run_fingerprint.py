"""What a run computed, as JSON: to prove that a refactor changed no number.

    python scripts/run_fingerprint.py <tracking uri> <run id | run name> [--steps 5] > before.json
    ... change the code, rerun the same command line with the same seed ...
    python scripts/run_fingerprint.py <tracking uri> <run> > after.json && diff before.json after.json

It prints the run's eval/accuracy curve, the first `--steps` values of train/loss (and of
train/grad_norm and rollout/reward_mean), and the trained token ids of step 1 (every sample
of `traces/step_00001.jsonl`: its tokens and loss mask)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlflow.tracking import MlflowClient


def fingerprint(uri: str, run: str, steps: int) -> dict:
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    matches = [r for r in runs if run in (r.info.run_id, r.info.run_name) and r.info.status == "FINISHED"]
    if len(matches) != 1:
        raise SystemExit(f"{run!r}: {len(matches)} finished runs of that id or name in {uri}")
    run_id = matches[0].info.run_id

    def history(key: str, first: int | None = None) -> list[list[float]]:
        points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        return [[m.step, m.value] for m in points][:first]

    trace = Path(client.download_artifacts(run_id, "traces/step_00001.jsonl")).read_text().splitlines()
    return {
        "eval/accuracy": history("eval/accuracy"),
        "train/loss": history("train/loss", steps),
        "train/grad_norm": history("train/grad_norm", steps),
        "rollout/reward_mean": history("rollout/reward_mean", steps),
        "step_1_trained_tokens": [[row["token_ids"], row["loss_mask"]] for row in map(json.loads, trace)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tracking_uri")
    p.add_argument("run", help="run id or run name")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    print(json.dumps(fingerprint(a.tracking_uri, a.run, a.steps)))


if __name__ == "__main__":
    main()
