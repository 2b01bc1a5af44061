"""Where prompts come from: the built-in arithmetic task, the user's files (JSONL, Parquet, or a
Hugging Face `datasets` directory written by `save_to_disk`: rlexp/data/file_sources.py), or a
dataset on the Hugging Face hub named by its id (`HubSource`).

A source returns `Problem`s for a split ("train" or "eval"). The file sources read every row
when built (in preflight, before any heavy import) and fail with one line naming the file,
the row and the key; pyarrow is imported only by the sources that need it, PIL only by those
with an `image_key` (rows with images: rlexp/data/images.py). Only `HubSource` downloads, and
only a hub id (through the hub cache, as `model.path` does: rlexp/data/hub.py); the file
sources' paths must be local."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlexp.data import arithmetic
from rlexp.data.hub import resolve
from rlexp.data.images import load_images

# The reference answer after GSM8K's "####" (the file and hub sources' default `answer_pattern`)
GSM8K_ANSWER = r"####\s*(.+)$"


@dataclass(frozen=True)
class Problem:
    messages: list[dict[str, Any]]  # content: a string, or parts (text, image) for a vision-language model
    answer: str
    where: str = ""  # file:line (JSONL) or file: row i (Parquet, datasets), for error messages
    # what a judge or agent needs beyond the answer (a task's name and entry, an environment's
    # task index); copied into each of its samples' `metadata`, JSON-serialisable
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptSource(Protocol):
    commit: str | None = None  # the hub commit the data were read at (HubSource), logged with the run

    def problems(self, split: str) -> list[Problem]:
        """The prompts of a split ("train" or "eval"), in a fixed order."""
        ...


def _messages(question: str, system_prompt: str | None, images: list | None = None) -> list[dict[str, Any]]:
    """The system prompt (if any) and the user's question; with `images` (a list, even empty),
    the question's content is parts: the images first, then the text."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    content: Any = question
    if images is not None:
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": question}]
    return system + [{"role": "user", "content": content}]


class ArithmeticSource(PromptSource):
    """`a<op>b=` with operands in 0..max_operand; `eval_size` problems held out by `seed`."""

    def __init__(self, max_operand: int, ops: str, eval_size: int, seed: int,
                 system_prompt: str | None = None):
        self.train_pairs, self.eval_pairs = arithmetic.split(max_operand, ops, eval_size, seed)
        self.system_prompt = system_prompt

    def problems(self, split: str) -> list[Problem]:
        pairs = self.train_pairs if split == "train" else self.eval_pairs
        return [Problem(_messages(q, self.system_prompt), a) for q, a in pairs]


class _RowSource(PromptSource):
    """What the file sources share (the one owner of it): a row, a mapping of field names
    to values, becomes a Problem by `question_key` / `answer_key` (a string or a number);
    if `answer_pattern` is set, the reference answer is its first group in the answer field
    (GSM8K's, the default: `GSM8K_ANSWER`; None: the whole field). With `image_key` set,
    that field names the row's images (rlexp/data/images.py: one or a list, paths relative to
    `base`, bytes, or `datasets` Image dicts) and the question becomes image parts then a text
    part, for a vision-language model.
    The eval split is the eval rows, or else `eval_size` train rows held out by `seed`.
    Subclasses read their format and call `_map` and `_split`."""

    splits: dict[str, list[Problem]]

    def _fields(self, question_key: str, answer_key: str, answer_pattern: str | None,
                system_prompt: str | None, image_key: str | None) -> None:
        self.question_key, self.answer_key, self.image_key = question_key, answer_key, image_key
        self.pattern = re.compile(answer_pattern, re.M) if answer_pattern else None
        self.system_prompt = system_prompt

    def problems(self, split: str) -> list[Problem]:
        return self.splits[split]

    def _split(self, train: list[Problem], eval_rows: list[Problem] | None, eval_size: int, seed: int,
               name: str) -> None:
        if eval_rows is not None:
            self.splits = {"train": train, "eval": eval_rows}
            return
        if eval_size >= len(train):
            raise ValueError(f"{name}: eval_size={eval_size} leaves no training rows (it has {len(train)})")
        train = list(train)
        random.Random(seed).shuffle(train)
        self.splits = {"train": train[eval_size:], "eval": train[:eval_size]}

    def _columns(self) -> list[str]:
        """The fields a row needs, each once."""
        return list(dict.fromkeys(k for k in (self.question_key, self.answer_key, self.image_key) if k))

    def _require(self, names: Iterable[str], where: str, what: str = "key") -> None:
        """`where` (a row, or a table whose columns are `names`) has every field it needs."""
        present = set(names)
        options = (("question_key", self.question_key), ("answer_key", self.answer_key),
                   ("image_key", self.image_key))
        for option, key in options:
            if key and key not in present:
                raise ValueError(f"{where}: missing {what} {key!r} (has {sorted(present)}); "
                                 f"see data.source.{option}")

    def _map(self, rows: Iterable[Mapping[str, Any]], where: Callable[[int], str],
             name: str, base: Path) -> list[Problem]:
        """`base`: the directory relative image paths are in."""
        problems = [self._problem(row, where(i), base) for i, row in enumerate(rows)]
        if not problems:
            raise ValueError(f"{name}: no rows")
        return problems

    def _problem(self, row: Mapping[str, Any], where: str, base: Path) -> Problem:
        self._require(row, where)
        values = []
        for key in (self.question_key, self.answer_key):
            value = row[key]
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(f"{where}: key {key!r} must be a string or number, got {_kind(value)}")
            values.append(str(value))
        question, answer = values
        if self.pattern:
            m = self.pattern.search(answer)
            if not m:
                raise ValueError(f"{where}: answer {answer[-40:]!r} does not match "
                                 f"answer_pattern {self.pattern.pattern!r}")
            answer = m.group(1).strip()
        images = None
        if self.image_key:
            images = load_images(row[self.image_key], base, f"{where}: key {self.image_key!r}")
        return Problem(_messages(question, self.system_prompt, images), answer, where)


