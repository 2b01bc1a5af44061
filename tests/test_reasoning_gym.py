"""data=reasoning_gym and judge=reasoning_gym: the source is deterministic, its eval split never
shares a question with training, weights hold, bad names fail in one line when the source is
built (preflight); the judge scores with each task's own score_answer; eval accuracy per task;
and one real-vLLM rollout scored as reasoning-gym scores it."""

import asyncio
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from reasoning_gym import get_score_answer_fn
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from rlexp.data.manager import DataManager
from rlexp.data.reasoning_gym import ReasoningGymSource
from rlexp.errors import ConfigError
from rlexp.evaluator import Evaluator
from rlexp.judges.reasoning_gym import ReasoningGymJudge
from rlexp.preflight import load_inputs
from rlexp.sample import Constraint, Sample, SamplingConfig, Status
from tests.test_config import _compose

ROOT = Path(__file__).resolve().parents[1]
SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 distinct questions
MIX = {"chain_sum": {"weight": 3, "config": SUMS},
       "letter_counting": {"config": {"max_words": 3, "min_words": 1}}}


def _digest(source: ReasoningGymSource) -> list:
    return [(split, p.messages, p.answer, json.dumps(p.metadata, sort_keys=True))
            for split in ("train", "eval") for p in source.problems(split)]


def _questions(source: ReasoningGymSource, split: str) -> list[str]:
    return [p.messages[-1]["content"] for p in source.problems(split)]


def test_the_same_seeds_make_the_same_problems():
    a = ReasoningGymSource(MIX, train_size=300, eval_size=50, seed=3)
    assert _digest(a) == _digest(ReasoningGymSource(MIX, train_size=300, eval_size=50, seed=3))
    assert _digest(a) != _digest(ReasoningGymSource(MIX, train_size=300, eval_size=50, seed=4))
    reseeded = dict(MIX, chain_sum=dict(MIX["chain_sum"], seed=99))  # one task's own seed
    b = ReasoningGymSource(reseeded, train_size=300, eval_size=50, seed=3)
    assert _questions(a, "eval") != _questions(b, "eval")


def test_problems_do_not_depend_on_the_hash_seed():
    """No str hashing in the generators or the mix draw: another process with another
    PYTHONHASHSEED makes the same problems."""
    code = ("import json, sys; from rlexp.data.reasoning_gym import ReasoningGymSource; "
            "s = ReasoningGymSource(json.loads(sys.argv[1]), train_size=300, eval_size=50, seed=3); "
            "print(json.dumps([(k, p.messages, p.answer, json.dumps(p.metadata, sort_keys=True)) "
            "for k in ('train', 'eval') for p in s.problems(k)]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(MIX)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="12345"))
    assert out.returncode == 0, out.stderr[-2000:]
    here = _digest(ReasoningGymSource(MIX, train_size=300, eval_size=50, seed=3))
    assert json.loads(out.stdout) == json.loads(json.dumps(here))


def test_no_eval_question_is_trained_on():
    # 200 possible sums, 120 eval entries: most training draws hit an eval question and are redrawn
    source = ReasoningGymSource({"chain_sum": {"config": SUMS}}, train_size=500, eval_size=120, seed=0)
    train, held_out = _questions(source, "train"), set(_questions(source, "eval"))
    assert len(train) == 500 and len(source.problems("eval")) == 120
    assert held_out.isdisjoint(train)
    assert len(set(train)) + len(held_out) <= 200


def test_too_few_distinct_questions_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"'count_bits'.*only 0 of \d+ have a question outside the eval"):
        ReasoningGymSource({"count_bits": {"config": {"max_n": 3}}}, train_size=10, eval_size=40)


def test_weights_hold_roughly():
    source = ReasoningGymSource(MIX, train_size=2000, eval_size=400, seed=0, system_prompt=None)
    for split, n, tolerance in (("train", 2000, 0.04), ("eval", 400, 0.08)):  # 4 standard deviations
        counts = source.counts(split)
        assert sum(counts.values()) == n
        assert abs(counts["chain_sum"] / n - 0.75) < tolerance, counts
    off = ReasoningGymSource(dict(MIX, letter_counting={"weight": 0}), train_size=50, eval_size=10)
    assert off.counts("train") == {"chain_sum": 50}


def test_problem_carries_its_task_entry_and_config():
    source = ReasoningGymSource("chain_sum", train_size=5, eval_size=5, system_prompt="direct")
    p = source.problems("train")[0]
    assert p.messages[0] == {"role": "system", "content": SYSTEM_PROMPTS["direct"]}
    assert p.messages[1]["content"] == p.metadata["entry"]["question"]
    assert p.answer == p.metadata["entry"]["answer"] and p.metadata["task"] == "chain_sum"
    assert p.metadata["config"] == {}
    json.dumps(p.metadata)
    own = ReasoningGymSource(["chain_sum"], train_size=5, eval_size=5, system_prompt="Be brief.")
    assert own.problems("eval")[0].messages[0]["content"] == "Be brief."
    bare = ReasoningGymSource({"chain_sum": None}, train_size=5, eval_size=5, system_prompt=None)
    assert [m["role"] for m in bare.problems("eval")[0].messages] == ["user"]
    # enum-typed config fields take their YAML strings
    aiw = ReasoningGymSource({"aiw": {"config": {"task_types": ["siblings"], "task_type_weights": [1.0]}}},
                             train_size=5, eval_size=5)
    assert all("sisters" in q for q in _questions(aiw, "train"))


