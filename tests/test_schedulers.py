"""Scheduler orchestration with a timed fake engine and a fake trainer: the staleness bound,
admission control, the update modes (keep, abort, wait), tail batches, filtering. (The real engine's partial
rollout and sync/async parity with real vLLM are tested in test_engines_interrupted.py / test_run.py.)"""

import asyncio
import random
import time
from collections import Counter
from dataclasses import replace

import pytest

from rlexp.agents.single_turn import request_seed
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.schedulers.sync import SyncScheduler
from rlexp.step import rl_step
from tests.fakes import TimedEngine, VersionOnlyTransport

PROMPT = [1, 2, 3]


class CountingAgent:
    """Single-turn: PROMPT + the engine's tokens; reward from the sample's seed (so some
    groups have no reward variance)."""

    def __init__(self, engine, reward_p: float = 0.5):
        self.engine = engine
        self.reward_p = reward_p

    async def rollout(self, s: Sample) -> Sample:
        gen = await self.engine.generate(PROMPT, replace(self.engine.sampling,
                                                         seed=request_seed(0, s)))
        s.trace = TokenTrace()
        s.trace.append(PROMPT, role="prompt")
        s.trace.append(gen.token_ids, role="assistant", generation=gen)
        s.reward = float(random.Random(s.metadata["seed"]).random() < self.reward_p)
        s.status = Status.COMPLETED
        return s

    async def aclose(self) -> None:
        pass


class SleepyTrainer:
    """Records what it trains; `fit` takes `fit_s` seconds (in a thread, like the real one),
    and first waits until `until()` holds when given."""

    def __init__(self, fit_s: float, until=None):
        self.fit_s = fit_s
        self.until = until
        self.batches: list[list[Sample]] = []
        self.versions: list[int] = []  # the version each fit was told it trains

    def fit(self, batch, version):
        waited = 0
        while self.until is not None and not self.until():
            time.sleep(0.001)
            waited += 1
            assert waited < 60_000, "the condition the trainer waits for never came"
        time.sleep(self.fit_s)
        self.batches.append(batch)
        self.versions.append(version)
        return {}

    def weights(self):
        return iter(())


def _data(groups=4, per_prompt=4):
    return DataManager(ArithmeticSource(max_operand=99, ops="+", eval_size=10, seed=0),
                       prompts_per_step=groups, samples_per_prompt=per_prompt, seed=0)


async def _train(scheduler, steps=8, fit_s=0.02, token_s=0.001, mean_len=8.0, max_tokens=64,
                 reward_p=0.5, until=None):
    engine = TimedEngine(token_s, max_tokens, mean_len)
    trainer = SleepyTrainer(fit_s, until)
    data = _data()
    agent = CountingAgent(engine, reward_p)
    metrics = []
    try:
        for version in range(steps):
            _, m = await rl_step(scheduler, data, agent, engine, trainer, VersionOnlyTransport(), version)
            metrics.append(m)
    finally:
        await scheduler.aclose()
    return trainer, engine, metrics


def _staleness(trainer):
    """Per trained sample: the version the trainer was told it trains, minus the oldest
    version of the sample's tokens."""
    assert trainer.versions == list(range(len(trainer.batches)))  # the loop's count, passed on
    return [[s.staleness(v) for s in batch if s.status == Status.COMPLETED]
            for v, batch in zip(trainer.versions, trainer.batches)]


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
@pytest.mark.parametrize("slow", ["trainer", "rollout"])
def test_no_trained_sample_exceeds_the_staleness_bound(eta, mode, slow):
    sched = AsyncScheduler(staleness_threshold=eta, update_mode=mode)

    def rollout_caught_up():  # every group admission control allows has finished
        return not sched._running and sched._launched == (sched._version + eta + 1) * 4

    if slow == "trainer":  # each fit starts once rollout has run as far ahead as it may
        run = _train(sched, fit_s=0.001, token_s=0.0005, until=rollout_caught_up)
    else:
        run = _train(sched, fit_s=0.001, token_s=0.004)
    trainer, engine, metrics = asyncio.run(run)
    stale = _staleness(trainer)
    assert all(len(b) == 16 for b in trainer.batches)  # every step got a full batch
    assert max(max(b) for b in stale) <= eta
    assert [m["rollout/staleness_max"] for m in metrics] == [float(max(b)) for b in stale]
    if slow == "trainer":
        # Rollout runs the full bound ahead, so the bound is used, not just obeyed.
        assert max(max(b) for b in stale[eta:]) == eta
    # Admission control: never more groups admitted than can be trained within the bound
    # (a group that expired in flight frees its place).
    expired_groups = sum(m["samples/expired"] for m in metrics) / 4
    assert sched._launched - expired_groups <= (engine.version + eta + 1) * 4


