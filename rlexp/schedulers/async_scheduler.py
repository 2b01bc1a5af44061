"""AsyncScheduler: rollout runs in the background while the trainer trains, within a bound
on staleness (`Sample.staleness`: policy versions between the version that generated a
sample's oldest trained token and the version being trained).

Lifecycle of a prompt group: launched (admission control) -> in flight -> finished ->
accepted (waiting for a batch) or FILTERED -> trained, or EXPIRED if it got too stale.
A long-running group can instead be set aside as a tail-batch candidate (ABORTED) and
re-rolled later. Rollout and training only meet at `produce_batch` and `sync_weights`, so
the engine may sit on another device than the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from rlexp.constraints import AtLeast0, UpdateMode, UpdateModeSetting
from rlexp.data.manager import DataManager
from rlexp.errors import SyncMismatch
from rlexp.protocols import Agent, RolloutEngine
from rlexp.sample import Sample, Status, staleness
from rlexp.schedulers.ledger import GroupLedger
from rlexp.schedulers.sync import rollout_group
from rlexp.trainer.sync_check import NOT_REACHED

log = logging.getLogger(__name__)


@dataclass
class GroupRollout:
    """One prompt group from launch to batch."""

    index: int  # launch order; batches take accepted groups in this order
    start_version: int  # policy version served when it was launched
    fresh: list[Sample]  # untouched copies of the prompts, to re-roll the group
    tail: bool = False  # a re-roll of a set-aside group: never set aside again
    task: asyncio.Task | None = None  # None until launched (a group restored from a checkpoint)
    meter: list[int] = field(default_factory=lambda: [0])  # tokens generated for it
    cancelled: Status | None = None  # EXPIRED or ABORTED (set aside) once cancelled
    samples: list[Sample] = field(default_factory=list)


def _task(r: GroupRollout) -> asyncio.Task:
    assert r.task is not None, "every group in self._running was launched"
    return r.task


def _check_generated_since_launch(r: GroupRollout) -> None:
    """A group's tokens come from the versions the engine served since its launch: one older
    than `start_version` means a push the loop made never reached the engine. Otherwise the
    staleness bound would expire such groups as they finish, and launch more, without end."""
    oldest = min((s.oldest_version for s in r.samples if s.response_length), default=r.start_version)
    if oldest < r.start_version:
        raise SyncMismatch(f"a prompt group launched while the engine was to serve policy version "
                           f"{r.start_version} came back with tokens the engine generated at version "
                           f"{oldest}. Likely cause: {NOT_REACHED}")


def fresh_copies(group: list[Sample]) -> list[Sample]:
    """The group's prompts as drawn, to roll out again (same uids: a re-roll replaces them)."""
    return [Sample(group_id=s.group_id, prompt=s.prompt, answer=s.answer, uid=s.uid,
                   metadata=dict(s.metadata)) for s in group]


def engine_update_mode(setting: UpdateModeSetting, modes: tuple[str, ...]) -> UpdateMode:
    """The mode an engine that can do `modes` pauses with: `setting`, or for auto keep where it
    can (nothing prefilled again: docs/async.md "Keep or abort: measured"), else abort."""
    if setting != "auto":
        return setting
    return "keep" if "keep" in modes else "abort"


