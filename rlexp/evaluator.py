"""Evaluator: metrics from an evaluation batch. It does no rollout itself: the loop
produces the batch from the held-out split (`RLLoop.evaluate` in rlexp/loop.py)."""

from __future__ import annotations

from collections import defaultdict
from math import comb

from rlexp.constraints import AtLeast1
from rlexp.sample import Sample, SamplingConfig, Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def per_task_accuracy(batch: list[Sample]) -> dict[str, float]:
    """`eval/accuracy/<task>` for samples whose `metadata["task"]` names one (a mix of tasks:
    rlexp/data/reasoning_gym.py); failed or aborted samples count as wrong, as overall."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for s in batch:
        if "task" in s.metadata:
            by_task[s.metadata["task"]].append(s.correct if s.status == Status.COMPLETED else 0.0)
    return {f"eval/accuracy/{task}": sum(v) / len(v) for task, v in sorted(by_task.items())}


class Evaluator:
    """`every_n_steps`, `prompts` (None = the whole held-out split), `samples_per_prompt`
    and `sampling` tell the loop how to produce the eval batch."""

    def __init__(self, every_n_steps: AtLeast1, sampling: SamplingConfig, samples_per_prompt: AtLeast1 = 1,
                 prompts: AtLeast1 | None = None):
        self.every_n_steps = every_n_steps
        self.sampling = sampling
        self.samples_per_prompt = samples_per_prompt
        self.prompts = prompts

    def metrics(self, batch: list[Sample]) -> dict[str, float]:
        done = [s for s in batch if s.status == Status.COMPLETED]
        groups: dict[int, list[float]] = defaultdict(list)
        for s in done:
            groups[s.group_id].append(s.correct)
        n = self.samples_per_prompt
        metrics = {
            # Failed or aborted samples count as wrong: the denominator is every eval sample.
            "eval/accuracy": sum(sum(g) for g in groups.values()) / max(len(batch), 1),
            "eval/reward_mean": sum(s.reward for s in done) / max(len(done), 1),
            "eval/response_length_mean": sum(s.response_length for s in done) / max(len(done), 1),
            "eval/truncated_frac": sum(s.finish_reason == "length" for s in done) / max(len(done), 1),
            "eval/prompts": float(len(groups)),
            "eval/failed": float(len(batch) - len(done)),
        }
        firsts = [s.reward_components["turn_1"] for s in done if "turn_1" in s.reward_components]
        if firsts:  # multi-turn: how often the first answer was already right
            metrics["eval/first_turn_accuracy"] = sum(firsts) / len(batch)
        metrics |= per_task_accuracy(batch)
        k = 1
        while k <= n:
            full = [g for g in groups.values() if len(g) == n]
            metrics[f"eval/pass_at_{k}"] = sum(pass_at_k(n, int(sum(g)), k) for g in full) / max(len(full), 1)
            k *= 2
        return metrics
