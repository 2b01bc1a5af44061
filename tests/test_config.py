"""Compose every option of every config group and every experiment; reject bad configs early."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import rlexp.config  # noqa: F401  (registers resolvers)
from rlexp.config import ALGORITHM_GROUPS, validate
from rlexp.errors import ConfigError
from rlexp.guards import JudgeGuard
from rlexp.loop import build_guarded

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
REQUIRED_OVERRIDES = {("model", "local"): ["model.path=/tmp/x"],
                      ("data", "jsonl"): ["data.source.train_path=/tmp/x.jsonl"],
                      ("judge", "reward_functions"): ["judge.functions=[math.sqrt]"],
                      ("advantage", "gae"): ["critic=value"], ("critic", "value"): ["advantage=gae"],
                      ("advantage", "distill"): ["teacher=local", "teacher.model_path=/tmp/x"],
                      ("recipe", "distill"): ["teacher=local", "teacher.model_path=/tmp/x"],
                      ("recipe", "grpo_distill"): ["teacher=local", "teacher.model_path=/tmp/x"],
                      ("teacher", "local"): ["teacher.model_path=/tmp/x"],
                      ("teacher", "openai"): ["teacher.model=x"],
                      ("experiment", "distill"): ["teacher.model_path=/tmp/x"]}


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_required_keys_exist():
    cfg = _compose([])
    for key in ("trainer.total_steps", "data.prompts_per_step", "data.samples_per_prompt",
                "rollout.max_response_tokens", "evaluator.every_n_steps", "logger.tracking_uri",
                "logger.experiment_name", "seed"):
        assert OmegaConf.select(cfg, key) is not None, key
    assert cfg.logger.tracking_uri.startswith("sqlite:////")  # absolute path
    validate(cfg)


@pytest.mark.parametrize("group, option", [
    (g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))])
def test_every_option_composes_and_validates(group, option):
    cfg = _compose([f"{group}={option}"] + REQUIRED_OVERRIDES.get((group, option), []))
    OmegaConf.resolve(cfg)
    validate(cfg)
    if group == "critic":
        assert (cfg.trainer.critic is None) == (option == "none")
    elif group == "teacher":
        assert (cfg.teacher is None) == (option == "none")
    elif group in ALGORITHM_GROUPS:  # placed under the trainer
        assert cfg.trainer[group]._target_.startswith("rlexp.algorithms.")
    elif group not in ("experiment", "recipe"):
        assert cfg[group]._target_


@pytest.mark.parametrize("group", ["judge", "scheduler", "evaluator", "data"])
def test_cheap_groups_instantiate(group):
    cfg = _compose([])
    obj = build_guarded(cfg, group, JudgeGuard) if group == "judge" else instantiate(cfg[group])
    assert type(getattr(obj, "judge", obj)).__module__.startswith("rlexp.")


BAD_OVERRIDES = [
    ("trainer.total_steps=0", "trainer.total_steps must be >= 1"),
    ("data.prompts_per_step=-3", "data.prompts_per_step must be >= 1"),
    ("data.samples_per_prompt=1", "samples_per_prompt must be >= 2 for rlexp.algorithms.advantages.Group"),
    ("rollout.max_response_tokens=abc", "must be an integer, got 'abc'"),
    ("rollout.temperature=0", "rollout.temperature must be > 0"),
    ("trainer.sync_check.bound=sometimes",
     "trainer.sync_check.bound must be a number or one of auto, off, False; got 'sometimes'"),
    ("sync_timeout_s=0", "sync_timeout_s must be > 0"),
    ("trainer.optimizer.lr=-1", "trainer.optimizer.lr must be > 0"),
    ("trainer.lr_schedule=linear", "trainer.lr_schedule must be one of constant, cosine"),
    ("agent=multiturn agent.max_turns=0", "agent.max_turns must be >= 1"),
    ("agent=tool agent.on_prefix_break=ignore", "agent.on_prefix_break must be one of split, restart"),
    ("agent=tool agent.tool_prompt=sometimes", "agent.tool_prompt must be one of auto, template, system_"),
    ("rollout.replicas=2", "rollout.replicas=2 runs several engines as Ray actors: add cluster=ray"),
    ("agent=openai agent.entrypoint=nope.mod:fn", "agent.entrypoint 'nope.mod:fn' cannot be loaded"),
    ("agent=environment agent.factory=nope.mod:Env",
     "agent.factory 'nope.mod:Env' cannot be loaded: ModuleNotFoundError"),
    ("agent=environment agent.factory=Env", "agent.factory must look like 'package.module:Class'"),
    ("scheduler=async scheduler.staleness_threshold=-1", "scheduler.staleness_threshold must be >= 0"),
    ("scheduler=async scheduler.tail_batch_candidate_step=1", "go on together"),
    ("scheduler=async scheduler.staleness_threshold=1 scheduler.tail_batch_candidate_step=2 "
     "scheduler.tail_batch_trigger_size=4", "tail_batch_candidate_step=2 must be <= scheduler.staleness"),
    ("scheduler=async scheduler.tail_batch_candidate_step=1 scheduler.tail_batch_trigger_size=99",
     "tail_batch_trigger_size=99 must be <= data.prompts_per_step=32"),
    ("scheduler=async rollout.enable_sleep_mode=true", "use scheduler=sync with it"),
    ("trainer.kl.estimator=k4", "trainer.kl.estimator must be one of k1, k2, k3, low_var_kl"),
    ("trainer.kl.where=advantage", "trainer.kl.where must be one of loss, reward"),
    ("trainer.policy_loss.dual_clip=0.5", "trainer.policy_loss.dual_clip must be > 1"),
    ("mismatch=icepop trainer.mismatch.high=0.9", "trainer.mismatch.high must be > 1"),
    ("advantage=gae", "advantage=gae needs critic=value"),
    ("trainer.routing_replay=rollout", "it needs rollout.routing_capture=true"),
    ("trainer.routing_replay=always", "trainer.routing_replay must be one of none, rollout"),
    ("critic=value", "a critic is only used by advantage=gae"),
    ("recipe=ppo trainer.critic.value_clip=-1", "trainer.critic.value_clip must be > 0"),
    ("advantage=rloo data.samples_per_prompt=1", "data.samples_per_prompt must be >= 2 for rlexp.algorithms"),
    ("agent._target_=rlexp.agents.nope.Agent", "agent._target_: cannot import 'rlexp.agents.nope.Agent'"),
    ("judge._target_=rlexp.judges.math_exact.Nope", "judge._target_: cannot import"),
    ("judge._target_=tests.fakes.ScoreOnlyJudge",
     "judge._target_: tests.fakes.ScoreOnlyJudge has no bind: a judge has the methods of "
     "rlexp.protocols.Judge"),
    ("trainer.optimizer._target_=torch.optim.Adamw", "trainer.optimizer._target_: cannot import"),
    ("data.prompts_per_step=4 data.samples_per_prompt=4 trainer.minibatches_per_step=3",
     "minibatches_per_step=3 must divide the samples of a step"),
    ("agent.guard.timeout_s=0", "agent.guard.timeout_s must be > 0"),
    ("judge.guard.timeout_s=-1", "judge.guard.timeout_s must be > 0"),
    ("+judge.guard.retries=2", "judge.guard.retries is not an argument of rlexp.guards.JudgeGuard"),
    ("agent=multiturn +agent.max_turn=5", "agent.max_turn is not an argument of rlexp.agents.multiturn"),
    ("rollout.top_p=1.5", "rollout.top_p must be <= 1, got 1.5"),
    ("evaluator.prompts=0", "evaluator.prompts must be >= 1, got 0"),
    ("trainer.ref_kl_every_n_steps=-1", "trainer.ref_kl_every_n_steps must be >= 0, got -1"),
    ("+trainer.track_ref_kl=true", "trainer.track_ref_kl is not an argument of rlexp.trainer.controller"),
    ("max_failure_fraction=1.5", "max_failure_fraction must be <= 1"),
    ("checkpoint.every_n_steps=-1", "checkpoint.every_n_steps must be >= 0"),
    ("loop=lowlevel", "loop must be one of fit, low_level; got 'lowlevel'"),
    ("judge=llm rollout=hf", "judge.judges.grader grades on the policy's engine with its reply constrained"),
    ("scheduler=async scheduler.update_mode=keep rollout=hf",
     "scheduler.update_mode=keep: rollout._target_=rlexp.rollout.hf_engine.HFEngine can do abort or wait"),
    ("scheduler=async scheduler.update_mode=pause", "scheduler.update_mode must be one of"),
    ("loop=low_level cluster=ray trainer.workers=2", "loop=low_level calls the trainer in this process: it "
     "needs trainer.workers=1, got 2"),
]


@pytest.mark.parametrize("override, message", BAD_OVERRIDES)
def test_validate_names_the_bad_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(_compose(override.split()))


def _run(*overrides, timeout=120):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "rlexp.run", *overrides], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=CONF.parent)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.total_steps=0"], "rlexp: config error: trainer.total_steps must be >= 1, got 0"),
    (["data.prompts_per_step=100000"], "data.prompts_per_step=100000 cannot be filled"),
    (["data=jsonl", "data.source.train_path=/nonexistent/train.jsonl"],
     "/nonexistent/train.jsonl: data file not found"),
    (["rollout.max_model_len=20", "model.warm_start_steps=0"],
     "prompt(s) of the train split do not fit in rollout.max_model_len=20"),
    (["evaluator.prompts=500"], "evaluator.prompts=500 is more than the eval split has (200)"),
    (["rollout._target_=rlexp.rollout.nope.Engine"], "rollout._target_: cannot import"),
    (["resume=/nonexistent/run"], "resume=/nonexistent/run: /nonexistent/run/rlexp_config.yaml not found"),
])
def test_bad_config_fails_fast_with_one_line(overrides, message, tmp_path):
    res = _run(*overrides, f"logger.tracking_uri=sqlite:///{tmp_path}/m.db")
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    assert "vLLM engine up" not in res.stderr + res.stdout  # failed before any engine started


def test_unknown_group_option_is_named():
    res = _run("scheduler=nope")
    assert res.returncode != 0
    assert "Could not find 'scheduler/nope'" in res.stderr


@pytest.mark.parametrize("value, annotation, message", [
    (0, "AtLeast1", "x must be >= 1, got 0"),
    (None, "AtLeast1 | None", None),
    (1.5, "TopP", "x must be <= 1, got 1.5"),
    ("9", "AtLeast1", "x must be an integer, got '9'"),
    (True, "int", "x must be an integer, got True"),
    (2, "float", None),
    ("fast", "Literal['a', 'b']", "x must be one of a, b; got 'fast'"),
    ("yes", "bool", "x must be true or false"),
    (object(), "Callable", None),  # not a value the config can state: not checked
])
def test_check_value_reads_the_signature_annotation(value, annotation, message):
    from collections.abc import Callable  # noqa: F401  (named by the annotation strings)
    from typing import Literal  # noqa: F401

    from rlexp.config import check_value
    from rlexp.constraints import AtLeast1, TopP  # noqa: F401

    if message is None:
        check_value("x", value, eval(annotation))
    else:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            check_value("x", value, eval(annotation))


@pytest.mark.parametrize("override, message", [
    ("trainer.lr_schedule=bogus", "trainer.lr_schedule must be one of constant, cosine; got 'bogus'"),
    ("agent=tool agent.on_prefix_break=ignore", "agent.on_prefix_break must be one of split, restart"),
])
def test_the_static_check_alone_refuses_a_value_whose_type_another_module_declares(override, message):
    """`LrSchedule` and `PrefixBreak` are imported from other rlexp modules: the static check
    reads them from those modules' source, so the error comes before torch is imported."""
    with pytest.raises(ConfigError, match=message):
        validate(_compose(override.split()), static=True)
