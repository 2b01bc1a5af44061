"""One RL step, the unit `RLLoop.train` repeats: produce a batch with policy version v,
fit the trainer on it, sync the new weights to the engine, which then serves v + 1; and the
step's metrics (rollout, training, timings, throughput). The weight sync is bounded in time
(`sync_within`): a hung one stops the run with SyncHung instead of blocking it forever.

    batch, metrics = await rl_step(scheduler, data, agent, engine, trainer, transport, version)

Follow one update further down: `trainer.fit` -> rlexp/trainer/update.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from rlexp.data.manager import DataManager
from rlexp.errors import SyncHung
from rlexp.metrics import rollout_metrics
from rlexp.protocols import Agent, RolloutEngine, Scheduler, Trainer
from rlexp.sample import Sample
from rlexp.trainer.sync_check import check_compared, check_versions
from rlexp.weights.protocols import NamedTensors, WeightTransport

log = logging.getLogger("rlexp")


def outgoing(transport: WeightTransport, trainer: Trainer) -> NamedTensors:
    """What `transport` carries to the engine: the policy's full tensors, or a LoRA run's
    adapter tensors for a transport that `sends_adapter` (weight_transfer=lora_adapter)."""
    if getattr(transport, "sends_adapter", False):  # a transport of a test may not subclass the Protocol
        return trainer.adapter_weights()  # type: ignore[attr-defined]  # TrainController's (sends_from_driver)
    return trainer.weights()


async def sync_within(transport: WeightTransport, weights: NamedTensors, engine: RolloutEngine, version: int,
                      timeout_s: float) -> None:
    """The transfer and the engine's reload, stopped with SyncHung past `timeout_s` (the run's
    `sync_timeout_s`): a hung sync otherwise blocks the run forever with no error. The
    transport's awaits (the engine's reload, Ray, vLLM's transfer calls) are cancelled; the
    run's cleanup then shuts the engine down, a process hung in its reload included."""
    try:
        await asyncio.wait_for(transport.transfer(weights, engine, version), timeout_s)
    except TimeoutError:
        log.error("weight sync to policy version %d hung past %g s: stopping the run", version, timeout_s)
        raise SyncHung(f"the weight sync to policy version {version} did not finish in {timeout_s:g} s "
                       f"(sync_timeout_s): transport {type(transport).__name__}, engine "
                       f"{type(engine).__name__}. The engine is shut down; the run's checkpoints "
                       "are kept") from None


async def rl_step(scheduler: Scheduler, data: DataManager, agent: Agent, engine: RolloutEngine,
                  trainer: Trainer, transport: WeightTransport, version: int,
                  fit: Callable[[list[Sample], int], dict[str, float]] | None = None,
                  sync_timeout_s: float = 300.0) -> tuple[list[Sample], dict[str, float]]:
    """produce -> fit -> sync for policy `version`; after it the engine serves `version + 1`.
    Under the async scheduler, rollout goes on in the background during fit. `fit`: the
    update (default `trainer.fit`; loop=low_level: rlexp/trainer/update.py's `fit` from the loop); it
    checks the last sync on its first forward (SyncMismatch). The batch's own token versions
    are checked against `version` before it (SyncMismatch: the sync never reached the engine),
    and that the check compared tokens after it (SyncUnchecked). A sync longer than
    `sync_timeout_s` raises SyncHung."""
    t0, busy0, tokens0 = time.time(), engine.busy.busy_s, engine.busy.tokens
    again0 = engine.busy.prefilled_again
    batch = await scheduler.produce_batch(data, agent, version)
    to_compare = check_versions(batch, version, scheduler.max_staleness)
    t1 = time.time()
    await engine.sleep()  # GPU with rollout.enable_sleep_mode: free vLLM's memory for training
    train_metrics = await asyncio.to_thread(fit or trainer.fit, batch, version)
    await engine.wake_up()
    check_compared(train_metrics, version, to_compare)
    t2 = time.time()
    weights = outgoing(transport, trainer)
    publish = partial(sync_within, transport, weights, engine, version + 1, sync_timeout_s)
    await scheduler.sync_weights(engine, publish, version + 1)
    t3 = time.time()
    busy, generated = engine.busy.busy_s - busy0, engine.busy.tokens - tokens0
    metrics = rollout_metrics(batch, version) | train_metrics
    metrics["rollout/prefilled_again_tokens"] = float(engine.busy.prefilled_again - again0)
    metrics |= engine.pop_replica_metrics()  # a pool's per replica (cluster=ray)
    if busy > 0.01:  # generation speed while the engine had work (this step's window)
        metrics["throughput/rollout_tokens_per_s"] = generated / busy
    for k, v in scheduler.pop_counts().items():  # rejected before reaching the batch
        metrics[k] = metrics.get(k, 0.0) + v
    return batch, metrics | {
        "timing/produce_s": t1 - t0, "timing/fit_s": t2 - t1, "timing/sync_s": t3 - t2,
        "timing/step_s": t3 - t0, "rollout/policy_version": float(version),
        "rollout/engine_idle_frac": 1.0 - busy / (t3 - t0),
        "throughput/train_tokens_per_s": metrics["rollout/tokens"] / (t3 - t0),  # end to end
        "train/idle_frac": 1.0 - (t2 - t1) / (t3 - t0)}
