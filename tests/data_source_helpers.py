"""What the data-source tests (tests/test_data_sources.py, test_data_source_images.py)
share: rows written as JSONL and as Parquet."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path: Path, rows: list[dict] | pa.Table) -> str:
    pq.write_table(rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows), path)
    return str(path)