def test_admission_control_stops_launching_at_the_bound():
    async def main():
        engine = TimedEngine(0.0005)
        sched = AsyncScheduler(staleness_threshold=2)
        data = _data()
        await sched.produce_batch(data, CountingAgent(engine), 0)
        # The trainer never comes back: rollout must stop on its own. Each time a group finishes
        # the producer books it and decides whether to launch more in the same call, so once
        # every launched group is booked, launching has stopped (or exceeded the bound).
        while sched._running and sched._launched <= 3 * 4:
            await asyncio.sleep(0)
        launched = sched._launched
        await sched.aclose()
        return launched
    assert asyncio.run(main()) == 3 * 4  # (version 0 + eta 2 + 1) batches of 4 groups


def test_abort_continues_generations_under_the_new_version():
    sched = AsyncScheduler(staleness_threshold=2, update_mode="abort")
    trainer, engine, metrics = asyncio.run(_train(sched, steps=10, fit_s=0.01, token_s=0.002,
                                                  mean_len=30, max_tokens=120))
    resumed = [s for b in trainer.batches for s in b if len(set(s.versions[3:])) > 1]
    assert resumed and sum(m["samples/resumed"] for m in metrics) == len(resumed)
    for s in resumed:  # versions never go back, and each token keeps the one that produced it
        assert s.versions[3:] == sorted(s.versions[3:])
    assert engine.updates_while_generating == 0  # weights never changed under a running request
    assert sum(m["rollout/mixed_tokens"] for m in metrics) == 0  # each piece prefilled again


def test_keep_updates_weights_under_frozen_generations_and_marks_their_mixed_tokens():
    sched = AsyncScheduler(staleness_threshold=2, update_mode="keep")
    trainer, engine, metrics = asyncio.run(_train(sched, steps=10, fit_s=0.01, token_s=0.002,
                                                  mean_len=30, max_tokens=120))
    assert engine._interrupts == 0 and engine.updates_while_generating > 0  # nothing cut short
    done = [s for b in trainer.batches for s in b if s.status == Status.COMPLETED]
    assert sum(m["samples/resumed"] for m in metrics) == sum(len(set(s.versions[3:])) > 1 for s in done) > 0
    mixed = 0
    for s in done:
        (turn,) = [t for t in s.turns if t["mask"]]
        if "mixed_from" not in turn:  # sent and finished at one version
            assert len(set(s.versions[3:])) == 1 and s.trace.model_sampled() == [1] * len(s.tokens)
            continue
        context = turn["context_version"]  # the version the request was sent at
        first_newer = 3 + next(i for i, v in enumerate(s.versions[3:]) if v != context)
        assert turn["mixed_from"] == first_newer and min(s.versions[first_newer:]) > context
        assert s.trace.model_sampled() == [1] * first_newer + [0] * (len(s.tokens) - first_newer)
        assert s.oldest_version == context
        mixed += len(s.tokens) - first_newer
    assert sum(m["rollout/mixed_tokens"] for m in metrics) == mixed > 0
    for batch, version, m in zip(trainer.batches, trainer.versions, metrics):  # tokens per version
        trained = [s for s in batch if s.status == Status.COMPLETED]
        spread = [len(set(s.versions[3:])) for s in trained]
        assert m["rollout/versions_per_sample_mean"] == sum(spread) / len(trained)
        prefix = "rollout/token_staleness_hist/"
        hist = {int(k[len(prefix):]): v for k, v in m.items() if k.startswith(prefix)}
        assert hist == Counter(version - v for s in trained for v in s.versions[3:])
    assert any(m["rollout/versions_per_sample_mean"] > 1 for m in metrics)


class PauseRecorder(TimedEngine):
    """A TimedEngine that records the mode of every pause; `modes`: what it says it can do."""

    def __init__(self, modes: tuple[str, ...]):
        super().__init__(0.0005)
        self.update_modes, self.paused_with = modes, []

    async def pause(self, mode: str) -> None:
        self.paused_with.append(mode)
        await super().pause(mode if mode in self.update_modes else "wait")


@pytest.mark.parametrize(("modes", "setting", "expected"), [
    (("keep", "abort", "wait"), "auto", "keep"),  # vLLM's: keep, nothing prefilled again
    (("abort", "wait"), "auto", "abort"),  # rollout=hf's: it cannot keep
    (("keep", "abort", "wait"), "abort", "abort"),  # a mode set is the mode used
    (("keep", "abort", "wait"), "wait", "wait"),
])
def test_update_mode_auto_keeps_where_the_engine_can_else_aborts(modes, setting, expected):
    async def main():
        engine, sched = PauseRecorder(modes), AsyncScheduler(1, update_mode=setting)
        for version in (1, 2):
            await sched.sync_weights(engine, _noop, version)
        return engine.paused_with
    assert AsyncScheduler().update_mode == "auto"  # the default
    assert asyncio.run(main()) == [expected, expected]


