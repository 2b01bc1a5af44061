"""An offline Hugging Face cache for tinker-cookbook's recipes (recipes/sl_loop.py, rl_loop.py),
with synthetic arithmetic data under the real dataset names and a locally built tokenizer:

    python scripts/tinker_hub_cache.py ROOT [--tokenizer DIR] [--model-id rlexp/tiny-chat]
                                       [--train-rows 256] [--test-rows 32] [--seed 0]
                                       [--format plain|rl_loop] [--ops +-*] [--max-operand 99]
                                       [--with-replacement]
    HF_HOME=ROOT HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
        .venv-tinker/bin/python -m tinker_cookbook.recipes.sl_loop base_url=... model_name=...

writes, under ROOT (as HF_HOME lays them out):
- hub/datasets--HuggingFaceH4--no_robots, hub/datasets--openai--gsm8k and
  hub/datasets--zwhe99--DeepMath-103K: hub-layout repos (refs/main, snapshots/<rev>/ with a
  README.md whose `configs` name the parquet files), as the real ones: no_robots config `default`
  (prompt, prompt_id, messages, category), gsm8k config `main` (question, answer ending
  `#### <number>`), splits train and test; DeepMath config `default` (question, final_answer,
  difficulty, topic, r1_solution_1..3), split train only (recipes/distillation's `deepmath`).
- datasets/HuggingFaceH4___no_robots, datasets/openai___gsm8k and datasets/zwhe99___deep_math-103_k:
  the same rows prepared as `load_dataset` caches them. Offline, `load_dataset` of these names
  reads only this cache (datasets never reads hub/ then).
- with --tokenizer: hub/models--<org>--<name>, a model repo of DIR's files (and, without a
  config.json there, the hub cache's record that it has none), which
  `AutoTokenizer.from_pretrained(model id)` (tinker_cookbook's `get_tokenizer`) loads offline.

Every row is made here (no download): "What is 12 + 7?", answered `\\boxed{19}` (no_robots) or
`12 + 7 = <<12+7=19>>19` then `#### 19` (gsm8k), final_answer `19` (DeepMath). The same arguments
give the same rows, and every dataset the same problems. --format rl_loop: each no_robots
conversation is the prompt that recipes/rl_loop.py builds (its strawberry exchange, then the
question with its suffix " Provide a numerical answer without units, written inside \\boxed{}.")
answered `\\boxed{19}`: sl_loop on it teaches exactly rl_loop's format
(scripts/tinker_cookbook_lab.py: SFT, then RL), and DeepMath's questions carry the same suffix.
--ops and --max-operand pick the problems (operands 0..max, products 0..12 at most); --with-replacement draws
rows independently (repeats, and test rows among the train rows), for more rows than distinct
problems.
Runs with the main venv's Python or .venv-tinker's (datasets and huggingface_hub).

The recipes pick their renderer with `model_info.get_recommended_renderer_name(model_name)`,
which raises for a model it does not list (rlexp/...): for rlexp.models.tiny's tokenizer (the
ChatML template of Qwen) --model-id Qwen/Qwen3-4B-Instruct-2507 gets renderer qwen3_instruct,
which renders exactly that template."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before datasets is imported: it reads the flag once

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
NO_ROBOTS, GSM8K, DEEPMATH = "HuggingFaceH4/no_robots", "openai/gsm8k", "zwhe99/DeepMath-103K"
NO_ROBOTS_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
---
Synthetic arithmetic conversations in HuggingFaceH4/no_robots's format (scripts/tinker_hub_cache.py).
"""
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
Synthetic arithmetic problems in openai/gsm8k's format (scripts/tinker_hub_cache.py).
"""
DEEPMATH_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
Synthetic arithmetic problems in zwhe99/DeepMath-103K's format (scripts/tinker_hub_cache.py).
"""


# recipes/rl_loop.py's prompt: its few-shot exchange before the question, and the question's suffix
RL_LOOP_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_LOOP_PREFIX = [
    {"content": "How many r's are in strawberry?" + RL_LOOP_SUFFIX, "role": "user"},
    {"content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e "
                "8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}", "role": "assistant"},
]


def problems(n: int, rng: random.Random, ops: str = "+-*", max_operand: int = 99,
             with_replacement: bool = False) -> list[tuple[str, int]]:
    """`n` ("a op b", value) pairs, distinct unless `with_replacement`, operands 0..max_operand
    (products: 0..12 at most)."""
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops {ops!r}: choose from {''.join(OPS)}")
    his = {op: min(12, max_operand) if op == "*" else max_operand for op in ops}
    if not with_replacement and n > sum((hi + 1) ** 2 for hi in his.values()):
        raise ValueError(f"{n} problems asked, too many distinct ones for these operands "
                         "(--with-replacement allows repeats)")
    out: dict[str, int] = {}
    rows: list[tuple[str, int]] = []
    while len(rows) < n:
        op = rng.choice(ops)
        a, b = rng.randint(0, his[op]), rng.randint(0, his[op])
        expr = f"{a} {op} {b}"
        if with_replacement or expr not in out:
            out[expr] = OPS[op](a, b)
            rows.append((expr, out[expr]))
    return rows


def no_robots_row(expr: str, value: int, fmt: str = "plain") -> dict:
    prompt = f"What is {expr}?" + (RL_LOOP_SUFFIX if fmt == "rl_loop" else "")
    return {"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(),
            "messages": [*(RL_LOOP_PREFIX if fmt == "rl_loop" else []), {"content": prompt, "role": "user"},
                         {"content": f"\\boxed{{{value}}}", "role": "assistant"}],
            "category": "Open QA"}


