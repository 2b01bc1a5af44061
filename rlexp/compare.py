"""Compare the jobs of a sweep: a table and plots, also logged to the sweep's parent run.

    python -m rlexp.compare sweeps/<sweep dir>            # or a parent run id
    python -m rlexp.compare <...> --tracking-uri sqlite:////abs/path/mlflow.db

The tracking URI comes from the flag, else the sweep dir's rlexp_sweep.json (written when
the sweep started), else MLFLOW_TRACKING_URI. Writes compare.md, compare.csv and
PNG plots into the sweep dir: eval accuracy and training reward against step and against
wall-clock time, one line per job; and, where jobs differ only by `seed`, per setting (the
jobs' values of the other swept keys): a table of means and seed spread, eval accuracy as the
seeds' mean with a min-max band (against step, wall-clock and tokens sampled), the staleness
histogram of the trained samples, and the trainer/rollout mismatch per staleness value."""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from mlflow.tracking import MlflowClient

from rlexp.compare_plots import history, plot_settings
from rlexp.tracking.sweep import SWEEP_TAG, read_sweep

COLUMNS = ["job", "run", "status", "eval_final", "eval_best", "wall_min", "rollout_tok_s",
           "train_tok_s", "staleness_mean", "staleness_max"]
SETTING_COLUMNS = ["setting", "seeds", "eval_final", "eval_auc", "auc_vs_first", "wall_min",
                   "staleness_mean", "mismatch_kl", "ratio_mean", "clip_frac", "expired",
                   "reward_last10", "entropy_last10", "length_last10"]
EXPIRED = "samples/expired"


def find_sweep(target: str, tracking_uri: str | None) -> tuple[MlflowClient, str, Path | None]:
    """(client, parent run id, sweep dir) from a sweep dir or a parent run id."""
    info = read_sweep(target) if Path(target).is_dir() else None
    # The sweep's own record wins over the environment: MLflow's set_tracking_uri exports
    # MLFLOW_TRACKING_URI, so a stale value from some other run is easy to inherit.
    uri = tracking_uri or (info or {}).get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        sys.exit(f"rlexp.compare: no tracking URI: {target} has no rlexp_sweep.json; "
                 "pass --tracking-uri or set MLFLOW_TRACKING_URI")
    client = MlflowClient(tracking_uri=uri)
    if info is not None:
        return client, info["parent_run_id"], Path(target)
    if Path(target).exists():
        sys.exit(f"rlexp.compare: {target} is not a sweep dir (no rlexp_sweep.json)")
    parent = client.get_run(target)
    sweep_dir = parent.data.tags.get(SWEEP_TAG)
    return client, target, Path(sweep_dir) if sweep_dir and Path(sweep_dir).is_dir() else None


def summarize(client, run) -> dict:
    rid = run.info.run_id

    def values(key):
        return [m.value for m in history(client, rid, key)]

    evals, stale = values("eval/accuracy"), values("rollout/staleness_mean")
    tok_s, train_tok_s = values("throughput/rollout_tokens_per_s"), values("throughput/train_tokens_per_s")
    end = run.info.end_time or run.info.start_time
    return {
        "job": int(run.data.tags.get("rlexp.job_num", -1)), "run": run.info.run_name,
        "status": run.info.status,
        "eval_final": evals[-1] if evals else float("nan"), "eval_best": max(evals, default=float("nan")),
        "wall_min": (end - run.info.start_time) / 60000,
        "rollout_tok_s": sum(tok_s) / len(tok_s) if tok_s else float("nan"),
        "train_tok_s": sum(train_tok_s) / len(train_tok_s) if train_tok_s else float("nan"),
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_max": max(values("rollout/staleness_max"), default=0.0),
    }


