import json

import pytest

from rlexp.data import arithmetic
from rlexp.data.file_sources import JsonlSource
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource, Problem


def test_arithmetic_split_is_deterministic_disjoint_and_correct():
    train, held_out = arithmetic.split(29, "+", 200, seed=3)
    assert (train, held_out) == arithmetic.split(29, "+", 200, seed=3)
    assert held_out != arithmetic.split(29, "+", 200, seed=4)[1]
    assert len(held_out) == 200 and len(train) == 30 * 30 - 200
    assert not {q for q, _ in train} & {q for q, _ in held_out}
    for q, a in held_out[:20]:
        x, y = q.rstrip("=").split("+")
        assert int(x) + int(y) == int(a)


def test_arithmetic_rejects_bad_difficulty():
    with pytest.raises(ValueError, match="unknown op"):
        arithmetic.split(9, "+/", 10, 0)
    with pytest.raises(ValueError, match="leaves no training problems"):
        arithmetic.split(3, "+", 16, 0)


def _write(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_gsm8k_style_mapping(tmp_path):
    train = _write(tmp_path / "train.jsonl", [
        {"q": "Tom has 3 apples and buys 4.", "a": "3+4=7\n#### 7"},
        {"q": "What is 6*7?", "a": "#### 42"},
    ])
    src = JsonlSource(train, eval_path=train, question_key="q", answer_key="a",
                      answer_pattern=r"####\s*(.+)$", system_prompt="Be brief.")
    probs = src.problems("train")
    assert [p.answer for p in probs] == ["7", "42"]
    assert probs[1].messages == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 6*7?"}]


@pytest.mark.parametrize("line, message", [
    ("{not json\n", "not valid JSON"),
    ('["a list"]\n', "expected a JSON object"),
    ('{"question": "x"}\n', "missing key 'answer'"),
    ('{"question": "x", "answer": "no marker"}\n', "does not match answer_pattern"),
    ('{"question": null, "answer": "#### 1"}\n', "must be a string or number"),
])
def test_jsonl_malformed_row_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "ok", "answer": "#### 1"}\n\n' + line)
    with pytest.raises(ValueError, match=message) as err:
        JsonlSource(str(path), eval_path=str(path), answer_pattern=r"####\s*(.+)$")
    assert f"{path}:3:" in str(err.value)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlSource(str(tmp_path / "nope.jsonl"))


def test_data_manager_groups_and_epochs():
    src = ArithmeticSource(max_operand=4, ops="+", eval_size=5, seed=0)
    dm = DataManager(src, prompts_per_step=4, samples_per_prompt=3, seed=0)
    seen = []
    for _ in range(5):  # 20 prompts = one full epoch of the 20 training problems
        groups = dm.sample_groups(4)
        assert all(len(g) == 3 and len({s.prompt[-1]["content"] for s in g}) == 1 for g in groups)
        assert all(len({s.group_id for s in g}) == 1 for g in groups)
        seen += [g[0].prompt[-1]["content"] for g in groups]
    assert sorted(seen) == sorted(p.messages[-1]["content"] for p in src.problems("train"))
    assert [g[0].group_id for g in dm.sample_groups(2)] == [20, 21]  # ids go on across epochs


class _Tagged:
    def problems(self, split):
        return [Problem([{"role": "user", "content": f"q{i}"}], str(i), metadata={"task": f"t{i}"})
                for i in range(3)]


def test_a_problems_metadata_reaches_each_of_its_samples_as_a_copy():
    groups = DataManager(_Tagged(), prompts_per_step=3, samples_per_prompt=2, seed=0,
                         split="eval").sample_groups(3)
    assert [[s.metadata["task"] for s in g] for g in groups] == [["t0", "t0"], ["t1", "t1"], ["t2", "t2"]]
    groups[0][0].metadata["task"] = "changed"  # one sample's metadata is its own
    assert groups[0][1].metadata["task"] == "t0" and "seed" in groups[0][1].metadata


def test_eval_split_keeps_order():
    src = ArithmeticSource(max_operand=9, ops="+", eval_size=10, seed=0)
    dm = DataManager(src, prompts_per_step=10, samples_per_prompt=1, seed=0, split="eval")
    got = [g[0].answer for g in dm.sample_groups(10)]
    assert got == [p.answer for p in src.problems("eval")]


def test_the_shapes_task_draws_as_many_shapes_as_its_answer_and_holds_out_its_eval_split():
    from rlexp.data.shapes import ShapesSource

    source = ShapesSource(max_shapes=4, image_size=64, train_size=300, eval_size=50, seed=3)
    train, held = source.problems("train"), source.problems("eval")
    assert len(train) == 300 and len(held) == 50
    assert {p.answer for p in train} == {"1", "2", "3", "4"}
    for problem in train[:60] + held[:20]:
        image = problem.messages[0]["content"][0]["image"]
        quarters = [image.crop((x, y, x + 32, y + 32)) for y in (0, 32) for x in (0, 32)]
        drawn = sum(q.convert("L").getextrema()[0] < 250 for q in quarters)  # a quarter with ink
        assert str(drawn) == problem.answer, problem.where
    again = ShapesSource(max_shapes=4, image_size=64, train_size=300, eval_size=50, seed=3)
    assert list(again.problems("eval")[0].messages[0]["content"][0]["image"].getdata()) == \
        list(held[0].messages[0]["content"][0]["image"].getdata())
    with pytest.raises(ValueError, match="max_shapes=5"):
        ShapesSource(max_shapes=5)
