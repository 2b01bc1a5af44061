"""MathVerifyJudge (judge=math): math-verify's equivalence, the rule that found the answer, the
guard's timeout cutting off a computation that holds the GIL, and no signal.alarm off the main thread."""

import asyncio
import signal
import threading

import pytest

from rlexp.errors import JudgeError
from rlexp.guards import JudgeGuard
from rlexp.judges.math_verify import RULES, MathVerifyJudge, judge_text
from rlexp.sample import Sample


@pytest.fixture(scope="module")
def judge():
    return MathVerifyJudge(correct_reward=1.0, format_reward=0.1, workers=1)


def _sample(response: str, answer: str) -> Sample:
    return Sample(group_id=0, prompt=[], answer=answer, response_text=response)


def _score(judge, response: str, answer: str) -> Sample:
    return asyncio.run(judge.score(_sample(response, answer)))  # a new loop each time: the worker is reused


@pytest.mark.parametrize("response, answer, rule, predicted", [
    ("0.5", "\\frac{1}{2}", "number", "0.5"),
    ("$\\boxed{\\frac{3}{4}}$", "0.75", "boxed", "\\frac{3}{4}"),
    ("The answer is 1,234.", "1234", "answer", "1234"),
    ("#### 72", "72", "gsm8k", "72"),
    ("18 dollars", "18", "number", "18"),
    ("It costs $1,234.56 in total", "1234.56", "number", "1234.56"),
    ("so we get 3/4 of the cake", "0.75", "expr", "3/4"),
    ("First $x = 3$, then $y = \\frac{1}{2}$", "\\frac{1}{2}", "latex", "y = \\frac{1}{2}"),
    ("3 + 4 = 7, 7 * 2 = 14\n#### 14\nso 99 is not it", "14", "gsm8k", "14"),
    ("The final answer is $\\boxed{5}$. I hope it is correct.", "5", "boxed", "5"),
    ("we get \\boxed{\\sqrt{8}}", "2\\sqrt{2}", "boxed", "\\sqrt{8}"),
])
def test_equivalent_forms_are_correct_and_the_rule_is_recorded(judge, response, answer, rule, predicted):
    s = _score(judge, response, answer)
    rules = {f"rule_{r}": float(r == rule) for r in RULES}
    assert s.reward_components == {"correct": 1.0, "format": 1.0} | rules
    assert s.reward == pytest.approx(1.1)
    assert s.metadata["judge_rule"] == rule and s.metadata["predicted"] == predicted


@pytest.mark.parametrize("response, answer, rule", [
    ("0.6", "\\frac{1}{2}", "number"),
    ("$\\boxed{\\frac{2}{3}}$", "0.75", "boxed"),
    ("The answer is 1,235.", "1234", "answer"),
    ("#### 71", "72", "gsm8k"),
    ("19 dollars", "18", "number"),
    ("First I got 18, but it is 20 in the end", "18", "number"),  # the last answer counts
    ("We find 12 apples.\n#### 7", "12", "gsm8k"),  # the answer after #### counts
    ("\\boxed{12} and later 14", "14", "boxed"),  # boxed before a plain number
])
def test_wrong_answers_are_not_correct(judge, response, answer, rule):
    s = _score(judge, response, answer)
    assert s.reward_components["correct"] == 0.0 and s.reward_components["format"] == 1.0
    assert s.reward_components[f"rule_{rule}"] == 1.0 and s.metadata["judge_rule"] == rule
    assert s.reward == pytest.approx(0.1)


@pytest.mark.parametrize("response", ["", "I do not know.", "####"])
def test_no_answer_gives_format_0(judge, response):
    s = _score(judge, response, "5")
    assert s.reward_components == {"correct": 0.0, "format": 0.0} | {f"rule_{r}": 0.0 for r in RULES}
    assert s.reward == 0.0
    assert s.metadata["judge_rule"] is None and s.metadata["predicted"] is None


def test_a_computation_holding_the_gil_is_cut_off_by_the_guard(judge):
    """9^(9^7) takes sympy seconds in C with the GIL held: in a thread it would freeze the loop,
    guard included. In the worker process the loop goes on, and the worker is killed."""
    _score(judge, "1", "1")  # a warm worker
    stuck = judge._idle[0].proc

    async def run():
        beats_while_computing = 0

        async def heartbeat():
            nonlocal beats_while_computing
            while True:
                await asyncio.sleep(0.02)
                beats_while_computing += stuck.poll() is None  # the worker not killed yet

        task = asyncio.create_task(heartbeat())
        with pytest.raises(JudgeError, match="timed out"):
            await JudgeGuard(judge, timeout_s=0.5).score(_sample("\\boxed{9^{9^{7}}}", "1"))
        task.cancel()
        return beats_while_computing

    # The loop kept running while the worker computed (a loop frozen by the computation could
    # beat at most once before the worker was killed).
    assert asyncio.run(run()) >= 2
    assert stuck.returncode == -signal.SIGKILL  # killed (and reaped), not left computing
    s = _score(judge, "#### 72", "72")  # a fresh worker takes over
    assert s.reward == pytest.approx(1.1) and judge._idle[0].proc is not stuck


def test_runs_in_asyncio_off_the_main_thread(judge):
    """math-verify's default timeouts use signal.alarm, which raises off the main thread: the
    judge (and math-verify as the worker calls it) must work in a thread's event loop."""
    results: dict[str, object] = {}

    def target():
        try:
            results["sample"] = asyncio.run(judge.score(_sample("$\\boxed{\\frac{3}{4}}$", "0.75")))
            results["direct"] = judge_text("The answer is \\frac{1}{2}", "0.5")  # math-verify in this thread
        except BaseException as e:
            results["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and "error" not in results, results.get("error")
    sample = results["sample"]
    assert isinstance(sample, Sample) and sample.reward_components["correct"] == 1.0
    assert results["direct"] == (True, "answer", "\\frac{1}{2}")
