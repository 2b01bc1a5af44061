"""An OpenEnv environment: guess the hidden number, each guess an arithmetic expression.

Written against OpenEnv's own types (openenv-core), so it runs in OpenEnv's venv, served by
OpenEnv's server; rlexp steps it over the WebSocket protocol (agent=openenv):

    python -m rlexp.run experiment=tool agent=openenv \\
        agent.environment=examples.environments.openenv_guess:GuessEnvironment agent.tool_name=calculator

The hidden number is the dataset row's answer (rlexp sends the row with `reset`): for the
arithmetic task, "12+34=" hides 46, so a policy that calls its calculator with the question's
expression hits it at once; the tiny model warm-started for tool use does (experiment=tool),
most of the time. Feedback says "too low" / "too high"; reward 1.0 on the hit, the episode
ends on the hit or after `MAX_GUESSES`."""

from __future__ import annotations

import ast
import operator
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 3
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class GuessAction(Action):
    """Guess the hidden number."""

    # the pattern bounds a guess: guided decoding (tool_choice=required) ends the string by it
    expression: str = Field(pattern=r"^[0-9+*-]{1,12}$",
                            description="the guess: an integer, or +, - and * of integers (e.g. 12+34)")


class GuessObservation(Observation):
    message: str = Field(default="", description="what the last guess was worth")


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


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance, nothing shared

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, answer: str | None = None,
              **row: Any) -> GuessObservation:
        """`answer`: the dataset row's (the number to find); without one, a number from `seed`."""
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.target = int(answer) if answer is not None else (seed or 0) % 100
        return GuessObservation(message="")  # nothing to add to the row's prompt

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        try:
            guess = evaluate(action.expression)
        except (ValueError, SyntaxError) as e:
            return GuessObservation(message=f"invalid guess ({e}); {left} left", done=left <= 0, reward=0.0)
        if guess == self.target:
            return GuessObservation(message=f"{guess} is right", done=True, reward=1.0)
        hint = "too low" if guess < self.target else "too high"
        return GuessObservation(message=f"{guess} is {hint}; {left} left", done=left <= 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
