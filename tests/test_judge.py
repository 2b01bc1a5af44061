import asyncio

import pytest

from rlexp.judges.math_exact import MathExactJudge, extract_answer
from rlexp.sample import Sample


@pytest.mark.parametrize("text, expected", [
    ("46", "46"),
    ("the sum is 1,234.", "1234"),
    ("3 then 4 #### 12", "12"),
    ("so \\boxed{-7} and 9", "-7"),
    ("5.0", "5"),
    ("no digits", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_judge_keeps_components():
    judge = MathExactJudge(correct_reward=1.0, format_reward=0.1)
    s = Sample(group_id=0, prompt=[], answer="42", response_text="it is 42")
    asyncio.run(judge.score(s))
    assert s.reward_components == {"correct": 1.0, "format": 1.0}
    assert s.reward == pytest.approx(1.1)
    s.response_text = "it is 41"
    asyncio.run(judge.score(s))
    assert s.reward_components["correct"] == 0.0 and s.reward == pytest.approx(0.1)
