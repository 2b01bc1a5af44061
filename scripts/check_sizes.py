"""The size limits: no file over 350 lines, no function over 60 lines.

    python scripts/check_sizes.py   # exit 1, listing every offender, unless all are within the limits

Walks the *.py files of rlexp/, tests/, bench/, scripts/ (and examples/ where it exists). A
function (or method) counts from its `def` line to its last line, decorators excluded; a file
counts all its lines.

Why: one idea per file and one job per function keep the code readable, reviewable and easy
to test in pieces. The limits are met by splitting - a module per responsibility, helpers whose
names explain what they do - never by compression: packing statements onto one line, joining
lines or cutting docstrings and comments would pass the count and defeat its purpose."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("rlexp", "tests", "bench", "scripts", "examples")
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 60


def python_files(root: Path) -> Iterator[Path]:
    """Every *.py file under the checked folders that exist, in a stable order."""
    for folder in FOLDERS:
        top = root / folder
        if top.is_dir():
            yield from sorted(top.rglob("*.py"))


def function_lengths(tree: ast.AST) -> Iterator[tuple[int, str, int]]:
    """(line, qualified name, length) of every function and method, nested ones included."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                end = child.end_lineno or child.lineno
                yield child.lineno, name, end - child.lineno + 1
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def offenders(path: Path, shown: str) -> list[str]:
    """The lines to print for one file: the file itself if too long, then each long function."""
    source = path.read_text()
    found = []
    file_lines = len(source.splitlines())
    if file_lines > MAX_FILE_LINES:
        found.append(f"{shown}: {file_lines} lines (limit {MAX_FILE_LINES})")
    tree = ast.parse(source, filename=shown)
    for line, name, length in function_lengths(tree):
        if length > MAX_FUNCTION_LINES:
            found.append(f"{shown}:{line}: {name} is {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


def main() -> int:
    files = list(python_files(ROOT))
    problems = []
    for path in files:
        problems.extend(offenders(path, str(path.relative_to(ROOT))))
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(
        f"OK: {len(files)} files within {MAX_FILE_LINES} lines, "
        f"their functions within {MAX_FUNCTION_LINES} lines"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
