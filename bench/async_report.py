"""What bench/async_speedup.py reads back from each run's MLflow store and prints: one run's
numbers, the medians over repetitions, the tables, the ratios and the headline."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from mlflow.tracking import MlflowClient

NAN = float("nan")
MAIN_COLUMNS = ["loop_s", "wall_s", "eval_start", "eval_end", "engine_idle", "trainer_idle",
                "staleness_mean", "staleness_max", "expired", "untrained_tokens", "len_mean", "len_p50",
                "len_p90", "len_max", "ktok_per_s"]
UPDATE_COLUMNS = ["updates", "pause_s_per_upd", "again_tokens", "again_per_upd", "mixed_tokens",
                  "engine_idle"]


def response_lengths(client: MlflowClient, run_id: str, steps: int) -> list[int]:
    """Every trained response's length (its loss-mask tokens) over the run's step traces, sorted."""
    lengths = []
    for step in range(1, steps + 1):
        path = client.download_artifacts(run_id, f"traces/step_{step:05d}.jsonl")
        lengths += [sum(json.loads(x)["loss_mask"]) for x in Path(path).read_text().splitlines()]
    return sorted(lengths)


def update_numbers(hist) -> dict[str, float]:
    """The weight updates' cost. An update is a step that logged `rollout/update_pause_s` (the
    async scheduler logs it after every pause; the sync one never pauses, so it has none and
    its per-update numbers are NaN). Tokens prefilled again per update: the run's sum of
    `rollout/prefilled_again_tokens` over those updates; pause per update: the mean of
    `rollout/update_pause_s`."""
    pauses, again = hist("rollout/update_pause_s"), sum(hist("rollout/prefilled_again_tokens"))
    return {
        "updates": float(len(pauses)), "again_tokens": again,
        "again_per_upd": again / len(pauses) if pauses else NAN,
        "pause_s_per_upd": statistics.mean(pauses) if pauses else NAN,
        "mixed_tokens": sum(hist("rollout/mixed_tokens")),
    }


def read_run(uri: str, steps: int, wall_s: float) -> dict[str, float]:
    """One run's numbers, from its MLflow store at `uri` (`wall_s`: its whole process's time)."""
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def hist(key: str) -> list[float]:
        history = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    lengths = response_lengths(client, run.info.run_id, steps)
    evals, loop_s = hist("eval/accuracy"), sum(hist("timing/step_s"))
    return {
        "loop_s": loop_s, "wall_s": wall_s, "eval_start": evals[0], "eval_end": evals[-1],
        "engine_idle": statistics.mean(hist("rollout/engine_idle_frac")),
        "trainer_idle": statistics.mean(hist("train/idle_frac")),
        "staleness_mean": statistics.mean(hist("rollout/staleness_mean")),
        "staleness_max": max(hist("rollout/staleness_max")),
        "expired": sum(hist("samples/expired")), "untrained_tokens": sum(hist("rollout/untrained_tokens")),
        "len_p50": lengths[len(lengths) // 2], "len_p90": lengths[int(len(lengths) * 0.9)],
        "len_max": lengths[-1], "len_mean": statistics.mean(lengths),
        # The policies drift apart, so equal steps need not mean equal tokens: also per token.
        "ktok_per_s": sum(lengths) / 1000 / loop_s,
    } | update_numbers(hist)


def nan_median(values: list[float]) -> float:
    """The median of the values that are numbers; NaN if none is."""
    numbers = [v for v in values if not math.isnan(v)]
    return statistics.median(numbers) if numbers else NAN


def medians(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per configuration, the median of each number over its repetitions."""
    return {n: {k: nan_median([r[k] for r in rs]) for k in rs[0]} for n, rs in results.items()}


def print_table(title: str, med: dict[str, dict[str, float]], columns: list[str]) -> None:
    """One row per configuration (in `med`'s order), one column per number; NaN shows as '-'."""
    width = max(len("config"), *map(len, med))
    print(f"\n{title}")
    print(f"{'config':{width}s} " + " ".join(f"{c:>15s}" for c in columns))
    for name, m in med.items():
        cells = ["-" if math.isnan(m[c]) else f"{m[c]:.3f}" for c in columns]
        print(f"{name:{width}s} " + " ".join(f"{c:>15s}" for c in cells))


def print_ratios(med: dict[str, dict[str, float]], pins: list[str]) -> None:
    """Each async configuration against sync on the same cores."""
    print()
    for pin in pins:
        sync = med[f"sync{pin}"]
        for n in async_names(med, pin):
            print(f"sync{pin}/{n}: training loop {sync['loop_s'] / med[n]['loop_s']:.2f}x, "
                  f"whole run {sync['wall_s'] / med[n]['wall_s']:.2f}x, "
                  f"trained tokens/s {med[n]['ktok_per_s'] / sync['ktok_per_s']:.2f}x")


def async_names(med: dict, pin: str) -> list[str]:
    """The async configurations on the cores `pin` names ("" shared, "_pin" pinned)."""
    return [n for n in med if n.startswith("async_") and n.endswith("_pin") == (pin == "_pin")]


def keep_line(results: dict[str, list[dict]]) -> str:
    """Whether every keep-mode run (each repetition, shared and pinned) prefilled 0 tokens again."""
    keep = {n: sum(r["again_tokens"] for r in rs) for n, rs in results.items() if n.startswith("async_keep_")}
    if not keep:
        return "keep mode prefilled 0 tokens again: not run (keep not in --modes)"
    verdict = "yes" if all(v == 0 for v in keep.values()) else "NO"
    detail = ", ".join(f"{n} {v:.0f}" for n, v in keep.items())
    return f"keep mode prefilled 0 tokens again: {verdict} (tokens over all repetitions: {detail})"


def print_headline(med: dict[str, dict[str, float]], results: dict[str, list[dict]], pin: str) -> None:
    """The fastest async configuration (median loop time) on the cores `pin` names against sync on
    the same cores, the keep-mode check, then `ratio: X` (sync / that configuration, loop time) last."""
    best = min(async_names(med, pin), key=lambda n: med[n]["loop_s"])
    ratio = med[f"sync{pin}"]["loop_s"] / med[best]["loop_s"]
    print(f"\nheadline: sync{pin} / {best} (the fastest async configuration by median training-loop time)")
    print(keep_line(results))
    print(f"ratio: {ratio:.3f}")
