"""MultiTurnAgent: answer, get environment feedback, try again (up to `max_turns`). Whether
an answer was correct is its judge's call (`Sample.correct` of the conversation so far), so
the feedback follows the same rule as the reward.

It talks to the policy through the token-tracked, OpenAI-shaped client, so the training
sample holds exactly the tokens the engine saw and produced: prompts and feedback with
loss mask 0, the policy's replies with loss mask 1."""

from __future__ import annotations

from rlexp.agents.single_turn import request_seed
from rlexp.chat.client import SessionStore
from rlexp.chat.session import PrefixBreak
from rlexp.constraints import AtLeast1
from rlexp.protocols import Agent, Judge, RolloutEngine
from rlexp.sample import Sample, SamplingConfig


class MultiTurnAgent(Agent):
    sends_images = True  # a prompt's images reach the engine (config.py checks it for image data)

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, sampling: SamplingConfig | None = None,
                 max_turns: AtLeast1 = 3, feedback: str = "Incorrect, try again.",
                 on_prefix_break: PrefixBreak = "split", max_context: int | None = None):
        self.judge = judge
        self.sampling = sampling or engine.sampling
        self.max_turns = max_turns
        self.feedback = feedback
        self.store = SessionStore(engine, tokenizer, max_context or engine.max_model_len, on_prefix_break)

    async def rollout(self, sample: Sample) -> list[Sample]:
        messages = list(sample.prompt)
        async with self.store.record(self.sampling) as rec:
            for turn in range(self.max_turns):
                seed = request_seed(self.sampling.seed, sample, turn)
                reply = await rec.client.chat.completions.create(messages=messages, seed=seed)
                choice = reply.choices[0]
                messages.append({"role": "assistant", "content": choice.message.content})
                if turn == self.max_turns - 1 or choice.finish_reason == "length":
                    break
                if (await self.judge.score(rec.newest(sample))).correct:
                    break
                messages.append({"role": "user", "content": self.feedback})
        samples = rec.samples(sample)
        for s in samples:
            await self.judge.score(s)
        return samples

    async def aclose(self) -> None:
        """Nothing held between rollouts."""
