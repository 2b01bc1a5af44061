"""The RL loop as one recipe: setup -> train -> cleanup.

    loop = RLLoop(cfg, run_dir)
    final = await loop.execute(tags, resume_from)   # setup, restore, train, cleanup

`train` is one `for step` doing produce -> fit -> sync (rlexp/step.py's `rl_step`) -> log ->
evaluate -> checkpoint.

Who owns what:
- the loop owns the policy version (`self.version`: weight versions published so far). It
  passes it to the scheduler (which batch trains it), the trainer (staleness per token) and
  the weight transport (the engine then serves that version); nobody else counts it.
- the trainer owns its weights and optimizer, and writes them into a checkpoint (`save`/`load`);
  the loop saves the rest beside them (`checkpoint.RunState`: step, version, data positions
  and sample numbering, scheduler, RNGs), captured and restored in that one place.
- the weight transport carries the trainer's weights to the engine (rlexp/weights/).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlexp import checkpoint
from rlexp.chat import tool_prompt
from rlexp.checkpoint import RunState
from rlexp.cluster import build_cluster
from rlexp.config import derived
from rlexp.errors import (
    EngineDead,
    ProgrammingError,
    RunStopped,
    SyncMismatch,
    TrainerDead,
    config_error_unwrapped,
)
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.metrics import GeneratedLengths, failure_report
from rlexp.preflight import Inputs, check_lengths, load_inputs
from rlexp.progress import Progress, SweepPosition
from rlexp.protocols import Agent, RolloutEngine, Scheduler, Teacher, Tracker, Trainer
from rlexp.sample import Sample
from rlexp.schedulers.sync import SyncScheduler
from rlexp.signals import StopOnSignals
from rlexp.step import outgoing, rl_step, sync_within
from rlexp.teachers.scoring import Aligner, TeacherScoring
from rlexp.trainer import update
from rlexp.trainer.controller import TrainController
from rlexp.weights.protocols import WeightTransport

log = logging.getLogger("rlexp")


def build(cfg: DictConfig, group: str, **runtime: Any) -> Any:
    """Instantiate `cfg[group]` from its `_target_`; `runtime` objects are passed by keyword."""
    injected = f" (+ {', '.join(runtime)})" if runtime else ""
    log.info("building %-16s %s%s", group, cfg[group]._target_, injected)
    return instantiate(cfg[group], **runtime)


def build_guarded(cfg: DictConfig, group: str, guard: type, **runtime: Any) -> Any:
    """A component wrapped in its fault guard; the group's `guard` sub-node holds the guard's
    arguments, every other key is the component's."""
    spec = OmegaConf.to_container(cfg[group], resolve=True)  # resolved while still in the whole config
    assert isinstance(spec, dict)
    guard_args = spec.pop("guard", None) or {}
    injected = f" (+ {', '.join(k for k in runtime if not k.startswith('_'))})" if runtime else ""
    log.info("building %-16s %s%s, guard %s", group, spec["_target_"], injected, guard_args)
    with config_error_unwrapped():  # a component that refuses its arguments: its one line
        component = instantiate(spec, **runtime)
    return guard(component, **guard_args)


