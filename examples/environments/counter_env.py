"""An environment class in the shape TRL's `GRPOTrainer(environment_factory=CounterEnv)` takes,
run by rlexp as it is:

    python -m rlexp.run experiment=tool agent=environment \\
        agent.factory=examples.environments.counter_env:CounterEnv

A counter the policy sets with its calculator: `reset` reads the row's target (its answer),
each `calculator` call sets the counter to the value of an arithmetic expression, and the
reward is 1.0 when the counter ends at the target. The tiny model warm-started for tool use
(experiment=tool) calls `calculator` with the question's expression ("12+34=" -> "12+34"),
so it is often right and RL has something to sharpen."""

from __future__ import annotations

import ast
import operator
import re

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an expression of integers with +, - and * (no names, no calls)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an expression of integers with + - *: {expression!r}")

    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")
    expression = re.sub(r"\b0+(?=\d)", "", expression.strip())  # "046" is 46
    return value(ast.parse(expression, mode="eval").body)


class CounterEnv:
    def __init__(self):
        self.target, self.counter, self.reward = 0, 0, 0.0

    def reset(self, answer: str, **row) -> str | None:
        """A new episode: the counter at 0, the row's answer its target. Nothing is added to
        the prompt (None); a text returned here would be appended to it."""
        self.target, self.counter, self.reward = int(answer), 0, 0.0
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and set the counter to its value.

        Args:
            expression: integers with +, - and *, e.g. "12+34"

        Returns:
            The counter's new value.
        """
        self.counter = evaluate(expression)
        self.reward = float(self.counter == self.target)
        return str(self.counter)
