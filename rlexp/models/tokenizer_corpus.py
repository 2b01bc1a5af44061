"""The text the small architectures' BPE tokenizers are trained on (rlexp/models/arch.py's
`build_tokenizer`): arithmetic and word problems with their answers, the docstrings of a fixed
list of standard-library modules and built-in types, and a few lines of non-English text and
symbols, so that the merges cover digits, English prose and multi-byte characters alike.
Deterministic for a given Python version (the docstrings are that version's)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import random
from collections.abc import Iterator
from pathlib import Path

UNICODE_LINES = (
    "Café, naïve façade, coöperate, jalapeño, Zürich, Ærøskøbing, São Paulo, Kraków.",
    "“Quotes” and ‘apostrophes’ — dashes – ellipses… and non-breaking spaces.",
    "Русский текст: съешь же ещё этих мягких французских булок.",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "العربية: نص قصير للاختبار. עברית: טקסט קצר.",
    "हिन्दी पाठ, ไทย ข้อความ, emoji 🙂🚀🎉 and math ∑ ∫ √ π ≈ 3.14159 ≤ ∞.",
)
_DOC_MODULES = ("collections", "json.decoder", "json.encoder", "re._compiler", "string", "textwrap",
                "functools", "random", "statistics", "datetime", "argparse", "logging", "dataclasses", "csv",
                "difflib", "fractions", "pathlib", "shutil", "heapq", "bisect", "enum", "contextlib",
                "operator", "copy", "pprint", "calendar", "base64", "uuid", "urllib.parse", "email.message",
                "unittest.case", "queue", "glob", "fnmatch", "tempfile", "pydoc", "inspect", "ast",
                "tokenize", "codecs", "zipfile", "tarfile", "http.client", "typing", "asyncio.tasks",
                "subprocess", "threading", "smtplib", "ftplib", "imaplib", "mailbox", "configparser",
                "optparse", "gettext", "locale", "decimal", "ipaddress", "urllib.request", "http.cookiejar")
_BUILTIN_TYPES = (str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float, complex, range,
                  memoryview)
_NAMES = ("Alice", "Bob", "Carmen", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal")
_THINGS = ("apples", "books", "marbles", "coins", "stamps", "pencils", "cookies", "shells")


@functools.cache
def corpus() -> tuple[str, ...]:
    """The tokenizer's training text, deterministic for a given Python version: arithmetic
    and word problems with answers, the docstrings of a fixed list of standard modules and
    their public members (no reprs, paths or addresses), and a few lines of other scripts."""
    rng = random.Random(0)
    lines = []
    for _ in range(6000):
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-*")
        lines.append(f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}")
    for _ in range(3000):
        who, other, thing = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        lines.append(f"{who} has {a} {thing} and {other} gives {who} {b} more. How many {thing} does {who} "
                     f"have now?\nAnswer: {who} has {a} + {b} = {a + b} {thing}. The answer is {a + b}.")
    return (*lines, *UNICODE_LINES * 20, *_docstrings())


def _docstrings() -> Iterator[str]:
    """Read from the modules' source files (not from the live objects, which other libraries
    patch: transformers adds methods to logging.Logger) and from built-in types (immutable)."""
    seen: set[str] = set()
    texts: list[str | None] = []
    for name in _DOC_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec else None
        if not origin or not origin.endswith(".py"):
            continue
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
        texts += [ast.get_docstring(node) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls in _BUILTIN_TYPES:
        texts += [inspect.getdoc(cls), *(inspect.getdoc(m) for k, m in sorted(vars(cls).items())
                                          if not k.startswith("_"))]
    for text in texts:
        if text and text not in seen:
            seen.add(text)
            yield text
