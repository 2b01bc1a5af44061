"""reasoning-gym's procedural tasks as a PromptSource (`data=reasoning_gym`).

One task or a weighted mix, each by its reasoning-gym name with its generator config and seed,
generated locally when the source is built (in preflight, before any engine starts). Every
Problem carries its task's name, the reasoning-gym entry (question, answer, metadata) and the
generator config in `metadata`, which `judge=reasoning_gym` scores with that task's own
`score_answer` (rlexp/judges/reasoning_gym.py) and the evaluator counts per task
(`eval/accuracy/<task>`).

The held-out eval split is generated first; training entries whose question text is in it are
skipped (and drawn again), so no question is ever in both splits. Both are fixed by the seeds
(and reasoning-gym's version): a task's generator seed for each split is derived from its
`seed`, the task's name and the split."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import random
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlexp.constraints import AtLeast1
from rlexp.data.sources import Problem, PromptSource, _messages

# A name of reasoning_gym.utils.SYSTEM_PROMPTS ("default": think, then <answer>...</answer>)
DEFAULT_SYSTEM_PROMPT = "default"
_SPEC_KEYS = ("weight", "config", "seed")
_MAX_DRAWS = 20  # train entries drawn per train entry kept, at most, before giving up


@dataclass(frozen=True)
class Task:
    """One task of the mix: its reasoning-gym name, weight, generator config and seed."""

    name: str
    weight: float
    config: dict[str, Any]
    seed: int


def _plain(value: Any) -> Any:
    """Mappings and sequences (OmegaConf's DictConfig / ListConfig included) as dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def _close(name: str, options: Sequence[str], what: str) -> str:
    close = difflib.get_close_matches(name, options, n=5, cutoff=0.6)
    if close:
        return f"close {what}: {', '.join(close)}"
    return f"{what}: {', '.join(sorted(options))}"


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's tasks by name: (dataset class, config dataclass). Imported here, when a
    source is built (about 1 s: it imports sympy and matplotlib)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ValueError(f"data=reasoning_gym needs the reasoning-gym package ({e}); "
                         "pip install 'rlexp[examples]' or reasoning-gym") from None
    return {k: v for k, v in DATASETS.items() if k != "composite"}


def parse_tasks(tasks: Any, seed: int) -> list[Task]:
    """The mix as Tasks, checked against reasoning-gym's registry: `tasks` is one name, a list
    of names (equal weights), or a mapping name -> spec, where a spec is null (weight 1, the
    task's default config), a number (its weight) or a mapping with any of `weight` (default 1;
    0 leaves the task out), `config` (the generator's config keys) and `seed` (default: the
    source's `seed`). ValueError, one line, naming an unknown task or config key."""
    tasks = _plain(tasks)
    if isinstance(tasks, str):
        tasks = {tasks: None}
    elif isinstance(tasks, list):
        if not all(isinstance(t, str) for t in tasks):
            raise ValueError(f"reasoning-gym tasks: a list of task names, got {tasks!r}")
        tasks = {t: None for t in tasks}
    if not isinstance(tasks, dict) or not tasks:
        raise ValueError(f"reasoning-gym tasks: a task name, a list of names or a mapping name -> "
                         f"{{weight, config, seed}}, got {tasks!r}")
    registry = _registry()
    out = []
    for name, spec in tasks.items():
        where = f"reasoning-gym task {name!r}"
        if name not in registry:
            hint = " (a mix is the tasks mapping itself)" if name == "composite" else ""
            raise ValueError(f"unknown {where}{hint}; {_close(name, list(registry), 'tasks')}")
        if spec is None:
            spec = {}
        elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
            spec = {"weight": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: null, a weight or a mapping of {', '.join(_SPEC_KEYS)}; got {spec!r}")
        for key in spec:
            if key not in _SPEC_KEYS:
                raise ValueError(f"{where}: unknown key {key!r}; {_close(key, _SPEC_KEYS, 'keys')}")
        weight, config = spec.get("weight", 1.0), spec.get("config") or {}
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise ValueError(f"{where}: weight must be a number >= 0 (0 leaves it out), got {weight!r}")
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config must be a mapping of generator keys, got {config!r}")
        task_seed = spec.get("seed")
        task_seed = seed if task_seed is None else task_seed
        if isinstance(task_seed, bool) or not isinstance(task_seed, int):
            raise ValueError(f"{where}: seed must be an integer, got {task_seed!r}")
        if weight > 0:
            _check_config(name, registry[name][1], config)
            out.append(Task(name, float(weight), config, task_seed))
    if not out:
        raise ValueError("reasoning-gym tasks: every weight is 0; give one task a weight > 0")
    return out


def _check_config(name: str, config_cls: type, config: dict[str, Any]) -> None:
    """The generator's config dataclass takes every key, and its own `validate` passes."""
    fields = [f.name for f in dataclasses.fields(config_cls)]  # type: ignore[arg-type]
    for key in config:
        if key in ("seed", "size"):
            instead = f"tasks.{name}.seed" if key == "seed" else "data.source.train_size / eval_size"
            raise ValueError(f"reasoning-gym task {name!r}: config key {key!r} is set by rlexp; "
                             f"use {instead}")
        if key not in fields:
            keys = [f for f in fields if f not in ("seed", "size")]
            raise ValueError(f"reasoning-gym task {name!r}: unknown config key {key!r}; "
                             f"{_close(key, keys, 'keys')}")
    try:
        made = config_cls(**_typed(config_cls, config))
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym task {name!r}: bad config {config}: "
                         f"{e or type(e).__name__}") from None


def _typed(config_cls: type, config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the strings of enum-typed fields as the enum's members (YAML has no enums:
    aiw's `task_types: [siblings]` is `[TaskType.SIBLINGS]`)."""
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # annotations that do not evaluate: the values as given
        return config

    def coerce(value: Any, hint: Any) -> Any:
        args = typing.get_args(hint)
        if isinstance(hint, type) and issubclass(hint, enum.Enum) and not isinstance(value, hint):
            return hint(value)
        if isinstance(value, list) and args:
            return [coerce(v, args[0]) for v in value]
        return value

    return {k: coerce(v, hints[k]) if k in hints else v for k, v in config.items()}


def build_dataset(name: str, config: dict[str, Any], seed: int = 0, size: int = 1) -> Any:
    """reasoning-gym's dataset of task `name` with generator `config` (as `create_dataset`)."""
    from reasoning_gym import create_dataset
    from reasoning_gym.factory import DATASETS

    return create_dataset(name, **_typed(DATASETS[name][1], config), seed=seed, size=size)


def _derived_seed(task: Task, split: str, draw: int = 0) -> int:
    """A generator seed for one split (and one draw of train entries) of a task. reasoning-gym
    makes entry i from Random(seed + i), so seeds s and s + 1 share entries: derived seeds are
    hashed far apart (a str seed hashes the same in every process)."""
    return random.Random(f"rlexp/reasoning_gym/{task.seed}/{task.name}/{split}/{draw}").getrandbits(31)


def _jsonable(entry: dict[str, Any], task: str) -> dict[str, Any]:
    """The entry itself (kept as made: some tasks score against tuples a JSON round trip turns
    into lists), after checking it is JSON-serialisable, as sample metadata must be."""
    try:
        json.dumps(entry)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym task {task!r}: an entry is not JSON-serialisable ({e})") from None
    return entry


class ReasoningGymSource(PromptSource):
    """reasoning-gym tasks (`tasks`: one name, a list, or a mapping name -> {weight, config,
    seed}: `parse_tasks`). Each split's entries are drawn task by task in the weights'
    proportions (a seeded draw per entry, as reasoning-gym's composite dataset draws them):
    `eval_size` held-out entries first, then `train_size` training entries none of whose
    question texts is in the eval split. `system_prompt`: a name of reasoning-gym's
    `SYSTEM_PROMPTS` ("default": think, then the answer in `<answer></answer>`; "direct",
    "simple", "DeepSeekZero", "chain_of_draft"), your own text, or null (the question alone).

    A Problem: the system prompt and the question; `answer` the entry's answer ("" where the
    task has none: it checks answers itself); `metadata` {"task": name, "entry": the entry,
    "config": its generator config}."""

    def __init__(self, tasks: str | list[str] | dict[str, Any], train_size: AtLeast1 = 2000,
                 eval_size: AtLeast1 = 200, seed: int = 0,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT):
        self.tasks = parse_tasks(tasks, seed)
        self.seed = seed
        self.system_prompt = _system_prompt(system_prompt)
        eval_entries = self._draw("eval", eval_size, set())
        held_out = {e["question"] for _, e in eval_entries}
        train_entries = self._draw("train", train_size, held_out)
        self.splits = {"eval": self._problems(eval_entries, "eval"),
                       "train": self._problems(train_entries, "train")}

    def problems(self, split: str) -> list[Problem]:
        return self.splits[split]

    def counts(self, split: str) -> dict[str, int]:
        """Problems per task in a split."""
        out = {t.name: 0 for t in self.tasks}
        for p in self.splits[split]:
            out[p.metadata["task"]] += 1
        return out

    def _draw(self, split: str, size: int, held_out: set[str]) -> list[tuple[Task, dict[str, Any]]]:
        """`size` (task, entry) pairs, in a seeded order of tasks by weight."""
        rng = random.Random(f"rlexp/reasoning_gym/{self.seed}/mix/{split}")
        order = rng.choices(range(len(self.tasks)), weights=[t.weight for t in self.tasks], k=size)
        entries = {i: iter(self._entries(t, split, order.count(i), held_out))
                   for i, t in enumerate(self.tasks)}
        return [(self.tasks[i], next(entries[i])) for i in order]

    def _entries(self, task: Task, split: str, n: int, held_out: set[str]) -> list[dict[str, Any]]:
        """`n` entries of `task` whose questions are not in `held_out`, drawn from generators
        seeded for this split (a new seed for each further draw of what was skipped)."""
        out: list[dict[str, Any]] = []
        tried = draw = 0
        while len(out) < n:
            if tried >= _MAX_DRAWS * n:
                raise ValueError(
                    f"reasoning-gym task {task.name!r}: {tried} {split} entries drawn, only {len(out)} of "
                    f"{n} have a question outside the eval split: its config {task.config} makes too few "
                    f"distinct questions; lower data.source.eval_size or widen the config")
            missing = n - len(out)
            dataset = build_dataset(task.name, task.config, _derived_seed(task, split, draw), missing)
            for i in range(missing):
                try:
                    entry = dataset[i]
                except Exception as e:  # a config its validate() let through
                    raise ValueError(f"reasoning-gym task {task.name!r}: config {task.config} fails to make "
                                     f"an entry ({type(e).__name__}: {e})") from None
                if entry["question"] not in held_out:
                    out.append(_jsonable(entry, task.name))
            tried += missing
            draw += 1
        return out

    def _problems(self, entries: list[tuple[Task, dict[str, Any]]], split: str) -> list[Problem]:
        return [Problem(_messages(e["question"], self.system_prompt),
                        "" if e.get("answer") is None else str(e["answer"]),
                        where=f"reasoning-gym {split} {i} ({t.name})",
                        metadata={"task": t.name, "entry": e, "config": t.config})
                for i, (t, e) in enumerate(entries)]


def _system_prompt(value: str | None) -> str | None:
    if value is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(value, value)
