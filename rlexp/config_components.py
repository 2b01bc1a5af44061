"""The config checks between groups that read what the components say of themselves, before
anything is built: each flag is an attribute its Protocol declares with a default (which a
class gets by subclassing the Protocol, as rlexp's own do, or declares itself), read from
the group's `_target_` class, never guessed from its name. A class without it is not that
component: a ConfigError names the key and the Protocol to subclass."""

from __future__ import annotations

from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from rlexp.cluster import Cluster
from rlexp.errors import ConfigError
from rlexp.protocols import Agent, Judge, RolloutEngine, Scheduler
from rlexp.weights.protocols import WeightTransport


def check_components(cfg: DictConfig, images: bool) -> None:
    """Raise ConfigError naming the first key whose component does not go with the others.
    `images`: the data has prompts with images."""
    _check_judge_methods(cfg)
    _check_scheduler(cfg)
    _check_update_mode(cfg)
    _check_adapter_transport(cfg)
    _check_cluster(cfg)
    _check_graders(cfg)
    if images:
        _check_images(cfg)


def member(component: Any, key: str, protocol: type, attribute: str) -> Any:
    """`component`'s `attribute`, a member of `protocol` (`component`: the class `key` names,
    or what was built from it); without it `component` is not one of them."""
    try:
        return getattr(component, attribute)
    except AttributeError:
        cls = component if isinstance(component, type) else type(component)
        raise ConfigError(f"{key}: {cls.__module__}.{cls.__qualname__} is not an rlexp {protocol.__name__}: "
                          f"it has no {attribute} (subclass {protocol.__module__}.{protocol.__qualname__})"
                          ) from None


def declares(node: DictConfig | None, key: str, protocol: type, attribute: str) -> Any:
    """What the component `node` (at `key`) builds declares of itself: its `_target_` class's
    `attribute`, a member of `protocol`. With no node (cluster unset: LocalCluster), or a
    factory function (weight_transfer=auto, whose product depends on the cluster it is built
    for), the Protocol's default."""
    target = node.get("_target_") if node is not None else None
    built = get_object(target) if isinstance(target, str) else None
    if not isinstance(built, type):
        return getattr(protocol, attribute)
    return member(built, f"{key}._target_", protocol, attribute)


def _check_judge_methods(cfg: DictConfig) -> None:
    """A judge of your own has every method of the `Judge` Protocol (the optional ones by
    subclassing it): checked now, not when the loop first calls one after the engine started."""
    target = OmegaConf.select(cfg, "judge._target_")
    if not isinstance(target, str):
        return
    methods = [name for name, member in vars(Judge).items() if callable(member) and not name.startswith("_")]
    missing = [name for name in methods if not callable(getattr(get_object(target), name, None))]
    if missing:
        raise ConfigError(f"judge._target_: {target} has no {', '.join(missing)}: a judge has the methods "
                          "of rlexp.protocols.Judge (subclass it to inherit the optional ones' defaults)")


def _check_images(cfg: DictConfig) -> None:
    """Prompts with images need an agent that sends them and an engine that takes them."""
    if not declares(cfg.agent, "agent", Agent, "sends_images"):
        raise ConfigError(f"data.source has prompts with images, which agent._target_={cfg.agent._target_} "
                          "does not send to the engine (its `sends_images` is false): use "
                          "agent=single_turn, multiturn, tool or openai")
    if not declares(cfg.rollout, "rollout", RolloutEngine, "takes_images"):
        raise ConfigError(f"data.source has prompts with images: rollout._target_={cfg.rollout._target_} "
                          "takes none (its `takes_images` is false); use rollout=vllm")


