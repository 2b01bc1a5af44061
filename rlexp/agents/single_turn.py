"""SingleTurnAgent: one prompt in, one completion out, scored by the judge."""

from __future__ import annotations

from dataclasses import replace

from rlexp.protocols import Judge, RolloutEngine
from rlexp.sample import Sample, SamplingConfig, Status, TokenTrace


def encode(tokenizer, text: str) -> list[int]:
    """Text to token ids, adding no special tokens (a chat template writes them as text, so
    none is added twice). A fast tokenizer encodes one text directly: its batch path
    (`tokenizer.encode`) wakes a thread pool per call, which cost ~0.9 ms a prompt while
    vLLM held the other core (~0.05 ms alone)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def render_prompt(tokenizer, messages) -> list[int]:
    """Chat-template the prompt messages into token ids."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode(tokenizer, text)


def request_seed(base: int | None, sample: Sample, turn: int = 0) -> int | None:
    """The engine seed for one sample's `turn`-th call: from the sampling seed and the
    sample's own seed (set by the DataManager), so rollouts reproduce whatever order
    requests finish in."""
    if base is None:
        return None
    key = (base, sample.metadata.get("seed", sample.uid)) + ((turn,) if turn else ())
    return hash(key) & 0x7FFFFFFF


class PromptCache:
    """Chat-templated prompt ids by message content: the samples of a group share one
    prompt, so it is rendered once per group, not once per sample."""

    def __init__(self, tokenizer, max_entries: int = 8192):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._ids: dict[tuple, list[int]] = {}

    def __call__(self, messages: list[dict[str, str]]) -> list[int]:
        key = tuple((m["role"], m["content"]) for m in messages)
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= self.max_entries:
                self._ids.clear()
            ids = self._ids[key] = render_prompt(self.tokenizer, messages)
        return list(ids)


class SingleTurnAgent:
    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge,
                 sampling: SamplingConfig | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.judge = judge
        self.sampling = sampling or engine.sampling
        self.render = PromptCache(tokenizer)

    async def rollout(self, sample: Sample) -> Sample:
        prompt = self.render(sample.prompt)
        sampling = replace(self.sampling, seed=request_seed(self.sampling.seed, sample))
        gen = await self.engine.generate(prompt, sampling)
        sample.response_text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        sample.trace = TokenTrace()
        sample.trace.append(prompt, role="prompt")
        sample.trace.append(gen.token_ids, role="assistant", text=sample.response_text, generation=gen)
        sample.finish_reason = gen.finish_reason
        if gen.finish_reason == "abort":
            sample.status = Status.ABORTED
            return sample
        sample = await self.judge.score(sample)
        sample.status = Status.COMPLETED
        return sample

    async def aclose(self) -> None:
        """Nothing held between rollouts."""