@pytest.mark.parametrize("tasks, message", [
    ("chain_sun", "unknown reasoning-gym task 'chain_sun'; close tasks: chain_sum, decimal_chain_sum"),
    ({"chain_sum": {"config": {"max_digit": 2}}},
     "reasoning-gym task 'chain_sum': unknown config key 'max_digit'; close keys: max_digits, min_digits"),
    ({"chain_sum": {"config": {"min_terms": 3, "max_terms": 2}}},
     "reasoning-gym task 'chain_sum': bad config {'min_terms': 3, 'max_terms': 2}: "
     "max_terms must be >= min_terms"),
    ({"chain_sum": {"config": {"seed": 1}}}, "config key 'seed' is set by rlexp; use tasks.chain_sum.seed"),
    ({"chain_sum": {"wieght": 2}}, "task 'chain_sum': unknown key 'wieght'; close keys: weight"),
    ({"chain_sum": {"weight": -1}}, "weight must be a number >= 0"),
    ({"chain_sum": 0}, "every weight is 0"),
    ("composite", "unknown reasoning-gym task 'composite' (a mix is the tasks mapping itself)"),
])
def test_bad_tasks_are_one_line_errors(tasks, message):
    with pytest.raises(ValueError) as err:
        ReasoningGymSource(tasks, train_size=5, eval_size=5)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("+data.source.tasks.chain_sun.weight=1", "data.source: unknown reasoning-gym task 'chain_sun'; close "
                                               "tasks: chain_sum"),
    ("+data.source.tasks.aiw.config.max_entity=3",
     "data.source: reasoning-gym task 'aiw': unknown config key 'max_entity'; close keys: max_entities"),
])
def test_bad_tasks_fail_in_preflight_through_the_config(override, message):
    """load_inputs builds the source first (before the model and any engine)."""
    cfg = _compose(["data=reasoning_gym", override])
    with pytest.raises(ConfigError) as err:
        load_inputs(cfg)
    assert message in str(err.value)


def test_experiment_composes_and_builds_its_source():
    cfg = _compose(["experiment=reasoning_gym"])
    from hydra.utils import instantiate

    source = instantiate(cfg.data.source)
    assert set(source.counts("eval")) == {"aiw", "letter_counting", "count_bits"}
    assert cfg.model.task_eval_size == 200  # the default run's cached tiny model, whatever eval_size


# --- the judge --------------------------------------------------------------------------------

def _sample(problem, reply: str) -> Sample:
    return Sample(group_id=0, prompt=problem.messages, answer=problem.answer, response_text=reply,
                  metadata=dict(problem.metadata))


def _score(judge: ReasoningGymJudge, sample: Sample) -> Sample:
    return asyncio.run(judge.score(sample))


@pytest.fixture(scope="module")
def sums():
    return ReasoningGymSource({"chain_sum": {"config": SUMS}}, train_size=20, eval_size=20, seed=0)


def _with_answer(source, split="eval", length=1):
    return next(p for p in source.problems(split) if len(p.answer) == length and p.answer != "0")


def test_judge_correct_wrong_partial(sums):
    p = _with_answer(sums)
    own = get_score_answer_fn("chain_sum")
    judge = ReasoningGymJudge()
    right = _score(judge, _sample(p, f"<think>easy</think> <answer>{p.answer}</answer>"))
    assert right.reward == 1.0 and right.reward_components == {"score": 1.0, "correct": 1.0, "format": 1.0}
    assert right.metadata["predicted"] == p.answer and right.metadata["task"] == "chain_sum"
    wrong_answer = str(int(p.answer) + 1)
    wrong = _score(judge, _sample(p, f"<answer>{wrong_answer}</answer>"))
    assert wrong.reward == 0.0 and wrong.reward_components["correct"] == 0.0
    # chain_sum's own score gives partial credit where the answer is inside the reply
    partial_reply = f"<answer>1{p.answer}</answer>"
    partial = _score(judge, _sample(p, partial_reply))
    expected = own(f"1{p.answer}", p.metadata["entry"])
    assert 0 < expected < 1
    assert partial.reward == pytest.approx(expected) and partial.reward_components["score"] == expected
    assert partial.reward_components["correct"] == 0.0
    strict = _score(ReasoningGymJudge(partial_credit=False), _sample(p, partial_reply))
    assert strict.reward == 0.0 and strict.reward_components["score"] == expected
    scaled = _score(ReasoningGymJudge(correct_reward=2.0, format_reward=0.5), _sample(p, partial_reply))
    assert scaled.reward == pytest.approx(2.0 * expected + 0.5)


