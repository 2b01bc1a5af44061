"""How rlexp's SamplingConfig goes out to vLLM: as vLLM's SamplingParams (the sampling
settings, the structured output a constraint asks for, the tokens the engine must never
sample, and what comes back: token ids and the sampled tokens' logprobs as flat lists, no
text), and whether
a sample may go out with the other samples of its group as one request with n > 1."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rlexp.sample import SamplingConfig


def sampling_params(sampling: SamplingConfig, unsampled: Sequence[int] = (), n: int = 1):
    """vLLM's SamplingParams for `sampling`, `n` completions per request; `unsampled`: token
    ids masked out (a vision-language model's image placeholders, rlexp/models/vlm.py)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    c = sampling.constraint
    constraint = None if c is None else StructuredOutputsParams(
        regex=c.spec if c.kind == "regex" else None, json=c.spec if c.kind == "json_schema" else None,
        json_object=True if c.kind == "json_object" else None)
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        logit_bias=(sampling.logit_bias or {}) | dict.fromkeys(unsampled, float("-inf")) or None,
        logprobs=sampling.top_logprobs,  # 0: the sampled token's logprob only
        flat_logprobs=True,  # as flat lists (vllm.logprobs.FlatLogprobs), not a dict per token
        top_k=sampling.top_k,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos,
        detokenize=bool(sampling.stop),  # tokens are the source of truth; text only to find a stop
        structured_outputs=constraint,
        n=n,
    )


def groupable(sampling: SamplingConfig, unsampled: Sequence[int], routing_capture: bool) -> bool:
    """A request that can go out with the other samples of its group as one request with
    n > 1 (rlexp/rollout/vllm_groups.py): seeded, sampled from the model's distribution
    (no grammar, penalty or bias, no masked placeholders), nothing fetched per request
    (`routing_capture`: the experts each request's tokens were routed to)."""
    return (sampling.seed is not None and not routing_capture and not unsampled
            and not sampling.depends_on_the_reply and not sampling.logit_bias)


def one_request(samplings: list[SamplingConfig], unsampled: Sequence[int], routing_capture: bool) -> bool:
    """Samples that go out as one request with n (`groupable`, every setting but the seed the
    same, seeds that follow each other by one)."""
    first = samplings[0]
    return (groupable(first, unsampled, routing_capture)
            and all(s.seed == first.seed + i and replace(s, seed=first.seed) == first  # type: ignore[operator]
                    for i, s in enumerate(samplings)))
