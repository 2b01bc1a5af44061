"""What one RL step is measured by: the batch's rollout statistics (rewards, lengths,
statuses, staleness), merged with the trainer's and the step's timings by the loop."""

from __future__ import annotations

from collections import Counter

from rlexp.sample import Sample, Status


def was_resumed(s: Sample) -> bool:
    """A policy turn whose tokens came from more than one policy version (partial rollout)."""
    return any(t["mask"] and len(set(s.versions[slice(*t["span"])])) > 1 for t in s.turns)


def rollout_metrics(batch: list[Sample], version: int) -> dict[str, float]:
    """`version`: the policy version the batch trains (staleness is measured against it)."""
    done = [s for s in batch if s.status == Status.COMPLETED]
    staleness = Counter(s.staleness(version) for s in done)
    tokens = sum(s.response_length for s in batch)
    counts = Counter(s.status.value for s in batch)
    n = max(len(done), 1)
    # Agent-specific per-sample metrics: `*_mean` keys are averaged, others summed.
    extra: dict[str, list[float]] = {}
    for s in batch:
        for k, v in s.metadata.get("metrics", {}).items():
            extra.setdefault(k, []).append(v)
    agent_metrics = {k: sum(v) / len(v) if k.endswith("_mean") else sum(v) for k, v in extra.items()}
    return agent_metrics | {
        "rollout/reward_mean": sum(s.reward for s in done) / n,
        "rollout/accuracy": sum(s.reward_components.get("correct", 0.0) for s in done) / n,
        "rollout/response_length_mean": sum(s.response_length for s in done) / n,
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in done) / n,
        "rollout/tokens": float(tokens),
        **{f"samples/{st.value}": float(counts.get(st.value, 0)) for st in Status},
        "samples/resumed": float(sum(was_resumed(s) for s in done)),
        # agent/judge faults (FAILED, or ABORTED by a timeout): the run stops past a limit
        "samples/failed_frac": sum(s.error is not None for s in batch) / max(len(batch), 1),
        "rollout/staleness_mean": sum(k * n for k, n in staleness.items()) / n,
        "rollout/staleness_max": float(max(staleness, default=0)),
        **{f"rollout/staleness_hist/{k}": float(c) for k, c in staleness.items()},
    }


def failure_report(batch: list[Sample], step: int, limit: float, checkpoint: str, run_dir: str) -> str:
    failed = [s for s in batch if s.error]
    reasons = Counter(s.error for s in failed).most_common(3)
    listed = "; ".join(f"{n}x {r}" for r, n in reasons)
    return (f"step {step}: {len(failed)} of {len(batch)} samples failed, more than "
            f"scheduler.max_failure_fraction={limit} (most common: {listed}). Checkpoint saved to "
            f"{checkpoint}. Fix the cause, then resume: python -m rlexp.run resume={run_dir}")