class AsyncScheduler:
    """Knobs (versions = weight updates; B = `data.prompts_per_step` groups per batch):

    - staleness_threshold η: no sample with staleness > η is trained. Admission control
      keeps (groups trained + accepted + in flight) <= (version + η + 1) * B
      + over_sample_groups, so at most about η batches run ahead of the trainer.
      A group that gets too stale anyway (waiting, or still in flight) is EXPIRED.
    - update_mode: what a weight update does with the generations in flight (docs/async.md):
      auto (the default: keep where the rollout engine can, as vLLM can, else abort), keep
      (an in-flight update: the engine pauses with their requests and KV cache, loads the
      weights and resumes them, nothing prefilled again; the tokens after the update are the
      new weights' over KV the old ones wrote), abort (cut short, continued under the new
      weights from their tokens, prompt and tokens prefilled again), wait (the update waits
      until they finish). Every token keeps the version that produced it.
    - tail_batch_candidate_step c (1..η, 0 = off): a group still in flight after c weight
      updates is set aside (cancelled, ABORTED, its tokens counted as never trained).
    - tail_batch_trigger_size k (1..B): once k groups are set aside, they are re-rolled
      from scratch under the current policy, and the next batch waits for all of them and
      trains them first (the tail batch). Long prompts are deferred, never dropped.
    - over_sample_groups: extra groups in flight beyond the bound, so filtered groups are
      replaced without waiting (the surplus may expire).
    - filter_zero_variance: groups whose rewards have no variance are FILTERED.
    - pause_for_eval: while the held-out split is evaluated, no group is launched (groups
      already in flight go on), so evaluation gets the engine first and `timing/eval_s`
      measures evaluation; false lets training rollouts compete with it.

    With η = 0 and no over-sampling this is exactly the SyncScheduler: the same groups,
    launched together, trained in the same order."""

    overlaps_training = True  # generates while the trainer trains

    def __init__(self, staleness_threshold: AtLeast0 = 1, update_mode: UpdateModeSetting = "auto",
                 tail_batch_candidate_step: AtLeast0 = 0, tail_batch_trigger_size: AtLeast0 = 0,
                 over_sample_groups: AtLeast0 = 0, filter_zero_variance: bool = False,
                 pause_for_eval: bool = True):
        self.ledger = GroupLedger(filter_zero_variance)
        self.pause_for_eval = pause_for_eval
        self.staleness_threshold = staleness_threshold
        self.update_mode = update_mode
        self._mode_used: str | None = None  # what `update_mode` resolved to, logged once
        self.tail_candidate_step = tail_batch_candidate_step
        self.tail_trigger_size = tail_batch_trigger_size
        self.over_sample_groups = over_sample_groups
        self._version = 0  # the policy version the engine serves, as the loop last said
        self._batch_groups = 0
        self._running: list[GroupRollout] = []
        self._accepted: list[GroupRollout] = []
        self._set_aside: list[GroupRollout] = []
        self._launched = 0
        self._trained_groups = 0
        self._syncing = False
        self._pause_s = 0.0  # seconds the engine spent paused for weight updates since the last step
        self._evaluating = False  # launches wait while set (pause_for_eval)
        self._restored: list[GroupRollout] = []  # in flight at the checkpoint: relaunched on resume
        self._producer: asyncio.Task | None = None
        self._wake_producer = asyncio.Event()
        self._wake_consumer = asyncio.Event()

    @property
    def max_staleness(self) -> int:
        """η: a batch never holds a token older than that."""
        return self.staleness_threshold

    # ---- consumer side (the training loop) ---------------------------------------------
    async def produce_batch(self, data: DataManager, agent: Agent, version: int) -> list[Sample]:
        self._version = version  # already so after a sync; on the first call, set before any launch
        if self._producer is None:
            self._batch_groups = data.prompts_per_step
            for r in self._restored:
                self._start(agent, r.fresh, r.tail, index=r.index)
            self._restored = []
            self._producer = asyncio.create_task(self._produce(data, agent))
            self._producer.add_done_callback(lambda _: self._wake_consumer.set())
        while True:
            self._wake_consumer.clear()
            if self._producer.done():
                self._producer.result()  # re-raise what stopped it
                raise RuntimeError("the rollout producer stopped")
            # Here too, not only in the producer: right after a weight sync the producer may
            # not have run yet, and the batch must not take groups the new version expired.
            self._bookkeep()
            tails_in_flight = any(r.tail and not r.cancelled for r in self._running)
            if not tails_in_flight and len(self._accepted) >= self._batch_groups:
                break
            await self._wake_consumer.wait()
        self._accepted.sort(key=lambda r: (not r.tail, r.index))
        taken = self._accepted[: self._batch_groups]
        self._accepted = self._accepted[self._batch_groups:]
        self._trained_groups += len(taken)
        for r in taken:
            self.ledger.trains(r.samples, r.meter[0])
        self.ledger.counts["rollout/tail_groups"] += sum(r.tail for r in taken)
        self._wake_producer.set()
        return [s for r in taken for s in r.samples]

    async def sync_weights(self, engine: RolloutEngine, publish: Callable[[], Awaitable[None]],
                           version: int) -> None:
        self._syncing = True  # no launches while the engine is paused
        paused = time.perf_counter()
        try:
            mode = engine_update_mode(self.update_mode, engine.update_modes)
            if mode != self._mode_used:
                log.info("weight updates: update_mode=%s (set: %s)", mode, self.update_mode)
                self._mode_used = mode
            await engine.pause(mode)
            try:
                await publish()
            finally:
                await engine.resume()
            self._version = version
            self._pause_s += time.perf_counter() - paused
        finally:
            self._syncing = False
            self._wake_producer.set()

    def pop_counts(self) -> dict[str, float]:
        """Counts since the last call: groups rejected (filtered, expired, set aside), tail
        groups trained, tokens generated but never trained; the seconds of the update's pause
        (pause, weights, resume)."""
        out = self.ledger.pop() | ({"rollout/update_pause_s": self._pause_s} if self._pause_s else {})
        self._pause_s = 0.0
        return out

    @contextlib.asynccontextmanager
    async def evaluating(self) -> AsyncIterator[None]:
        """With `pause_for_eval`, no group is launched until evaluation ends. Entering does
        not yield to the event loop: the producer, woken by the sync, cannot launch first."""
        self._evaluating = self.pause_for_eval
        try:
            yield
        finally:
            self._evaluating = False
            self._wake_producer.set()

    # ---- checkpoint -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Finished groups waiting for a batch are kept with their tokens (and versions, so
        the bound still applies after resume); groups in flight or set aside are kept as
        their prompts and start again from scratch on resume, under the restored policy. Groups
        cancelled as EXPIRED whose task has not ended yet are counted as expired here."""
        def prompts(runs):
            return [GroupRollout(r.index, r.start_version, r.fresh, r.tail) for r in runs]

        expiring = [(r.fresh, Status.EXPIRED, r.meter[0])
                    for r in self._running if r.cancelled is Status.EXPIRED]
        return self.ledger.state_dict(rejecting=expiring) | {
            "launched": self._launched, "trained_groups": self._trained_groups,
            "accepted": [GroupRollout(r.index, r.start_version, r.fresh, r.tail, meter=list(r.meter),
                                      samples=r.samples) for r in self._accepted],
            "in_flight": prompts(r for r in self._running if r.cancelled is None) + prompts(self._restored),
            "set_aside": prompts(self._set_aside)}

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state)
        self._launched, self._trained_groups = state["launched"], state["trained_groups"]
        self._accepted, self._set_aside = state["accepted"], state["set_aside"]
        self._restored = state["in_flight"]

    async def aclose(self) -> None:
        tasks = [r.task for r in self._running if r.task] + ([self._producer] if self._producer else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- producer side (background task) -----------------------------------------------
    async def _produce(self, data: DataManager, agent: Agent) -> None:
        while True:
            self._wake_producer.clear()
            if not self._syncing:
                self._bookkeep()
                if not self._evaluating:
                    self._launch(data, agent)
            self._wake_consumer.set()
            await self._wake_producer.wait()

    def _bookkeep(self) -> None:
        """Move finished groups on, cancel groups that can no longer be trained."""
        eta = self.staleness_threshold
        for r in [r for r in self._running if _task(r).done()]:
            self._running.remove(r)
            if r.cancelled is not None:
                self.ledger.reject(r.fresh, r.cancelled, r.meter[0])
                continue
            r.samples = _task(r).result()
            _check_generated_since_launch(r)
            if self.ledger.keeps(r.samples, r.meter[0]):
                self._accepted.append(r)
        for r in [r for r in self._accepted if any(s.staleness(self._version) > eta for s in r.samples)]:
            self._accepted.remove(r)
            self.ledger.reject(r.samples, Status.EXPIRED, r.meter[0])
        for r in [r for r in self._running if r.cancelled is None]:
            age = staleness(self._version, r.start_version)  # of the tokens it may still produce
            if not r.tail and self.tail_candidate_step and age >= self.tail_candidate_step:
                r.cancelled = Status.ABORTED
                self._set_aside.append(r)
                _task(r).cancel()
            elif age > eta:
                r.cancelled = Status.EXPIRED
                _task(r).cancel()

    def _launch(self, data: DataManager, agent: Agent) -> None:
        k = self.tail_trigger_size
        if k and len(self._set_aside) >= k:
            tails, self._set_aside = self._set_aside[:k], self._set_aside[k:]
            log.info("tail batch: re-rolling %d long-running groups", len(tails))
            for r in tails:
                self._start(agent, fresh_copies(r.fresh), tail=True)
        active = sum(1 for r in self._running if r.cancelled is None)
        capacity = ((self._version + self.staleness_threshold + 1) * self._batch_groups
                    + self.over_sample_groups)
        admitted = self._trained_groups + len(self._accepted) + active
        if admitted < capacity:
            for group in data.sample_groups(capacity - admitted):
                self._start(agent, group)

    def _start(self, agent: Agent, group: list[Sample], tail: bool = False, index: int | None = None) -> None:
        if index is None:
            index, self._launched = self._launched, self._launched + 1
        rollout = GroupRollout(index, self._version, fresh_copies(group), tail)
        rollout.task = asyncio.create_task(rollout_group(agent, group, rollout.meter))
        rollout.task.add_done_callback(lambda _: self._wake_producer.set())
        self._running.append(rollout)
