"""The sources of the user's local files: JSONL (`JsonlSource`) and Parquet (`ParquetSource`),
one file per split, which share one constructor (`_FileSource`), and a Hugging Face `datasets`
directory written by `save_to_disk` (`HFDiskSource`).

Each reads every row when built (in preflight, before any heavy import) and makes it a
`Problem` as every row-reading source does (`_RowSource`, rlexp/data/sources.py), failing with
one line naming the file, the row and the key. pyarrow is imported only by the sources that
read it. Paths must be local: nothing here downloads (a dataset on the hub: `HubSource`)."""

from __future__ import annotations

import json
from abc import abstractmethod
from pathlib import Path
from typing import Any

from rlexp.data.sources import GSM8K_ANSWER, Problem, _one_line, _RowSource


class _FileSource(_RowSource):
    """A source read from one local file per split, in the format its subclass reads
    (`_load`): `train_path`, and `eval_path` or else `eval_size` train rows held out by `seed`.
    The constructor both file formats share, its arguments the keys of their config groups."""

    def __init__(self, train_path: str, eval_path: str | None = None,
                 question_key: str = "question", answer_key: str = "answer",
                 answer_pattern: str | None = GSM8K_ANSWER, eval_size: int = 200, seed: int = 0,
                 system_prompt: str | None = None, image_key: str | None = None):
        self._fields(question_key, answer_key, answer_pattern, system_prompt, image_key)
        self._split(self._load(train_path), self._load(eval_path) if eval_path else None, eval_size, seed,
                    train_path)

    @abstractmethod
    def _load(self, name: str) -> list[Problem]:
        """The problems of the file `name`, checked row by row."""


class JsonlSource(_FileSource):
    """One JSON object per line; rows are named `file:line`. Fields and hold-out: `_RowSource`.
    Without `eval_path`, `eval_size` rows of the train file are held out by `seed`. Image
    paths (`image_key`) are relative to the file's directory."""

    def _load(self, name: str) -> list[Problem]:
        path = _local_file(name)
        with path.open(encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        return self._map((self._parse(line, f"{path}:{n}") for n, line in lines),
                         lambda i: f"{path}:{lines[i][0]}", str(path), path.parent)

    @staticmethod
    def _parse(line: str, where: str) -> dict:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        return row


class ParquetSource(_FileSource):
    """A local Parquet file, one problem per row; rows are named `file: row i` (from 0, as
    `pandas.read_parquet(file).iloc[i]`). Fields and hold-out as JsonlSource (`_RowSource`);
    only the keys' columns are read. Images (`image_key`): paths relative to the file's
    directory, bytes, or `datasets` Image dicts."""

    def _load(self, name: str) -> list[Problem]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = _local_file(name)
        if path.stat().st_size == 0:
            raise ValueError(f"{path}: empty file (0 bytes), not a Parquet file")
        try:
            parquet = pq.ParquetFile(path)
            self._require(parquet.schema_arrow.names, str(path), "column")
            table = parquet.read(columns=self._columns())
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
        return self._map(table.to_pylist(), lambda i: f"{path}: row {i}", str(path), path.parent)


class HFDiskSource(_RowSource):
    """A Hugging Face `datasets` directory written by `save_to_disk`, local only (nothing is
    downloaded): a DatasetDict directory, whose `train_split` (and `eval_split`, if set) are
    used, or a single Dataset directory, used whole. Without `eval_split` or `eval_path`,
    `eval_size` train rows are held out by `seed`; `eval_path` is another such directory.
    Rows are named `split dir: row i` (from 0, as `ds[split][i]`). Fields as JsonlSource;
    images (`image_key`) as ParquetSource, paths relative to the directory named here
    (`datasets.Image()` columns hold the bytes themselves).

    Read with pyarrow, as `datasets.load_from_disk` reads it (state.json lists the Arrow
    stream files of a split, in order; dataset_dict.json lists the splits), because
    `import datasets` takes 1.5-2 s (pandas, fsspec, huggingface_hub) and this runs in
    preflight; tests check both read the same rows."""

    def __init__(self, train_path: str, eval_path: str | None = None, train_split: str = "train",
                 eval_split: str | None = None, question_key: str = "question", answer_key: str = "answer",
                 answer_pattern: str | None = GSM8K_ANSWER, eval_size: int = 200, seed: int = 0,
                 system_prompt: str | None = None, image_key: str | None = None):
        self._fields(question_key, answer_key, answer_pattern, system_prompt, image_key)
        train = self._load(train_path, train_split, "train_split")
        eval_rows = None
        if eval_path or eval_split:
            if not eval_path and not _is_dataset_dict(Path(train_path)):
                raise ValueError(f"{train_path}: a single Dataset, not a DatasetDict: there is no split "
                                 f"eval_split={eval_split!r} to choose; unset eval_split to hold out "
                                 f"eval_size rows, or set eval_path")
            eval_rows = self._load(eval_path or train_path, eval_split, "eval_split")
        self._split(train, eval_rows, eval_size, seed, train_path)

    def _load(self, name: str, split: str | None, key: str) -> list[Problem]:
        path = root = _local_dir(name)
        if _is_dataset_dict(path):
            splits = _read_json(path / "dataset_dict.json").get("splits")
            if not isinstance(splits, list):
                raise ValueError(f"{path / 'dataset_dict.json'}: no list of 'splits'")
            if split is None:
                raise ValueError(f"{path}: a DatasetDict (splits {splits}): set data.source.{key}")
            if split not in splits:
                raise ValueError(f"{path}: no split {split!r} (has {splits}); set data.source.{key}")
            path = path / split
            if not path.is_dir():
                raise ValueError(f"{path}: split {split!r} listed in dataset_dict.json but missing")
        return self._read_dataset(path, root)

    def _read_dataset(self, path: Path, base: Path) -> list[Problem]:
        import pyarrow as pa

        state_file = path / "state.json"
        if not state_file.is_file():
            has = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else []
            raise ValueError(f"{path}: not a datasets save_to_disk directory (no dataset_dict.json or "
                             f"state.json; has {has})")
        try:
            files = [path / f["filename"] for f in _read_json(state_file)["_data_files"]]
        except (KeyError, TypeError):
            raise ValueError(f"{state_file}: no list of '_data_files'") from None
        tables = []
        for file in files:
            if not file.is_file():
                raise ValueError(f"{file}: listed in {state_file.name} but missing")
            try:
                table = pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{file}: not a readable Arrow file ({_one_line(e)})") from None
            self._require(table.column_names, str(file), "column")
            tables.append(table.select(self._columns()))
        rows = [row for table in tables for row in table.to_pylist()]
        return self._map(rows, lambda i: f"{path}: row {i}", str(path), base)


def _not_local(name: str) -> None:
    if "://" in name:
        raise ValueError(f"{name}: not a local path (data are read from local files only, never "
                         f"downloaded: save them locally first)")


def _local_file(name: str) -> Path:
    _not_local(name)
    path = Path(name)
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a data file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file not found")
    return path


def _local_dir(name: str) -> Path:
    _not_local(name)
    path = Path(name)
    if path.is_file():
        raise ValueError(f"{path}: a file, not a datasets save_to_disk directory")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: datasets directory not found (a local save_to_disk directory; "
                                f"hub names are not downloaded)")
    return path


def _is_dataset_dict(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not valid JSON ({_one_line(e)})") from None
