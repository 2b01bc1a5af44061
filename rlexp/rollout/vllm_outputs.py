"""What a vLLM completion gives back: its new tokens as they stream, and the whole reply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlexp.rollout.vllm_groups import Reply


def report_new(completion, seen: int, on_tokens: Callable[[list[int], list[float]], None]) -> int:
    """`on_tokens` with the tokens of `completion` past the first `seen`; how many it has now."""
    ids = list(completion.token_ids[seen:])
    steps = (completion.logprobs or [])[seen:]
    if ids:
        on_tokens(ids, [step[t].logprob for t, step in zip(ids, steps)])
    return seen + len(ids)


def reply(completion: Any, top_logprobs: int, version: int) -> Reply:
    """A completion's ids, logprobs, `top_logprobs` alternatives per step and finish reason."""
    ids = list(completion.token_ids)
    steps = [step for step in completion.logprobs or [] if step is not None]
    logprobs = [step[tid].logprob for tid, step in zip(ids, steps)]
    k = top_logprobs  # each step also holds the sampled token, whatever its rank
    top = [{t: lp.logprob for t, lp in step.items() if lp.rank is not None and lp.rank <= k}
           for step in steps] if k else []
    return ids, logprobs, top, completion.finish_reason or "abort", version
