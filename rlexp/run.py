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

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlexp.agents.single_turn import render_prompt
from rlexp.config import ConfigError, validate, validate_data, validate_lengths
from rlexp.sample import SamplingConfig, Status
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


async def run(cfg: DictConfig, tags: dict[str, str] | None = None) -> dict[str, float]:
    derived = validate(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # Data first: cheap, and bad files must fail before any model or engine starts.
    try:
        source = instantiate(cfg.data.source)
    except InstantiationException as e:
        raise ConfigError(f"data.source: {e.__cause__ or e}") from e
    data = build(cfg, "data", source=source, split="train")
    evaluator = build(cfg, "evaluator")
    n_eval = min(evaluator.prompts or len(source.problems("eval")), len(source.problems("eval")))
    eval_data = instantiate(cfg.data, source=source, split="eval", prompts_per_step=n_eval,
                            samples_per_prompt=evaluator.samples_per_prompt)
    validate_data(cfg, len(data), len(eval_data))
    log.info("derived: %s", derived)

    model_path = build(cfg, "model")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for split, dm in (("train", data), ("eval", eval_data)):
        longest = max(len(render_prompt(tokenizer, p.messages)) for p in dm.problems)
        validate_lengths(cfg, longest, f"{split} split")

    tracker = build(cfg, "logger")
    tracker.tags = tags or {}
    extra = {f"derived.{k}": v for k, v in derived.items()} | {"model.resolved_path": model_path}
    tracker.start(cfg, extra_params=extra)
    status, final, agents, engine, scheduler = "FAILED", {}, (), None, None
    try:
        engine = build(cfg, "rollout", model_path=model_path, seed=cfg.seed)
        judge = build(cfg, "judge")
        agent = build(cfg, "agent", engine=engine, tokenizer=tokenizer, judge=judge)
        eval_sampling = SamplingConfig(evaluator.temperature, 1.0, cfg.rollout.max_response_tokens, cfg.seed)
        eval_agent = instantiate(cfg.agent, engine=engine, tokenizer=tokenizer, judge=judge,
                                 sampling=eval_sampling, _convert_="object")  # a dataclass, not a DictConfig
        agents = (agent, eval_agent)
        scheduler = build(cfg, "scheduler")
        trainer = build(cfg, "trainer", model_path=model_path, temperature=cfg.rollout.temperature)
        eval_args = (eval_agent, tokenizer, eval_data, evaluator, tracker)
        # Everything built so far lives for the whole run: move it out of the cyclic GC's
        # reach, so full collections stay cheap (they otherwise stall rollouts for ~0.3 s).
        gc.collect()
        gc.freeze()
        total = cfg.trainer.total_steps
        for step in range(total):
            if step % evaluator.every_n_steps == 0:
                final = await evaluate(step, *eval_args)
            metrics = await rl_step(scheduler, data, agent, engine, trainer)
            batch = metrics.pop("batch")
            tracker.log_metrics(metrics, step + 1)
            tracker.log_samples(batch, step + 1, tokenizer.decode)
            log.info("step %4d/%d  reward %.3f  loss %+.4f  entropy %.3f  %.2fs "
                     "(produce %.2f fit %.2f sync %.2f)", step + 1, total, metrics["rollout/reward_mean"],
                     metrics.get("train/loss", 0.0), metrics.get("train/entropy", 0.0),
                     metrics["timing/step_s"], metrics["timing/produce_s"], metrics["timing/fit_s"],
                     metrics["timing/sync_s"])
        final = await evaluate(total, *eval_args)
        status = "FINISHED"
        return final
    finally:
        if scheduler is not None:
            await scheduler.aclose()
        for a in agents:
            if hasattr(a, "aclose"):
                await a.aclose()
        if engine is not None:
            engine.shutdown()
        tracker.end(status)  # a run that raised is marked FAILED in MLflow, its metrics kept
        gc.unfreeze()  # a sweep runs the next job in this process: let this one's objects go


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
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    tags = sweep_job_tags(cfg) if multirun else {}
    if cfg.logger.get("run_name") is None and HydraConfig.initialized():
        overrides = HydraConfig.get().overrides.task
        cfg.logger.run_name = ",".join(overrides) if overrides else "default"
    try:
        final = asyncio.run(run(cfg, tags))
    except ConfigError as e:
        print(f"rlexp: config error: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        if tags:
            log_failed_job(cfg, tags, e)  # failed before its MLflow run started
        return None  # the sweep goes on
    except Exception:
        if not multirun:
            raise
        # A failed job must not stop the sweep: its MLflow run is already marked FAILED.
        log.exception("job %s (%s) failed", HydraConfig.get().job.num, cfg.logger.run_name)
        return None
    return final.get("eval/accuracy")


if __name__ == "__main__":
    main()
