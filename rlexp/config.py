"""Config checks that run before any model or engine starts, and rlexp's OmegaConf resolvers."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# `${rlexp.abspath:mlflow.db}`: absolute path from the directory the command runs in.
OmegaConf.register_new_resolver("rlexp.abspath", lambda p: os.path.abspath(p), replace=True)


def _job_dirname(sweep_dir: str, num: int, overrides) -> str:
    """A sweep job's directory: `<num>_<the values of the swept keys>`, e.g. `2_staleness_threshold=2`."""
    from rlexp.tracking.sweep import job_run_name, read_sweep

    info = read_sweep(sweep_dir) or {"varying": []}
    name = job_run_name(info["varying"], list(overrides)) if info["varying"] else "job"
    return f"{num}_{name.replace('/', '_')}"


# hydra.sweep.subdir: ${rlexp.job_dirname:${hydra.sweep.dir},${hydra.job.num},${hydra.overrides.task}}
OmegaConf.register_new_resolver("rlexp.job_dirname", _job_dirname, replace=True)


class ConfigError(ValueError):
    """A bad config value, reported as one line before anything expensive starts."""


RUN_CONFIG = "rlexp_config.yaml"  # a run's resolved config, in its run dir: what `resume=` reads


def resume_config(resume: str, overrides: list[str], search_dir: Path) -> tuple[DictConfig, Path, Path]:
    """`resume=<run dir>` or `resume=latest` (the run under `search_dir` checkpointed last):
    that run's saved config, its dir, and its newest checkpoint. Other `key=value` overrides
    on the command line apply on top (e.g. `trainer.total_steps=600` to extend a run); a key
    of a non-default group option composes only with that choice repeated (`judge=faulty
    judge.raise_rate=0`). Switching a config group is refused."""
    from rlexp.checkpoint import CheckpointError, latest_checkpoint, latest_run_dir

    try:
        run_dir = latest_run_dir(search_dir) if resume == "latest" else Path(resume)
        if not (run_dir / RUN_CONFIG).is_file():
            raise ConfigError(f"resume={resume}: {run_dir / RUN_CONFIG} not found (not an rlexp run dir?)")
        ckpt = latest_checkpoint(run_dir)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    cfg = OmegaConf.load(run_dir / RUN_CONFIG)
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


def _int(cfg, key: str, minimum: int) -> int:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key} must be an integer, got {v!r} ({type(v).__name__})")
    if v < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {v}")
    return v


def _float(cfg, key: str, minimum: float, strict: bool = False) -> float:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key} must be a number, got {v!r} ({type(v).__name__})")
    if v < minimum or (strict and v == minimum):
        raise ConfigError(f"{key} must be {'>' if strict else '>='} {minimum}, got {v}")
    return float(v)


def _choice(cfg, key: str, choices: tuple[str, ...]) -> None:
    if OmegaConf.select(cfg, key) is not None and _get(cfg, key) not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {_get(cfg, key)!r}")


