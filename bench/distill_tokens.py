"""On-policy distillation against GRPO: student tokens sampled until the held-out accuracy
reaches 90% of the teacher's, read from the sweeps of experiment=distill (docs/distillation.md).

    .venv/bin/python bench/distill_tokens.py --teacher-accuracy 0.80 sweeps/<grpo> sweeps/<distill>

Each job's arm is its recipe (grpo, distill, grpo_distill), its seed its `seed`. Student tokens
sampled by step s: the sum of `rollout/tokens` (every response token the student generated for
training) over steps 1..s; a job reaches the target at its first evaluation at or above
0.9 x the teacher's accuracy. Printed: per arm and seed the step and tokens, per arm the mean
and spread; a picture of held-out accuracy against student tokens sampled (mean over seeds,
band = min..max), written beside the first sweep and logged to every sweep's parent run.
The headline, last: ratio = mean tokens distillation needs / mean tokens GRPO needs (seeds that
never reach the target are reported, and the ratio is then a bound)."""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from itertools import accumulate
from pathlib import Path

from rlexp.compare import find_sweep, history


def jobs(sweeps: list[str]) -> tuple[list[tuple], list[tuple]]:
    """(client, run) of every job of the sweeps, and (client, parent run id) of each sweep."""
    found, parents = [], []
    for target in sweeps:
        client, parent_id, _ = find_sweep(target, None)
        parent = client.get_run(parent_id)
        children = client.search_runs([parent.info.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{parent_id}'")
        found += [(client, r) for r in children if r.info.status == "FINISHED"]
        parents.append((client, parent_id))
    return found, parents


def curve(client, run) -> list[tuple[int, float, float]]:
    """(step, student tokens sampled by then, held-out accuracy) at each evaluation."""
    tokens = {m.step: m.value for m in history(client, run.info.run_id, "rollout/tokens")}
    steps = sorted(tokens)
    total = dict(zip(steps, accumulate(tokens[s] for s in steps)))
    total[0] = 0.0
    return [(m.step, total[m.step], m.value) for m in history(client, run.info.run_id, "eval/accuracy")
            if m.step in total]


def reached(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    return next(((step, tok) for step, tok, acc in points if acc >= target), None)


def plot(arms: dict[str, list], out: Path, target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, curves in sorted(arms.items()):
        steps = sorted(set.intersection(*({s for s, _, _ in c} for c in curves)))
        at = [{s: (t, a) for s, t, a in c} for c in curves]
        x = [statistics.fmean(p[s][0] for p in at) for s in steps]
        acc = [[p[s][1] for p in at] for s in steps]
        label = f"{arm} (n={len(curves)})"
        (line,) = ax.plot(x, [statistics.fmean(v) for v in acc], marker=".", label=label)
        ax.fill_between(x, [min(v) for v in acc], [max(v) for v in acc], alpha=0.15,
                        color=line.get_color())
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="90% of the teacher's accuracy")
    ax.set_xlabel("student tokens sampled")
    ax.set_ylabel("held-out accuracy (mean over seeds, band = min..max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="sweep dirs of experiment=distill")
    ap.add_argument("--teacher-accuracy", type=float, required=True, help="the teacher's held-out accuracy")
    ap.add_argument("--out", type=Path, default=None, help="the picture (default: in the first sweep dir)")
    args = ap.parse_args()
    target = 0.9 * args.teacher_accuracy
    found, parents = jobs(args.sweeps)
    arms: dict[str, list] = defaultdict(list)
    needs: dict[str, list[float | None]] = defaultdict(list)
    print(f"target: held-out accuracy >= {target:.3f} (0.9 x the teacher's {args.teacher_accuracy:.3f})")
    for client, run in sorted(found, key=lambda cr: (cr[1].data.params.get("algorithm.recipe", ""),
                                                      int(cr[1].data.params.get("seed", 0)))):
        arm, seed = run.data.params.get("algorithm.recipe") or "grpo", run.data.params.get("seed")
        points = curve(client, run)
        arms[arm].append(points)
        hit = reached(points, target)
        needs[arm].append(None if hit is None else hit[1])
        final = points[-1]
        where = (f"step {hit[0]}, {hit[1]:,.0f} tokens" if hit
                 else f"not reached in {final[0]} steps ({final[1]:,.0f} tokens)")
        print(f"{arm:14s} seed {seed}: {where}; final accuracy {final[2]:.3f}")
    for arm, values in sorted(needs.items()):
        got = [v for v in values if v is not None]
        spread = f"{min(got):,.0f}..{max(got):,.0f}" if got else "-"
        mean = f"{statistics.fmean(got):,.0f}" if got else "-"
        print(f"{arm:14s} tokens to the target: mean {mean} over {len(got)} of {len(values)} seeds "
              f"(min..max {spread})")
    out = plot(arms, args.out or Path(args.sweeps[0]) / "distill_tokens.png", target)
    for client, parent_id in parents:
        client.log_artifact(parent_id, str(out), artifact_path="compare")
    print(f"picture: {out}")
    grpo = [v for v in needs.get("grpo", []) if v is not None]
    for arm in ("grpo_distill", "distill"):
        got = [v for v in needs.get(arm, []) if v is not None]
        if grpo and got:
            every = len(got) == len(needs[arm]) and len(grpo) == len(needs["grpo"])
            bound = "" if every else " (a bound: some seeds never reached it)"
            print(f"{arm} / grpo tokens: {statistics.fmean(got) / statistics.fmean(grpo):.3f}{bound}")
    got = [v for v in needs.get("distill", []) if v is not None]
    print(f"ratio: {statistics.fmean(got) / statistics.fmean(grpo):.3f}" if grpo and got else "ratio: nan")


if __name__ == "__main__":
    main()
