"""Parquet files and `datasets` save_to_disk directories give the same Problems as the same rows
in JSONL; bad files fail with one line naming the file (row, key) before any heavy import.
Rows with images: test_data_source_images.py."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from rlexp.data.file_sources import HFDiskSource, JsonlSource, ParquetSource
from tests.data_source_helpers import _jsonl, _parquet

ROOT = Path(__file__).resolve().parents[1]
PATTERN = r"####\s*(.+)$"
HEAVY = ("torch", "transformers", "vllm", "mlflow", "datasets")  # datasets: read with pyarrow instead


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        rows.append({"question": f"Q{seed}-{i}: Tom has {a} apples and buys {b}. How many now?",
                     "answer": f"{a}+{b}={a + b}\n#### {a + b}", "id": i})
    return rows


TRAIN, TEST = _rows(40, 1), _rows(12, 2)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """The same rows as JSONL, Parquet, a DatasetDict dir (train/test) and single Dataset dirs."""
    d = tmp_path_factory.mktemp("good")
    for name, rows in (("train", TRAIN), ("test", TEST)):
        _jsonl(d / f"{name}.jsonl", rows)
        _parquet(d / f"{name}.parquet", rows)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(str(d / "hf"))
    datasets.Dataset.from_list(TRAIN).save_to_disk(str(d / "hf_train"), num_shards=3)  # 3 arrow files
    datasets.Dataset.from_list(TEST).save_to_disk(str(d / "hf_test"))
    return d


def _same(a, b):
    for split in ("train", "eval"):
        assert [(p.messages, p.answer) for p in a.problems(split)] == \
               [(p.messages, p.answer) for p in b.problems(split)], split


def test_good_files_give_the_same_problems_as_jsonl(good):
    kw = dict(answer_pattern=PATTERN, system_prompt="Think, then end with '#### <answer>'.")
    jsonl = JsonlSource(str(good / "train.jsonl"), eval_path=str(good / "test.jsonl"), **kw)
    assert [p.answer for p in jsonl.problems("eval")][:2] == [TEST[0]["answer"].split()[-1],
                                                               TEST[1]["answer"].split()[-1]]
    _same(jsonl, ParquetSource(str(good / "train.parquet"), eval_path=str(good / "test.parquet"), **kw))
    _same(jsonl, HFDiskSource(str(good / "hf"), eval_split="test", **kw))
    _same(jsonl, HFDiskSource(str(good / "hf_train"), eval_path=str(good / "hf_test"), **kw))
    _same(jsonl, HFDiskSource(str(good / "hf"), eval_path=str(good / "hf"), eval_split="test", **kw))


@pytest.mark.parametrize("seed", [0, 7])
def test_held_out_split_is_the_same_as_jsonl(good, seed):
    kw = dict(answer_pattern=PATTERN, eval_size=9, seed=seed)
    jsonl = JsonlSource(str(good / "train.jsonl"), **kw)
    assert len(jsonl.problems("eval")) == 9 and len(jsonl.problems("train")) == 31
    _same(jsonl, ParquetSource(str(good / "train.parquet"), **kw))
    _same(jsonl, HFDiskSource(str(good / "hf"), **kw))
    _same(jsonl, HFDiskSource(str(good / "hf_train"), **kw))


def test_rows_are_named_by_file_and_index(good):
    src = ParquetSource(str(good / "train.parquet"), eval_path=str(good / "test.parquet"))
    assert src.problems("eval")[3].where == f"{good}/test.parquet: row 3"
    src2 = HFDiskSource(str(good / "hf"), eval_split="test")
    assert src2.problems("eval")[3].where == f"{good}/hf/test: row 3"


def test_numbers_and_other_keys_map_like_jsonl(tmp_path):
    rows = [{"q": f"{i}*7=", "a": i * 7, "x": 0.5} for i in range(10)]
    kw = dict(question_key="q", answer_key="a", answer_pattern=None, eval_size=3, seed=1)
    jsonl = JsonlSource(_jsonl(tmp_path / "n.jsonl", rows), **kw)
    assert jsonl.problems("train")[0].answer.isdigit()
    _same(jsonl, ParquetSource(_parquet(tmp_path / "n.parquet", rows), **kw))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    _same(jsonl, HFDiskSource(str(tmp_path / "hf"), **kw))


def test_pyarrow_reader_reads_what_load_from_disk_reads(good, tmp_path):
    """The save_to_disk layout read without `datasets`: same rows, same order, also for several
    shards and for a dataset saved after shuffle/select (an indices mapping)."""
    ds = datasets.Dataset.from_list(TRAIN).shuffle(seed=3).select(range(5, 30))
    ds.save_to_disk(str(tmp_path / "shuffled"), num_shards=2)
    for path in (good / "hf_train", tmp_path / "shuffled"):
        loaded = datasets.load_from_disk(str(path))
        src = HFDiskSource(str(path), eval_size=1, seed=0, answer_pattern=None)
        ours = sorted(src.problems("train") + src.problems("eval"), key=lambda p: int(p.where.split()[-1]))
        assert [p.messages[-1]["content"] for p in ours] == loaded["question"]
        assert [p.answer for p in ours] == loaded["answer"]


ARROW = "data-00000-of-00001.arrow"
# name -> (ParquetSource / HFDiskSource arguments, the error's text); {d}: the bad_dir fixture
BAD = {
    "parquet random bytes": ({"train_path": "{d}/random.parquet"},
                             "{d}/random.parquet: not a readable Parquet file (Parquet magic bytes"),
    "parquet truncated": ({"train_path": "{d}/truncated.parquet"},
                          "{d}/truncated.parquet: not a readable Parquet file"),
    "parquet empty file": ({"train_path": "{d}/empty.parquet"},
                           "{d}/empty.parquet: empty file (0 bytes), not a Parquet file"),
    "parquet zero rows": ({"train_path": "{d}/zero_rows.parquet"}, "{d}/zero_rows.parquet: no rows"),
    "parquet missing column": ({"train_path": "{d}/no_answer.parquet"},
                               "{d}/no_answer.parquet: missing column 'answer' (has ['question', "
                               "'solution']); see data.source.answer_key"),
    "parquet null value": ({"train_path": "{d}/null.parquet"},
                           "{d}/null.parquet: row 2: key 'question' must be a string or number, got null"),
    "parquet list value": ({"train_path": "{d}/list.parquet", "answer_pattern": None},
                           "{d}/list.parquet: row 0: key 'answer' must be a string or number, got list"),
    "parquet answer pattern": ({"train_path": "{d}/no_marker.parquet"},
                               "{d}/no_marker.parquet: row 1: answer '42' does not match answer_pattern"),
    "parquet not found": ({"train_path": "{d}/nope.parquet"}, "{d}/nope.parquet: data file not found"),
    "parquet remote": ({"train_path": "s3://bucket/train.parquet"},
                       "s3://bucket/train.parquet: not a local path"),
    "parquet is a dir": ({"train_path": "{d}/hf"}, "{d}/hf: a directory, not a data file"),
    "hf wrong split": ({"train_path": "{d}/hf", "eval_split": "validation"},
                       "{d}/hf: no split 'validation' (has ['train', 'test']); set data.source.eval_split"),
    "hf wrong train split": ({"train_path": "{d}/hf", "train_split": "training"},
                             "{d}/hf: no split 'training' (has ['train', 'test']); "
                             "set data.source.train_split"),
    "hf dict needs a split": ({"train_path": "{d}/hf_single", "eval_path": "{d}/hf"},
                              "{d}/hf: a DatasetDict (splits ['train', 'test']): set data.source.eval_split"),
    "hf eval split of a Dataset": ({"train_path": "{d}/hf_single", "eval_split": "test"},
                                   "{d}/hf_single: a single Dataset, not a DatasetDict"),
    "hf not a datasets dir": ({"train_path": "{d}/not_hf"},
                              "{d}/not_hf: not a datasets save_to_disk directory (no dataset_dict.json or "
                              "state.json; has ['train.csv'])"),
    "hf a file": ({"train_path": "{d}/full.parquet"},
                  "{d}/full.parquet: a file, not a datasets save_to_disk directory"),
    "hf hub name": ({"train_path": "openai/gsm8k"}, "openai/gsm8k: datasets directory not found"),
    "hf corrupt arrow": ({"train_path": "{d}/hf_corrupt"},
                         "{d}/hf_corrupt/" + ARROW + ": not a readable Arrow file"),
    "hf missing column": ({"train_path": "{d}/hf", "question_key": "problem"},
                          "{d}/hf/train/" + ARROW + ": missing column 'problem' (has ['answer', 'id', "
                          "'question']); see data.source.question_key"),
    "hf split dir missing": ({"train_path": "{d}/hf_no_train"},
                             "{d}/hf_no_train/train: split 'train' listed in dataset_dict.json but missing"),
    "hf zero rows": ({"train_path": "{d}/hf_empty"}, "{d}/hf_empty: no rows"),
    "hf bool value": ({"train_path": "{d}/hf_bool", "answer_pattern": None},
                      "{d}/hf_bool: row 0: key 'answer' must be a string or number, got bool"),
}


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    good = _rows(5, 0)
    (d / "random.parquet").write_bytes(random.Random(0).randbytes(3000))
    _parquet(d / "full.parquet", good * 20)
    (d / "truncated.parquet").write_bytes((d / "full.parquet").read_bytes()[:-100])
    (d / "empty.parquet").write_bytes(b"")
    _parquet(d / "zero_rows.parquet", pa.Table.from_pylist(good).slice(0, 0))
    _parquet(d / "no_answer.parquet", [{"question": r["question"], "solution": r["answer"]} for r in good])
    _parquet(d / "null.parquet", good[:2] + [{"question": None, "answer": "#### 1", "id": 2}])
    _parquet(d / "list.parquet", [{"question": "q", "answer": [1, 2]}])
    _parquet(d / "no_marker.parquet", good[:1] + [{"question": "q", "answer": "42"}])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(good),
                          "test": datasets.Dataset.from_list(good)}).save_to_disk(str(d / "hf"))
    datasets.Dataset.from_list(good).save_to_disk(str(d / "hf_single"))
    datasets.Dataset.from_list([{"question": "q", "answer": True}]).save_to_disk(str(d / "hf_bool"))
    datasets.Dataset.from_list(good).select([]).save_to_disk(str(d / "hf_empty"))
    (d / "hf_no_train").mkdir()
    (d / "hf_no_train" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (d / "not_hf").mkdir()
    (d / "not_hf" / "train.csv").write_text("question,answer\n")
    datasets.Dataset.from_list(good).save_to_disk(str(d / "hf_corrupt"))
    (d / "hf_corrupt" / ARROW).write_bytes(b"not arrow at all")
    return d


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_file_and_the_problem(bad_dir, name):
    kwargs, message = BAD[name]
    kwargs = {"answer_pattern": PATTERN, "eval_size": 1,
              **{k: v.format(d=bad_dir) if isinstance(v, str) else v for k, v in kwargs.items()}}
    cls = ParquetSource if name.startswith("parquet") else HFDiskSource
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        cls(**kwargs)
    assert message.format(d=bad_dir) in str(err.value)
    assert "\n" not in str(err.value)


def _run(*overrides, cwd: Path):
    """`python -m rlexp.run`, with -X importtime: stderr lists every module the run imported."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "rlexp.run", *overrides,
                           f"hydra.run.dir={cwd}/run"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