def validate(cfg: DictConfig) -> dict[str, int]:
    """Raise ConfigError naming the first bad key; return derived sizes for logging."""
    _check_targets(cfg)
    _int(cfg, "seed", 0)
    steps = _int(cfg, "trainer.total_steps", 1)
    prompts = _int(cfg, "data.prompts_per_step", 1)
    per_prompt = _int(cfg, "data.samples_per_prompt", 1)
    if per_prompt < 2 and "grpo" in str(_get(cfg, "trainer._target_")).lower():
        raise ConfigError(f"data.samples_per_prompt must be >= 2 for GRPO (advantages compare "
                          f"samples of one prompt), got {per_prompt}")
    _int(cfg, "rollout.max_response_tokens", 1)
    _int(cfg, "rollout.max_model_len", 2)
    _float(cfg, "rollout.temperature", 0.0, strict=True)
    top_p = _float(cfg, "rollout.top_p", 0.0, strict=True)
    if top_p > 1:
        raise ConfigError(f"rollout.top_p must be <= 1, got {top_p}")
    _int(cfg, "evaluator.every_n_steps", 1)
    _int(cfg, "evaluator.samples_per_prompt", 1)
    _float(cfg, "evaluator.temperature", 0.0)
    if _get(cfg, "evaluator.prompts") is not None:
        _int(cfg, "evaluator.prompts", 1)
    minibatches = _int(cfg, "trainer.minibatches_per_step", 1)
    if (prompts * per_prompt) % minibatches:
        raise ConfigError(f"trainer.minibatches_per_step={minibatches} must divide the samples of a step "
                          f"(data.prompts_per_step * data.samples_per_prompt = {prompts * per_prompt})")
    _int(cfg, "checkpoint.every_n_steps", 0)
    _int(cfg, "checkpoint.keep_last", 0)
    for key in ("agent.timeout_s", "judge.timeout_s"):
        if OmegaConf.select(cfg, key) is not None:
            _float(cfg, key, 0.0, strict=True)
    failure_limit = _float(cfg, "scheduler.max_failure_fraction", 0.0)
    if failure_limit > 1:
        raise ConfigError(f"scheduler.max_failure_fraction must be <= 1, got {failure_limit}")
    _int(cfg, "trainer.micro_batch_tokens", 1)
    _float(cfg, "trainer.max_grad_norm", 0.0, strict=True)
    _float(cfg, "trainer.optimizer.lr", 0.0, strict=True)
    _check_agent(cfg)
    _check_scheduler(cfg, prompts)
    _choice(cfg, "trainer.lr_schedule", ("constant", "cosine"))
    _choice(cfg, "trainer.old_logprobs", ("rollout", "recompute"))
    _choice(cfg, "trainer.off_policy_correction", ("none", "decoupled", "tis"))
    if OmegaConf.select(cfg, "trainer.is_cap") is not None:
        _float(cfg, "trainer.is_cap", 1.0)
    return {"samples_per_step": prompts * per_prompt, "total_train_samples": steps * prompts * per_prompt}


def _check_targets(cfg: DictConfig, path: str = "") -> None:
    """Every `_target_` must import, so a typo fails here, not after the engine started."""
    from hydra.utils import get_object

    for key, value in cfg.items_ex(resolve=False) if isinstance(cfg, DictConfig) else ():
        where = f"{path}{key}"
        if key == "_target_":
            try:
                get_object(value)
            except Exception as e:
                cause = e.__cause__ or e
                raise ConfigError(f"{where}: cannot import {value!r} "
                                  f"({type(cause).__name__}: {cause})") from None
        elif isinstance(value, DictConfig):
            _check_targets(value, where + ".")


def _check_agent(cfg: DictConfig) -> None:
    for key, minimum in (("agent.max_turns", 1), ("agent.max_tool_calls", 0)):
        if OmegaConf.select(cfg, key) is not None:
            _int(cfg, key, minimum)
    _choice(cfg, "agent.on_prefix_break", ("split", "restart"))
    _choice(cfg, "agent.transport", ("inprocess", "http"))
    if OmegaConf.select(cfg, "agent.entrypoint") is not None:
        from rlexp.agents.openai_agent import load_entrypoint

        try:
            load_entrypoint(_get(cfg, "agent.entrypoint"))
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_scheduler(cfg: DictConfig, prompts_per_step: int) -> None:
    if OmegaConf.select(cfg, "scheduler.max_filter_rounds") is not None:
        _int(cfg, "scheduler.max_filter_rounds", 1)
    if OmegaConf.select(cfg, "scheduler.staleness_threshold") is None:
        return
    eta = _int(cfg, "scheduler.staleness_threshold", 0)
    _int(cfg, "scheduler.over_sample_groups", 0)
    step = _int(cfg, "scheduler.tail_batch_candidate_step", 0)
    size = _int(cfg, "scheduler.tail_batch_trigger_size", 0)
    if (step == 0) != (size == 0):
        raise ConfigError("scheduler.tail_batch_candidate_step and scheduler.tail_batch_trigger_size "
                          f"go on together (both > 0) or off (both 0); got {step} and {size}")
    if step > eta:
        raise ConfigError(f"scheduler.tail_batch_candidate_step={step} must be <= "
                          f"scheduler.staleness_threshold={eta}: a group in flight that long has expired")
    if size > prompts_per_step:
        raise ConfigError(f"scheduler.tail_batch_trigger_size={size} must be <= "
                          f"data.prompts_per_step={prompts_per_step} (a tail batch fits in one batch)")
    if OmegaConf.select(cfg, "rollout.enable_sleep_mode"):
        raise ConfigError("rollout.enable_sleep_mode=true frees the engine during training, which the "
                          "async scheduler uses to keep generating; use scheduler=sync with it")


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