async def _noop() -> None:
    pass


def test_wait_lets_running_generations_finish_before_the_update():
    sched = AsyncScheduler(staleness_threshold=2, update_mode="wait")
    trainer, *_ = asyncio.run(_train(sched, steps=10, fit_s=0.01, token_s=0.002, mean_len=30,
                                     max_tokens=120))
    assert all(len(set(s.versions[3:])) == 1 for b in trainer.batches for s in b)


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_tail_batch_sets_long_groups_aside_and_trains_them_later(mode):
    sched = AsyncScheduler(staleness_threshold=2, update_mode=mode,
                           tail_batch_candidate_step=1, tail_batch_trigger_size=2)
    trainer, engine, metrics = asyncio.run(_train(sched, steps=16, fit_s=0.02, token_s=0.001,
                                                  mean_len=12, max_tokens=200))
    aborted = sum(m["samples/aborted"] for m in metrics)
    tails = sum(m["rollout/tail_groups"] for m in metrics)
    assert aborted >= 8 and tails >= 2  # at least one tail batch of 2 groups of 4 samples
    assert max(max(b) for b in _staleness(trainer)) <= 2
    assert sum(m["rollout/untrained_tokens"] for m in metrics) > 0  # set-aside work is counted
    trained_gids = [s.group_id for b in trainer.batches for s in b]
    assert len(set(trained_gids)) * 4 == len(trained_gids)  # no group trained twice


@pytest.mark.parametrize("make", [lambda: SyncScheduler(filter_zero_variance=True),
                                  lambda: AsyncScheduler(1, filter_zero_variance=True)])
def test_groups_without_reward_variance_are_filtered_and_counted(make):
    sched = make()
    trainer, _, metrics = asyncio.run(_train(sched, steps=4, reward_p=0.3))
    assert sum(m["samples/filtered"] for m in metrics) > 0
    for batch in trainer.batches:
        assert len(batch) == 16
        by_group = {}
        for s in batch:
            by_group.setdefault(s.group_id, set()).add(s.reward)
        assert all(len(r) == 2 for r in by_group.values())


@pytest.mark.parametrize("filtering", [False, True])
def test_staleness_zero_trains_the_same_batches_as_sync(filtering):
    def run(sched):
        trainer, *_ = asyncio.run(_train(sched, steps=5, fit_s=0.01, reward_p=0.3))
        return [[(s.group_id, s.tokens, s.versions, s.reward) for s in b] for b in trainer.batches]
    sync = run(SyncScheduler(filter_zero_variance=filtering))
    assert sync == run(AsyncScheduler(0, filter_zero_variance=filtering))
    assert sync != run(AsyncScheduler(1, filter_zero_variance=filtering))  # the test can tell


class StartCounter(CountingAgent):
    def __init__(self, engine):
        super().__init__(engine)
        self.started = 0

    async def rollout(self, s: Sample) -> Sample:
        self.started += 1
        return await super().rollout(s)


class NoTracker:
    def log_metrics(self, metrics, step):
        self.metrics = metrics

    def log_samples(self, batch, step, decode, name="traces"):
        pass


@pytest.mark.parametrize("pause", [True, False])
def test_evaluation_under_the_async_scheduler_launches_no_training_rollouts(pause):
    """The step's weight sync wakes the producer, which would refill admission while the
    held-out split is evaluated; `pause_for_eval` holds it until evaluation ends."""
    from omegaconf import DictConfig

    from rlexp.evaluator import Evaluator
    from rlexp.loop import RLLoop

    async def go():
        engine = TimedEngine(token_s=0.001)
        train_agent, sched = StartCounter(engine), AsyncScheduler(1, pause_for_eval=pause)
        data = _data()
        try:
            await rl_step(sched, data, train_agent, engine, SleepyTrainer(0.01), VersionOnlyTransport(), 0)
            loop = RLLoop(DictConfig({}))
            loop.scheduler, loop.tracker, loop.version = sched, NoTracker(), 1
            loop.eval_agent, loop.eval_data = CountingAgent(engine), _data()
            loop.evaluator = Evaluator(every_n_steps=1, sampling=engine.sampling)
            loop.tokenizer = type("Decoder", (), {"decode": staticmethod(str)})()
            before = train_agent.started
            metrics = await loop.evaluate(1)
            return train_agent.started - before, metrics
        finally:
            await sched.aclose()

    started_during_eval, metrics = asyncio.run(go())
    assert metrics["timing/eval_s"] > 0 and "eval/accuracy" in metrics
    assert (started_during_eval == 0) == pause  # without the pause, the refill ran during eval