def test_judge_without_tags(sums):
    p = _with_answer(sums)
    tagged = _score(ReasoningGymJudge(), _sample(p, f" {p.answer} "))
    assert tagged.reward == 0.0 and tagged.metadata["predicted"] is None
    assert tagged.reward_components == {"score": 0.0, "correct": 0.0, "format": 0.0}
    loose = _score(ReasoningGymJudge(require_tag=False), _sample(p, f" {p.answer} "))
    assert loose.reward == 1.0 and loose.reward_components["format"] == 0.0
    # the tags still win where they are there, the last pair of them
    reply = f"<answer>x</answer><answer>{p.answer}</answer>"
    last = _score(ReasoningGymJudge(require_tag=False), _sample(p, reply))
    assert last.reward == 1.0


def test_judge_finds_the_task_from_the_entry_and_scores_with_the_config():
    # decimal_arithmetic's tolerance is one unit of its config's max_num_decimal_places: 0.1 here,
    # 0.001 with the default config, which is all reasoning-gym's get_score_answer_fn knows
    config = {"min_num_decimal_places": 1, "max_num_decimal_places": 1, "min_terms": 2, "max_terms": 2}
    source = ReasoningGymSource({"decimal_arithmetic": {"config": config}}, train_size=5, eval_size=5)
    p = source.problems("eval")[0]
    near = str(Decimal(p.answer) + Decimal("0.05"))
    assert get_score_answer_fn("decimal_arithmetic")(near, p.metadata["entry"]) == 0.0
    s = _sample(p, f"<answer>{near}</answer>")
    del s.metadata["task"]  # then the entry's source_dataset names it
    assert _score(ReasoningGymJudge(), s).reward_components["correct"] == 1.0
    assert s.metadata["task"] == "decimal_arithmetic"
    with pytest.raises(ValueError, match="no metadata\\['entry'\\]"):
        _score(ReasoningGymJudge(), Sample(group_id=0, prompt=[], answer="1", response_text="1"))


def test_eval_accuracy_per_task():
    source = ReasoningGymSource(MIX, train_size=10, eval_size=40, seed=0)
    data = DataManager(source, prompts_per_step=40, samples_per_prompt=1, seed=0, split="eval")
    judge = ReasoningGymJudge()
    batch = []
    for group in data.sample_groups(40):
        s = group[0]
        # right on every chain_sum, wrong on every letter_counting
        s.response_text = f"<answer>{s.answer if s.metadata['task'] == 'chain_sum' else 'none'}</answer>"
        s.status = Status.COMPLETED
        batch.append(_score(judge, s))
    metrics = Evaluator(every_n_steps=1, sampling=SamplingConfig()).metrics(batch)
    n = source.counts("eval")
    assert metrics["eval/accuracy/chain_sum"] == 1.0 and metrics["eval/accuracy/letter_counting"] == 0.0
    assert metrics["eval/accuracy"] == pytest.approx(n["chain_sum"] / 40)


# --- one real vLLM engine ---------------------------------------------------------------------

@pytest.mark.vllm
def test_vllm_rollouts_are_scored_as_reasoning_gym_scores_them(tiny_model_path, tokenizer):
    """SingleTurnAgent + the judge on a real engine: each trace turn is its decoded span, and
    the reward is reasoning-gym's own score_answer on the decoded completion. The reply is
    constrained to `<answer>N</answer>` (the tiny model never learned the tags), so that some
    replies are right and some wrong."""
    from rlexp.agents.single_turn import SingleTurnAgent
    from tests.conftest import vllm_on_thread

    source = ReasoningGymSource({"letter_counting": {"config": {"min_words": 1, "max_words": 2}},
                                 "count_bits": {"config": {"max_n": 63}}},
                                train_size=8, eval_size=8, seed=0, system_prompt="direct")
    samples = [s for g in DataManager(source, 8, 2, seed=0).sample_groups(8) for s in g]
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, seed=0,
                              constraint=Constraint("regex", r"<answer>[1-4]</answer>"))
    with vllm_on_thread(tiny_model_path, 600, seed=0, max_model_len=512, kv_cache_gb=0.25, max_num_seqs=16,
                        max_response_tokens=24) as (engine, run):
        agent = SingleTurnAgent(engine, tokenizer, ReasoningGymJudge(), sampling=sampling)

        async def go():
            return await asyncio.gather(*(agent.rollout(s) for s in samples))

        samples = run(go())
    assert all(s.status == Status.COMPLETED for s in samples)
    for s in samples:
        for turn in s.turns:
            start, end = turn["span"]
            assert turn["text"] == tokenizer.decode(s.tokens[start:end])
        start, end = s.turns[-1]["span"]
        completion = tokenizer.decode(s.tokens[start:end], skip_special_tokens=True)
        assert completion == s.response_text
        own = get_score_answer_fn(s.metadata["task"])(extract_answer(completion), s.metadata["entry"])
        assert s.reward == own and s.reward_components["correct"] == float(own == 1.0)
    assert {s.reward for s in samples} == {0.0, 1.0}, [(s.response_text, s.answer) for s in samples]
