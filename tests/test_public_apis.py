"""rlexp uses MLflow and Hydra through their public APIs only: no private module or attribute
(`hydra._internal`, `MlflowClient()._tracking_client`), no MLflow store internals, and no
SQL of its own against MLflow's database. Imports inside functions count."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPENDENCIES = ("mlflow", "hydra", "omegaconf")
INTERNAL = ("mlflow.store", "mlflow.server", "mlflow.utils", "mlflow.tracking._")  # not in MLflow's API docs
DATABASE = ("sqlalchemy", "sqlite3", "alembic")  # MLflow's tables are its own
HYDRA_KEYS = {"_target_", "_convert_", "_partial_", "_recursive_", "_args_"}  # instantiate()'s config keys


def _defined_private_names(files: list[Path]) -> set[str]:
    """`_name`s rlexp itself defines (functions, classes, attributes, fields, arguments)."""
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def violations(source: str, own: set[str]) -> list[str]:
    tree = ast.parse(source)
    found, uses_dependency = [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statements = [[a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            statements = [[node.module, *(f"{node.module}.{a.name}" for a in node.names)]]
        else:
            continue
        for names in statements:
            top = names[0].split(".")[0]
            uses_dependency |= top in DEPENDENCIES
            private = [n for n in names if any(p.startswith("_") for p in n.split(".")[1:])
                       or n.startswith(INTERNAL)]
            if top in DATABASE:
                found.append(f"line {node.lineno}: imports {names[0]} (SQL of our own)")
            elif top in DEPENDENCIES and private:
                found.append(f"line {node.lineno}: imports {private[0]}")
    if uses_dependency:  # `obj._name` where rlexp never defines `_name`: a dependency's private attribute
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in own | HYDRA_KEYS):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_rlexp_uses_only_public_mlflow_and_hydra_apis():
    files = sorted((ROOT / "rlexp").rglob("*.py"))
    own = _defined_private_names(files)
    found = {str(f.relative_to(ROOT)): v for f in files if (v := violations(f.read_text(), own))}
    assert found == {}


def test_the_check_finds_private_uses():
    planted = '''
import mlflow
from mlflow.tracking import MlflowClient

def truncate(run_id):
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    import sqlalchemy
    store = MlflowClient()._tracking_client.store
    return mlflow.tracking._tracking_service.utils._get_store()
'''
    found = violations(planted, own={"_writer"})
    assert [v.split(":")[0] for v in found] == ["line 6", "line 7", "line 8", "line 9", "line 10", "line 10"]
    assert any("._tracking_client" in v for v in found) and any("hydra._internal" in v for v in found)
