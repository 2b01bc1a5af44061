"""Composition root: compose -> validate -> build -> loop (produce, fit, sync, evaluate) -> clean up.

    python -m rlexp.run [group=option ...] [key=value ...]
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlexp import checkpoint
from rlexp.agents.single_turn import render_prompt
from rlexp.config import RUN_CONFIG, ConfigError, resume_config, validate, validate_data, validate_lengths
from rlexp.faults import AgentGuard, EngineDead, JudgeGuard, RunStopped
from rlexp.sample import SamplingConfig, Status, set_uid_counter, uid_counter
from rlexp.schedulers.sync import SyncScheduler
from rlexp.tracking.sweep import SWEEP_TAG, job_run_name, log_failed_job, read_sweep

log = logging.getLogger("rlexp")


def build(cfg: DictConfig, group: str, **runtime):
    log.info("building %-9s %s", group, cfg[group]._target_)
    return instantiate(cfg[group], **runtime)


def was_resumed(s) -> bool:
    """A policy turn whose tokens came from more than one policy version (partial rollout)."""
    return any(t["mask"] and len(set(s.versions[slice(*t["span"])])) > 1 for t in s.turns)


def rollout_metrics(batch, version: int) -> dict[str, float]:
    done = [s for s in batch if s.status == Status.COMPLETED]
    staleness = Counter(s.staleness(version) for s in done)
    tokens = sum(s.response_length for s in batch)
    counts = Counter(s.status.value for s in batch)
    n = max(len(done), 1)
    # Agent-specific per-sample metrics: `*_mean` keys are averaged, others summed.
    extra: dict[str, list[float]] = {}
    for s in batch:
        for k, v in s.metadata.get("metrics", {}).items():
            extra.setdefault(k, []).append(v)
    agent_metrics = {k: sum(v) / len(v) if k.endswith("_mean") else sum(v) for k, v in extra.items()}
    return agent_metrics | {
        "rollout/reward_mean": sum(s.reward for s in done) / n,
        "rollout/accuracy": sum(s.reward_components.get("correct", 0.0) for s in done) / n,
        "rollout/response_length_mean": sum(s.response_length for s in done) / n,
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in done) / n,
        "rollout/tokens": float(tokens),
        **{f"samples/{st.value}": float(counts.get(st.value, 0)) for st in Status},
        "samples/resumed": float(sum(was_resumed(s) for s in done)),
        # agent/judge faults (FAILED, or ABORTED by a timeout): the run stops past a limit
        "samples/failed_frac": sum(s.error is not None for s in batch) / max(len(batch), 1),
        "rollout/staleness_mean": sum(k * n for k, n in staleness.items()) / n,
        "rollout/staleness_max": float(max(staleness, default=0)),
        **{f"rollout/staleness_hist/{k}": float(c) for k, c in staleness.items()},
    }


async def evaluate(step, agent, tokenizer, eval_data, evaluator, tracker) -> dict[str, float]:
    """Roll out the held-out split with the eval agent (eval sampling settings), then score
    the batch. Nothing else is generating meanwhile: evaluation has the engine to itself."""
    t0 = time.time()
    batch = await SyncScheduler().produce_batch(eval_data, agent)
    metrics = evaluator.evaluate(batch) | {"timing/eval_s": time.time() - t0}
    tracker.log_metrics(metrics, step)
    tracker.log_samples(batch, step, tokenizer.decode, name="eval_traces")
    log.info("step %4d  eval/accuracy %.3f  (%d samples, %.1fs)", step, metrics["eval/accuracy"],
             len(batch), metrics["timing/eval_s"])
    return metrics


async def rl_step(scheduler, data, agent, engine, trainer) -> dict:
    """produce -> fit -> sync. Returns the step's metrics, and the batch under "batch".
    Under the async scheduler, rollout goes on in the background during fit."""
    t0, busy0, tokens0 = time.time(), engine.busy.busy_s, engine.busy.tokens
    version = engine.version  # the policy version this step trains
    batch = await scheduler.produce_batch(data, agent)
    t1 = time.time()
    await engine.sleep()  # GPU with rollout.enable_sleep_mode: free vLLM's memory for training
    train_metrics = await asyncio.to_thread(trainer.fit, batch)
    await engine.wake_up()
    t2 = time.time()
    await scheduler.sync_weights(trainer, engine)
    t3 = time.time()
    busy, generated = engine.busy.busy_s - busy0, engine.busy.tokens - tokens0
    metrics = rollout_metrics(batch, version) | train_metrics
    if busy > 0.01:  # generation speed while the engine had work (this step's window)
        metrics["throughput/rollout_tokens_per_s"] = generated / busy
    for k, v in scheduler.pop_counts().items():  # rejected before reaching the batch
        metrics[k] = metrics.get(k, 0.0) + v
    return metrics | {
        "timing/produce_s": t1 - t0, "timing/fit_s": t2 - t1, "timing/sync_s": t3 - t2,
        "timing/step_s": t3 - t0, "rollout/policy_version": float(version),
        "rollout/engine_idle_frac": 1.0 - busy / (t3 - t0),
        "throughput/train_tokens_per_s": metrics["rollout/tokens"] / (t3 - t0),  # end to end
        "train/idle_frac": 1.0 - (t2 - t1) / (t3 - t0), "batch": batch}


def build_guarded(cfg: DictConfig, group: str, guard, **runtime):
    """A component wrapped in its fault guard; `timeout_s` is the guard's, not the component's."""
    node = cfg[group]
    timeout = node.get("timeout_s")
    log.info("building %-9s %s%s", group, node._target_, f" (timeout {timeout}s)" if timeout else "")
    spec = OmegaConf.to_container(node, resolve=True)  # resolved while still in the whole config
    spec.pop("timeout_s", None)
    return guard(instantiate(spec, **runtime), timeout)


@dataclass
class Parts:
    """What a run is made of, built once; the loop, checkpoints and resume share it."""

    cfg: DictConfig
    run_dir: Path
    tokenizer: Any
    data: Any
    eval_data: Any
    evaluator: Any
    tracker: Any
    engine: Any = None
    agent: Any = None
    eval_agent: Any = None
    scheduler: Any = None
    trainer: Any = None

    async def evaluate(self, step: int) -> dict[str, float]:
        return await evaluate(step, self.eval_agent, self.tokenizer, self.eval_data, self.evaluator,
                              self.tracker)

    async def save_checkpoint(self, step: int) -> Path:
        """Everything logged up to `step` is flushed first: a checkpoint's step is the last
        one fully in MLflow. The state is snapshotted now and written in a thread (the async
        scheduler's rollouts go on meanwhile)."""
        self.tracker.flush()
        state = checkpoint.serialize({
            "step": step, "data": self.data.state_dict(), "eval_data": self.eval_data.state_dict(),
            "scheduler": self.scheduler.state_dict(), "rng": checkpoint.rng_state(),
            "next_uid": uid_counter(), "engine_version": self.engine.version})
        return await asyncio.to_thread(
            checkpoint.save, self.run_dir, step, self.trainer.model.state_dict(),
            self.trainer.state_dict(), state, self.tracker.run_id, self.cfg.checkpoint.keep_last)

    async def restore(self, ckpt: dict) -> int:
        """Trainer, engine weights, scheduler, RNGs and sample ids as they were at the checkpoint."""
        state = ckpt["state"]
        self.trainer.load_state_dict(ckpt["trainer"], ckpt["weights"])
        await self.engine.update_weights(self.trainer.model.state_dict())
        self.engine.version = state["engine_version"]
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        set_uid_counter(state["next_uid"])
        log.info("resumed at step %d (policy version %d)", state["step"], self.engine.version)
        return state["step"]


def load_data(cfg: DictConfig):
    """Data first: cheap, and bad files must fail before any model or engine starts."""
    try:
        source = instantiate(cfg.data.source)
    except InstantiationException as e:
        raise ConfigError(f"data.source: {e.__cause__ or e}") from e
    data = build(cfg, "data", source=source, split="train")
    evaluator = build(cfg, "evaluator")
    n_source = len(source.problems("eval"))
    if evaluator.prompts is not None and evaluator.prompts > n_source:
        raise ConfigError(f"evaluator.prompts={evaluator.prompts} is more than the eval split has "
                          f"({n_source}); use null for the whole split")
    eval_data = instantiate(cfg.data, source=source, split="eval",
                            prompts_per_step=evaluator.prompts or n_source,
                            samples_per_prompt=evaluator.samples_per_prompt)
    validate_data(cfg, len(data), len(eval_data))
    return data, eval_data, evaluator


async def run(cfg: DictConfig, tags: dict[str, str] | None = None, run_dir: str | Path = ".",
              resume_from: Path | None = None) -> dict[str, float]:
    derived = validate(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    data, eval_data, evaluator = load_data(cfg)
    log.info("derived: %s", derived)
    model_path = build(cfg, "model")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for split, dm in (("train", data), ("eval", eval_data)):
        validate_lengths(cfg, [(len(render_prompt(tokenizer, p.messages)), p.where or f"{split} prompt {i}")
                               for i, p in enumerate(dm.problems)], split)
    ckpt = None
    if resume_from is not None:
        ckpt = checkpoint.load(resume_from)
        try:
            data.load_state_dict(ckpt["state"]["data"])
            eval_data.load_state_dict(ckpt["state"]["eval_data"])
        except ValueError as e:
            raise ConfigError(f"resume from {resume_from}: {e}") from e

    parts = Parts(cfg, Path(run_dir), tokenizer, data, eval_data, evaluator, build(cfg, "logger"))
    if ckpt is None:
        parts.tracker.tags = tags or {}
        extra = {f"derived.{k}": v for k, v in derived.items()} | {"model.resolved_path": model_path}
        parts.tracker.start(cfg, extra_params=extra)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, Path(run_dir) / RUN_CONFIG, resolve=True)  # what `resume=` reads back
    else:
        parts.tracker.resume(ckpt["meta"]["mlflow_run_id"], ckpt["state"]["step"], tags or {})
    status, error, final = "FAILED", None, {}
    try:
        await build_parts(parts, model_path)
        start = await parts.restore(ckpt) if ckpt else 0
        gc.collect()  # everything built so far lives for the whole run: move it out of the
        gc.freeze()   # cyclic GC's reach, so full collections stay cheap (else ~0.3 s stalls)
        final = await train(parts, start)
        status = "FINISHED"
        return final
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        if isinstance(e, EngineDead):
            found = checkpoint.checkpoints(run_dir)
            last = f"last checkpoint: step {found[-1][0]}" if found else "no checkpoint was saved"
            raise EngineDead(f"{e}; {last}. Resume: python -m rlexp.run resume={run_dir}") from e
        raise
    finally:
        await close_parts(parts)
        parts.tracker.end(status, error)  # a run that raised is marked FAILED, its metrics kept
        gc.unfreeze()  # a sweep runs the next job in this process: let this one's objects go


async def build_parts(parts: Parts, model_path: str) -> None:
    cfg, tokenizer = parts.cfg, parts.tokenizer
    parts.engine = engine = build(cfg, "rollout", model_path=model_path, seed=cfg.seed)
    judge = build_guarded(cfg, "judge", JudgeGuard)
    parts.agent = build_guarded(cfg, "agent", AgentGuard, engine=engine, tokenizer=tokenizer, judge=judge)
    eval_sampling = SamplingConfig(parts.evaluator.temperature, 1.0, cfg.rollout.max_response_tokens,
                                   cfg.seed)
    parts.eval_agent = build_guarded(cfg, "agent", AgentGuard, engine=engine, tokenizer=tokenizer,
                                     judge=judge, sampling=eval_sampling,
                                     _convert_="object")  # a dataclass, not a DictConfig
    parts.scheduler = build(cfg, "scheduler")
    parts.trainer = build(cfg, "trainer", model_path=model_path, temperature=cfg.rollout.temperature)


async def close_parts(parts: Parts) -> None:
    if parts.scheduler is not None:
        await parts.scheduler.aclose()
    for a in (parts.agent, parts.eval_agent):
        if a is not None and hasattr(a, "aclose"):
            await a.aclose()
    if parts.engine is not None:
        parts.engine.shutdown()


async def train(parts: Parts, start: int) -> dict[str, float]:
    """Steps start+1 .. total_steps: produce -> fit -> sync, log; evaluate every
    `evaluator.every_n_steps` and at the end; checkpoint every `checkpoint.every_n_steps`
    and at the end. A step's metrics, its evaluation and its checkpoint all carry its number."""
    cfg, tracker, scheduler = parts.cfg, parts.tracker, parts.scheduler
    total, every_ckpt = cfg.trainer.total_steps, cfg.checkpoint.every_n_steps
    final: dict[str, float] = {}
    if start == 0:
        final = await parts.evaluate(0)
    for step in range(start + 1, total + 1):
        metrics = await rl_step(scheduler, parts.data, parts.agent, parts.engine, parts.trainer)
        batch = metrics.pop("batch")
        tracker.log_metrics(metrics, step)
        tracker.log_samples(batch, step, parts.tokenizer.decode)
        log.info("step %4d/%d  reward %.3f  loss %+.4f  entropy %.3f  %.2fs "
                 "(produce %.2f fit %.2f sync %.2f)", step, total, metrics["rollout/reward_mean"],
                 metrics.get("train/loss", 0.0), metrics.get("train/entropy", 0.0),
                 metrics["timing/step_s"], metrics["timing/produce_s"], metrics["timing/fit_s"],
                 metrics["timing/sync_s"])
        if step % parts.evaluator.every_n_steps == 0 or step == total:
            final = await parts.evaluate(step)
        too_many_failed = metrics["samples/failed_frac"] > scheduler.max_failure_fraction
        if too_many_failed or (every_ckpt and (step % every_ckpt == 0 or step == total)):
            path = await parts.save_checkpoint(step)
        if too_many_failed:
            raise RunStopped(failure_report(batch, step, scheduler.max_failure_fraction, path, parts.run_dir))
    return final


def failure_report(batch, step: int, limit: float, path: Path, run_dir: Path) -> str:
    failed = [s for s in batch if s.error]
    reasons = Counter(s.error for s in failed).most_common(3)
    listed = "; ".join(f"{n}x {r}" for r, n in reasons)
    return (f"step {step}: {len(failed)} of {len(batch)} samples failed, more than "
            f"scheduler.max_failure_fraction={limit} (most common: {listed}). Checkpoint saved to "
            f"{path}. Fix the cause, then resume: python -m rlexp.run resume={run_dir}")


def sweep_job_tags(cfg: DictConfig) -> dict[str, str]:
    """In a Hydra multirun: nest this job's MLflow run under the sweep's parent run and name
    it by what differs between the jobs (`staleness_threshold=2`)."""
    hc = HydraConfig.get()
    info = read_sweep(hc.sweep.dir)
    if info is None:
        return {}
    overrides = list(hc.overrides.task)
    if cfg.logger.get("run_name") is None:
        cfg.logger.run_name = job_run_name(info["varying"], overrides)
    return {"mlflow.parentRunId": info["parent_run_id"], SWEEP_TAG: info["sweep_id"],
            "rlexp.role": "job", "rlexp.job_num": str(hc.job.num),
            "rlexp.overrides": " ".join(overrides), "rlexp.job_dir": hc.runtime.output_dir}


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    tags = sweep_job_tags(cfg) if multirun else {}
    overrides = list(hc.overrides.task)
    if cfg.logger.get("run_name") is None:
        cfg.logger.run_name = ",".join(overrides) if overrides else "default"
    try:
        run_dir, resume_from = Path(hc.runtime.output_dir), None
        if cfg.get("resume"):  # the interrupted run's own config, its dir, its newest checkpoint
            cfg, run_dir, resume_from = resume_config(cfg.resume, overrides, Path(hc.run.dir).parent)
        final = asyncio.run(run(cfg, tags, run_dir, resume_from))
    except ConfigError as e:
        print(f"rlexp: config error: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        if tags:
            log_failed_job(cfg, tags, e)  # failed before its MLflow run started
        return None  # the sweep goes on
    except RunStopped as e:
        print(f"rlexp: run stopped: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(3)
        return None
    except Exception:
        if not multirun:
            raise
        # A failed job must not stop the sweep: its MLflow run is already marked FAILED.
        log.exception("job %s (%s) failed", HydraConfig.get().job.num, cfg.logger.run_name)
        return None
    return final.get("eval/accuracy")


if __name__ == "__main__":
    main()
