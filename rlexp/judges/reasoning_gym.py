"""`judge=reasoning_gym`: each reasoning-gym task's own `score_answer`, on the answer the reply
puts in `<answer></answer>` tags (rlexp/data/reasoning_gym.py makes the problems)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rlexp.data.reasoning_gym import build_dataset
from rlexp.protocols import Judge
from rlexp.sample import Sample


class ReasoningGymJudge(Judge):
    """score = the task's `score_answer(answer, entry)` (0..1, some tasks give partial credit),
    with the task and entry from the sample's metadata (`task`, else the entry's
    `source_dataset`) and the scorer built with the problem's generator `config`, as the entry
    was made (some tasks score by it). The answer is the text inside the reply's last
    `<tag></tag>` pair, stripped, as reasoning-gym's `extract_answer` finds it.

    Without the tags: with `require_tag` (the default, as reasoning-gym's own training scores
    it) the answer is None, which every task scores 0; with `require_tag=false` the whole reply,
    stripped, is the answer (a model that never learned the tags, such as the tiny one).

    reward = correct_reward * score + format_reward * [the tags were found]; with
    `partial_credit=false`, the score's place is taken by `correct` (full marks or nothing: a
    small model learns to game substring credit, e.g. "21" earns 0.5 for an answer of 1 or 2).
    reward_components: `score`, `correct` (1.0 iff the score is full marks, 1.0) and `format`;
    `metadata`: `predicted` (the answer scored) and `task` (per-task eval accuracy counts by it)."""

    def __init__(self, correct_reward: float = 1.0, format_reward: float = 0.0, tag: str = "answer",
                 require_tag: bool = True, partial_credit: bool = True):
        self.correct_reward = correct_reward
        self.format_reward = format_reward
        self.tag = tag
        self.require_tag = require_tag
        self.partial_credit = partial_credit
        self._scorers: dict[tuple[str, str], Any] = {}

    def scorer(self, task: str, config: dict[str, Any] | None = None) -> Any:
        """The reasoning-gym dataset whose `score_answer` scores `task` (built once per config)."""
        key = (task, json.dumps(config or {}, sort_keys=True))
        if key not in self._scorers:
            self._scorers[key] = build_dataset(task, dict(config or {}))
        return self._scorers[key]

    def answer(self, text: str) -> tuple[str | None, bool]:
        """(the answer to score, whether it was in the tags)."""
        from reasoning_gym.utils import extract_answer

        tagged = extract_answer(text, tag_name=self.tag)
        if tagged is not None:
            return tagged, True
        return (None if self.require_tag else text.strip()), False

    async def score(self, sample: Sample) -> Sample:
        entry = sample.metadata.get("entry")
        if not isinstance(entry, dict):
            raise ValueError("judge=reasoning_gym scores reasoning-gym problems: this sample has no "
                             "metadata['entry'] (use data=reasoning_gym)")
        task = sample.metadata.get("task") or entry["metadata"]["source_dataset"]
        scorer = self.scorer(task, sample.metadata.get("config"))
        predicted, tagged = self.answer(sample.response_text)
        # in a worker thread: a few tasks score with sympy or a solver, which must not hold up rollout
        score = float(await asyncio.to_thread(scorer.score_answer, predicted, entry))
        correct = float(score >= 1.0)
        sample.reward_components = {"score": score, "correct": correct, "format": float(tagged)}
        earned = score if self.partial_credit else correct
        sample.reward = self.correct_reward * earned + self.format_reward * float(tagged)
        sample.metadata["predicted"] = predicted
        sample.metadata["task"] = task
        return sample
