"""Config checks that run before any model or engine starts, and rlexp's OmegaConf resolvers."""

from __future__ import annotations

import inspect
import operator
import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from rlexp.config_components import check_components
from rlexp.constraints import Fraction, Positive
from rlexp.errors import CheckpointError, ConfigError
from rlexp.guards import GUARDS
from rlexp.signatures import static_signature

# `${rlexp.abspath:mlflow.db}`: absolute path from the directory the command runs in.
OmegaConf.register_new_resolver("rlexp.abspath", lambda p: os.path.abspath(p), replace=True)
# `${rlexp.checkout:examples}`: absolute path from the checkout (holding rlexp/, examples/, make envs' venvs).
CHECKOUT = Path(__file__).resolve().parents[1]
OmegaConf.register_new_resolver("rlexp.checkout", lambda p: str(CHECKOUT / p), replace=True)


def cache_root() -> Path:
    """Where rlexp keeps what it builds once and reuses from any directory (the built models):
    $RLEXP_CACHE, else $XDG_CACHE_HOME/rlexp, else ~/.cache/rlexp (as Hugging Face's cache)."""
    if os.environ.get("RLEXP_CACHE"):
        return Path(os.environ["RLEXP_CACHE"]).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache").expanduser().resolve() / "rlexp"


# `${rlexp.cache:models}`: that path under cache_root().
OmegaConf.register_new_resolver("rlexp.cache", lambda p: str(cache_root() / p), replace=True)


# The config groups that compose the algorithm, each placed under trainer.<group>
ALGORITHM_GROUPS = ("advantage", "policy_loss", "mismatch", "kl", "aggregation", "critic")

def _job_dirname(sweep_dir: str, num: int, overrides) -> str:
    """A sweep job's directory: `<num>_<the values of the swept keys>`, e.g. `2_staleness_threshold=2`."""
    from rlexp.tracking.sweep import job_run_name, read_sweep

    info = read_sweep(sweep_dir) or {"varying": []}
    name = job_run_name(info["varying"], list(overrides)) if info["varying"] else "job"
    return f"{num}_{name.replace('/', '_')}"


# hydra.sweep.subdir: ${rlexp.job_dirname:${hydra.sweep.dir},${hydra.job.num},${hydra.overrides.task}}
OmegaConf.register_new_resolver("rlexp.job_dirname", _job_dirname, replace=True)


def resume_config(resume: str, overrides: list[str], search_dir: Path) -> tuple[DictConfig, Path, Path]:
    """`resume=<run dir>` or `resume=latest` (`checkpoint.find_run`): that run's saved config,
    its dir, and its newest checkpoint. Other `key=value` overrides on the command line apply
    on top (e.g. `trainer.total_steps=600` to extend a run); a key of a non-default group
    option composes only with that choice repeated (`judge=faulty judge.raise_rate=0`).
    Switching a config group is refused."""
    from rlexp.checkpoint import RUN_CONFIG, find_run

    try:
        run_dir, ckpt = find_run(resume, search_dir)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    cfg = OmegaConf.load(run_dir / RUN_CONFIG)
    assert isinstance(cfg, DictConfig)
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    choices = OmegaConf.load(hydra_file).hydra.runtime.choices if hydra_file.is_file() else {}
    for override in overrides:
        key, value = override.split("=", 1)
        if key == "resume" or key.startswith("hydra.") or choices.get(key) == value:
            continue  # e.g. `judge=faulty`, repeated so that `judge.raise_rate=0` composes
        current = OmegaConf.select(cfg, key, default="__missing__")
        if current == "__missing__" or isinstance(current, DictConfig):
            what = "is not a key of" if current == "__missing__" else "switches a config group of"
            raise ConfigError(f"{override}: {what} the resumed run ({run_dir / RUN_CONFIG}); "
                              "only key=value overrides of existing keys apply when resuming")
        OmegaConf.update(cfg, key, OmegaConf.select(OmegaConf.from_dotlist([override]), key))
    cfg.resume = str(run_dir)
    return cfg, run_dir, ckpt


def _get(cfg: DictConfig, key: str):
    value = OmegaConf.select(cfg, key, default="__missing__")
    if value == "__missing__":
        raise ConfigError(f"{key} is missing from the config")
    return value


