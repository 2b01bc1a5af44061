"""A reward function of your own: a judge is a class with `async score(sample) -> sample`.
Subclassing `Judge` gives it the default of the Protocol's optional method (`bind`)."""

import re

from rlexp.protocols import Judge


class ShortAnswerJudge(Judge):
    """reward = [the reply's last number == the reference] - length_penalty * the reply's tokens."""

    def __init__(self, length_penalty: float = 0.001):
        self.length_penalty = length_penalty

    async def score(self, sample):
        numbers = re.findall(r"-?\d+", sample.response_text)
        correct = float(bool(numbers) and numbers[-1] == sample.answer.strip())
        sample.reward_components = {"correct": correct}  # eval/accuracy reads "correct"
        sample.reward = correct - self.length_penalty * sample.response_length
        return sample