def plot(client, runs, key: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        hist = history(client, run.info.run_id, key)
        if not hist:
            continue
        t0 = run.info.start_time
        axes[0].plot([m.step for m in hist], [m.value for m in hist], marker=".", label=run.info.run_name)
        axes[1].plot([(m.timestamp - t0) / 60000 for m in hist], [m.value for m in hist], marker=".",
                     label=run.info.run_name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock (minutes since the job started)")
    for ax in axes:
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(key)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def table_markdown(rows: list[dict], columns: list[str] = COLUMNS) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ---- settings: the jobs of a sweep that differ only by seed ---------------------------------
def setting_of(run) -> str:
    """`staleness_threshold=2` for the job named `staleness_threshold=2,seed=1`."""
    parts = [p for p in run.info.run_name.split(",") if not p.startswith("seed=")]
    return ",".join(parts) or "all"


def by_setting(runs) -> dict[str, list]:
    groups: dict[str, list] = defaultdict(list)
    for run in runs:
        groups[setting_of(run)].append(run)
    return dict(groups)


def spread(values: list[float]) -> str:
    """mean ± sample standard deviation over seeds (just the value for one seed)."""
    values = [float(v) for v in values if v == v]  # without NaN (metric not logged): stdev fails on it
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def token_weighted(client, run_id: str, key: str) -> float:
    """`offpolicy/<key>/staleness_<k>` over every step and k, weighted by token count."""
    run = client.get_run(run_id)
    total = weight = 0.0
    for name in run.data.metrics:
        if name.startswith(f"offpolicy/{key}/staleness_"):
            k = name.rsplit("_", 1)[1]
            tokens = {m.step: m.value for m in history(client, run_id, f"offpolicy/tokens/staleness_{k}")}
            for m in history(client, run_id, name):
                total += m.value * tokens.get(m.step, 0.0)
                weight += tokens.get(m.step, 0.0)
    return total / weight if weight else float("nan")


def eval_auc(client, run) -> float:
    """Mean eval accuracy over the run's evaluations: the area under its curve, per eval."""
    values = [m.value for m in history(client, run.info.run_id, "eval/accuracy")]
    return statistics.fmean(values) if values else float("nan")


def summarize_setting(client, name: str, runs, first: dict[str, float]) -> dict:
    """`first`: eval_auc by seed of the first setting; `auc_vs_first` is this setting's
    difference from it, paired by seed (same seed: same initial model, data order, eval split)."""
    def per_seed(fn):
        return [fn(r.info.run_id) for r in runs]

    def evals(rid):
        return [m.value for m in history(client, rid, "eval/accuracy")]

    paired = [eval_auc(client, r) - first[r.data.params["seed"]] for r in runs
              if r.data.params.get("seed") in first]

    def mean_metric(key, last: int | None = None):
        return lambda rid: statistics.fmean([m.value for m in history(client, rid, key)][-(last or 0):]
                                            or [float("nan")])

    return {
        "setting": name, "seeds": len(runs),
        "eval_final": spread(per_seed(lambda rid: (evals(rid) or [float("nan")])[-1])),
        "eval_auc": spread([eval_auc(client, r) for r in runs]), "auc_vs_first": spread(paired),
        "wall_min": spread([((r.info.end_time or r.info.start_time) - r.info.start_time) / 60000
                            for r in runs]),
        "staleness_mean": spread(per_seed(mean_metric("rollout/staleness_mean"))),
        "mismatch_kl": spread(per_seed(lambda rid: token_weighted(client, rid, "mismatch_kl"))),
        "ratio_mean": spread(per_seed(lambda rid: token_weighted(client, rid, "ratio_mean"))),
        "clip_frac": spread(per_seed(mean_metric("train/clip_frac"))),
        "expired": int(sum(per_seed(lambda rid: sum(m.value for m in history(client, rid, EXPIRED))))),
        "reward_last10": spread(per_seed(mean_metric("rollout/reward_mean", 10))),
        "entropy_last10": spread(per_seed(mean_metric("train/entropy", 10))),
        "length_last10": spread(per_seed(mean_metric("rollout/response_length_mean", 10))),
    }


def compare(target: str, tracking_uri: str | None = None, out_dir: str | None = None) -> Path:
    client, parent_id, sweep_dir = find_sweep(target, tracking_uri)
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    if not runs:
        sys.exit(f"rlexp.compare: the sweep's parent run {parent_id} has no child runs yet")
    runs.sort(key=lambda r: (int(r.data.tags.get("rlexp.job_num", 0)), r.info.start_time))
    rows = [summarize(client, r) for r in runs]
    out = Path(out_dir or sweep_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    md = table_markdown(rows)
    (out / "compare.md").write_text(md)
    with open(out / "compare.csv", "w", newline="") as csv_file:
        w = csv.DictWriter(csv_file, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    files = [out / "compare.md", out / "compare.csv"]
    for key in ("eval/accuracy", "rollout/reward_mean"):
        files.append(plot(client, runs, key, out / f"compare_{key.replace('/', '_')}.png"))
    groups = by_setting(runs)
    if len(groups) < len(runs):  # some jobs differ only by seed
        first = {r.data.params.get("seed"): eval_auc(client, r) for r in next(iter(groups.values()))}
        settings = [summarize_setting(client, name, group, first) for name, group in groups.items()]
        md += "\nPer setting (mean ± standard deviation over seeds):\n\n"
        md += table_markdown(settings, SETTING_COLUMNS)
        (out / "compare.md").write_text(md)
        files += plot_settings(client, groups, out)
    for f in files:
        client.log_artifact(parent_id, str(f), artifact_path="compare")
    print(md)
    print("wrote " + ", ".join(str(f) for f in files) + f"; logged to parent run {parent_id}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlexp.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a sweep dir (sweeps/...) or the sweep's parent run id")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--out", default=None, help="where to write the files (default: the sweep dir)")
    args = ap.parse_args(argv)
    compare(args.target, args.tracking_uri, args.out)


if __name__ == "__main__":
    main()