def validate(cfg: DictConfig, static: bool = False, images: bool = False) -> None:
    """Raise ConfigError naming the first bad key. Each component's arguments are checked
    against its constructor's signature (`check_arguments`); what is checked here besides
    are top-level keys and relations between groups (those that read what the components
    declare of themselves: rlexp/config_components.py). `static`: only what needs no import
    of the components (see check_arguments); the full check follows the imports. `images`:
    the data has prompts with images (rlexp.preflight found some)."""
    check_arguments(cfg, static=static)
    for key, minimum in (("seed", 0), ("checkpoint.every_n_steps", 0), ("checkpoint.keep_last", 0)):
        check_value(key, _get(cfg, key), Annotated[int, Ge(minimum)])
    check_value("max_failure_fraction", _get(cfg, "max_failure_fraction"), Fraction)
    check_value("sync_timeout_s", _get(cfg, "sync_timeout_s"), Positive)
    check_value("loop", _get(cfg, "loop"), Literal["fit", "low_level"])
    check_value("trainer.optimizer.lr", _get(cfg, "trainer.optimizer.lr"), Annotated[float, Gt(0)])
    samples, minibatches = derived(cfg)["samples_per_step"], cfg.trainer.minibatches_per_step
    if samples % minibatches:
        raise ConfigError(f"trainer.minibatches_per_step={minibatches} must divide the samples of a step "
                          f"(data.prompts_per_step * data.samples_per_prompt = {samples})")
    if static:
        return
    target = OmegaConf.select(cfg, "trainer.advantage._target_")
    estimator = get_object(target) if target else None  # an AdvantageEstimator class
    least = estimator.min_samples_per_prompt if estimator else 1
    if cfg.data.samples_per_prompt < least:
        raise ConfigError(f"data.samples_per_prompt must be >= {least} for {target} (its advantages "
                          f"compare samples of one prompt), got {cfg.data.samples_per_prompt}")
    needs_values = estimator.needs_values if estimator else False
    if needs_values != (OmegaConf.select(cfg, "trainer.critic") is not None):
        raise ConfigError(f"trainer.advantage {target} and trainer.critic do not go together: "
                          "advantage=gae needs critic=value, and a critic is only used by advantage=gae "
                          "(recipe=ppo sets both)")
    _check_teacher(cfg, estimator)
    if OmegaConf.select(cfg, "agent.entrypoint") is not None:
        from rlexp.agents.openai_agent import load_entrypoint

        try:
            load_entrypoint(cfg.agent.entrypoint)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if isinstance(OmegaConf.select(cfg, "agent.factory"), str):  # agent=environment: importable now
        from rlexp.agents.environment import load_factory

        load_factory(cfg.agent.factory)
    _check_reward_functions(cfg)
    check_components(cfg, images)
    if OmegaConf.select(cfg, "trainer.routing_replay") == "rollout" and \
            not OmegaConf.select(cfg, "rollout.routing_capture"):
        raise ConfigError("trainer.routing_replay=rollout replays the engine's routing: it needs "
                          "rollout.routing_capture=true (rollout=vllm, an MoE model)")


def _check_teacher(cfg: DictConfig, estimator: Any) -> None:
    """On-policy distillation's terms need a teacher; the top-k forward KL needs its top-k ids
    over the student's own vocabulary; advantage=distill already is the reverse-KL term."""
    teacher = OmegaConf.select(cfg, "teacher")
    distill = OmegaConf.select(cfg, "trainer.distill") or {}
    pure = bool(estimator and estimator.needs_teacher)
    kl_coef, forward_kl = distill.get("kl_coef", 0.0), distill.get("forward_kl_coef", 0.0)
    if (pure or kl_coef or forward_kl) and teacher is None:
        used = ("advantage=distill" if pure else
                "trainer.distill.kl_coef" if kl_coef else "trainer.distill.forward_kl_coef")
        raise ConfigError(f"{used} needs a teacher: teacher=local teacher.model_path=<dir>, or "
                          "teacher=openai teacher.base_url=<url> teacher.model=<name>")
    if pure and kl_coef:
        raise ConfigError("advantage=distill is the reverse-KL advantage already: set "
                          "trainer.advantage.kl_coef, not trainer.distill.kl_coef (which adds it to "
                          "a reward estimator's)")
    if forward_kl and (not teacher.get("top_k") or teacher.get("align")):
        raise ConfigError("trainer.distill.forward_kl_coef needs the teacher's top-k ids over the "
                          f"student's vocabulary: teacher.top_k > 0 (got {teacher.get('top_k')}) "
                          "and teacher.align=false")


def _check_reward_functions(cfg: DictConfig) -> None:
    """judge=reward_functions: every function imports, before the engine starts."""
    if "functions" not in cfg.judge.keys():  # `in` alone is False for a `???` value
        return
    from rlexp.judges.reward_functions import load_functions

    if OmegaConf.is_missing(cfg.judge, "functions"):
        raise ConfigError("judge.functions is required: the reward functions' import paths, e.g. "
                          "'judge.functions=[my_rewards.accuracy]' (their module on PYTHONPATH)")
    try:
        load_functions(cfg.judge.functions)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def derived(cfg: DictConfig) -> dict[str, int]:
    """Sizes that follow from the config, printed and logged (`derived.*` params)."""
    per_step = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    return {"samples_per_step": per_step, "total_train_samples": cfg.trainer.total_steps * per_step}


