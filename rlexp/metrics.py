"""What one RL step is measured by: the batch's rollout statistics (rewards, lengths,
statuses, staleness), merged with the trainer's and the step's timings by the loop."""

from __future__ import annotations

from collections import Counter

import numpy as np

from rlexp.protocols import Agent
from rlexp.sample import Sample, Status


def was_resumed(s: Sample) -> bool:
    """A policy turn whose tokens came from more than one policy version (a weight update while
    it generated: update_mode abort or keep)."""
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
        "rollout/accuracy": sum(s.correct for s in done) / n,
        **length_stats([s.response_length for s in done], "rollout/response_length"),  # trained
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in done) / n,
        "rollout/tokens": float(tokens),
        **{f"samples/{st.value}": float(counts.get(st.value, 0)) for st in Status},
        "samples/resumed": float(sum(was_resumed(s) for s in done)),
        # newer weights' tokens over KV older ones wrote (update_mode=keep): not sync-checked
        "rollout/mixed_tokens": float(sum(s.trace.mixed_tokens() for s in done)),
        # agent/judge faults (FAILED, or ABORTED by a timeout): the run stops past a limit
        "samples/failed_frac": sum(s.error is not None for s in batch) / max(len(batch), 1),
        "rollout/staleness_mean": sum(k * n for k, n in staleness.items()) / n,
        "rollout/staleness_max": float(max(staleness, default=0)),
        **{f"rollout/staleness_hist/{k}": float(c) for k, c in staleness.items()},
        **version_spread(done, version),
        **expert_load([s.trace.routed_experts for s in done]),
    }


def version_spread(done: list[Sample], version: int) -> dict[str, float]:
    """Tokens per policy version within the trajectories: the mean number of versions whose
    tokens one trained sample holds (1 unless a weight update met it mid-trajectory), and the
    trained tokens by their own staleness (`rollout/token_staleness_hist/<k>`)."""
    per_token: Counter[int] = Counter()
    versions = 0
    for s in done:
        trained = [v for v, m in zip(s.versions, s.loss_mask) if m]
        per_token.update(trained)
        versions += len(set(trained))
    return {"rollout/versions_per_sample_mean": versions / max(len(done), 1),
            **{f"rollout/token_staleness_hist/{version - v}": float(c) for v, c in sorted(per_token.items())}}


def expert_load(routings: list) -> dict[str, float]:
    """MoE (rollout.routing_capture): per layer, the busiest expert's share of the engine's
    (position, top-k) routing slots over the batch (1/experts when balanced), and the routing
    data's size in bytes."""
    arrays = [r for r in routings if r is not None]
    if not arrays:
        return {}
    ids = np.concatenate(arrays)  # [positions, layers, k]
    out = {"moe/routing_bytes": float(sum(a.nbytes for a in arrays))}
    for layer in range(ids.shape[1]):
        counts = np.bincount(ids[:, layer].ravel())
        out[f"moe/expert_load_max/layer_{layer}"] = float(counts.max() / counts.sum())
    return out


def length_stats(lengths: list[int], prefix: str) -> dict[str, float]:
    """Mean, median and 90th percentile of response lengths (0 without any)."""
    xs = sorted(lengths) or [0]
    return {f"{prefix}_mean": sum(xs) / len(xs), f"{prefix}_p50": float(xs[len(xs) // 2]),
            f"{prefix}_p90": float(xs[min(len(xs) - 1, 9 * len(xs) // 10)])}


class GeneratedLengths(Agent):
    """An Agent passing rollouts through to `agent`, keeping the response length of every
    sample it completed, trained or not (filtered, expired, or waiting for a later batch).
    `pop_metrics`: their distribution since the last call, logged beside the trained batch's
    (`rollout/response_length_*`); a scheduler that trains some lengths more often than it
    generates them (long rollouts expiring, or lost on resume) shows as a gap between them."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.lengths: list[int] = []

    async def rollout(self, sample: Sample) -> Sample | list[Sample]:
        out = await self.agent.rollout(sample)
        self.lengths += [s.response_length for s in (out if isinstance(out, list) else [out])
                         if s.status == Status.COMPLETED]
        return out

    async def aclose(self) -> None:
        await self.agent.aclose()

    def pop_metrics(self) -> dict[str, float]:
        lengths, self.lengths = self.lengths, []
        return {"rollout/generated_samples": float(len(lengths)),
                **length_stats(lengths, "rollout/generated_response_length")}


def failure_report(batch: list[Sample], step: int, limit: float, checkpoint: str, run_dir: str) -> str:
    failed = [s for s in batch if s.error]
    reasons = Counter(s.error for s in failed).most_common(3)
    listed = "; ".join(f"{n}x {r}" for r, n in reasons)
    return (f"step {step}: {len(failed)} of {len(batch)} samples failed, more than "
            f"max_failure_fraction={limit} (most common: {listed}). Checkpoint saved to "
            f"{checkpoint}. Fix the cause, then resume: python -m rlexp.run resume={run_dir}")
