"""The schedulers' filtering, over-sampling and tail batches with real vLLM, the real judge and
the real trainer (their orchestration under a timed fake engine is in test_schedulers.py).
Generation order and speed vary from run to run, so every assertion is about which groups
were rolled out, kept, rejected or trained, read from records of what happened, never about
timing. A weight update waits until every group drawn so far but the held ones has finished
(`GatedTrainer`), so the groups in flight at an update are exactly the ones a test chose."""

import asyncio
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from rlexp.agents.single_turn import SingleTurnAgent
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.judges.math_exact import MathExactJudge
from rlexp.sample import SamplingConfig, Status
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.schedulers.sync import SyncScheduler
from rlexp.step import rl_step
from rlexp.weights.ram_file import RamFileTransport
from tests.conftest import vllm_on_thread

pytestmark = pytest.mark.vllm
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=16, seed=0)
HANG_FAILSAFE_S = 600  # turns a scheduler that never hands over a batch into a failure
LR = 1e-6  # real updates that leave the tiny model's accuracy where it is


@pytest.fixture(scope="module")
def vllm(tiny_model_path):
    """One real vLLM engine for the module, on an event loop in a background thread (the
    engine belongs to the loop it was made on); `run(coro)` runs a test's coroutine there."""
    with vllm_on_thread(tiny_model_path, HANG_FAILSAFE_S, seed=0, max_model_len=256, kv_cache_gb=0.25,
                        max_num_seqs=32) as (engine, run):
        yield SimpleNamespace(engine=engine, run=run)


class RecordingAgent:
    """The real single-turn agent, recording every sample's rollout: the engine's policy
    version when its group started, its reward. The first attempt at a group in `hold`
    keeps generating until it is cancelled (a rollout that runs long); a re-roll of it
    runs normally. `settled` is notified whenever a rollout finishes."""

    def __init__(self, engine, tokenizer, samples_per_prompt: int, hold=()):
        self.inner = SingleTurnAgent(engine, tokenizer, MathExactJudge(), sampling=SAMPLING)
        self.engine, self.n, self.hold = engine, samples_per_prompt, set(hold)
        self.started: dict[int, int] = {}  # group id -> the engine's version at its first rollout
        self.attempts: Counter[int] = Counter()  # group id -> rollouts started
        self.rewards: dict[int, list[float]] = {}  # group id -> its last attempt's rewards
        self.settled = threading.Condition()
        self.finished: Counter[int] = Counter()  # group id -> rollouts finished
        self.cancelled: Counter[int] = Counter()  # group id -> rollouts cancelled

    async def rollout(self, sample):
        gid = sample.group_id
        self.attempts[gid] += 1
        self.started.setdefault(gid, self.engine.version)
        if self.attempts[gid] == self.n + 1:
            self.rewards[gid] = []
        if gid in self.hold and self.attempts[gid] <= self.n:
            try:
                while True:
                    await self.inner.rollout(sample)
            except asyncio.CancelledError:
                self.cancelled[gid] += 1
                raise
        try:
            out = await self.inner.rollout(sample)
            self.rewards.setdefault(gid, []).append(out.reward)
            return out
        finally:
            with self.settled:
                self.finished[gid] += 1
                self.settled.notify_all()

    def done_with(self, drawn: list[int]) -> bool:
        """Every rollout of the groups in `drawn` has finished (a held group's first never does)."""
        return all(self.finished[g] >= self.n for g in drawn if g not in self.hold)

    def without_variance(self) -> set[int]:
        return {g for g, r in self.rewards.items() if len(set(r)) == 1}

    async def aclose(self) -> None:
        await self.inner.aclose()


class DrawnData(DataManager):
    """Records the group ids drawn: the scheduler draws a group's prompts before it launches it."""

    def __init__(self, groups: int, per_prompt: int):
        super().__init__(ArithmeticSource(max_operand=29, ops="+", eval_size=10, seed=0),
                         prompts_per_step=groups, samples_per_prompt=per_prompt, seed=0)
        self.drawn: list[int] = []

    def sample_groups(self, n):
        groups = super().sample_groups(n)
        self.drawn += [g[0].group_id for g in groups]
        return groups


