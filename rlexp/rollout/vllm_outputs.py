"""What a vLLM completion gives back: its new tokens as they stream, the whole reply, and a
prompt's own logprobs (a teacher's scores)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlexp.errors import TeacherError
from rlexp.rollout.vllm_groups import Reply
from rlexp.sample import PromptLogprobs


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


def prompt_scores(output: Any, token_ids: list[int], top_k: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of `token_ids` (entry 0 is None: nothing predicts it) as each
    token's logprob given the ones before, with the `top_k` likeliest ids per position (each
    entry holds the prompt's own token whatever its rank, and the ranks 1 .. top_k)."""
    entries = list(output.prompt_logprobs or [])[1:]
    n = len(token_ids) - 1
    if len(entries) != n or any(e is None or t not in e for t, e in zip(token_ids[1:], entries)):
        raise TeacherError(f"vLLM returned prompt logprobs for {len(entries)} of {n} positions")
    logprobs = [e[t].logprob for t, e in zip(token_ids[1:], entries)]
    top = [{i: lp.logprob for i, lp in e.items() if lp.rank is not None and lp.rank <= top_k}
           for e in entries] if top_k else None
    return PromptLogprobs(logprobs, top)