def _check_cluster(cfg: DictConfig) -> None:
    on_ray = declares(cfg.get("cluster"), "cluster", Cluster, "distributed")
    replicas = OmegaConf.select(cfg, "rollout.replicas") or 1
    if replicas != 1 and not on_ray:  # an engine class builds one engine; replicas are a pool's
        raise ConfigError(f"rollout.replicas={replicas} runs several engines as Ray actors: add cluster=ray")
    workers = OmegaConf.select(cfg, "trainer.workers") or 1
    if workers > 1 and OmegaConf.select(cfg, "loop") == "low_level":
        raise ConfigError(f"loop=low_level calls the trainer in this process: it needs trainer.workers=1, "
                          f"got {workers} (loop=fit runs a trainer group)")
    if workers > 1 and not on_ray:
        raise ConfigError(f"trainer.workers={workers} runs the trainer's ranks as Ray actors: "
                          "add cluster=ray")
    if workers > 1 and declares(cfg.get("weight_transfer"), "weight_transfer", WeightTransport,
                                "sends_from_driver"):
        raise ConfigError(f"weight_transfer={cfg.weight_transfer._target_} sends from a trainer in the "
                          f"driver; with trainer.workers={workers} use weight_transfer=auto (ram_file or "
                          "object_store)")


def _check_graders(cfg: DictConfig) -> None:
    """A model judge grading on the policy's engine with a constrained reply needs an engine
    that `constrains_replies` (vLLM)."""
    if declares(cfg.rollout, "rollout", RolloutEngine, "constrains_replies"):
        return
    parts = cfg.judge.get("judges") or {}
    nodes = [("judge", cfg.judge)] + [(f"judge.judges.{k}", v) for k, v in parts.items()]
    for where, node in nodes:
        if declares(node, where, Judge, "constrains_policy_replies") and node.get("base_url") is None \
                and node.get("reply_regex") is not None:
            raise ConfigError(f"{where} grades on the policy's engine with its reply constrained "
                              f"({where}.reply_regex), which rollout=hf cannot do: use rollout=vllm, "
                              f"{where}.reply_regex=null, or {where}.base_url")


def _check_update_mode(cfg: DictConfig) -> None:
    """A scheduler's `update_mode` is one its rollout engine can do (`update_modes`)."""
    mode = OmegaConf.select(cfg, "scheduler.update_mode")
    if mode in (None, "auto"):  # a scheduler that never pauses the engine (sync); auto: any engine
        return
    modes = declares(cfg.rollout, "rollout", RolloutEngine, "update_modes")
    if mode not in modes:
        raise ConfigError(f"scheduler.update_mode={mode}: rollout._target_={cfg.rollout._target_} can "
                          f"do {' or '.join(modes)} at a weight update (keep needs rollout=vllm)")


def _check_adapter_transport(cfg: DictConfig) -> None:
    """A transport that sends a LoRA adapter goes to an engine that serves adapters."""
    if not declares(cfg.get("weight_transfer"), "weight_transfer", WeightTransport, "sends_adapter"):
        return
    if not declares(cfg.rollout, "rollout", RolloutEngine, "serves_adapters"):
        raise ConfigError(f"weight_transfer._target_={cfg.weight_transfer._target_} sends a LoRA adapter; "
                          f"rollout._target_={cfg.rollout._target_} serves no adapter: use rollout=vllm")


def _check_scheduler(cfg: DictConfig) -> None:
    """Relations between the scheduler's knobs and the other groups."""
    if declares(cfg.scheduler, "scheduler", Scheduler, "overlaps_training") and \
            OmegaConf.select(cfg, "rollout.enable_sleep_mode"):
        raise ConfigError("rollout.enable_sleep_mode=true frees the engine during training, which "
                          f"{cfg.scheduler._target_} uses to keep generating; use scheduler=sync with it")
    if OmegaConf.select(cfg, "scheduler.tail_batch_candidate_step") is None:
        return
    eta, step = cfg.scheduler.staleness_threshold, cfg.scheduler.tail_batch_candidate_step
    size, prompts_per_step = cfg.scheduler.tail_batch_trigger_size, cfg.data.prompts_per_step
    if (step == 0) != (size == 0):
        raise ConfigError("scheduler.tail_batch_candidate_step and scheduler.tail_batch_trigger_size "
                          f"go on together (both > 0) or off (both 0); got {step} and {size}")
    if step > eta:
        raise ConfigError(f"scheduler.tail_batch_candidate_step={step} must be <= "
                          f"scheduler.staleness_threshold={eta}: a group in flight that long has expired")
    if size > prompts_per_step:
        raise ConfigError(f"scheduler.tail_batch_trigger_size={size} must be <= "
                          f"data.prompts_per_step={prompts_per_step} (a tail batch fits in one batch)")