@pytest.mark.parametrize("overrides, message", [
    (["data=parquet", "data.source.train_path={d}/random.parquet"],
     "rlexp: config error: data.source: {d}/random.parquet: not a readable Parquet file (Parquet magic bytes "
     "not found in footer."),
    (["data=hf_disk", "data.source.train_path={d}/hf", "data.source.eval_split=validation"],
     "rlexp: config error: data.source: {d}/hf: no split 'validation' (has ['train', 'test'])"),
])
def test_run_fails_in_preflight_with_one_line(bad_dir, overrides, message, tmp_path):
    """As test_preflight does for JSONL, but through `python -m rlexp.run` itself: exit 2, one
    line on stderr, and none of torch, transformers, vLLM, MLflow or datasets imported."""
    res = _run(*(o.format(d=bad_dir) for o in overrides), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    imported = {line.split("|")[-1].strip().split(".")[0]
                for line in lines if line.startswith("import time:")}
    others = [line for line in lines if not line.startswith("import time:")]
    assert len(others) == 1 and others[0].startswith(message.format(d=bad_dir)), others
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_make_gsm_data_writes_the_same_disjoint_rows_in_three_formats(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_gsm_data
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    make_gsm_data.main(["--out", str(tmp_path), "--train-size", "60", "--test-size", "20", "--seed", "3"])
    rows = {s: [json.loads(line) for line in (tmp_path / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "test")}
    assert (len(rows["train"]), len(rows["test"])) == (60, 20)
    assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
    for r in rows["train"] + rows["test"]:
        assert set(r) == {"question", "answer"} and "Do not include units" not in r["question"]
        body, final = r["answer"].rsplit("\n", 1)
        assert body.strip() and "####" not in body and final.startswith("#### ")
        float(final[5:])
    d, kw = str(tmp_path), dict(answer_pattern=PATTERN)
    jsonl = JsonlSource(f"{d}/train.jsonl", eval_path=f"{d}/test.jsonl", **kw)
    _same(jsonl, ParquetSource(f"{d}/train.parquet", eval_path=f"{d}/test.parquet", **kw))
    _same(jsonl, HFDiskSource(f"{d}/hf", eval_split="test", **kw))
    # the test split does not depend on --train-size
    make_gsm_data.main(["--out", f"{d}/b", "--train-size", "10", "--test-size", "20", "--seed", "3"])
    assert (tmp_path / "b" / "test.jsonl").read_text() == (tmp_path / "test.jsonl").read_text()
