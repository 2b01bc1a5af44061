"""Rule-based judge: extract the final answer, compare exactly with the reference."""

from __future__ import annotations

import re

from rlexp.protocols import Judge
from rlexp.sample import Sample

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The answer after the last `####`, else in the last `\\boxed{}`, else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return normalize(tail.split()[0]) if tail else None
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return normalize(boxed[-1])
    numbers = _NUMBER.findall(text)
    return normalize(numbers[-1]) if numbers else None


def normalize(ans: str) -> str:
    ans = ans.strip().rstrip(".").replace(",", "").replace("$", "")
    if re.fullmatch(r"-?\d+\.0+", ans):
        ans = ans.split(".")[0]
    return ans


class MathExactJudge(Judge):
    """reward = correct_reward * [answer == reference] + format_reward * [an answer was found]."""

    def __init__(self, correct_reward: float = 1.0, format_reward: float = 0.0):
        self.correct_reward = correct_reward
        self.format_reward = format_reward

    async def score(self, sample: Sample) -> Sample:
        predicted = extract_answer(sample.response_text)
        correct = float(predicted is not None and predicted == normalize(sample.answer))
        found = float(predicted is not None)
        sample.reward_components = {"correct": correct, "format": found}
        sample.reward = self.correct_reward * correct + self.format_reward * found
        sample.metadata["predicted"] = predicted
        return sample


class MultiTurnJudge(Judge):
    """Scores the final answer in the last assistant turn, discounted by the turn it came in:
    reward = correct_reward * discount ** (assistant turns - 1). Per-turn correctness is kept
    in `reward_components` (`turn_1`, `turn_2`, ...)."""

    def __init__(self, correct_reward: float = 1.0, discount: float = 0.8):
        self.correct_reward = correct_reward
        self.discount = discount

    async def score(self, sample: Sample) -> Sample:
        replies = [t["text"] for t in sample.turns if t["mask"]]
        ref = normalize(sample.answer)
        per_turn = [float(extract_answer(_strip_special(r)) == ref) for r in replies]
        correct = per_turn[-1] if per_turn else 0.0
        sample.reward_components = {"correct": correct, "turns": float(len(replies))}
        sample.reward_components |= {f"turn_{i + 1}": c for i, c in enumerate(per_turn)}
        sample.reward = self.correct_reward * correct * self.discount ** max(len(replies) - 1, 0)
        return sample


def _strip_special(text: str) -> str:
    return re.sub(r"<\|[^|]*\|>", "", text)
