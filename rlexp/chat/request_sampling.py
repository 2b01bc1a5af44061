"""The sampling settings of one chat or completions request: the request's OpenAI fields over
the session's defaults (`request_sampling`), checked against the context and the vocabulary
(a 400, `SessionError`, where OpenAI and vLLM refuse them too, never a silent cap), and each of
its `n` choices' own seed (`choice_sampling`). The SessionStore (rlexp/chat/client.py) asks
here before every generation."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlexp.chat.schema import ChatRequest, CompletionRequest
from rlexp.errors import SessionError
from rlexp.sample import SamplingConfig


def request_sampling(request: ChatRequest | CompletionRequest, default: SamplingConfig, prompt_len: int,
                     max_context: int, tokenizer: Any) -> SamplingConfig:
    """The request's sampling settings over `default`; asking for more tokens than the
    context has room for is an error (OpenAI's and vLLM's answer), not a silent cap."""
    room = max_context - prompt_len
    asked = getattr(request, "max_completion_tokens", None) or request.max_tokens
    if asked is not None and asked > room:
        field = "max_tokens" if asked == request.max_tokens else "max_completion_tokens"
        raise SessionError(f"{field} is {asked}, but the prompt has {prompt_len} tokens and the context "
                           f"is {max_context}: at most {room} tokens can be generated", param=field)
    return SamplingConfig(
        temperature=default.temperature if request.temperature is None else request.temperature,
        top_p=default.top_p if request.top_p is None else request.top_p,
        max_tokens=min(asked or default.max_tokens, room),
        seed=request.seed if "seed" in request.model_fields_set else default.seed,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias, tokenizer))


def _logit_bias(bias: dict[str, float] | None, tokenizer: Any) -> dict[int, float] | None:
    if not bias:
        return None
    out = {int(k): v for k, v in bias.items()}
    if max(out) >= len(tokenizer):
        raise SessionError(f"logit_bias: token id {max(out)} is not in the vocabulary "
                           f"(size {len(tokenizer)})", param="logit_bias")
    return out


def choice_sampling(sampling: SamplingConfig, i: int) -> SamplingConfig:
    """Choice i's sampling: seed + i, wrapped into the signed 64-bit range (None stays None)."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + i + 2**63) % 2**64 - 2**63)
