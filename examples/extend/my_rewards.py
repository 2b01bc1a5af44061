"""Reward functions as TRL's GRPOTrainer takes them (`reward_funcs`): `judge=reward_functions`
calls them unchanged, one completion at a time (conversational: each completion is a list of
messages)."""

import re


def accuracy(completions, answer, **kwargs):
    """1.0 where the reply's last number is the reference answer, else 0.0."""
    replies = [completion[0]["content"] for completion in completions]
    last = [re.findall(r"-?\d+", reply)[-1:] for reply in replies]
    return [float(n == [a.strip()]) for n, a in zip(last, answer)]


def brevity(completion_ids, **kwargs):
    """-0.01 per generated token beyond 8."""
    return [-0.01 * max(0, len(ids) - 8) for ids in completion_ids]
