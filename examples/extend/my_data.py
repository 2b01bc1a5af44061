"""A data source of your own: a PromptSource, with `problems(split) -> list[Problem]` (and the
Protocol's `commit`, inherited)."""

import csv
import random

from rlexp.data.sources import Problem, PromptSource


class CsvSource(PromptSource):
    """Rows `question,answer` of a CSV file with a header; `eval_size` rows held out by `seed`."""

    def __init__(self, path: str, eval_size: int, seed: int, system_prompt: str | None = None):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        for line, row in enumerate(rows, start=2):
            if not row.get("question") or not row.get("answer"):
                raise ValueError(f"{path}:{line}: a row needs a question and an answer, got {row}")
        random.Random(seed).shuffle(rows)
        self.splits = {"eval": rows[:eval_size], "train": rows[eval_size:]}
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def problems(self, split: str) -> list[Problem]:
        return [Problem(self.system + [{"role": "user", "content": row["question"]}], row["answer"])
                for row in self.splits[split]]
