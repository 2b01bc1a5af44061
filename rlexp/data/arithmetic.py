"""Built-in synthetic task: "a+b=" -> the number. Deterministic train / held-out split by seed."""

from __future__ import annotations

import random

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def all_problems(max_operand: int, ops: str) -> list[tuple[str, str]]:
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"arithmetic: unknown op(s) {sorted(unknown)}; choose from {sorted(OPS)}")
    return [
        (f"{a}{op}{b}=", str(OPS[op](a, b)))
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def split(max_operand: int, ops: str, eval_size: int, seed: int):
    """Return (train, eval) lists of (question, answer); disjoint, fixed by `seed`."""
    problems = all_problems(max_operand, ops)
    if eval_size >= len(problems):
        raise ValueError(
            f"arithmetic: eval_size={eval_size} leaves no training problems "
            f"(only {len(problems)} with max_operand={max_operand}, ops={ops!r})"
        )
    random.Random(seed).shuffle(problems)
    return problems[eval_size:], problems[:eval_size]
