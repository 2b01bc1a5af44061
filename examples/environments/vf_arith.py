"""A verifiers (0.4, `verifiers.v1`) environment that rlexp's tiny model can learn: "a+b=" ->
the number, one turn. Run it with rlexp (examples/environments/ on the worker's path):

    python -m rlexp.run experiment=verifiers          # conf/experiment/verifiers.yaml

or with verifiers' own tools, from its venv: PYTHONPATH=examples/environments
.venv-verifiers/bin/vf-eval vf_arith ... (verifiers' defaults: a hosted sandbox and the bash
harness; rlexp runs it with the subprocess runtime and the null harness).

The prompt is exactly rlexp's built-in arithmetic task's ("17+25=", no system prompt), so a
tiny model warm-started on that task starts well above zero. The one reward, `correct`,
is 1.0 when the last reply is the answer."""

from __future__ import annotations

import random
from typing import Literal

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str
    """The sum, as text: the reference rlexp keeps as the sample's answer."""


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return score(trace.last_reply, self.data.answer)


def score(reply: str, answer: str) -> float:
    return float(reply.strip() == answer)


class ArithConfig(vf.TasksetConfig):
    max_operand: int = 99
    """Operands are 0..max_operand."""
    ops: str = "+"
    eval_size: int = 200
    """Problems held out as the eval split (by `seed`)."""
    seed: int = 0
    split: Literal["train", "eval"] = "train"
    """Which of the two splits this taskset yields (rlexp: data.source.eval_args={split: eval})."""


def problems(config: ArithConfig) -> list[tuple[str, str]]:
    """The split's (question, answer) pairs, disjoint from the other split's, fixed by seed."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    pairs = [(f"{a}{op}{b}=", str(ops[op](a, b))) for op in config.ops
             for a in range(config.max_operand + 1) for b in range(config.max_operand + 1)]
    random.Random(config.seed).shuffle(pairs)
    return pairs[:config.eval_size] if config.split == "eval" else pairs[config.eval_size:]


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(prompt=q, answer=a, name=q), self.config.task)
                for q, a in problems(self.config)]


__all__ = ["ArithTaskset"]