class HubSource(_RowSource):
    """A dataset on the Hugging Face hub by its id (`name`: `org/name`, at `revision`, a branch,
    tag or commit; None: main), or a local directory of data files (a local directory wins over
    an id). An id is resolved to its snapshot in the hub cache exactly as `model.path` is
    (rlexp/data/hub.py: HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, tokens), its commit kept in
    `commit`; the directory is then read by `datasets.load_dataset(dir, config)`, which picks
    the format (JSON lines, Parquet, CSV, ...) and the splits from the files or the dataset
    card, and `train_split` (and `eval_split`, if set) are used. Without `eval_split`,
    `eval_size` train rows are held out by `seed`. Rows are named `name split: row i` (from 0,
    as `load_dataset(dir, config, split=split)[i]`). Fields as JsonlSource (`_RowSource`);
    images (`image_key`) as ParquetSource, paths relative to the directory.

    `import datasets` takes 1-2 s: it happens after the hub id is resolved, so an id missing
    from the cache offline fails first, in a fraction of a second."""

    def __init__(self, name: str, config: str | None = None, train_split: str = "train",
                 eval_split: str | None = None, revision: str | None = None,
                 question_key: str = "question", answer_key: str = "answer",
                 answer_pattern: str | None = GSM8K_ANSWER, eval_size: int = 200, seed: int = 0,
                 system_prompt: str | None = None, image_key: str | None = None):
        self._fields(question_key, answer_key, answer_pattern, system_prompt, image_key)
        snapshot = resolve(name, revision, "dataset", "name", "revision")
        self.name, self.path, self.commit = name, Path(snapshot.path), snapshot.commit
        if not self.path.is_dir():
            raise FileNotFoundError(f"{name}: no such directory, and not a hub dataset id (org/name)")
        splits = self._load(config)
        train = self._split_rows(splits, train_split, "train_split")
        eval_rows = self._split_rows(splits, eval_split, "eval_split") if eval_split else None
        self._split(train, eval_rows, eval_size, seed, name)

    def _load(self, config: str | None) -> Mapping[str, Any]:
        """The directory's splits, by `datasets.load_dataset` (a DatasetDict)."""
        import datasets

        try:
            return datasets.load_dataset(str(self.path), config)
        except (ValueError, OSError, datasets.exceptions.DatasetsError) as e:
            at = f"{self.name} ({self.path})" if str(self.path) != self.name else self.name
            raise ValueError(f"{at}: datasets.load_dataset cannot read it"
                             f"{f' (config {config!r})' if config else ''}: {_one_line(e)}") from None

    def _split_rows(self, splits: Mapping[str, Any], split: str, key: str) -> list[Problem]:
        if split not in splits:
            raise ValueError(f"{self.name}: no split {split!r} (has {sorted(splits)}); set data.source.{key}")
        where = f"{self.name} {split}"
        dataset = splits[split]
        self._require(dataset.column_names, where, "column")
        rows = dataset.select_columns(self._columns()).with_format("arrow")[:].to_pylist()
        return self._map(rows, lambda i: f"{where}: row {i}", where, self.path)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
