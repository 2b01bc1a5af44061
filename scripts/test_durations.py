"""Seconds per test file, from the JUnit XML reports of pytest runs: the table of the slowest
files (docs/install.md) and tests/durations.json, which orders `make test`'s work (the
costliest files first, tests/conftest.py).

    .venv/bin/python -m pytest ... --junitxml=part1.xml ; .venv/bin/python -m pytest ... --junitxml=part2.xml
    .venv/bin/python scripts/test_durations.py part1.xml part2.xml --top 15 --write tests/durations.json
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_seconds(reports: list[Path]) -> dict[str, float]:
    """Test file name -> the sum of its test cases' seconds (setup and teardown included)."""
    seconds: dict[str, float] = defaultdict(float)
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            name = next((f"{m}.py" for m in module if m.startswith("test_")), None)
            if name is not None:
                seconds[name] += float(case.get("time", 0))
    return dict(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--write", type=Path, help="write every file's seconds as JSON here")
    a = p.parse_args()
    seconds = file_seconds(a.reports)
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
    print("| test file | seconds |\n|---|---|")
    for name, s in ranked[: a.top]:
        print(f"| `{name}` | {s:.0f} |")
    print(f"| all {len(seconds)} files | {sum(seconds.values()):.0f} |")
    if a.write:
        a.write.write_text(json.dumps({k: round(v, 1) for k, v in ranked}, indent=1) + "\n")


if __name__ == "__main__":
    main()
