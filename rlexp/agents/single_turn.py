"""SingleTurnAgent: one prompt in, one completion out, scored by the judge."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from rlexp.chat.images import ImagePrompts, images_of
from rlexp.chat.render import encode, render_prompt_text
from rlexp.protocols import Agent, Judge, RolloutEngine
from rlexp.sample import Generation, Sample, SamplingConfig, Status, TokenTrace


def request_seed(base: int | None, sample: Sample, turn: int = 0) -> int | None:
    """The engine seed for one sample's `turn`-th call: from the sampling seed and the
    sample's own seed (set by the DataManager), so rollouts reproduce whatever order
    requests finish in. A group's first calls get consecutive seeds (its samples' seeds are
    consecutive), so an engine can send the group as one request with n > 1 whose samples
    each get the tokens of their own request (rlexp/rollout/vllm_groups.py)."""
    if base is None:
        return None
    key = sample.metadata.get("seed", sample.uid)
    if turn:
        return hash((base, key, turn)) & 0x7FFFFFFF
    return (hash((base,)) & 0x3FFFFFFF) + key


class PromptCache:
    """Chat-templated prompts (text, token ids) by message content: the samples of a group
    share one prompt, so it is rendered once per group, not once per sample."""

    def __init__(self, tokenizer, max_entries: int = 8192):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._rendered: dict[tuple, tuple[str, list[int]]] = {}

    def __call__(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        key = tuple((m["role"], m["content"]) for m in messages)
        rendered = self._rendered.get(key)
        if rendered is None:
            if len(self._rendered) >= self.max_entries:
                self._rendered.clear()
            text = render_prompt_text(self.tokenizer, messages)
            rendered = self._rendered[key] = (text, encode(self.tokenizer, text))
        return rendered[0], list(rendered[1])


class SingleTurnAgent(Agent):
    sends_images = True  # a prompt's images reach the engine (config.py checks it for image data)
    rolls_out_groups = True  # a prompt group in one coroutine, its completions asked for together

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge,
                 sampling: SamplingConfig | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.judge = judge
        self.sampling = sampling or engine.sampling
        self.render = PromptCache(tokenizer)
        self.render_images = ImagePrompts(tokenizer)
        # what skip_special_tokens skips: a reply without any of them decodes once
        self._special = frozenset(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    async def rollout(self, sample: Sample) -> Sample:
        sampling = replace(self.sampling, seed=request_seed(self.sampling.seed, sample))
        if images_of(sample.prompt):  # a vision-language model's prompt
            text, prompt, sample.mm_infer_info, sample.mm_train_info = self.render_images(sample.prompt)
            gen = await self.engine.generate(prompt, sampling, sample.mm_infer_info["images"])
        else:
            text, prompt = self.render(sample.prompt)
            gen = await self.engine.generate(prompt, sampling)
        return await self._finish(sample, text, prompt, gen)

    async def rollout_group(self, samples: list[Sample]) -> list[Sample | list[Sample] | BaseException]:
        """The group's samples as `rollout` gives each, in this one coroutine: the prompt
        rendered once, every completion asked of the engine at once (`generate_group`: one
        request with n on vLLM), then each reply decoded and judged."""
        if any(s.prompt != samples[0].prompt or images_of(s.prompt) for s in samples):
            return await super().rollout_group(samples)
        text, prompt = self.render(samples[0].prompt)
        samplings = [replace(self.sampling, seed=request_seed(self.sampling.seed, s)) for s in samples]
        try:
            gens = await self.engine.generate_group(prompt, samplings)
        except Exception as e:  # each sample fails with it, as each request would have
            return [e] * len(samples)
        # judged concurrently: a judge may wait on a thread, a process or a server
        finished = (self._finish(s, text, prompt, gen) for s, gen in zip(samples, gens))
        return list(await asyncio.gather(*finished, return_exceptions=True))

    async def _finish(self, sample: Sample, text: str, prompt: list[int], gen: Generation) -> Sample:
        """The sample with its reply: decoded, traced, and judged unless it was aborted."""
        # a turn's text is what its span decodes to, special tokens included (as on every agent)
        turn_text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        has_special = not self._special.isdisjoint(gen.token_ids)
        sample.response_text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True) \
            if has_special else turn_text
        sample.trace = TokenTrace()
        sample.trace.append(prompt, role="prompt", text=text)
        sample.trace.append(gen.token_ids, role="assistant", generation=gen, text=turn_text)
        sample.finish_reason = gen.finish_reason
        if gen.finish_reason == "abort":
            sample.status = Status.ABORTED
            return sample
        sample = await self.judge.score(sample)
        sample.status = Status.COMPLETED
        return sample

    async def aclose(self) -> None:
        """Nothing held between rollouts."""