class RLLoop:
    """One run: `cfg` is the validated, composed config; `run_dir` holds checkpoints; `sweep`:
    the job's place in its sweep, for the progress line."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path = ".", sweep: SweepPosition | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.sweep = sweep
        self.progress: Progress | None = None
        self.version = 0  # the policy version the engine serves (weight versions published)
        self.start_step = 0
        self.tracker: Tracker | None = None
        self.engine: RolloutEngine | None = None
        self.agent: Agent | None = None
        self.eval_agent: Agent | None = None
        self.teacher: Teacher | None = None  # on-policy distillation's (rlexp/teachers/)
        self.scoring: TeacherScoring | None = None  # the training agent, its samples scored by the teacher
        self.scheduler: Scheduler | None = None
        self.trainer: Trainer | None = None
        self.update: Callable[[list[Sample], int], dict[str, float]] | None = None  # the step's update
        self.transport: WeightTransport | None = None
        self.cluster: Any = None

    async def execute(self, tags: dict[str, str] | None = None, resume_from: Path | None = None,
                      inputs: Inputs | None = None) -> dict[str, float]:
        """setup -> (restore) -> train -> cleanup. A run that raised is marked FAILED in
        MLflow, its metrics kept; one that SIGTERM or SIGINT stopped, KILLED (Interrupted).
        `resume_from`: the checkpoint to continue from."""
        resumed = RunState.read(resume_from) if resume_from is not None else None
        self.setup_inputs(resumed, inputs)
        self.start_tracking(tags or {}, resumed)
        status, error = "FAILED", None
        signals = StopOnSignals.install()  # SIGTERM, SIGINT: the run stops, KILLED (rlexp/signals.py)
        try:
            await self.setup_components()
            if resumed is not None:
                await self.restore(resumed)
            gc.collect()  # everything built so far lives for the whole run: move it out of the
            gc.freeze()   # cyclic GC's reach, so full collections stay cheap (else ~0.3 s stalls)
            final = await self.train()
            status = "FINISHED"
            return final
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            if (stop := signals.stop(self.resume_hint())) is not None:
                status, error = "KILLED", f"{type(stop).__name__}: {stop}"
                raise stop from e
            if isinstance(e, (EngineDead, TrainerDead, ProgrammingError)):
                raise type(e)(f"{e}; {self.resume_hint()}") from e
            raise
        finally:
            signals.stopping = True
            try:
                await self.cleanup(status, error)
            finally:
                signals.restore()

    def resume_hint(self) -> str:
        """The last checkpoint and the command that resumes from it."""
        found = checkpoint.checkpoints(self.run_dir)
        last = f"last checkpoint: step {found[-1][0]}" if found else "no checkpoint was saved"
        return f"{last}. Resume: python -m rlexp.run resume={self.run_dir}"

    # ---- setup ------------------------------------------------------------------------
    def setup_inputs(self, resumed: RunState | None, inputs: Inputs | None = None) -> None:
        """Data (at the checkpoint's position when `resumed`), model, tokenizer: cheap, and bad
        input must fail before any engine starts (`inputs`: what rlexp.preflight already loaded)."""
        cfg = self.cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        inputs = inputs or load_inputs(cfg)
        self.data, self.eval_data, self.evaluator = inputs.data, inputs.eval_data, inputs.evaluator
        self.model_path = inputs.model_path
        self.commits = {"model.commit": inputs.model_commit, "data.commit": inputs.data_commit}
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if not inputs.lengths_checked:
            check_lengths(cfg, inputs, self.tokenizer)
        if resumed is not None:
            resumed.restore_data(self.data, self.eval_data)

    def start_tracking(self, tags: dict[str, str], resumed: RunState | None) -> None:
        self.tracker = tracker = build(self.cfg, "logger")
        # Before the run starts: a Ray cluster that cannot place the replicas is a config error.
        self.cluster = build_cluster(self.cfg)
        readable = {"model_path": self.model_path}  # by every node the cluster placed work on
        if resumed is not None and resumed.path is not None:
            readable["resume"] = str(resumed.path)
        self.cluster.check_readable(readable)
        if resumed is None:
            tracker.tags = tags
            sizes = derived(self.cfg)
            log.info("derived: %s", sizes)
            extra = {f"derived.{k}": v for k, v in sizes.items()} | {"model.resolved_path": self.model_path}
            extra |= {k: v for k, v in self.commits.items() if v is not None}  # hub ids' resolved commits
            extra |= self.cluster.params()
            if "tool_prompt" in self.cfg.agent:
                asked = self.cfg.agent.tool_prompt
                extra["chat.tool_prompt"] = path = tool_prompt.resolve(self.tokenizer, asked)
                log.info("tool specs: %s path (agent.tool_prompt=%s)", path, asked)
            tracker.start(self.cfg, extra_params=extra)
            checkpoint.save_run_config(self.run_dir, self.cfg)
        else:
            tracker.resume(resumed.run_id, resumed.step, tags)

    async def setup_components(self) -> None:
        cfg, tokenizer = self.cfg, self.tokenizer
        # The transport first: it may refuse this machine (no CUDA), and it may configure the engine.
        self.transport = build(cfg, "weight_transfer", cluster=self.cluster)  # every transport takes it
        log.info("building %-16s on cluster=%s", "rollout", self.cluster.name)
        self.engine = engine = self.cluster.rollout_engine(cfg.rollout, self.model_path, self.transport)
        judge = build_guarded(cfg, "judge", JudgeGuard)
        judge.bind(engine, tokenizer)  # a model judge grades with the policy's engine
        self.agent = build_guarded(cfg, "agent", AgentGuard, engine=engine, tokenizer=tokenizer, judge=judge)
        if cfg.get("teacher") is not None:  # on-policy distillation: every completed sample scored
            self.teacher = teacher = build(cfg, "teacher")
            aligner = Aligner.load(self.model_path, teacher.tokenizer_path) if teacher.align else None
            self.agent = self.scoring = TeacherScoring(self.agent, teacher, aligner)
        self.eval_agent = build_guarded(cfg, "agent", AgentGuard, engine=engine, tokenizer=tokenizer,
                                        judge=judge, sampling=self.evaluator.sampling,
                                        _convert_="object")  # a dataclass, not a DictConfig
        self.scheduler = build(cfg, "scheduler")
        log.info("building %-16s %s x%d on cluster=%s", "trainer", cfg.trainer._target_,
                 cfg.trainer.get("workers", 1), self.cluster.name)
        if cfg.loop == "low_level":  # the trainer in this process (config.py: trainer.workers=1)
            log.info("loop=low_level: the loop runs the update's stages (rlexp/trainer/update.py)")
            trainer: TrainController = instantiate(cfg.trainer, model_path=self.model_path)
            self.trainer, self.update = trainer, partial(update.fit, trainer.learner)
        else:
            self.trainer = self.cluster.trainer(cfg.trainer, self.model_path)
            self.update = self.trainer.fit

    async def restore(self, resumed: RunState) -> None:
        """Trainer, engine weights, policy version, scheduler and RNGs as they were at the
        checkpoint (the data's position was restored with the inputs)."""
        assert self.trainer and self.engine and self.transport and self.scheduler and resumed.path
        self.trainer.load(resumed.path)
        self.version = resumed.version
        await sync_within(self.transport, outgoing(self.transport, self.trainer), self.engine, self.version,
                          self.cfg.sync_timeout_s)
        resumed.restore(self.scheduler)
        self.start_step = resumed.step
        log.info("resumed at step %d (policy version %d)", self.start_step, self.version)

    # ---- the loop ---------------------------------------------------------------------
    async def train(self) -> dict[str, float]:
        """Steps start+1 .. total_steps. A step's metrics, its evaluation and its checkpoint
        all carry its number; evaluation every `evaluator.every_n_steps`, at step 0 and at the
        end; a checkpoint every `checkpoint.every_n_steps` and at the end."""
        assert self.scheduler and self.agent and self.engine and self.trainer and self.transport
        assert self.tracker is not None
        total, every_ckpt = self.cfg.trainer.total_steps, self.cfg.checkpoint.every_n_steps
        final: dict[str, float] = {}
        self.progress = Progress(total, self.start_step, self.sweep)
        if self.start_step == 0:
            final = await self.evaluate(0)
        agent = GeneratedLengths(self.agent)  # every length generated, beside the ones trained
        for step in range(self.start_step + 1, total + 1):
            async with self.saved_on_sync_mismatch(step):
                batch, metrics = await rl_step(self.scheduler, self.data, agent, self.engine, self.trainer,
                                               self.transport, self.version, self.update,
                                               self.cfg.sync_timeout_s)
            metrics |= agent.pop_metrics() | (self.scoring.pop_metrics() if self.scoring else {})
            self.version += 1  # published by the step's sync: the engine serves it now
            self.tracker.log_metrics(metrics, step)
            self.tracker.log_samples(batch, step, self.tokenizer.decode)
            log.info("step %4d/%d  reward %.3f  loss %+.4f  entropy %.3f  %.2fs "
                     "(produce %.2f fit %.2f sync %.2f)", step, total, metrics["rollout/reward_mean"],
                     metrics.get("train/loss", 0.0), metrics.get("train/entropy", 0.0),
                     metrics["timing/step_s"], metrics["timing/produce_s"], metrics["timing/fit_s"],
                     metrics["timing/sync_s"])
            self.progress.update(step, metrics["rollout/reward_mean"])
            if step % self.evaluator.every_n_steps == 0 or step == total:
                final = await self.evaluate(step)
            limit = self.cfg.max_failure_fraction
            too_many_failed = metrics["samples/failed_frac"] > limit
            if too_many_failed or (every_ckpt and (step % every_ckpt == 0 or step == total)):
                path = await self.save_checkpoint(step)
            if too_many_failed:
                raise RunStopped(failure_report(batch, step, limit, str(path), str(self.run_dir)))
        return final

    @asynccontextmanager
    async def saved_on_sync_mismatch(self, step: int) -> AsyncIterator[None]:
        """Around step `step`: when its fit finds that the last sync did not land (SyncMismatch,
        before any optimizer step), the loop's state as it was before the step is saved with
        the trainer's weights, which are still step - 1's."""
        before = self.run_state(step - 1)
        try:
            yield
        except SyncMismatch as e:
            if step == 1:
                raise SyncMismatch(f"step 1: {e}. Nothing was trained yet: fix the setup, start again") from e
            path = await self.save_checkpoint(step - 1, before)
            raise SyncMismatch(f"step {step}: {e}. The trainer's weights are intact (no optimizer step ran): "
                               f"checkpoint of step {step - 1} saved to {path}; once the sync is fixed: "
                               f"python -m rlexp.run resume={self.run_dir}") from e

    def run_state(self, step: int) -> bytes:
        """The loop's part of a checkpoint at `step`, snapshotted now."""
        assert self.scheduler is not None
        return RunState.capture(step, self.version, self.data, self.eval_data, self.scheduler).serialize()

    async def evaluate(self, step: int) -> dict[str, float]:
        """Roll out the held-out split with the eval agent (eval sampling settings), then score
        the batch. The scheduler launches no training rollouts meanwhile (`Scheduler.evaluating`):
        evaluation has the engine first."""
        assert self.eval_agent is not None and self.tracker is not None and self.scheduler is not None
        t0 = time.time()
        async with self.scheduler.evaluating():
            batch = await SyncScheduler().produce_batch(self.eval_data, self.eval_agent, self.version)
        metrics = self.evaluator.metrics(batch) | {"timing/eval_s": time.time() - t0}
        self.tracker.log_metrics(metrics, step)
        self.tracker.log_samples(batch, step, self.tokenizer.decode, name="eval_traces")
        log.info("step %4d  eval/accuracy %.3f  (%d samples, %.1fs)", step, metrics["eval/accuracy"],
                 len(batch), metrics["timing/eval_s"])
        if self.progress is not None:
            self.progress.evaluated(step, metrics["eval/accuracy"])
        return metrics

    async def save_checkpoint(self, step: int, state: bytes | None = None) -> Path:
        """Everything logged up to `step` is flushed first: a checkpoint's step is the last
        one fully in MLflow. The state (`state`: one captured earlier) is snapshotted now and
        written in a thread (the async scheduler's rollouts go on meanwhile)."""
        assert self.tracker and self.scheduler and self.trainer
        self.tracker.flush()
        if state is None:
            state = self.run_state(step)
        return await asyncio.to_thread(checkpoint.save, self.run_dir, step, self.trainer, state,
                                       self.tracker.run_id, self.cfg.checkpoint.keep_last)

    async def cleanup(self, status: str, error: str | None) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.scheduler is not None:
            await self.scheduler.aclose()
        for agent in (self.agent, self.eval_agent):
            if agent is not None:
                await agent.aclose()
        if self.engine is not None:
            self.engine.shutdown()
        if self.teacher is not None:
            self.teacher.shutdown()
        if self.transport is not None:
            self.transport.close()
        if self.cluster is not None:
            self.cluster.shutdown()
        if self.tracker is not None:
            self.tracker.end(status, error)
        gc.unfreeze()  # a sweep runs the next job in this process: let this one's objects go