def check_arguments(node: DictConfig, path: str = "", callee: Any = None, static: bool = False) -> None:
    """Every `_target_` must import, and the keys beside it must be arguments of what it names
    (or of `callee`), with values its signature allows (types, `Literal` choices,
    `rlexp.constraints` bounds). A group's `guard` sub-node is checked against its guard.
    `static`: read rlexp's own targets from their source instead of importing them (no torch,
    vLLM or MLflow yet); what the source cannot tell is left to the full check."""
    target = node.get("_target_")
    signature, name = None, None
    if callee is not None:
        signature, name = _signature(callee), f"{callee.__module__}.{callee.__qualname__}"
    if target is not None:
        name = target
        try:
            signature = static_signature(target) if static else _signature(get_object(target))
        except Exception as e:
            cause = e.__cause__ or e
            raise ConfigError(f"{path}_target_: cannot import {target!r} "
                              f"({type(cause).__name__}: {cause})") from None
    params, hints = signature or ({}, {})
    for key, value in node.items_ex(resolve=False):
        where = f"{path}{key!s}"
        if isinstance(key, str) and key.startswith("_"):
            continue
        if key == "guard" and path.rstrip(".") in GUARDS:
            check_arguments(node.guard or DictConfig({}), where + ".", GUARDS[path.rstrip(".")], static)
            continue
        if signature is not None and key not in params and not _takes_kwargs(params):
            raise ConfigError(f"{where} is not an argument of {name} "
                              f"(it takes: {', '.join(k for k in params if k != 'self')})")
        if isinstance(value, DictConfig):
            check_arguments(value, where + ".", static=static)
        elif key in hints:
            try:
                resolved = node[key]
            except MissingMandatoryValue:
                continue  # `???`: required on the command line; instantiate names it
            check_value(where, resolved, hints[key])


def _signature(obj) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}, {}
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # annotations that do not evaluate (third-party code): names only
        hints = {}
    return params, hints


def _takes_kwargs(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_value(where: str, value: Any, annotation: Any) -> None:
    """Raise ConfigError unless `value` fits `annotation`. Checked: bool, int, float, str,
    `Literal`, `X | None` and annotated_types bounds (Ge, Gt, Le, Lt); anything else passes.

    Not pydantic's `TypeAdapter(annotation).validate_python` (tried 2026-11-26, pydantic 2.14,
    on every config option and the bad overrides of tests/test_config.py): in lax mode it takes
    "9" and True for an int and "yes" for a bool; in strict mode (rlexp/chat/schema.py's) it
    refuses a YAML list for `tuple[str, ...]` (agent=tool's `tools`) and a string for a `Path`;
    in both, object() for a `Callable` (not a config value): its errors must be sorted by kind
    to know which to report; and it gives bounds as floats ("<= 1.0") and choices as
    "'a' or 'b'": with its errors mapped onto these messages, 22 of the 37 it raised still
    differed (every float bound, every `Literal`). Its cost is not the reason: importing it
    took 0.09-0.14 s and the adapters 0.06 s for the default config."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *bounds = typing.get_args(annotation)
        check_value(where, value, base)
        for bound in bounds:
            for attr, op, ok in (("ge", ">=", operator.ge), ("gt", ">", operator.gt),
                                 ("le", "<=", operator.le), ("lt", "<", operator.lt)):
                limit = getattr(bound, attr, None)
                if limit is not None and not ok(value, limit):
                    raise ConfigError(f"{where} must be {op} {limit}, got {value}")
    elif origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(annotation)):
            return
        if len(options) == 1:
            check_value(where, value, options[0])
        elif not any(_fits(where, value, option) for option in options):
            raise ConfigError(f"{where} must be {' or '.join(map(_described, options))}; got {value!r}")
    elif origin is typing.Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(map(str, choices))}; got {value!r}")
    elif annotation is bool and not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r} ({type(value).__name__})")
    elif annotation is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} must be an integer, got {value!r} ({type(value).__name__})")
    elif annotation is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where} must be a number, got {value!r} ({type(value).__name__})")
    elif annotation is str and not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r} ({type(value).__name__})")


def _fits(where: str, value: Any, annotation: Any) -> bool:
    try:
        check_value(where, value, annotation)
    except ConfigError:
        return False
    return True


def _described(annotation: Any) -> str:
    """How an error names what an option of a union takes."""
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(annotation)))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def validate_data(cfg: DictConfig, n_train: int, n_eval: int) -> None:
    """Checks that need the dataset (cheap to load) but no model."""
    if cfg.data.prompts_per_step > n_train:
        raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} cannot be filled: "
                          f"the train split has only {n_train} prompts")
    if n_eval == 0:
        raise ConfigError("the eval split is empty; set data.eval_size or data.eval_path")


def validate_lengths(cfg: DictConfig, prompts: list[tuple[int, str]], split: str) -> None:
    """Every prompt of a split, as (chat-templated length, where it comes from), must leave
    room for a full response."""
    room = cfg.rollout.max_model_len - cfg.rollout.max_response_tokens
    too_long = [(n, where) for n, where in prompts if n > room]
    if too_long:
        n, where = max(too_long)
        raise ConfigError(f"{len(too_long)} prompt(s) of the {split} split do not fit in "
                          f"rollout.max_model_len={cfg.rollout.max_model_len} with "
                          f"rollout.max_response_tokens={cfg.rollout.max_response_tokens} (first: "
                          f"{too_long[0][1]}); the longest ({where}) has {n} tokens. Raise "
                          f"max_model_len or drop those rows")
