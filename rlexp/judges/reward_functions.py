"""`judge=reward_functions`: reward functions written for TRL's GRPOTrainer (`reward_funcs`),
used unchanged.

    python -m rlexp.run judge=reward_functions 'judge.functions=[my_rewards.accuracy,my_rewards.brevity]'

Each function is called as TRL calls it on a conversational dataset, here with one sample:

    f(prompts=[messages], completions=[[{"role": "assistant", "content": reply}]],
      completion_ids=[generated token ids], answer=[reference answer], trainer_state=None)

and returns a list of one float, or of one None ("not applicable": it adds nothing). An
`async def` function is awaited; a plain one runs in a worker thread, so that a slow
function never holds up rollout."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object

from rlexp.protocols import Judge
from rlexp.sample import Sample


def load_functions(paths: tuple[str, ...] | list[str]) -> list[Callable[..., Any]]:
    """The functions at dotted import paths (`module.function`), as `_target_` names a class;
    ValueError naming the path that does not import or is not callable."""
    functions = []
    for path in paths:
        try:
            fn = get_object(path)
        except Exception as e:
            raise ValueError(f"judge.functions: cannot import {path!r} ({type(e.__cause__ or e).__name__}: "
                             f"{e.__cause__ or e})") from None
        if not callable(fn):
            raise ValueError(f"judge.functions: {path!r} is not a function")
        functions.append(fn)
    return functions


class RewardFunctions(Judge):
    """reward = sum_i weights[i] * f_i(sample) over the functions that return a number (TRL's
    `reward_funcs` with `reward_weights`); each value is also a reward component, named by the
    function. `weights`: one per function, null: all 1.0. Correctness (`eval/accuracy`) is the
    component of the function named by `correct_function` being > 0, else the reward being > 0."""

    def __init__(self, functions: list[str], weights: list[float] | None = None,
                 correct_function: str | None = None):
        self.functions = load_functions(functions)
        self.names = [path.rsplit(".", 1)[-1] for path in functions]
        self.weights = list(weights) if weights is not None else [1.0] * len(self.functions)
        if not self.functions or len(self.weights) != len(self.functions):
            raise ValueError(f"judge.weights: one per function ({len(self.functions)}), "
                             f"got {len(self.weights)}")
        if correct_function is not None and correct_function not in self.names:
            raise ValueError(f"judge.correct_function={correct_function} is none of {', '.join(self.names)}")
        self.correct_function = correct_function

    async def score(self, sample: Sample) -> Sample:
        kwargs = {"prompts": [sample.prompt],
                  "completions": [[{"role": "assistant", "content": sample.response_text}]],
                  "completion_ids": [[t for t, m in zip(sample.tokens, sample.loss_mask) if m]],
                  "answer": [sample.answer], "trainer_state": None}
        values = [await _call(fn, kwargs) for fn in self.functions]
        sample.reward_components = {n: v for n, v in zip(self.names, values) if v is not None}
        sample.reward = sum(w * v for w, v in zip(self.weights, values) if v is not None)
        if self.correct_function is not None:
            value = sample.reward_components.get(self.correct_function, 0.0)
            sample.reward_components["correct"] = float(value > 0)
        return sample


async def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> float | None:
    """The function's one value. A wrong type is a bug in it (TypeError: the run stops); a
    value that is not finite fails this sample only."""
    name = getattr(fn, "__name__", repr(fn))
    out = await fn(**kwargs) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, **kwargs)
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise TypeError(f"reward function {name} must return a list with one value per completion "
                        f"(TRL's convention; here one completion), got {out!r}")
    value = out[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward function {name} returned {value!r}: a number or None")
    if not math.isfinite(value):
        raise ValueError(f"reward function {name} returned {value}")
    return float(value)
