"""Constructor signatures read from source code, without importing it.

The config check (`rlexp.config.check_arguments`) needs the arguments of every `_target_`;
importing them to find out would import torch, vLLM and MLflow first (seconds). For rlexp's
own components the source says the same: the parameters of the class's `__init__` (or its
dataclass fields, or the function's), and the annotations that evaluate from light names
(`typing`, `rlexp.constraints`, type aliases of the module, and the aliases it imports from
another rlexp module, read from that module's source too: `LrSchedule`, `PrefixBreak`).
Anything the source cannot tell (a re-exported class, an `__init__` inherited from another
module, a package that is not rlexp's) is None, and the full check after the imports covers it.

Why not `inspect.signature` (measured 2026-11-26 on a busy 2-core CPU machine, torch 2.13
CPU, transformers 5.19, medians of 3 fresh processes): `check_arguments(compose("config"),
static=False)`, which imports each target for `inspect.signature`, takes 9.9 s and imports
torch, transformers and MLflow; with `static=True` (this module) it takes 0.16 s and imports
none of them. Per target, `hydra.utils.get_object` (one fresh process each):
rlexp.trainer.controller.TrainController 11.2 s (torch, transformers),
rlexp.tracking.mlflow_tracker.MlflowTracker 2.8 s (MLflow), each rlexp.algorithms target
2.5 s (torch), the agents, judges and data sources 0.01-0.04 s.
End to end, `python -m rlexp.run trainer.workers=0` (exit 2) takes 0.7-0.9 s; a bad value
left to the full check takes seconds more: `trainer.lr_schedule=bogus` 10.5 s where
`LrSchedule` is not read from rlexp/trainer/schedule.py (`_aliases`), 1.0 s where it is, and
the first time in a directory the full check comes only after model=tiny is built (minutes)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from typing import Any

# Modules whose names an annotation may use, imported to evaluate it (all cheap).
_LIGHT_MODULES = {"typing", "annotated_types", "rlexp.constraints", "rlexp.chat.tool_prompt", "pathlib",
                  "collections.abc"}
_KINDS = inspect.Parameter
_HAS_DEFAULT = None  # the value does not matter: only whether there is one


def static_signature(target: str) -> tuple[dict[str, inspect.Parameter], dict[str, Any]] | None:
    """(parameters, evaluable annotations) of `target` ("rlexp.pkg.module.Name"), or None;
    ModuleNotFoundError / AttributeError where the target does not exist."""
    module, _, name = target.rpartition(".")
    if not module or module.split(".")[0] != "rlexp":
        return None
    try:
        spec = importlib.util.find_spec(module)
    except ImportError as e:  # a parent package is missing
        raise ModuleNotFoundError(str(e)) from None
    if spec is None:
        raise ModuleNotFoundError(f"No module named {module!r}")
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return None
    with open(origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    node = next((n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    if node is None:
        if name in _top_level_names(tree):
            return None  # imported or assigned: only importing tells what it is
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    namespace = _namespace(tree)
    if isinstance(node, ast.ClassDef):
        return _class_signature(node, tree, namespace)
    return _parameters(node.args, namespace, skip_first=False)


def _class_signature(node: ast.ClassDef, tree: ast.Module, namespace: dict[str, Any]):
    """The class's `__init__` parameters, its dataclass fields, or those of the one class it
    derives from where that is a class of the same module (JsonlSource: `_FileSource`'s)."""
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        return _parameters(init.args, namespace, skip_first=True)
    if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
        return _dataclass_fields(node, namespace)
    if len(node.bases) == 1 and isinstance(node.bases[0], ast.Name):
        name = node.bases[0].id
        base = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if base is not None:
            return _class_signature(base, tree, namespace)
    return None


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
    return names


def _namespace(tree: ast.Module) -> dict[str, Any]:
    """Names an annotation of this module may use: its imports from light modules and the
    aliases it imports from other rlexp modules (read from their source, `_aliases`), then its
    top-level aliases that evaluate from those (`PrefixBreak = Literal["split", "restart"]`)."""
    namespace: dict[str, Any] = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module in _LIGHT_MODULES:
            module = importlib.import_module(n.module)
            namespace |= {a.asname or a.name: getattr(module, a.name)
                          for a in n.names if hasattr(module, a.name)}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "rlexp":
            aliases = _aliases(str(n.module))
            namespace |= {a.asname or a.name: aliases[a.name] for a in n.names if a.name in aliases}
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name in _LIGHT_MODULES:
                    namespace[a.asname or a.name] = importlib.import_module(a.name)
    for n in tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            value = _evaluate(n.value, namespace)
            if value is None:
                namespace.pop(n.targets[0].id, None)  # reassigned to what this cannot tell
            else:
                namespace[n.targets[0].id] = value
        elif isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            namespace.pop(n.name, None)
    return namespace


_ALIASES: dict[str, dict[str, Any]] = {}


def _aliases(module: str) -> dict[str, Any]:
    """The names rlexp's `module` would give an annotation that imports them (its evaluable
    aliases and light imports), read from its source without importing it; {} where there is
    no such source."""
    if module not in _ALIASES:
        _ALIASES[module] = {}  # also ends a cycle of imports between modules
        try:
            spec = importlib.util.find_spec(module)
        except ImportError:
            spec = None
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py"):
            with open(origin, encoding="utf-8") as f:
                _ALIASES[module] = _namespace(ast.parse(f.read()))
    return _ALIASES[module]


def _evaluate(expression: ast.expr | None, namespace: dict[str, Any]) -> Any:
    if expression is None:
        return None
    try:
        return eval(compile(ast.Expression(expression), "<annotation>", "eval"), dict(namespace))
    except Exception:  # a name from a heavy module (torch.Tensor, RolloutEngine): not checked here
        return None


def _parameters(args: ast.arguments, namespace: dict[str, Any], skip_first: bool):
    positional = [*args.posonlyargs, *args.args][1 if skip_first else 0:]
    n_defaults = len(args.defaults)
    params, hints = {}, {}
    for i, a in enumerate(positional):
        has_default = i >= len(positional) - n_defaults
        params[a.arg] = _KINDS(a.arg, _KINDS.POSITIONAL_OR_KEYWORD,
                               default=_HAS_DEFAULT if has_default else _KINDS.empty)
    for a, default in zip(args.kwonlyargs, args.kw_defaults):
        params[a.arg] = _KINDS(a.arg, _KINDS.KEYWORD_ONLY,
                               default=_KINDS.empty if default is None else _HAS_DEFAULT)
    if args.vararg:
        params[args.vararg.arg] = _KINDS(args.vararg.arg, _KINDS.VAR_POSITIONAL)
    if args.kwarg:
        params[args.kwarg.arg] = _KINDS(args.kwarg.arg, _KINDS.VAR_KEYWORD)
    for a in [*positional, *args.kwonlyargs]:
        hint = _evaluate(a.annotation, namespace)
        if hint is not None:
            hints[a.arg] = hint
    return params, hints


def _dataclass_fields(node: ast.ClassDef, namespace: dict[str, Any]):
    params, hints = {}, {}
    for n in node.body:
        if (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                and "ClassVar" not in ast.unparse(n.annotation) and "init=False" not in ast.unparse(n)):
            name = n.target.id
            params[name] = _KINDS(name, _KINDS.KEYWORD_ONLY,
                                  default=_KINDS.empty if n.value is None else _HAS_DEFAULT)
            hint = _evaluate(n.annotation, namespace)
            if hint is not None:
                hints[name] = hint
    return params, hints