class GatedTrainer:
    """The real trainer; `fit` returns only once every group drawn so far has finished (but
    the held ones), so no other group is in flight at the weight update that follows."""

    def __init__(self, model_path: str, agent: RecordingAgent, data: DrawnData):
        from rlexp.trainer.controller import TrainController

        self.trainer = TrainController(model_path, temperature=SAMPLING.temperature, total_steps=8,
                                   ref_kl_every_n_steps=0,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
        self.agent, self.data = agent, data
        self.batches: list[list] = []

    def fit(self, batch, version):
        metrics = self.trainer.fit(batch, version)
        with self.agent.settled:
            assert self.agent.settled.wait_for(lambda: self.agent.done_with(self.data.drawn), HANG_FAILSAFE_S)
        self.batches.append(batch)
        return metrics

    def weights(self):
        return self.trainer.weights()


async def _run(engine, scheduler, data, agent, trainer, steps):
    """`steps` loop steps from policy version 0 (the model's weights published as version 0
    first: other tests moved the shared engine on)."""
    transport = RamFileTransport()
    metrics = []
    try:
        await transport.transfer(trainer.weights(), engine, 0)
        for version in range(steps):
            metrics.append((await rl_step(scheduler, data, agent, engine, trainer, transport, version))[1])
    finally:
        await scheduler.aclose()
        transport.close()
    return metrics


def _groups(batch) -> list[int]:
    """The batch's group ids, in batch order."""
    return list(dict.fromkeys(s.group_id for s in batch))


def _policy_versions(sample) -> set[int]:
    return {v for v, trained in zip(sample.versions, sample.loss_mask) if trained}


def _total(metrics, key) -> float:
    return sum(m.get(key, 0.0) for m in metrics)


@pytest.mark.parametrize("make", [lambda: SyncScheduler(filter_zero_variance=True, max_filter_rounds=100),
                                  lambda: AsyncScheduler(staleness_threshold=0, filter_zero_variance=True)],
                         ids=["sync", "async"])
def test_groups_without_reward_variance_are_filtered_and_replaced(vllm, tiny_model_path, tokenizer, make):
    """The tiny model gets 1-2% of answers right (temperature 1): 8 samples per prompt give
    one group in ten a right answer; the others are filtered and replaced."""
    groups, per_prompt, steps = 2, 8, 2
    agent = RecordingAgent(vllm.engine, tokenizer, per_prompt)
    data = DrawnData(groups, per_prompt)
    trainer = GatedTrainer(tiny_model_path, agent, data)
    metrics = vllm.run(_run(vllm.engine, make(), data, agent, trainer, steps))
    flat = agent.without_variance()
    assert flat, agent.rewards  # the judge gave some groups equal rewards: filtering was exercised
    trained = [g for b in trainer.batches for g in _groups(b)]
    assert [len(_groups(b)) for b in trainer.batches] == [groups] * steps  # replaced: full batches
    assert len(set(trained)) == len(trained) and not flat & set(trained)
    for batch in trainer.batches:
        assert all(len({s.reward for s in batch if s.group_id == g}) == 2 for g in _groups(batch))
    # every group rolled out was trained or filtered, none lost (at η=0 nothing runs ahead)
    assert set(agent.rewards) == set(trained) | flat
    assert _total(metrics, "samples/filtered") == per_prompt * len(flat)
    assert _total(metrics, "samples/expired") == 0


def test_the_batch_is_short_when_max_filter_rounds_run_out(vllm, tokenizer):
    """Two rounds of 8 groups of 8 (one group in ten has a right answer): the second rolls out
    as many groups as the first filtered, and what is still missing after it is missing
    from the batch."""
    groups, per_prompt, rounds = 8, 8, 2
    sched = SyncScheduler(filter_zero_variance=True, max_filter_rounds=rounds)
    agent = RecordingAgent(vllm.engine, tokenizer, per_prompt)
    batch = vllm.run(sched.produce_batch(DrawnData(groups, per_prompt), agent, 0))
    first = set(range(groups))  # group ids are drawn in order
    kept_first = first - agent.without_variance()
    second = set(agent.rewards) - first
    assert len(second) == groups - len(kept_first)  # replacements for the filtered, and no third round
    assert second == set(range(groups, groups + len(second)))
    kept = set(agent.rewards) - agent.without_variance()
    assert len(kept) < groups, agent.rewards  # short: too few groups had reward variance
    assert _groups(batch) == sorted(kept)
    assert all(s.status == Status.COMPLETED for s in batch)
    assert sched.pop_counts()["samples/filtered"] == per_prompt * len(agent.without_variance())


def test_over_sampled_groups_are_launched_beyond_the_bound_and_expire_unused(vllm, tiny_model_path,
                                                                             tokenizer):
    """η = 0, B = 2, 2 extra groups: every version launches B + 2 groups, trains B, and the
    2 left over are too stale for the next batch."""
    groups, per_prompt, extra, steps = 2, 2, 2, 3
    sched = AsyncScheduler(staleness_threshold=0, over_sample_groups=extra)
    agent = RecordingAgent(vllm.engine, tokenizer, per_prompt)
    data = DrawnData(groups, per_prompt)
    trainer = GatedTrainer(tiny_model_path, agent, data)
    metrics = vllm.run(_run(vllm.engine, sched, data, agent, trainer, steps))
    launched = Counter(agent.started.values())  # groups by the version they were launched under
    assert [launched[v] for v in range(steps)] == [groups + extra] * steps
    assert [m["samples/expired"] for m in metrics] == [0.0] + [extra * per_prompt] * (steps - 1)
    assert [len(_groups(b)) for b in trainer.batches] == [groups] * steps
    for version, batch in enumerate(trainer.batches):  # on-policy: every token of the version trained
        assert {agent.started[g] for g in _groups(batch)} == {version}
        assert all(s.staleness(version) == 0 for s in batch)


def test_a_long_running_group_is_set_aside_and_trained_first_in_a_tail_batch(vllm, tiny_model_path,
                                                                             tokenizer):
    """Group 0's first rollout never ends on its own: after one weight update it is set aside
    (ABORTED, its requests cancelled in vLLM), re-rolled under the new policy, and trained at
    the head of the next batch, once."""
    groups, per_prompt, steps = 2, 2, 3
    sched = AsyncScheduler(staleness_threshold=1, update_mode="abort",
                           tail_batch_candidate_step=1, tail_batch_trigger_size=1)
    agent = RecordingAgent(vllm.engine, tokenizer, per_prompt, hold={0})
    data = DrawnData(groups, per_prompt)
    trainer = GatedTrainer(tiny_model_path, agent, data)
    metrics = vllm.run(_run(vllm.engine, sched, data, agent, trainer, steps))
    batches = [_groups(b) for b in trainer.batches]
    trained = [g for b in batches for g in b]
    assert [len(b) for b in batches] == [groups] * steps and len(set(trained)) == len(trained)
    assert 0 not in batches[0] and batches[1][0] == 0  # deferred, then at the head of the tail batch
    assert agent.cancelled[0] == per_prompt and agent.attempts[0] == 2 * per_prompt
    assert [m.get("rollout/tail_groups", 0.0) for m in metrics] == [0.0, 1.0, 0.0]
    assert _total(metrics, "samples/aborted") == per_prompt and _total(metrics, "samples/expired") == 0
    assert _total(metrics, "rollout/untrained_tokens") > 0  # the set-aside generations are counted
    tail = [s for s in trainer.batches[1] if s.group_id == 0]
    assert all(_policy_versions(s) == {1} for s in tail)  # re-rolled from scratch under the new policy
    assert vllm.engine.busy.active == 0  # the cancelled requests were released by the engine
