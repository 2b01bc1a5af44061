"""A scripted RolloutEngine for unit tests of orchestration logic (never the only test of
a component: the real engines have their own tests)."""

from __future__ import annotations

from rlexp.sample import Generation, SamplingConfig


class ScriptedEngine:
    """Replies with the next scripted text (tokenized), logprob -0.5 per token; records
    every prompt it was given and every token list it returned."""

    def __init__(self, tokenizer, replies: list[str], max_model_len: int = 512):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.sampling = SamplingConfig(1.0, 1.0, 200, 0)
        self.max_model_len = max_model_len
        self.version = 0
        self.calls: list[tuple[list[int], list[int]]] = []

    async def generate(self, token_ids: list[int], sampling: SamplingConfig) -> Generation:
        text = self.replies.pop(0) if self.replies else "0"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        self.calls.append((list(token_ids), ids))
        return Generation(ids, [-0.5] * len(ids), finish, [self.version] * len(ids))
