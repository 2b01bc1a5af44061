"""What a run computed, as JSON: to prove that a refactor changed no number.

    python scripts/run_fingerprint.py <tracking uri> <run id | run name> [--steps 5] > before.json
    ... change the code, rerun the same command line with the same seed ...
    python scripts/run_fingerprint.py <tracking uri> <run> > after.json && diff before.json after.json

It prints the run's eval/accuracy curve, the first `--steps` values of train/loss (and of
train/grad_norm and rollout/reward_mean), and the trained token ids of step 1 (every sample
of `traces/step_00001.jsonl`: its tokens and loss mask). With `--all`, the first `--steps`
values of every metric the run logged but those that measure the clock or the machine
(`CLOCK_OR_MACHINE`: seconds, rates, memory, replica pool counters)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from mlflow.tracking import MlflowClient

# metric names that measure wall-clock time or the machine, not the computation
CLOCK_OR_MACHINE = re.compile(r"^(timing|memory|system)/|_s$|_s/|per_s|_mb|busy|idle|throughput|"
                              r"wait|lag|elapsed")


def fingerprint(uri: str, run: str, steps: int, every_metric: bool = False) -> dict:
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    matches = [r for r in runs if run in (r.info.run_id, r.info.run_name) and r.info.status == "FINISHED"]
    if len(matches) != 1:
        raise SystemExit(f"{run!r}: {len(matches)} finished runs of that id or name in {uri}")
    run_id = matches[0].info.run_id

    def history(key: str, first: int | None = None) -> list[list[float]]:
        points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        return [[m.step, m.value] for m in points][:first]

    if every_metric:
        keys = sorted(k for k in client.get_run(run_id).data.metrics if not CLOCK_OR_MACHINE.search(k))
        return {k: history(k, steps) for k in keys}
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
    p.add_argument("--all", action="store_true", help="every metric but the clock's and the machine's")
    a = p.parse_args()
    print(json.dumps(fingerprint(a.tracking_uri, a.run, a.steps, a.all)))


if __name__ == "__main__":
    main()
