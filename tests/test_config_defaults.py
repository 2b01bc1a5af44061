"""Defaults live in the YAML: where a constructor gives a parameter a default too, it is the
value the config group sets, so that a reader (or a test building the class by hand) never
meets two defaults for one key.

    pytest tests/test_config_defaults.py

Checked for every node of conf/<group>/*.yaml whose `_target_` is rlexp's (nested ones
included: trainer.sync_check, a data group's source, a weighted judge's parts), for every key
set to a plain value (no `${...}` interpolation, no `???`, no sub-node), on the nodes that say
what the default is: the group's default option (conf/config.yaml's `defaults:`) and the
option that alone builds its class. Other options building the same class are variants
(advantage=dr_grpo's `std: none` beside grpo's `population`) and may differ. Experiments
and recipes are sparse overrides of the groups, not a group's own config."""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"
OVERRIDES = ("experiment", "recipe", "hydra")  # not a component's config
# A record built in YAML as a value, not a component: its defaults are the training sampling's,
# the evaluator's node is one use of it (greedy)
RECORDS = {"rlexp.sample.SamplingConfig"}


@dataclass(frozen=True)
class Node:
    file: Path  # conf/<group>/<option>.yaml
    key: str  # where in the file ("" for its top; "source", "judges.rm", ...)
    target: str
    node: DictConfig

    @property
    def name(self) -> str:
        file = str(self.file.relative_to(CONF))
        return f"{file}:{self.key}" if self.key else file


def _targeted(node: Any, file: Path, key: str = "") -> list[Node]:
    """Every node under `node` (itself included) whose `_target_` is rlexp's."""
    if not isinstance(node, DictConfig):
        return []
    target = node.get("_target_") if "_target_" in node else None
    found = [Node(file, key, target, node)] if isinstance(target, str) and target.startswith("rlexp.") else []
    for k in node:
        if not (OmegaConf.is_interpolation(node, k) or OmegaConf.is_missing(node, k)):
            found += _targeted(node._get_node(k), file, f"{key}.{k}" if key else str(k))
    return found


def _default_options() -> set[Path]:
    """The file of each group's default option, from conf/config.yaml's `defaults:`."""
    chosen = [item for item in OmegaConf.load(CONF / "config.yaml").defaults if isinstance(item, DictConfig)]
    return {CONF / group / f"{option}.yaml" for item in chosen for group, option in item.items() if option}


def _checked() -> list[Node]:
    nodes = [n for file in sorted(CONF.glob("*/*.yaml")) if file.parent.name not in OVERRIDES
             for n in _targeted(OmegaConf.load(file), file) if n.target not in RECORDS]
    files = Counter(target for target, _ in {(n.target, n.file) for n in nodes})
    defaults = _default_options()
    return [n for n in nodes if n.file in defaults or files[n.target] == 1]


def _plain(node: DictConfig, key: str) -> tuple[bool, Any]:
    """(whether `key` holds a plain value, that value): a scalar or a list of scalars."""
    if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
        return False, None
    value = node._get_node(key)
    if isinstance(value, DictConfig):
        return False, None
    if isinstance(value, ListConfig):
        items = [value._get_node(i) for i in range(len(value))]
        if any(isinstance(i, (DictConfig, ListConfig)) or i._is_interpolation() for i in items):
            return False, None
        return True, OmegaConf.to_container(value)
    return True, node[key]


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, tuple):
        default = list(default)
    if isinstance(value, bool) or isinstance(default, bool):  # true is not 1
        return value is default
    return value == default


def disagreements(node: DictConfig, target: Any, where: str) -> list[str]:
    """A line for each key `node` sets to a plain value whose parameter of `target` (a class's
    constructor or a function) has another default."""
    signature = inspect.signature(target.__init__ if inspect.isclass(target) else target)
    out = []
    for key in node:
        param = signature.parameters.get(str(key))
        if str(key).startswith("_") or param is None or param.default is inspect.Parameter.empty:
            continue
        plain, value = _plain(node, str(key))
        if plain and not _same(value, param.default):
            out.append(f"{where}: {key}: the YAML sets {value!r}, "
                       f"the constructor's default is {param.default!r}")
    return out


CHECKED = _checked()


@pytest.mark.parametrize("entry", CHECKED, ids=lambda n: n.name)
def test_a_constructor_default_is_the_value_its_config_group_sets(entry):
    found = disagreements(entry.node, get_object(entry.target), f"conf/{entry.name} ({entry.target})")
    assert not found, "\n".join(found)


def test_the_defaults_and_the_only_options_are_checked_and_variants_left_alone():
    names = {n.name for n in CHECKED}
    assert {"trainer/default.yaml", "trainer/default.yaml:sync_check", "data/arithmetic.yaml:source",
            "advantage/grpo.yaml", "advantage/gae.yaml", "judge/reward_model.yaml:judges.rm"} <= names
    assert "advantage/dr_grpo.yaml" not in names  # a variant of grpo.yaml's class
    assert "judge/llm.yaml:judges.rule" not in names  # MathExactJudge: judge=math_exact is the default
    assert not any("optimizer" in name for name in names)  # torch's, not rlexp's


def test_a_disagreement_names_the_file_key_and_both_values():
    def make(bound: str = "auto", rate: float = 0.5, names: tuple = ("a", "b"), on: bool = True):
        return None

    node = OmegaConf.create({"_target_": "x.make", "bound": "${other}", "rate": 0.25, "names": ["a", "b"],
                             "on": 1})
    assert disagreements(node, make, "conf/g/o.yaml") == [
        "conf/g/o.yaml: rate: the YAML sets 0.25, the constructor's default is 0.5",
        "conf/g/o.yaml: on: the YAML sets 1, the constructor's default is True"]
