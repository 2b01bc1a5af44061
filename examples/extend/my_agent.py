"""An agent of your own: `async rollout(sample)` and `async aclose()`, built with the run's
`engine`, `tokenizer` and `judge` (and `sampling` for evaluation). Subclassing `Agent` gives it
the Protocol's defaults of what an agent declares (`sends_images = False`)."""

from dataclasses import replace

from rlexp.agents.single_turn import request_seed
from rlexp.protocols import Agent
from rlexp.sample import Status, TokenTrace


class HintAgent(Agent):
    """One reply to the prompt with `hint` appended to the question. Tokens are the truth: the
    trace holds the prompt's ids and the engine's ids with their logprobs, never re-tokenized text."""

    def __init__(self, engine, tokenizer, judge, sampling=None, hint: str = ""):
        self.engine, self.tokenizer, self.judge = engine, tokenizer, judge
        self.sampling = sampling or engine.sampling
        self.hint = hint

    async def rollout(self, sample):
        *before, question = sample.prompt
        messages = [*before, {"role": "user", "content": question["content"] + self.hint}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        sampling = replace(self.sampling, seed=request_seed(self.sampling.seed, sample))  # reproducible
        gen = await self.engine.generate(prompt, sampling)
        sample.trace = TokenTrace()
        sample.trace.append(prompt, role="prompt", text=text)
        sample.trace.append(gen.token_ids, role="assistant", generation=gen)
        sample.response_text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        sample.finish_reason = gen.finish_reason
        if gen.finish_reason == "abort":  # cut short by a weight update: the scheduler re-rolls it
            sample.status = Status.ABORTED
            return sample
        sample = await self.judge.score(sample)
        sample.status = Status.COMPLETED
        return sample

    async def aclose(self):
        pass