def gsm8k_row(expr: str, value: int) -> dict:
    return {"question": f"What is {expr}?",
            "answer": f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}\n#### {value}"}


def deepmath_row(expr: str, value: int, fmt: str = "plain") -> dict:
    solution = f"{expr} = {value}. \\boxed{{{value}}}"
    return {"question": f"What is {expr}?" + (RL_LOOP_SUFFIX if fmt == "rl_loop" else ""),
            "final_answer": str(value), "difficulty": 1.0, "topic": "Mathematics -> Algebra -> Prealgebra",
            "r1_solution_1": solution, "r1_solution_2": solution, "r1_solution_3": solution}


def write_dataset(stage: Path, card: str, folder: str, splits: dict[str, list[dict]]) -> None:
    """The repo's files in `stage`: README.md and FOLDER/<split>-00000-of-00001.parquet."""
    import datasets

    (stage / folder).mkdir(parents=True)
    (stage / "README.md").write_text(card)
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(stage / folder / f"{split}-00000-of-00001.parquet")


def prepare(stage: Path, repo_id: str, config: str, datasets_cache: Path) -> None:
    """`load_dataset`'s cache of the repo in `stage` (a folder named as the repo is), as if
    loaded from the hub: datasets_cache/<org>___<name>/<config>/0.0.0/<hash>/. Prepared from the
    local folder (a builder given repo_id wants hf:// files), then moved under the repo's name."""
    import datasets
    from datasets.naming import camelcase_to_snakecase  # how datasets names its cache folders

    local_cache = stage.parent / "prepared"
    datasets.load_dataset_builder(str(stage), config, cache_dir=str(local_cache)).download_and_prepare()
    org, name = repo_id.split("/")
    target = datasets_cache / f"{org}___{camelcase_to_snakecase(name)}"
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(local_cache / camelcase_to_snakecase(stage.name), target)


def add_repo(hub: Path, kind: str, repo_id: str, files: Path) -> str:
    """`files` (a folder) as the one revision of a hub-layout repo; returns that revision (the
    sha1 of the files' names and bytes, standing in for a commit)."""
    paths = sorted(p for p in files.rglob("*") if p.is_file())
    digest = hashlib.sha1()
    for p in paths:
        digest.update(p.relative_to(files).as_posix().encode() + b"\0" + p.read_bytes())
    rev = digest.hexdigest()
    repo = hub / f"{kind}s--{repo_id.replace('/', '--')}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(files, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    if kind == "model" and not (files / "config.json").is_file():
        # What the hub cache records for a file the repo lacks: AutoTokenizer (transformers 5)
        # reads a hub model's config.json first, and offline only such a record says "none".
        (repo / ".no_exist" / rev).mkdir(parents=True)
        (repo / ".no_exist" / rev / "config.json").touch()
    return rev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the cache root (HF_HOME)")
    ap.add_argument("--tokenizer", type=Path, help="a saved tokenizer (or model) directory")
    ap.add_argument("--model-id", default="rlexp/tiny-chat")
    ap.add_argument("--train-rows", type=int, default=256)
    ap.add_argument("--test-rows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["plain", "rl_loop"], default="plain",
                    help="no_robots conversations: the question alone, or rl_loop.py's prompt")
    ap.add_argument("--ops", default="+-*", help="operators of the problems")
    ap.add_argument("--max-operand", type=int, default=99)
    ap.add_argument("--with-replacement", action="store_true", help="rows may repeat problems")
    args = ap.parse_args()
    import datasets

    datasets.disable_progress_bars()
    if args.tokenizer and not (args.tokenizer / "tokenizer_config.json").is_file():
        sys.exit(f"tinker_hub_cache: {args.tokenizer} has no tokenizer_config.json")
    rows = problems(args.train_rows + args.test_rows, random.Random(args.seed), args.ops, args.max_operand,
                    args.with_replacement)
    split_rows = {"train": rows[args.test_rows:], "test": rows[:args.test_rows]}
    hub, datasets_cache = args.root / "hub", args.root / "datasets"
    hub.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for repo_id, config, card, folder, make_row in [
                (NO_ROBOTS, "default", NO_ROBOTS_CARD, "data",
                 lambda expr, value: no_robots_row(expr, value, args.format)),
                (GSM8K, "main", GSM8K_CARD, "main", gsm8k_row),
                (DEEPMATH, "default", DEEPMATH_CARD, "data",
                 lambda expr, value: deepmath_row(expr, value, args.format))]:
            stage = Path(tmp) / repo_id.split("/")[1]  # its name becomes the cache's dataset name
            splits = {split: [make_row(*p) for p in ps] for split, ps in split_rows.items()
                      if f"split: {split}" in card}  # DeepMath has a train split only
            write_dataset(stage, card, folder, splits)
            rev = add_repo(hub, "dataset", repo_id, stage)
            prepare(stage, repo_id, config, datasets_cache)
            print(f"tinker_hub_cache: {repo_id} ({config}) rev {rev[:12]}: "
                  + ", ".join(f"{len(rows)} {split}" for split, rows in splits.items()) + " rows")
    if args.tokenizer:
        rev = add_repo(hub, "model", args.model_id, args.tokenizer)
        print(f"tinker_hub_cache: {args.model_id} rev {rev[:12]} = {args.tokenizer}")
    print(f"tinker_hub_cache: use HF_HOME={args.root.resolve()} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")


if __name__ == "__main__":
    main()
