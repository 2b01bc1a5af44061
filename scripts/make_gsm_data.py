"""GSM8K-format data generated locally by reasoning-gym's `gsm_symbolic` templates, in the three
formats rlexp reads, so data=jsonl, data=parquet and data=hf_disk can be tried on the same rows:

    python scripts/make_gsm_data.py [--out .cache/data/gsm_symbolic] [--train-size 2000]
                                    [--test-size 200] [--seed 0] [--keep-instruction]

writes OUT/{train,test}.jsonl, OUT/{train,test}.parquet and OUT/hf (a save_to_disk DatasetDict
with splits train/test). Rows have GSM8K's fields: `question`, and `answer` = the worked
solution, then a last line `#### <number>`.

- One stream of problems (seed --seed), deduplicated by question text: the first --test-size
  distinct questions are the test split, the next --train-size ones (not in test) the train
  split, so the splits share no question, and the test split does not depend on --train-size.
  (They share templates: gsm_symbolic has 21 usable ones, with different names and numbers.)
- reasoning-gym appends " Give the result as your final answer. Do not include units." to every
  question; GSM8K has no such line, so it is stripped (--keep-instruction keeps it). Say how to
  answer in data.source.system_prompt instead, as for GSM8K itself.
- The solution must end with `#### <answer>` where <answer> is reasoning-gym's answer (as a
  number: "8.0" is rewritten "8"); one that ends with another number is dropped and counted."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

INSTRUCTION = " Give the result as your final answer. Do not include units."
FINAL = re.compile(r"\n*####\s*(\S+)\s*$")


def gsm8k_row(item: dict, keep_instruction: bool) -> dict[str, str] | None:
    """`item` from reasoning-gym as GSM8K's {question, answer}; None if its solution does not end
    with its answer."""
    question, answer = item["question"], str(item["answer"]).strip()
    if not keep_instruction and question.endswith(INSTRUCTION):
        question = question[: -len(INSTRUCTION)]
    cot = item["metadata"]["answer_cot"].rstrip()
    m = FINAL.search(cot)
    if m:
        if not _same_number(m.group(1), answer):
            return None
        cot = cot[: m.start()].rstrip()
    if "####" in cot or not cot:
        return None
    return {"question": question.strip(), "answer": f"{cot}\n#### {answer}"}


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a.replace(",", "")) == float(b.replace(",", ""))
    except ValueError:
        return a == b


def generate(train_size: int, test_size: int, seed: int, keep_instruction: bool):
    """(train rows, test rows, counts of what was skipped)."""
    import reasoning_gym

    need, rows, seen = train_size + test_size, [], set()
    skipped = {"duplicate": 0, "solution does not end with the answer": 0}
    start, size = 0, int(need * 1.1) + 100
    while len(rows) < need:
        # Items depend on (seed, index) only, so a bigger dataset starts with the same items.
        dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
        for index in range(start, size):
            row = gsm8k_row(dataset[index], keep_instruction)
            if row is None:
                skipped["solution does not end with the answer"] += 1
            elif (key := " ".join(row["question"].lower().split())) in seen:
                skipped["duplicate"] += 1
            else:
                seen.add(key)
                rows.append(row)
                if len(rows) == need:
                    break
        start, size = size, size * 2
        if size > 100 * need + 10_000:
            sys.exit(f"make_gsm_data: only {len(rows)} distinct questions found, {need} asked for")
    return rows[test_size:], rows[:test_size], skipped


def write(out: Path, splits: dict[str, list[dict[str, str]]]) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        pq.write_table(pa.Table.from_pylist(rows), out / f"{name}.parquet")
    hf = out / "hf"
    if hf.exists():
        if not (hf / "dataset_dict.json").is_file():
            sys.exit(f"make_gsm_data: {hf} exists and is not a datasets directory; not overwriting it")
        shutil.rmtree(hf)
    datasets.disable_progress_bars()
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
                         ).save_to_disk(str(hf))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/gsm_symbolic"))
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-instruction", action="store_true",
                        help=f"keep reasoning-gym's {INSTRUCTION.strip()!r} at the end of each question")
    args = parser.parse_args(argv)
    if args.train_size < 1 or args.test_size < 1:
        parser.error("--train-size and --test-size must be >= 1")
    start = time.perf_counter()
    train, test, skipped = generate(args.train_size, args.test_size, args.seed, args.keep_instruction)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    write(args.out, {"train": train, "test": test})
    print(f"make_gsm_data: {len(train)} train + {len(test)} test rows in {args.out}/ "
          f"(train/test .jsonl, .parquet, hf/); skipped {skipped}; {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
