"""A verifiers environment's taskset as rlexp's data (`data=verifiers`): every task is a
Problem whose messages are the task's prompt (its system prompt and prompt, as far as the
task's data holds them), whose answer is the task's `answer` field if it has one, and whose
metadata names the task (`task_index`, `task_split`) for agent=verifiers, which runs that
task's episode in the env. rlexp's DataManager draws the problems, so resuming, groups and
the held-out split work as for any source.

The held-out split is the env's own eval split when `eval_args` names it (taskset config
fields for it, e.g. `{split: test}`), else `eval_size` tasks held out by `seed`.

The tasks are listed by the env's worker in verifiers' venv (rlexp/envs/verifiers.py), once,
when the source is built (in preflight): an env that cannot be loaded stops the run there with
one line saying why, before any engine starts."""

from __future__ import annotations

import random
from typing import Any

from rlexp.data.sources import Problem, PromptSource
from rlexp.envs.verifiers import DEFAULT_PYTHON, list_tasks, spec


class VerifiersSource(PromptSource):
    """`env_id`: the verifiers taskset id (an importable module exporting its Taskset);
    `env_args`: the env's config (verifiers' EnvConfig fields: taskset, agent, ...);
    `eval_args`: taskset config fields of the env's own eval split (null: hold out
    `eval_size` tasks by `seed`); `paths`: directories to import the env from (put on the
    worker's PYTHONPATH); `python`: verifiers' venv's Python; `max_tasks`: the most tasks read
    (an infinite taskset is cut there)."""

    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None,
                 eval_args: dict[str, Any] | None = None, paths: list[str] | None = None,
                 python: str = DEFAULT_PYTHON, eval_size: int = 200, seed: int = 0,
                 max_tasks: int = 100_000, timeout_s: float = 300.0):
        self.spec = spec(env_id, env_args, eval_args, paths, max_tasks=max_tasks)
        listing = list_tasks(python, self.spec, timeout_s)
        self.info: dict[str, Any] = listing.get("info") or {}
        train = [self._problem(row, i, "train") for i, row in enumerate(listing["train"])]
        if listing.get("eval") is not None:
            self.splits = {"train": train, "eval": [self._problem(row, i, "eval")
                                                    for i, row in enumerate(listing["eval"])]}
            return
        if eval_size >= len(train):
            raise ValueError(f"verifiers env {env_id!r}: eval_size={eval_size} leaves no training tasks "
                             f"(it has {len(train)}); lower data.source.eval_size or set eval_args")
        shuffled = list(train)
        random.Random(seed).shuffle(shuffled)
        self.splits = {"train": shuffled[eval_size:], "eval": shuffled[:eval_size]}

    def _problem(self, row: dict[str, Any], index: int, split: str) -> Problem:
        where = f"verifiers env {self.spec['env_id']!r} {split} task {index}"
        messages = row.get("messages") or []
        if not messages:  # the user opens the conversation: no prompt rlexp can show
            messages = [{"role": "user", "content": row.get("name") or where}]
        metadata = {"task_index": index, "task_split": split}
        if row.get("name"):
            metadata["task_name"] = row["name"]
        return Problem(messages, row.get("answer") or "", where, metadata)

    def problems(self, split: str) -> list[Problem]:
        return self.splits[split]
