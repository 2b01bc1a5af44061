"""The per-setting plots of `python -m rlexp.compare` (rlexp/compare.py): eval accuracy as the
seeds' mean with a min-max band against step, wall-clock and tokens sampled; the training
curves; the staleness of the trained samples and the trainer/rollout mismatch per staleness."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

TRAINING_CURVES = {"rollout/reward_mean": "reward (training samples)", "train/entropy": "entropy",
                   "rollout/response_length_mean": "response length (tokens)"}


def history(client, run_id: str, key: str) -> list:
    return sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)


def plot_settings(client, groups: dict[str, list], out: Path) -> list[Path]:
    """Eval accuracy (seeds' mean, min-max band) by step and by wall-clock; the training curves
    (reward, entropy, length); the staleness histogram of trained samples; the trainer/rollout
    mismatch per staleness value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return [_plot_eval(plt, client, groups, out / "compare_settings_eval_accuracy.png"),
            _plot_training(plt, client, groups, out / "compare_settings_training.png"),
            _plot_staleness(plt, client, groups, out / "compare_settings_staleness.png")]


def sampled_tokens(client, run_id: str) -> dict[int, float]:
    """Tokens the rollout engine generated up to and including each step: trained
    (`rollout/tokens`) and never trained (`rollout/untrained_tokens`)."""
    per_step: defaultdict[int, float] = defaultdict(float)
    for key in ("rollout/tokens", "rollout/untrained_tokens"):
        for m in history(client, run_id, key):
            per_step[m.step] += m.value
    total, out = 0.0, {}
    for step in sorted(per_step):
        total += per_step[step]
        out[step] = total
    return out


def _plot_eval(plt, client, groups: dict[str, list], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for name, runs in groups.items():
        curves = [history(client, r.info.run_id, "eval/accuracy") for r in runs]
        steps = sorted(set.intersection(*({m.step for m in c} for c in curves)))
        if not steps:
            continue
        at = [{m.step: m for m in c} for c in curves]
        acc = [[a[s].value for a in at] for s in steps]
        minutes = [statistics.fmean((a[s].timestamp - r.info.start_time) / 60000 for a, r in zip(at, runs))
                   for s in steps]
        sampled = [sampled_tokens(client, r.info.run_id) for r in runs]
        tokens = [statistics.fmean(max((v for k, v in t.items() if k <= s), default=0.0) for t in sampled)
                  for s in steps]
        for ax, x in ((axes[0], steps), (axes[1], minutes), (axes[2], tokens)):
            label = f"{name} (n={len(runs)})"
            (line,) = ax.plot(x, [statistics.fmean(v) for v in acc], marker=".", label=label)
            ax.fill_between(x, [min(v) for v in acc], [max(v) for v in acc], alpha=0.15,
                            color=line.get_color())
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock (minutes since the job started)")
    axes[2].set_xlabel("tokens sampled (trained and not)")
    for ax in axes:
        ax.set_ylabel("eval/accuracy (mean over seeds, band = min..max)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    return _save(plt, fig, path)


def _plot_training(plt, client, groups: dict[str, list], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(TRAINING_CURVES), figsize=(15, 4))
    for ax, (key, label) in zip(axes, TRAINING_CURVES.items()):
        for name, runs in groups.items():
            by_step: dict[int, list[float]] = defaultdict(list)
            for r in runs:
                for m in history(client, r.info.run_id, key):
                    by_step[m.step].append(m.value)
            steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))
            ax.plot(steps, [statistics.fmean(by_step[s]) for s in steps], label=name, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{label}, mean over seeds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def _plot_staleness(plt, client, groups: dict[str, list], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(groups), 1)
    for i, (name, runs) in enumerate(groups.items()):
        hist: dict[int, float] = defaultdict(float)
        kl: dict[int, list[float]] = defaultdict(list)
        for r in runs:
            rid = r.info.run_id
            for key in client.get_run(rid).data.metrics:
                if key.startswith("rollout/staleness_hist/"):
                    hist[int(key.rsplit("/", 1)[1])] += sum(m.value for m in history(client, rid, key))
                if key.startswith("offpolicy/mismatch_kl/staleness_"):
                    kl[int(key.rsplit("_", 1)[1])] += [m.value for m in history(client, rid, key)]
        total = sum(hist.values()) or 1.0
        ks = sorted(hist)
        axes[0].bar([k + i * width for k in ks], [hist[k] / total for k in ks], width, label=name)
        ks = sorted(kl)
        axes[1].bar([k + i * width for k in ks], [statistics.median(kl[k]) for k in ks], width, label=name)
    axes[0].set_xlabel("staleness of a trained sample (policy versions)")
    axes[0].set_ylabel("share of trained samples")
    axes[1].set_xlabel("staleness of a trained token")
    axes[1].set_ylabel("k3 KL(trainer || rollout), median over steps")
    axes[1].set_yscale("symlog", linthresh=1e-3)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    """Lay `fig` out, write it to `path` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
