"""What a vLLM completion gives back: its new tokens as they stream, the whole reply, and a
prompt's own logprobs (a teacher's scores)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rlexp.errors import TeacherError
from rlexp.rollout.vllm_groups import Reply
from rlexp.sample import Generation, PromptLogprobs, SamplingConfig, stitch_routing


@dataclass
class Segments:
    """A completion sent in pieces: after each pause that aborted it, what is left of it goes out
    again from its tokens so far (prompt and tokens prefilled under the new weights). A token
    whose version is newer than its piece was sent at was produced over KV the older weights
    wrote (a keep pause): the completion is mixed from the first such token."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    mixed: tuple[int, int] | None = None  # (first mixed token, the version its KV is of)
    routing: Any = None
    pieces: int = 0

    def rest(self, sampling: SamplingConfig) -> SamplingConfig:
        """The sampling settings of the next piece: the tokens left, a seed of its own."""
        if not self.pieces:
            return sampling
        seed = None if sampling.seed is None else hash((sampling.seed, self.pieces)) & 0x7FFFFFFF
        return replace(sampling, max_tokens=sampling.max_tokens - len(self.ids), seed=seed)

    def restart(self, routing: Any) -> None:
        """The tokens so far are dropped (a completion that depends on its reply starts over)."""
        self.ids, self.logprobs, self.versions, self.top, self.mixed = [], [], [], [], None
        self.routing = routing
        self.pieces += 1

    def add(self, ids: list[int], logprobs: list[float], top: list[dict[int, float]], versions: list[int],
            sent_at: int, routing: Any = None) -> None:
        first = next((i for i, v in enumerate(versions) if v != sent_at), None)
        if self.mixed is None and first is not None:
            self.mixed = (len(self.ids) + first, sent_at)
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.top += top
        self.routing = stitch_routing(self.routing, routing)
        self.pieces += 1

    def generation(self, finish: str, top_logprobs: int) -> Generation:
        mixed_from, context_version = self.mixed if self.mixed is not None else (None, None)
        return Generation(self.ids, self.logprobs, finish, self.versions, self.top if top_logprobs else None,
                          self.routing, mixed_from, context_version)


def report_new(completion, seen: int, on_tokens: Callable[[list[int], list[float]], None]) -> int:
    """`on_tokens` with the tokens of `completion` past the first `seen`; how many it has now."""
    ids = list(completion.token_ids[seen:])
    if ids:
        on_tokens(ids, sampled_logprobs(completion.logprobs, len(ids), seen))
    return seen + len(ids)


def sampled_logprobs(flat: Any, n: int, start: int = 0) -> list[float]:
    """The sampled token's logprob at positions `start` .. `start + n - 1` of vLLM's
    `FlatLogprobs` (`flat_logprobs=True`): each position's entries begin with the sampled
    token (then the top ranks), so with no alternatives asked for the list is the answer."""
    if len(flat.logprobs) == len(flat.start_indices):  # one entry per position
        return list(flat.logprobs[start:start + n])
    return [flat.logprobs[i] for i in flat.start_indices[start:start + n]]


def top_alternatives(flat: Any, k: int) -> list[dict[int, float]]:
    """Per position, the ids ranked 1 .. `k` with their logprobs (the sampled token among them
    where its rank is within `k`), in the order vLLM lists them."""
    ids, logprobs, ranks = flat.token_ids, flat.logprobs, flat.ranks
    return [{ids[j]: logprobs[j] for j in range(a, b) if ranks[j] is not None and ranks[j] <= k}
            for a, b in zip(flat.start_indices, flat.end_indices)]


def reply(completion: Any, top_logprobs: int, version: int, sent_at: int) -> Reply:
    """A completion's ids, logprobs, `top_logprobs` alternatives per step, finish reason, each
    token's policy version (vLLM's weight-version spans, which the engine labels per step;
    `version` where it has none) and `sent_at`, the version the request was sent at."""
    ids = list(completion.token_ids)
    flat = completion.logprobs
    logprobs = sampled_logprobs(flat, len(ids)) if ids else []
    top = top_alternatives(flat, top_logprobs) if top_logprobs and ids else []
    return (ids, logprobs, top, completion.finish_reason or "abort",
            token_versions(completion.weight_versions, len(ids), version), sent_at)


def token_versions(spans: Any, n: int, version: int) -> list[int]:
    """Each of `n` output tokens' policy version from vLLM's `WeightVersionSpan`s (labels set by
    `AsyncLLM.update_weight_version`: rlexp's versions as text); `version` for tokens no span
    covers, or all of them where vLLM gave none."""
    out = [version] * n
    for span in spans or []:
        label, end = str(span.version), min(span.end, n)
        if label.lstrip("-").isdigit() and end > span.start:
            out[span.start:end] = [int(label)] * (end - span.start)
    return out


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
