"""Where a reply ends: before its first `stop` string, or after its first tool call when the
request allows one (`parallel_tool_calls=false`), cut token-aligned so that the session keeps
exactly the tokens returned."""

from __future__ import annotations

import re

from rlexp.sample import Generation

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def reply_end(text: str, stops: list[str], one_call: bool) -> int | None:
    """Where the reply ends in `text` (None: it goes on): before its first stop string, or
    after its first complete tool call (`one_call`), whichever comes first."""
    ends = [text.index(s) for s in stops if s in text]
    if one_call and (m := TOOL_CALL.search(text)):
        ends.append(m.end())
    return min(ends, default=None)


def cut(gen: Generation, tokenizer, stops: list[str], one_call: bool, prompt_len: int
         ) -> tuple[Generation, str, bool]:
    """(the generation's tokens the reply keeps, the reply's text, whether it was cut).

    A reply ends before its first `stop` string (the text excludes it, as OpenAI's does) or,
    with `one_call` (parallel_tool_calls=false under tool_choice "auto"), right after its first
    complete `<tool_call>...</tool_call>` (cut only when more than whitespace follows it: a
    reply that ended there itself keeps its end token). The tokens kept are whole ones, up to
    and including the one that completed the stop string or the call's closing markup: what
    the policy generated, so the session records (and trains) exactly them with their
    logprobs and versions, and the next turn, which writes them back as generated, extends
    them. The rest of the generation is dropped: never returned, recorded or trained.

    Cut after generation rather than stopped in the engine: vLLM's stop strings need its
    detokenizer (rlexp's engines generate tokens only, `detokenize=False`), every engine
    would have to implement them alike, and a reply interrupted by a weight update and
    continued would have to match across the restart; cutting here is one rule for every
    engine, streamed or not. The cost is the tokens generated past the end."""
    ids = gen.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    end = reply_end(text, stops, one_call)
    if end is None or (not any(s in text for s in stops) and not text[end:].strip()):
        return gen, text, False

    def ends(k: int) -> bool:
        return reply_end(tokenizer.decode(ids[:k], skip_special_tokens=True), stops, one_call) is not None

    lo, hi = 1, len(ids)  # the fewest tokens whose text ends the reply (a prefix's text only grows)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ends(mid) else (mid + 1, hi)
    text = tokenizer.decode(ids[:hi], skip_special_tokens=True)
    text = text[:reply_end(text, stops, one_call)]
    routing = gen.routed_experts  # positions computed: the prompt's and the kept tokens', less the last
    kept = Generation(ids[:hi], gen.logprobs[:hi], "stop", gen.versions[:hi],
                      None if gen.top_logprobs is None else gen.top_logprobs[:hi],
                      None if routing is None else routing[:prompt_len + hi - 1])
    return kept, text, True
