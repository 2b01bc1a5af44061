"""Where prompts come from: the built-in arithmetic task or the user's JSONL files.

A source returns `Problem`s for a split ("train" or "eval")."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlexp.data import arithmetic


@dataclass(frozen=True)
class Problem:
    messages: list[dict[str, str]]
    answer: str
    where: str = ""  # file:line, for error messages


class PromptSource(Protocol):
    def problems(self, split: str) -> list[Problem]:
        """The prompts of a split ("train" or "eval"), in a fixed order."""
        ...


def _messages(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": question}]


class ArithmeticSource:
    """`a<op>b=` with operands in 0..max_operand; `eval_size` problems held out by `seed`."""

    def __init__(self, max_operand: int, ops: str, eval_size: int, seed: int,
                 system_prompt: str | None = None):
        self.train_pairs, self.eval_pairs = arithmetic.split(max_operand, ops, eval_size, seed)
        self.system_prompt = system_prompt

    def problems(self, split: str) -> list[Problem]:
        pairs = self.train_pairs if split == "train" else self.eval_pairs
        return [Problem(_messages(q, self.system_prompt), a) for q, a in pairs]


class JsonlSource:
    """One JSON object per line. `question_key` / `answer_key` name the fields; if
    `answer_pattern` is set, the reference answer is its first group in the answer
    field (GSM8K: `####\\s*(.+)$`). Without `eval_path`, `eval_size` rows of the train
    file are held out by `seed`."""

    def __init__(self, train_path: str, eval_path: str | None = None,
                 question_key: str = "question", answer_key: str = "answer",
                 answer_pattern: str | None = None, eval_size: int = 200, seed: int = 0,
                 system_prompt: str | None = None):
        self.question_key, self.answer_key = question_key, answer_key
        self.pattern = re.compile(answer_pattern, re.M) if answer_pattern else None
        self.system_prompt = system_prompt
        train = self._load(Path(train_path))
        if eval_path:
            self.splits = {"train": train, "eval": self._load(Path(eval_path))}
        else:
            if eval_size >= len(train):
                raise ValueError(f"{train_path}: eval_size={eval_size} leaves no training rows "
                                 f"(file has {len(train)})")
            random.Random(seed).shuffle(train)
            self.splits = {"train": train[eval_size:], "eval": train[:eval_size]}

    def problems(self, split: str) -> list[Problem]:
        return self.splits[split]

    def _load(self, path: Path) -> list[Problem]:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: data file not found")
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    rows.append(self._parse(line, f"{path}:{lineno}"))
        if not rows:
            raise ValueError(f"{path}: no rows")
        return rows

    def _parse(self, line: str, where: str) -> Problem:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        values = []
        for key in (self.question_key, self.answer_key):
            if key not in row:
                raise ValueError(f"{where}: missing key {key!r} (has {sorted(row)})")
            if not isinstance(row[key], (str, int, float)) or isinstance(row[key], bool):
                raise ValueError(f"{where}: key {key!r} must be a string or number")
            values.append(str(row[key]))
        question, answer = values
        if self.pattern:
            m = self.pattern.search(answer)
            if not m:
                raise ValueError(f"{where}: answer {answer[-40:]!r} does not match "
                                 f"answer_pattern {self.pattern.pattern!r}")
            answer = m.group(1).strip()
        return Problem(_messages(question, self.system_prompt), answer, where)
